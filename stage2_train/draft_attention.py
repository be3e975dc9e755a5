"""Training attention for the drafter: the training layouts' block masks and the kernels that compute them.

`modeling_dflash.DFlashDraftModel` computes attention through its `attention` attribute (what prepares a layer's mask
and what attends with it); at inference that is `DenseAttention` (a dense boolean mask, SDPA). Training sets a
`TrainingAttention`, which also takes the layouts of `attention_masks.py` as the forward's ``attention_mask``:

    None          -> every query sees every key (inference layout: context = all positions < start, one block);
    AnchorLayout  -> the DFlash training mask over B padded sequences;
    PackedLayout  -> the same rule with the blocks of every sequence on one flat axis (batch 1);
    Tensor        -> explicit boolean mask [B, Q, C + Q] or [B, 1, Q, C + Q] (True = attend);
    BlockMask     -> a prebuilt flex mask (flex backend, full-attention layers only).

Backends (all take the same mask specification and agree numerically): ``eager`` (explicit softmax over the whole
dense mask, the reference), ``sdpa`` (torch SDPA with a boolean mask; the training layouts run per group of blocks,
see `grouped_attention`) and ``flex`` (flex_attention with a BlockMask; compiled on CUDA, the unfused implementation
elsewhere). ``auto`` picks per device and drafter width (`TrainingAttention.backend`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Union

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.stage2_train.attention_masks import (
    AnchorLayout,
    GroupedMask,
    PackedGroups,
    PackedLayout,
    batch_dense_mask,
    blocks_per_group,
    dense_to_block_mask,
    grouped_dense_mask,
    make_block_mask,
    make_packed_block_mask,
    packed_dense_mask,
    packed_groups,
)
from dflash.stage2_train.modeling_dflash import DenseAttention, DFlashDraftModel, drafter_for, repeat_kv

AttnImplementation = Literal["auto", "eager", "sdpa", "flex"]
FLEX_MIN_HIDDEN_SIZE = 2048  # `auto` uses flex_attention on CUDA from this drafter width on (see `backend`)
MaskSpec = Union[None, AnchorLayout, PackedLayout, Tensor, BlockMask]
PreparedMask = Union[None, Tensor, BlockMask, GroupedMask, PackedGroups]


# ---------------------------------------------------------------------------
# Kernels: q [B, H, Q, D], k/v [B, H_kv, K, D], mask prepared for the kernel -> [B, H, Q, D]
# ---------------------------------------------------------------------------


def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """softmax(q k^T * scaling + mask) v with the softmax in float32; mask is boolean [B, 1, Q, K] or None."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


sdpa_attention = DenseAttention.attend  # torch SDPA with an explicit boolean mask (KV heads expanded)


def grouped_attention(
    attend: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, groups: GroupedMask, scaling: float
) -> Tensor:
    """`attend` run per group of blocks (see `GroupedMask`): q [B, H, Q, D], k/v [B, H_kv, C + Q, D] -> [B, H, Q, D].

    Written by hand because SDPA has no block sparsity: with the whole mask it would score every query against
    every block, nearly all of it masked. Each group's keys are [the context; its own blocks], built by one
    concatenation of broadcast views per k and v, with the KV heads already expanded to the query heads (so `attend`
    copies nothing more); autograd sums the context's gradient over the groups.
    """
    batch, heads, q_len, dim = q.shape
    kv_heads, ctx_len, group = k.shape[1], groups.context_len, groups.queries_per_group
    num_groups, n_rep = q_len // group, heads // kv_heads

    def keys_per_group(x: Tensor) -> Tensor:  # [B, H_kv, C + n * G, D] -> [B * n, H, C + G, D]
        shape = (batch, num_groups, kv_heads, n_rep)
        context = x[:, None, :, None, :ctx_len].expand(*shape, ctx_len, dim)
        blocks = x[:, :, ctx_len:].unflatten(2, (num_groups, group)).transpose(1, 2)[:, :, :, None]
        return torch.cat([context, blocks.expand(*shape, group, dim)], dim=4).reshape(-1, heads, ctx_len + group, dim)

    queries = q.unflatten(2, (num_groups, group)).transpose(1, 2).flatten(0, 1)  # [B * n, H, G, D]
    out = attend(queries, keys_per_group(k), keys_per_group(v), groups.mask, scaling)
    return out.unflatten(0, (batch, num_groups)).transpose(1, 2).flatten(2, 3)


def packed_grouped_attention(
    attend: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, groups: PackedGroups, scaling: float
) -> Tensor:
    """`attend` run per group of blocks of a packed layout (see `PackedGroups`): q [1, H, N * Bk, D], k/v
    [1, H_kv, C + N * Bk, D] -> [1, H, N * Bk, D]. Each group's keys are its window of the flat context (gathered)
    followed by its own blocks, KV heads expanded; autograd scatters the context's gradient back over the windows.
    Written by hand for the reason `grouped_attention` is: SDPA has no block sparsity."""
    _, heads, q_len, dim = q.shape
    kv_heads, ctx_len = k.shape[1], k.shape[2] - q_len
    num_groups, group = groups.mask.shape[0], groups.queries_per_group

    def keys_per_group(x: Tensor) -> Tensor:  # [1, H_kv, C + N * Bk, D] -> [n, H, W + G, D]
        context = x[0][:, groups.context_index]  # [H_kv, n, W, D]
        blocks = x[0, :, ctx_len:].unflatten(1, (num_groups, group))  # [H_kv, n, G, D]
        return repeat_kv(torch.cat([context, blocks], dim=2).transpose(0, 1), heads // kv_heads)

    queries = q[0].unflatten(1, (num_groups, group)).transpose(0, 1)  # [n, H, G, D]
    out = attend(queries, keys_per_group(k), keys_per_group(v), groups.mask, scaling)
    return out.transpose(0, 1).flatten(1, 2)[None]


_compiled_flex_attention: Callable[..., Tensor] | None = None


def flex_attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | None, scaling: float) -> Tensor:
    """flex_attention with a BlockMask: compiled (fused kernel) on CUDA, the unfused implementation elsewhere."""
    global _compiled_flex_attention
    if q.device.type == "cuda":
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention)
        return _compiled_flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=True)


KERNELS: dict[str, Callable[..., Tensor]] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flex": flex_attention_forward,
}


# ---------------------------------------------------------------------------
# The drafter's attention during training
# ---------------------------------------------------------------------------


class TrainingAttention:
    """Prepares a layer's mask from a mask specification (see the module docstring) and attends with the backend's
    kernel; `DFlashDraftModel.forward` calls `prepare` once per layer type and `attend` in every layer."""

    def __init__(self, implementation: AttnImplementation, hidden_size: int, head_dim: int) -> None:
        if implementation != "auto" and implementation not in KERNELS:
            raise ValueError(f"unknown attn_implementation {implementation!r}")
        self.implementation = implementation
        self.hidden_size = hidden_size
        self.head_dim = head_dim

    def backend(self, device: torch.device) -> str:
        if self.implementation == "auto":
            # Measured on an H200 (benchmarks/results): flex's block-sparse kernels win for large drafters (hidden
            # 4096: 0.755 vs 1.041 s/step). A training run never gets here: fast_path.training_path chooses its
            # kernel by the run's length too (flex for small drafters in long runs); this rule serves drafters
            # built elsewhere (benchmarks, tests, `load_draft`).
            large = self.hidden_size >= FLEX_MIN_HIDDEN_SIZE
            return "flex" if device.type == "cuda" and large else "sdpa"
        return self.implementation

    def prepare(self, spec: MaskSpec, window: int | None, q_pos: Tensor, k_pos: Tensor) -> PreparedMask:
        """The mask `attend` takes for a layer with the given sliding window."""
        backend = self.backend(q_pos.device)
        if isinstance(spec, BlockMask):
            if backend != "flex" or window is not None:
                raise ValueError("a BlockMask needs attn_implementation='flex' and full-attention layers")
            return spec
        if isinstance(spec, PackedLayout):
            if backend == "flex":
                return make_packed_block_mask(spec, window)
            if backend == "sdpa":
                return packed_groups(spec, window, head_dim=self.head_dim)
            return packed_dense_mask(spec, window)[:, None]  # eager: the whole mask
        if isinstance(spec, AnchorLayout):
            if backend == "flex":
                return make_block_mask(spec, window)
            if backend == "sdpa":
                group = blocks_per_group(spec.num_blocks, spec.context_len, spec.block_size)
                if group < spec.num_blocks:
                    return grouped_dense_mask(spec, window, group)
            return batch_dense_mask(spec, window)[:, None]  # eager, or one group: the whole mask
        dense = DenseAttention.prepare(spec, window, q_pos, k_pos)  # None or an explicit mask, windowed
        if dense is None or backend != "flex":
            return dense
        return dense_to_block_mask(dense[:, 0])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: PreparedMask, scaling: float) -> Tensor:
        kernel = KERNELS[self.backend(q.device)]
        if isinstance(mask, GroupedMask):
            return grouped_attention(kernel, q, k, v, mask, scaling)
        if isinstance(mask, PackedGroups):
            return packed_grouped_attention(kernel, q, k, v, mask, scaling)
        return kernel(q, k, v, mask, scaling)


def use_training_attention(model: DFlashDraftModel, implementation: AttnImplementation = "auto") -> DFlashDraftModel:
    """Give `model` the training layouts and backends (in place); returns it."""
    model.attention = TrainingAttention(implementation, int(model.config.hidden_size), int(model.config.head_dim))
    return model


def training_drafter(config: Any, implementation: AttnImplementation = "auto") -> DFlashDraftModel:
    """A freshly initialised drafter of `config` (DFlash or DFlash 2, as it names) that takes the training layouts
    (see the module docstring)."""
    return use_training_attention(drafter_for(config), implementation)


@contextmanager
def uncompiled_sdpa(model: DFlashDraftModel) -> Iterator[DFlashDraftModel]:
    """`model` run eagerly (`torch.compiler.set_stance("force_eager")`: its compiled layers and the compiled
    flex_attention are bypassed) and with SDPA instead of flex, until the block ends (the ``eager`` reference backend
    is kept). For the evaluations inside a training run: they run the walk's padded layouts (a few sequences a
    forward), in shapes the training step never sees, under no_grad. Compiled, each new shape compiled anew until torch.compile's recompile limit was
    reached, after which the limited function ran eagerly for the rest of the process: on an H100 the evaluation at
    step 0 of a `--attention flex --compile` run left training on unfused flex, which ran out of memory at step 1
    (it tried to allocate 48.9 GiB) and then took ~2 s a step instead of 0.11 (2026-12-05). The backends agree
    numerically (tests), so the figures do not change."""
    previous = model.attention
    if isinstance(previous, TrainingAttention) and previous.implementation != "eager":
        model.attention = TrainingAttention("sdpa", previous.hidden_size, previous.head_dim)
    try:
        with torch.compiler.set_stance("force_eager"):
            yield model
    finally:
        model.attention = previous

