"""The training objective: what the loop minimises for one micro-batch, chosen with `dflash train --loss`.

An objective takes the drafter's final hidden states of the micro-batch's blocks [1, N * Bk, H], the frozen LM head
[V, H], the micro-batch (labels [1, N, Bk] with -100 where nothing is supervised, and whatever else the cache
provides), the weight of each block offset [Bk], and the weight sum of the whole global step (all processes and
accumulation steps, so that the update does not depend on how the global batch is split). It returns the loss of
this micro-batch, already divided by that sum, and its statistics (at least `correct_by_position` and
`count_by_position`, [Bk] each, for the accuracy the loop logs).

Adding an objective: a function here with this signature, an entry in `OBJECTIVES` (the `--loss` choices), and its
tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `dflash train --help` lists OBJECTIVES without it
    from torch import Tensor

    from dflash.stage2_train.attention_masks import PackedLayout


@dataclass
class MicroBatch:
    """One micro-batch on the training device, as the loop hands it to the drafter and the objective."""

    features: Tensor  # [1, C, D] the packed context features of its sequences, decoded, in the compute dtype
    block_ids: Tensor  # [1, N, Bk] block inputs: [anchor token, MASK, ...]
    labels: Tensor  # [1, N, Bk] the target's tokens at offsets 1..Bk-1, -100 where not supervised
    layout: PackedLayout  # where the sequences and their blocks sit, for the attention masks and positions


# (hidden, lm_head, micro-batch, position weights, global weight sum) -> (loss, stats)
Objective = Callable[..., tuple[Any, dict[str, Any]]]


def block_cross_entropy(hidden: Tensor, lm_head: Tensor, batch: MicroBatch, position_weights: Tensor,
                        global_weight_sum: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference DFlash objective: cross-entropy against the target's own next tokens at block offsets
    1..Bk-1, weighted exp(-(k - 1) / gamma), normalised by the global weight sum (`loss.dflash_loss`: fused with the
    LM head, in chunks, float32)."""
    from dflash.stage2_train.loss import dflash_loss

    return dflash_loss(hidden.to(lm_head.dtype), lm_head, batch.labels, position_weights, global_weight_sum)


OBJECTIVES: dict[str, Objective] = {"ce": block_cross_entropy}
