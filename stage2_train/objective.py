"""The training objective: what the loop minimises for one micro-batch, chosen with `dflash train --loss`.

An objective takes the drafter's final hidden states of the micro-batch's blocks [1, N * Bk, H], the frozen LM head
[V, H], the micro-batch (labels [1, N, Bk] with -100 where nothing is supervised, and whatever else the cache
provides), the weight of each block offset [Bk], and the weight sum of the whole global step (all processes and
accumulation steps, so that the update does not depend on how the global batch is split). It returns the loss of
this micro-batch, already divided by that sum, and its statistics (at least `correct_by_position` and
`count_by_position`, [Bk] each, for the accuracy the loop logs; `terms`, optional: the loss's named parts, each
divided by the global weight sum like the loss, which the loop logs as `loss_<name>`). Asked for `candidates=k`
(a DFlash 2 drafter), it also returns the top-k of the drafter's logits at every supervised position
(`stats["candidates"]`, `loss.dflash_loss`), which DFlash 2's selector loss scores.

Adding an objective: a function here with this signature, its name in `LOSSES` (the `--loss` choices) and a line
in `make_objective` (which binds the options it needs: options.py and the CLI), and its tests. An objective that
needs the target's top-k in the cache is listed in `NEEDS_TARGET_TOPK`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.shared.errors import UserError
from dflash.stage2_train.options import DEFAULT_KL_WEIGHT

if TYPE_CHECKING:  # torch is imported where it is used: `dflash train --help` lists LOSSES without it
    from torch import Tensor

    from dflash.stage2_train.attention_masks import PackedLayout


@dataclass
class MicroBatch:
    """One micro-batch on the training device, as the loop hands it to the drafter and the objective."""

    features: Tensor  # [1, C, D] the packed context features of its sequences, decoded, in the compute dtype
    block_ids: Tensor  # [1, N, Bk] block inputs: [anchor token, MASK, ...]
    labels: Tensor  # [1, N, Bk] the target's tokens at offsets 1..Bk-1, -100 where not supervised
    layout: PackedLayout  # where the sequences and their blocks sit, for the attention masks and positions
    sequences: int = 1  # how many sequences it packs
    valid_blocks: int = 0  # its blocks that are not padding, counted on the CPU before the copy (no device sync)
    # The flat positions of `labels` that are supervised (`loss.supervised_index`), found on the CPU before the copy
    # so that the loss need not wait for the device to find them; None: the loss finds them itself.
    label_index: Tensor | None = None
    # The flat positions DFlash 2's selector loss scores (`loss.selector_positions`), found on the CPU likewise;
    # None: the selector loss finds them itself.
    selector_index: Tensor | None = None
    # The target's top-k next-token distribution of each label position (a cache extracted with
    # --store-target-topk; else None): ids [1, N, Bk, K] int32 and log-probabilities [1, N, Bk, K] float16.
    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None


# (hidden, lm_head, micro-batch, position weights, global weight sum) -> (loss, stats)
Objective = Callable[..., tuple[Any, dict[str, Any]]]


def block_cross_entropy(hidden: Tensor, lm_head: Tensor, batch: MicroBatch, position_weights: Tensor,
                        global_weight_sum: Tensor, *, candidates: int = 0,
                        fused: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference DFlash objective: cross-entropy against the target's own next tokens at block offsets
    1..Bk-1, weighted exp(-(k - 1) / gamma), normalised by the global weight sum (`loss.dflash_loss`: fused with the
    LM head, in chunks, float32; ``fused``: each chunk's softmax and gradient compiled, with --compile)."""
    from dflash.stage2_train.loss import dflash_loss

    return dflash_loss(hidden.to(lm_head.dtype), lm_head, batch.labels, position_weights, global_weight_sum,
                       candidates=candidates, fused=fused, label_index=batch.label_index)


def block_kl(hidden: Tensor, lm_head: Tensor, batch: MicroBatch, position_weights: Tensor,
             global_weight_sum: Tensor, *, candidates: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """Distillation: KL(target || drafter) at the same positions, weights and normalisation as `ce`, from the
    target's top-k with its remaining mass as one "other" bucket (`loss.block_loss`, module docstring: why the
    bucket, and K = vocabulary size is the full KL). The cross-entropy is logged beside it (`loss_ce`)."""
    return _distill(hidden, lm_head, batch, position_weights, global_weight_sum, ce_weight=0.0, kl_weight=1.0,
                    candidates=candidates)


def block_mix(hidden: Tensor, lm_head: Tensor, batch: MicroBatch, position_weights: Tensor,
              global_weight_sum: Tensor, *, kl_weight: float = DEFAULT_KL_WEIGHT,
              candidates: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """(1 - w) * CE + w * KL with w = --kl-weight, both terms as in `ce` and `kl`, from one LM head product."""
    return _distill(hidden, lm_head, batch, position_weights, global_weight_sum, ce_weight=1.0 - kl_weight,
                    kl_weight=kl_weight, candidates=candidates)


def _distill(hidden: Tensor, lm_head: Tensor, batch: MicroBatch, position_weights: Tensor, global_weight_sum: Tensor,
             *, ce_weight: float, kl_weight: float, candidates: int) -> tuple[Tensor, dict[str, Any]]:
    from dflash.stage2_train.loss import block_loss

    if batch.topk_ids is None or batch.topk_logprobs is None:
        raise ValueError("this objective needs the target's top-k in the micro-batch (NEEDS_TARGET_TOPK)")
    loss, stats = block_loss(hidden.to(lm_head.dtype), lm_head, batch.labels, position_weights, global_weight_sum,
                             topk_ids=batch.topk_ids, topk_logprobs=batch.topk_logprobs, ce_weight=ce_weight,
                             kl_weight=kl_weight, candidates=candidates, label_index=batch.label_index)
    import torch

    denominator = torch.as_tensor(global_weight_sum, dtype=torch.float32, device=loss.device)
    denominator = denominator.clamp_min(torch.finfo(torch.float32).tiny)
    stats["terms"] = {"ce": stats["weighted_ce_sum"] / denominator, "kl": stats["weighted_kl_sum"] / denominator}
    return loss, stats


LOSSES = ("ce", "kl", "mix")  # the --loss choices, in this order
NEEDS_TARGET_TOPK = frozenset({"kl", "mix"})


def make_objective(loss: str, kl_weight: float = DEFAULT_KL_WEIGHT, compile: bool = False) -> Objective:
    """The objective of `--loss loss`, with the options it takes bound (--kl-weight: mix only; --compile: the
    cross-entropy's compiled chunks, `ce` only for now)."""
    if loss == "ce":
        return functools.partial(block_cross_entropy, fused=True) if compile else block_cross_entropy
    if loss == "kl":
        return block_kl
    if loss == "mix":
        return functools.partial(block_mix, kl_weight=kl_weight)
    raise UserError(f"--loss {loss}: choose one of {', '.join(LOSSES)}")


def check_cache_for(name: str, manifest: dict[str, Any], cache: Path | str) -> None:
    """Refuse `--loss name` on a cache without what it needs (the target's top-k for kl and mix), in one line."""
    if name in NEEDS_TARGET_TOPK and not manifest["identity"]["target_topk"]:
        raise UserError(f"--loss {name} distils the target's top-k next-token distribution, which the cache {cache} "
                        "does not hold: re-extract it with its options plus --store-target-topk K (`dflash extract "
                        "... --store-target-topk 32`), or train with --loss ce")
