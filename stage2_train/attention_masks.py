"""The DFlash training attention mask.

Training layout for one sequence of (valid) length S with sorted anchors p_1 < ... < p_A and block size Bk:

* queries: A * Bk block positions; block j holds positions p_j, p_j + 1, ..., p_j + Bk - 1;
* keys: [C context positions 0..C-1] + [the same A * Bk block positions] (C >= S when the batch is padded).

A query of block j may see context key c iff c < p_j (strictly before its anchor), and block key (j', k') iff
j' == j (bidirectional inside its own block). It never sees another block.

Batches hold B sequences padded to the same number of anchors A (``anchor_valid`` marks real ones) and the same
context length C (``context_lengths`` holds each real length). A padded anchor block sees only its own block, so
its softmax rows are never empty (no NaN) and, since no other block can see it, it never affects a valid block.

One predicate (`_visible`) defines the rule. It is evaluated on broadcast index tensors for the dense boolean mask
(the eager reference), for the grouped mask (SDPA: groups of blocks folded into the batch, so that a query scores
the context and its own group's blocks rather than every block) and on scalar indices as a flex-attention
``mask_mod``, so all backends share one definition. An optional sliding window additionally requires
``q_position - k_position < window``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from dflash.stage2_train.shape_buckets import bucket

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AnchorLayout:
    """Where the anchor blocks of a padded batch sit.

    anchors: [B, A] long; entries where ``anchor_valid`` is False are ignored (any value in range works).
    anchor_valid: [B, A] bool.
    context_lengths: [B] long, the valid context length S_b of each sequence (<= context_len).
    context_len: C, the padded number of context key positions (the context features' second dimension).
    block_size: Bk.
    """

    anchors: Tensor
    anchor_valid: Tensor
    context_lengths: Tensor
    context_len: int
    block_size: int

    @classmethod
    def from_anchor_lists(
        cls,
        anchor_lists: Sequence[Sequence[int] | Tensor],
        context_lengths: Sequence[int],
        block_size: int,
        num_blocks: int | None = None,
        context_len: int | None = None,
        device: torch.device | str | None = None,
    ) -> AnchorLayout:
        """Pad per-sequence anchor lists to ``num_blocks`` (default: the longest list) and validate them."""
        lists = [torch.as_tensor(a, dtype=torch.long).flatten().cpu() for a in anchor_lists]
        if len(lists) != len(context_lengths):
            raise ValueError(f"{len(lists)} anchor lists for {len(context_lengths)} context lengths")
        longest = max((len(a) for a in lists), default=0)
        num_blocks = longest if num_blocks is None else num_blocks
        if num_blocks < longest:
            raise ValueError(f"num_blocks={num_blocks} is smaller than the longest anchor list ({longest})")
        anchors = torch.zeros(len(lists), num_blocks, dtype=torch.long)
        valid = torch.zeros(len(lists), num_blocks, dtype=torch.bool)
        for row, a in enumerate(lists):
            anchors[row, : len(a)] = a
            valid[row, : len(a)] = True
        lengths = torch.as_tensor(list(context_lengths), dtype=torch.long)
        context_len = int(lengths.max()) if context_len is None else context_len
        layout = cls(anchors, valid, lengths, context_len, block_size)
        layout.validate()  # on the CPU copies: no device sync
        return layout.to(device) if device is not None else layout

    def to(self, device: torch.device | str) -> AnchorLayout:
        """The same layout with its tensors on ``device``."""
        return replace(
            self,
            anchors=self.anchors.to(device),
            anchor_valid=self.anchor_valid.to(device),
            context_lengths=self.context_lengths.to(device),
        )

    @property
    def batch_size(self) -> int:
        return self.anchors.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_keys(self) -> int:
        return self.context_len + self.num_queries

    @property
    def device(self) -> torch.device:
        return self.anchors.device

    def validate(self) -> None:
        """Check shapes and that every valid anchor lies inside its sequence (syncs with the device)."""
        if self.anchors.shape != self.anchor_valid.shape or self.anchors.dim() != 2:
            raise ValueError(f"anchors {tuple(self.anchors.shape)} / anchor_valid {tuple(self.anchor_valid.shape)}")
        if self.context_lengths.shape != (self.batch_size,):
            shape = tuple(self.context_lengths.shape)
            raise ValueError(f"context_lengths has shape {shape}, want ({self.batch_size},)")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if bool((self.context_lengths > self.context_len).any()):
            raise ValueError(f"a context length exceeds context_len={self.context_len}")
        bad = self.anchor_valid & ((self.anchors < 0) | (self.anchors >= self.context_lengths[:, None]))
        if bool(bad.any()):
            raise ValueError("a valid anchor lies outside [0, context_length) of its sequence")

    def query_position_ids(self) -> Tensor:
        """[B, A * Bk] positions of the block queries: anchor + offset (padded blocks get harmless positions)."""
        offsets = torch.arange(self.block_size, device=self.device)
        anchors = torch.where(self.anchor_valid, self.anchors, torch.zeros_like(self.anchors))
        return (anchors[:, :, None] + offsets).reshape(self.batch_size, self.num_queries)

    def context_position_ids(self) -> Tensor:
        """[B, C] positions of the context keys: 0..C-1."""
        return torch.arange(self.context_len, device=self.device).expand(self.batch_size, -1)


def _visible(
    layout: AnchorLayout, b: Tensor, q_idx: Tensor, kv_idx: Tensor, sliding_window: int | None
) -> Tensor:
    """The DFlash visibility rule for (batch b, query index q_idx, key index kv_idx); inputs broadcast."""
    bk, ctx_len = layout.block_size, layout.context_len
    q_block = q_idx // bk
    anchor = layout.anchors[b, q_block]
    valid = layout.anchor_valid[b, q_block]
    is_context = kv_idx < ctx_len
    kv_block = torch.clamp(kv_idx - ctx_len, min=0) // bk
    sees_context = is_context & valid & (kv_idx < anchor) & (kv_idx < layout.context_lengths[b])
    sees_own_block = ~is_context & (kv_block == q_block)
    visible = sees_context | sees_own_block
    if sliding_window is not None:
        q_pos = anchor + q_idx % bk
        k_pos = torch.where(is_context, kv_idx, layout.anchors[b, kv_block] + (kv_idx - ctx_len) % bk)
        visible = visible & (k_pos > q_pos - sliding_window)  # q_pos - k_pos < window, without a full-size int64
    return visible


def _check_window(layout: AnchorLayout, sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < layout.block_size:
        raise ValueError(f"sliding_window={sliding_window} must be >= block_size={layout.block_size}")


def batch_dense_mask(layout: AnchorLayout, sliding_window: int | None = None) -> Tensor:
    """Boolean mask [B, A * Bk, C + A * Bk]; True = the query may attend to the key."""
    _check_window(layout, sliding_window)
    device = layout.device
    b = torch.arange(layout.batch_size, device=device)[:, None, None]
    q_idx = torch.arange(layout.num_queries, device=device)[None, :, None]
    kv_idx = torch.arange(layout.num_keys, device=device)[None, None, :]
    return _visible(layout, b, q_idx, kv_idx, sliding_window)


@dataclass(frozen=True)
class GroupedMask:
    """The training mask cut into groups of consecutive blocks, for attention kernels without block sparsity.

    A block never sees another block, so a group of G blocks needs only the context keys and its own G * Bk block
    keys: attention runs per group over [C context keys; the group's block keys], with the groups folded into the
    batch dimension. ``mask`` is [B * n_groups, 1, G * Bk, C + G * Bk] (True = attend); row b * n_groups + g holds
    group g of sequence b. The same `_visible` rule as the dense mask decides every entry. The sizes are read from
    the mask's shape (not stored as ints), so that compiled layers see shapes, which may be dynamic, rather than
    constants to guard on.
    """

    mask: Tensor

    @property
    def queries_per_group(self) -> int:
        return self.mask.shape[2]

    @property
    def context_len(self) -> int:
        return self.mask.shape[3] - self.mask.shape[2]


# The grouped keys (the context copied per group plus every group's block keys) may be at most this many times the
# keys of the whole mask (C + A * Bk), which the ungrouped SDPA kept.
MAX_GROUPED_KEYS_RATIO = 2
# Below this many block keys per sequence (A * Bk) the copies cost more than the masked keys they save: one group.
# Measured on 2 CPU cores (benchmarks/bench_grouped_attention.py, 448 context tokens, batch 4): 16 anchors of 16
# 0.96x, 32 anchors 1.10x, 128 anchors 1.44x; 512 anchors after 1,024 tokens 2.7x.
MIN_GROUPED_BLOCK_KEYS = 512


def blocks_per_group(num_blocks: int, context_len: int, block_size: int) -> int:
    """How many consecutive blocks share a group: the fewest (so that each query scores the fewest keys, C + G * Bk)
    whose groups tile the blocks and whose keys, (A / G) * (C + G * Bk), stay within MAX_GROUPED_KEYS_RATIO times
    the whole mask's C + A * Bk. G = A (one group: the whole mask) always qualifies, e.g. for a prime A, and is
    the answer below MIN_GROUPED_BLOCK_KEYS block keys.

    For 512 anchors of 16 after 1,000 context tokens: G = 64, 2,024 keys per query instead of 9,192, and 1.76x the
    whole mask's keys in the copies.
    """
    whole = context_len + num_blocks * block_size
    if num_blocks * block_size < MIN_GROUPED_BLOCK_KEYS:
        return max(num_blocks, 1)
    for group in range(1, num_blocks + 1):
        copies = (num_blocks // group) * (context_len + group * block_size)
        if num_blocks % group == 0 and copies <= MAX_GROUPED_KEYS_RATIO * whole:
            return group
    return max(num_blocks, 1)


def grouped_dense_mask(
    layout: AnchorLayout, sliding_window: int | None = None, num_blocks_per_group: int | None = None
) -> GroupedMask:
    """The DFlash mask of ``layout`` for grouped attention (see `GroupedMask`); the group size defaults to
    `blocks_per_group` and must divide the number of blocks."""
    _check_window(layout, sliding_window)
    device, ctx_len = layout.device, layout.context_len
    if num_blocks_per_group is None:
        num_blocks_per_group = blocks_per_group(layout.num_blocks, ctx_len, layout.block_size)
    if num_blocks_per_group < 1 or layout.num_blocks % num_blocks_per_group:
        raise ValueError(f"{num_blocks_per_group} blocks per group do not tile {layout.num_blocks} blocks")
    group_queries = num_blocks_per_group * layout.block_size
    num_groups = layout.num_queries // group_queries
    b = torch.arange(layout.batch_size, device=device)[:, None, None, None]
    group_start = (torch.arange(num_groups, device=device) * group_queries)[None, :, None, None]
    q_idx = group_start + torch.arange(group_queries, device=device)[None, None, :, None]
    local_kv = torch.arange(ctx_len + group_queries, device=device)[None, None, None, :]
    kv_idx = torch.where(local_kv < ctx_len, local_kv, local_kv + group_start)  # index into [context; all blocks]
    mask = _visible(layout, b, q_idx, kv_idx, sliding_window)
    return GroupedMask(mask.reshape(-1, 1, group_queries, ctx_len + group_queries))


def make_mask_mod(layout: AnchorLayout, sliding_window: int | None = None) -> MaskMod:
    """A flex-attention ``mask_mod(b, h, q_idx, kv_idx)`` implementing the DFlash rule for ``layout``."""
    _check_window(layout, sliding_window)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _visible(layout, b, q_idx, kv_idx, sliding_window)

    return mask_mod


def make_block_mask(layout: AnchorLayout, sliding_window: int | None = None, compile: bool | None = None):
    """A flex-attention BlockMask for ``layout`` (heads broadcast). ``compile`` defaults to True on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    compile = layout.device.type == "cuda" if compile is None else compile
    return create_block_mask(
        make_mask_mod(layout, sliding_window),
        B=layout.batch_size,
        H=None,
        Q_LEN=layout.num_queries,
        KV_LEN=layout.num_keys,
        device=layout.device,
        _compile=compile,
    )


# --- masks for an arbitrary query/key position layout (inference with a sliding window, explicit masks) ---


def dense_to_block_mask(mask: Tensor, compile: bool | None = None):
    """Wrap an explicit boolean mask [B, Q, K] as a flex-attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    compile = mask.device.type == "cuda" if compile is None else compile

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask[b, q_idx, kv_idx]

    batch, q_len, kv_len = mask.shape
    return create_block_mask(
        mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=mask.device, _compile=compile
    )


# --- the packed training layout: the blocks of every sequence of a micro-batch on one flat axis, no padding blocks ---


@dataclass(frozen=True)
class PackedLayout:
    """Where the blocks of a packed micro-batch sit.

    The contexts of the micro-batch's sequences lie back to back on one flat axis of C positions (`context_len`,
    padded at the end to a bucket); their blocks follow on a second flat axis, sequence after sequence, N blocks
    of Bk (`block_size`), the last ones padding to a bucket (``block_valid`` False). Block j belongs to the sequence
    whose context starts at flat index ``block_context_start[j]`` and has its anchor at position
    ``block_anchor[j]`` of that sequence. Keys are [the C context positions; the N * Bk block positions], batch 1.

    The rule is the padded layout's (`AnchorLayout`): a block sees the context positions of its own sequence
    strictly before its anchor, the flat range [start_j, start_j + p_j), and its own block; never another block or
    another sequence. A padding block sees only itself. ``context_positions`` [C] holds each context token's
    position inside its sequence (the RoPE position; 0 for padding).
    """

    block_anchor: Tensor
    block_context_start: Tensor
    block_valid: Tensor
    context_positions: Tensor
    context_len: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.block_anchor.shape[0]

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_keys(self) -> int:
        return self.context_len + self.num_queries

    @property
    def device(self) -> torch.device:
        return self.block_anchor.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedLayout:
        return self.map_tensors(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def map_tensors(self, move: Callable[[Tensor], Tensor]) -> PackedLayout:
        """The same layout with `move` applied to each of its tensors (e.g. a copy to a device)."""
        return replace(self, **{name: move(getattr(self, name)) for name in
                                ("block_anchor", "block_context_start", "block_valid", "context_positions")})

    @classmethod
    def from_anchor_lists(cls, anchor_lists: Sequence[Sequence[int] | Tensor], context_lengths: Sequence[int],
                          block_size: int, num_blocks: int | None = None, context_len: int | None = None,
                          device: torch.device | str | None = None) -> PackedLayout:
        """Pack sequences of the given context lengths and anchors (each list inside its sequence), padding the
        blocks to ``num_blocks`` and the context to ``context_len`` (defaults: no padding)."""
        lists = [torch.as_tensor(a, dtype=torch.long).flatten().cpu() for a in anchor_lists]
        lengths = torch.as_tensor(list(context_lengths), dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        counts = torch.tensor([len(a) for a in lists], dtype=torch.long)
        real = int(counts.sum())
        num_blocks = real if num_blocks is None else num_blocks
        context_len = total if context_len is None else context_len
        if num_blocks < real or context_len < total:
            raise ValueError(f"{real} blocks / {total} context positions do not fit {num_blocks} / {context_len}")
        anchor = torch.zeros(num_blocks, dtype=torch.long)
        start = torch.zeros(num_blocks, dtype=torch.long)
        valid = torch.zeros(num_blocks, dtype=torch.bool)
        if real:
            anchor[:real] = torch.cat(lists)
            start[:real] = torch.repeat_interleave(starts, counts)
            valid[:real] = True
        positions = torch.zeros(context_len, dtype=torch.long)
        if total:
            positions[:total] = torch.arange(total) - torch.repeat_interleave(starts, lengths)
        bad = [(i, a.tolist()) for i, a in enumerate(lists) if len(a) and (int(a.min()) < 0 or int(a.max()) >= lengths[i])]
        if bad:
            raise ValueError(f"anchors outside their sequence: {bad[:3]}")
        layout = cls(anchor, start, valid, positions, context_len, block_size)
        return layout.to(device) if device is not None else layout

    def query_position_ids(self) -> Tensor:
        """[1, N * Bk] positions of the block queries inside their sequences: anchor + offset."""
        offsets = torch.arange(self.block_size, device=self.device)
        return (self.block_anchor[:, None] + offsets).reshape(1, self.num_queries)

    def context_position_ids(self) -> Tensor:
        """[1, C] positions of the context keys inside their sequences."""
        return self.context_positions[None]


def _packed_visible(layout: PackedLayout, q_idx: Tensor, kv_idx: Tensor, sliding_window: int | None) -> Tensor:
    """The DFlash rule on the packed layout for (query index, key index); inputs broadcast."""
    bk, ctx_len = layout.block_size, layout.context_len
    q_block = q_idx // bk
    start = layout.block_context_start[q_block]
    anchor = layout.block_anchor[q_block]
    is_context = kv_idx < ctx_len
    kv_block = torch.clamp(kv_idx - ctx_len, min=0) // bk
    sees_context = is_context & layout.block_valid[q_block] & (kv_idx >= start) & (kv_idx < start + anchor)
    visible = sees_context | (~is_context & (kv_block == q_block))
    if sliding_window is not None:
        q_pos = anchor + q_idx % bk
        context_pos = layout.context_positions[torch.clamp(kv_idx, max=ctx_len - 1)] if ctx_len else kv_idx
        k_pos = torch.where(is_context, context_pos, layout.block_anchor[kv_block] + (kv_idx - ctx_len) % bk)
        visible = visible & (k_pos > q_pos - sliding_window)
    return visible


def packed_dense_mask(layout: PackedLayout, sliding_window: int | None = None) -> Tensor:
    """Boolean mask [1, N * Bk, C + N * Bk] of the packed layout (the eager reference)."""
    if sliding_window is not None and sliding_window < layout.block_size:
        raise ValueError(f"sliding_window={sliding_window} must be >= block_size={layout.block_size}")
    q_idx = torch.arange(layout.num_queries, device=layout.device)[:, None]
    kv_idx = torch.arange(layout.num_keys, device=layout.device)[None, :]
    return _packed_visible(layout, q_idx, kv_idx, sliding_window)[None]


@dataclass(frozen=True)
class PackedGroups:
    """The packed mask cut into groups of G consecutive blocks for SDPA: group g's queries score only a window of W
    context positions starting at ``context_start[g]`` (covering what its blocks may see) and its own G * Bk block
    keys. ``mask`` [n_groups, 1, G * Bk, W + G * Bk] (True = attend), decided by `_packed_visible`;
    ``context_index`` [n_groups, W] the flat context position of each window key (clamped inside the context:
    positions past a window's end are masked)."""

    mask: Tensor
    context_index: Tensor

    @property
    def queries_per_group(self) -> int:
        return self.mask.shape[2]

    @property
    def window(self) -> int:
        return self.context_index.shape[1]


# Grouped attention over the packed layout copies the keys of each group's window: at most this many times the
# keys of the whole mask (C + N * Bk). The cheapest group sizes of packed micro-batches copy 2.3-5.5x (many
# sequences of 128-3,072 tokens, benchmarks/bench_packed_attention.py's draws); one long sequence alone up to ~10x,
# where a larger group does nearly as well.
MAX_PACKED_COPIES_RATIO = 6


def _block_windows(layout: PackedLayout) -> tuple[Tensor, Tensor]:
    """Each block's context window [lo, hi) on the flat context axis; a padding block's is empty (lo = C, hi = 0)."""
    lo = torch.where(layout.block_valid, layout.block_context_start,
                     torch.full_like(layout.block_anchor, layout.context_len))
    hi = torch.where(layout.block_valid, layout.block_context_start + layout.block_anchor, torch.zeros_like(lo))
    return lo, hi


def _group_windows(lo: Tensor, hi: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Each group of `group` consecutive blocks: the start and end of the context window its blocks may see."""
    ends = hi.view(-1, group).amax(1)
    starts = torch.minimum(lo.view(-1, group).amin(1), ends)  # a group of padding blocks only: empty, at its end
    return starts, ends


# Whether `window_width` rounds the context windows of grouped SDPA up to `bucket` sizes (benchmarks turn it off to
# compare; see `window_width`).
BUCKET_WINDOWS = True


def window_width(widest: int) -> int:
    """The context keys of every group of `packed_groups`, for the widest window `widest` of its micro-batch: rounded
    up by `shape_buckets.bucket` (the extra keys are masked), so that the attention of micro-batches shares few
    shapes: SDPA's cuDNN kernels build an execution plan per new shape, and with the exact width nearly every
    micro-batch had a new one."""
    widest = max(int(widest), 1)
    return bucket(widest) if BUCKET_WINDOWS else widest


def packed_blocks_per_group(layout: PackedLayout, head_dim: int) -> int:
    """Blocks per group for `packed_groups`: of the powers of two dividing N (N itself: the whole mask as one
    group), the one with the least attention work, (W_G + G * Bk) * (N * Bk + 2 * D * N / G), W_G the widest
    context window of a group: every query scores W_G + G * Bk keys, and each group copies that many keys and
    values of D per head; of those that copy at most MAX_PACKED_COPIES_RATIO times the whole mask's keys. The whole
    layout as one group below MIN_GROUPED_BLOCK_KEYS block keys (there the copies cost more than they save,
    measured on CPU).

    Not "the fewest under a key budget, else the whole mask": a micro-batch of many sequences then fell back to the
    whole mask, whose keys grow with the square of the micro-batch (H200, SmolLM2 drafter, 1,728 blocks after
    21,876 context tokens: 2.6 GB per layer for the mask alone, four of those runs side by side ran out of memory;
    benchmarks/bench_packed_attention.py)."""
    n, bk = layout.num_blocks, layout.block_size
    if n * bk < MIN_GROUPED_BLOCK_KEYS:
        return max(n, 1)
    lo, hi = (x.cpu() for x in _block_windows(layout))  # one transfer, then every candidate on the host
    candidates = [1 << i for i in range(n.bit_length()) if (1 << i) < n and n % (1 << i) == 0] + [n]
    keys_per_query = {}
    for group in candidates:
        starts, ends = _group_windows(lo, hi, group)
        keys_per_query[group] = window_width(int((ends - starts).max())) + group * bk
    # The memory plan (memory_plan.step_bytes) counts on at most this many copied keys.
    affordable = [g for g in candidates
                  if g == n or (n // g) * keys_per_query[g] <= MAX_PACKED_COPIES_RATIO * layout.num_keys]
    return min(affordable, key=lambda g: keys_per_query[g] * (n * bk + 2 * head_dim * (n // g)))


def packed_groups(layout: PackedLayout, sliding_window: int | None = None,
                  num_blocks_per_group: int | None = None, head_dim: int = 64) -> PackedGroups:
    """The packed layout's mask for grouped SDPA (see `PackedGroups`); the group size defaults to
    `packed_blocks_per_group` (for attention heads of `head_dim`) and must divide the number of blocks."""
    if sliding_window is not None and sliding_window < layout.block_size:
        raise ValueError(f"sliding_window={sliding_window} must be >= block_size={layout.block_size}")
    n, bk, ctx_len, device = layout.num_blocks, layout.block_size, layout.context_len, layout.device
    lo, hi = _block_windows(layout)
    if num_blocks_per_group is None:
        num_blocks_per_group = packed_blocks_per_group(layout, head_dim)
    if n % max(num_blocks_per_group, 1):
        raise ValueError(f"{num_blocks_per_group} blocks per group do not tile {n} blocks")
    group = max(num_blocks_per_group, 1)
    starts, ends = _group_windows(lo, hi, group) if n else (lo, hi)
    width = window_width(int((ends - starts).max()) if n else 0)  # one sync per micro-batch and layer type
    num_groups, group_queries = n // group, group * bk
    context_index = (starts[:, None] + torch.arange(width, device=device)).clamp(max=max(ctx_len - 1, 0))
    in_window = starts[:, None] + torch.arange(width, device=device) < ctx_len
    q_idx = (torch.arange(num_groups, device=device) * group_queries)[:, None, None] + \
        torch.arange(group_queries, device=device)[None, :, None]  # [n, G*Bk, 1]
    block_kv = ctx_len + (torch.arange(num_groups, device=device) * group_queries)[:, None] + \
        torch.arange(group_queries, device=device)  # [n, G*Bk]
    kv_idx = torch.cat([context_index, block_kv], dim=1)[:, None, :]  # [n, 1, W + G*Bk]
    mask = _packed_visible(layout, q_idx, kv_idx, sliding_window)
    keep = torch.cat([in_window, torch.ones_like(block_kv, dtype=torch.bool)], dim=1)[:, None, :]
    return PackedGroups((mask & keep)[:, None], context_index)


def make_packed_block_mask(layout: PackedLayout, sliding_window: int | None = None, compile: bool | None = None):
    """A flex-attention BlockMask of the packed layout (batch 1, heads broadcast); compiled on CUDA by default."""
    from torch.nn.attention.flex_attention import create_block_mask

    if sliding_window is not None and sliding_window < layout.block_size:
        raise ValueError(f"sliding_window={sliding_window} must be >= block_size={layout.block_size}")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _packed_visible(layout, q_idx, kv_idx, sliding_window)

    compile = layout.device.type == "cuda" if compile is None else compile
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=layout.num_queries, KV_LEN=layout.num_keys,
                             device=layout.device, _compile=compile)
