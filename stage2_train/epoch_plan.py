"""What one epoch trains: the micro-batches of its plan, and the anchors (blocks) of each sample.

Both are pure functions of (cache index, seed, epoch) and the run's settings (the token budget, the anchor rule, the
number of processes, which truncates the plan), never of the number of DataLoader workers, the rank, or where a run
was resumed (--resume refuses other settings, and a cache index with other training samples: `run_setup.resume`):

* `plan_epoch` shuffles the training samples per (seed, epoch) and packs them greedily, in that order, into
  micro-batches of at most `batch_tokens` tokens (context plus blocks: `AnchorRule.cost`), shuffles the micro-batch
  order and truncates to a multiple of `world_size`. Micro-batch i goes to rank i % world_size (`rank_plan`), so a
  global step is `world_size * grad_accum` consecutive micro-batches of the one global plan, whatever the number of
  ranks.
* `sample_anchors` draws a sample's anchors (`AnchorRule.count` of its anchor candidates) with an RNG seeded by
  (seed, epoch, shard, row): the same in every worker layout, rank count and after a resume; new ones every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash.stage2_train.cache_index import (ANCHOR_STREAM, PLAN_STREAM, CacheIndex, Sample, anchor_candidates,
                                             check_seed)
from dflash.stage2_train.options import DEFAULT_ANCHOR_DENSITY, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ANCHORS


@dataclass(frozen=True)
class AnchorRule:
    """How many anchors (blocks) a sequence gets per epoch: `density` of its anchor candidates, rounded up, at
    least 1 and at most `max_anchors` (density None: every candidate up to the cap, the reference's rule)."""

    density: float | None = DEFAULT_ANCHOR_DENSITY
    max_anchors: int = DEFAULT_MAX_ANCHORS
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"anchor density must be in (0, 1], got {self.density}")
        if self.max_anchors < 1 or self.block_size < 1:
            raise ValueError(f"max_anchors={self.max_anchors}, block_size={self.block_size}")

    def count(self, candidates: np.ndarray | int) -> np.ndarray:
        """Anchors drawn from sequences with these numbers of candidates."""
        n = np.asarray(candidates, dtype=np.int64)
        wanted = n if self.density is None else np.maximum(1, np.ceil(self.density * n - 1e-9)).astype(np.int64)
        return np.minimum(np.minimum(wanted, n), self.max_anchors)

    def cost(self, lengths: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """Tokens a sample adds to a packed micro-batch: its context plus its blocks."""
        return np.asarray(lengths, dtype=np.int64) + self.count(candidates) * self.block_size


def sample_anchors(loss_mask: np.ndarray, rule: AnchorRule, seed: int, epoch: int, shard: int, row: int) -> np.ndarray:
    """`rule.count` anchor candidates, uniformly without replacement, sorted (int64).

    The RNG is seeded by (seed, epoch, shard, row) only: the same anchors in any worker, on any rank, after a
    resume; fresh ones every epoch."""
    candidates = anchor_candidates(loss_mask)
    count = int(rule.count(len(candidates)))
    if len(candidates) <= count:
        return candidates.astype(np.int64)
    rng = np.random.default_rng([check_seed(seed), int(epoch), int(shard), int(row), ANCHOR_STREAM])
    chosen = rng.choice(len(candidates), size=count, replace=False)
    chosen.sort()
    return candidates[chosen].astype(np.int64)


def plan_epoch(index: CacheIndex, epoch: int, seed: int, batch_tokens: int, world_size: int = 1,
               rule: AnchorRule | None = None) -> list[list[Sample]]:
    """The global list of micro-batches of one epoch (every rank computes the same list).

    The training samples are shuffled per (seed, epoch) and packed greedily, in that order, into micro-batches whose
    tokens, context plus blocks (`AnchorRule.cost`; context only without a rule), stay within `batch_tokens`; a
    sample costlier than that forms a micro-batch alone. The micro-batches are shuffled again and the list is
    truncated to a multiple of `world_size`; micro-batch i belongs to rank i % world_size (see `rank_plan`). Packing
    leaves no padding to minimise, so lengths are not sorted."""
    if batch_tokens < 1 or world_size < 1:
        raise ValueError(f"batch_tokens={batch_tokens}, world_size={world_size}")
    samples = index.train
    rng = np.random.default_rng([check_seed(seed), int(epoch), PLAN_STREAM])
    order = rng.permutation(len(samples))
    train = index.is_train
    lengths, candidates = index.lengths[train], index.candidates[train]
    costs = rule.cost(lengths, candidates) if rule is not None else lengths.astype(np.int64)
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    filled = 0
    for position in order.tolist():
        cost = int(costs[position])
        if current and filled + cost > batch_tokens:
            batches.append(current)
            current, filled = [], 0
        current.append(samples[position])
        filled += cost
    if current:
        batches.append(current)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches[: len(batches) - len(batches) % world_size]


def rank_plan(plan: Sequence[list[Sample]], rank: int, world_size: int) -> list[list[Sample]]:
    """The micro-batches of `rank`: plan[rank], plan[rank + world_size], ..."""
    if len(plan) % world_size:
        raise ValueError(f"a plan of {len(plan)} micro-batches cannot be split over {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    return list(plan[rank::world_size])
