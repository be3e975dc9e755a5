"""The DFlash draft model (block-diffusion drafter), written out explicitly in the style of modeling_qwen3.py.

A stack of Qwen3-style decoder layers whose queries come from the block ("noise") stream only, while keys and
values are concat(k/v_proj(context), k/v_proj(block stream)). The context is the SAME tensor for every layer:
``hidden_norm(fc(target_features))`` where ``target_features`` concatenates the target's hidden states of
``target_layer_ids`` (it is not updated through the layers and is not passed through ``input_layernorm``).
The draft owns no embedding and no LM head: the block is embedded with the frozen target's ``embed_tokens`` and the
logits are ``target.lm_head(draft(...))``, both outside this module.

Parameter names equal the reference export (z-lab ``DFlashDraftModel``), without any prefix:
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``fc.weight``, ``hidden_norm.weight``.

Attention backends (all take the same mask specification and agree numerically):
``eager`` (explicit softmax over the whole dense mask, the reference), ``sdpa`` (torch SDPA with a boolean mask;
the training layout runs per group of blocks, see `grouped_attention`) and ``flex``
(flex_attention with a BlockMask; compiled on CUDA, the unfused implementation elsewhere).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash.shared.target_layers import default_layer_ids
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
    window_dense_mask,
)

AttnImplementation = Literal["auto", "eager", "sdpa", "flex"]
FLEX_MIN_HIDDEN_SIZE = 2048  # `auto` uses flex_attention on CUDA from this drafter width on (see `_backend`)
# What `DFlashDraftModel.forward` accepts as `attention_mask`:
#   None          -> every query sees every key (inference layout: context = all positions < start, one block);
#   AnchorLayout  -> the DFlash training mask over B padded sequences (see attention_masks.py);
#   PackedLayout  -> the same rule with the blocks of every sequence on one flat axis (batch 1; training);
#   Tensor        -> explicit boolean mask [B, Q, C + Q] or [B, 1, Q, C + Q] (True = attend);
#   BlockMask     -> a prebuilt flex mask (flex backend, full-attention layers only).
MaskSpec = Union[None, AnchorLayout, PackedLayout, Tensor, BlockMask]
PreparedMask = Union[None, Tensor, BlockMask, GroupedMask, PackedGroups]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@strict
class DFlashConfig(Qwen3Config):
    """A Qwen3 config plus the DFlash fields the reference loader reads.

    ``block_size`` and ``num_target_layers`` (the target's layer count) are top-level keys; ``mask_token_id`` and
    ``target_layer_ids`` live in ``dflash_config`` (as in the reference ``config.json``) and are exposed as
    properties. ``to_dict`` also writes ``rope_theta`` (and ``rope_scaling`` for non-default RoPE) at the top level
    because older loaders silently fall back to 10000 without it.
    """

    model_type = "qwen3"
    block_size: int = 16
    num_target_layers: int = 36
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.dflash_config = dict(self.dflash_config or {})
        for key in ("mask_token_id", "target_layer_ids"):  # tolerate top-level keys written by other tools
            if key in kwargs:
                self.dflash_config.setdefault(key, kwargs.pop(key))
        if self.architectures is None:
            self.architectures = ["DFlashDraftModel"]
        super().__post_init__(**kwargs)

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids is None:
            return default_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return list(ids)

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def embed_scale(self) -> float:
        """The target's embedding scale the block is embedded with (1.0 unless the target scales, e.g. Gemma)."""
        return float(self.dflash_config.get("embed_scale", 1.0))

    @property
    def num_context_layers(self) -> int:
        """How many target layers are concatenated into the context features (fc input = this * hidden)."""
        return len(self.target_layer_ids)

    @property
    def rope_theta(self) -> float:
        # transformers 5.17 reads this while the config is still being built (rope_parameters not set yet):
        # an AttributeError there means "use the default", any other error breaks every config load.
        rope = getattr(self, "rope_parameters", None) or {}
        if "rope_theta" not in rope:
            raise AttributeError("rope_theta")
        return float(rope["rope_theta"])

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        rope = dict(out.get("rope_parameters") or {})
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out


def _target_rope_parameters(target_config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE parameters of a target config dict written by transformers 4.x (rope_theta/rope_scaling) or 5.x.

    Per-layer-type parameters (Gemma 3: {sliding_attention: ..., full_attention: ...}) give the full-attention
    entry; a partial rotary factor (Qwen3-Next, GLM-4) is the target's attention detail and is not copied (the
    drafter rotates its whole head)."""
    rope = dict(target_config.get("rope_parameters") or {})
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    rope.pop("partial_rotary_factor", None)
    scaling = target_config.get("rope_scaling") or {}
    if not rope.get("rope_type") and scaling:
        rope.update(scaling)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", float(target_config.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    return rope


def config_from_target(
    target_config: Mapping[str, Any],
    target_layer_ids: Sequence[int] | None,
    num_draft_layers: int,
    block_size: int,
    mask_token_id: int,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    embed_scale: float = 1.0,
) -> DFlashConfig:
    """Size a draft config from the target's config dict (hidden, heads, KV heads, MLP, head_dim, RoPE, eps).

    ``target_layer_ids=None`` uses the reference default for ``num_draft_layers``. All draft layers use full
    attention unless ``layer_types`` (and ``sliding_window``) are given. ``embed_scale`` (the target's embedding
    scale) and the target's ``model_type`` are recorded in ``dflash_config``.
    """
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    kv_heads = int(target_config.get("num_key_value_heads") or heads)
    head_dim = int(target_config.get("head_dim") or hidden // heads)
    num_target_layers = int(target_config["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else None
    if ids is None:
        ids = default_layer_ids(num_target_layers, num_draft_layers)
    if any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} outside [0, {num_target_layers})")
    uses_window = layer_types is not None and "sliding_attention" in layer_types
    if uses_window and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=int(target_config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=num_draft_layers,
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_parameters=_target_rope_parameters(target_config),
        max_position_embeddings=int(target_config.get("max_position_embeddings", 32768)),
        vocab_size=int(target_config["vocab_size"]),
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=uses_window,
        sliding_window=sliding_window if uses_window else None,
        layer_types=list(layer_types) if layer_types is not None else None,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": ids, "embed_scale": float(embed_scale),
                       **({"target_model_type": target_config["model_type"]} if target_config.get("model_type")
                          else {})},
    )


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    """RMSNorm computed in float32 (identical to Qwen3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"DFlash draft layers use SwiGLU (silu); got hidden_act={config.hidden_act!r}")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [B, heads, L, D] with cos/sin [B, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kv_heads, L, D] -> [B, kv_heads * n_rep, L, D] (GQA expansion)."""
    if n_rep == 1:
        return x
    batch, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, n_rep, length, dim).reshape(batch, kv_heads * n_rep, length, dim)


# ---------------------------------------------------------------------------
# Attention backends: q [B, H, Q, D], k/v [B, H_kv, K, D], mask prepared for the backend -> [B, H, Q, D]
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


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """torch SDPA with an explicit boolean mask (KV heads expanded so every SDPA kernel accepts it)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=scaling)


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


ATTENTION_BACKENDS: dict[str, Callable[..., Tensor]] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flex": flex_attention_forward,
}


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Queries from the block stream; keys/values from [context; block]; q/k RMSNorm per head; RoPE; not causal."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} not a multiple of kv heads={self.num_kv_heads}")
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: Tensor,
        context: Tensor,
        q_rope: tuple[Tensor, Tensor],
        k_rope: tuple[Tensor, Tensor],
        mask: PreparedMask,
        backend: str,
    ) -> Tensor:
        """hidden_states [B, Q, H] (normed block stream), context [B, C, H] (normed fc output) -> [B, Q, H]."""
        batch, q_len, _ = hidden_states.shape
        kv_len = context.shape[1] + q_len
        kv_input = torch.cat([context, hidden_states], dim=1)

        q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q.transpose(1, 2), *q_rope)
        k = apply_rotary(k.transpose(1, 2), *k_rope)
        v = v.transpose(1, 2)

        attend = ATTENTION_BACKENDS[backend]
        if isinstance(mask, GroupedMask):
            out = grouped_attention(attend, q, k, v, mask, self.scaling)
        elif isinstance(mask, PackedGroups):
            out = packed_grouped_attention(attend, q, k, v, mask, self.scaling)
        else:
            out = attend(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x), context); then x + mlp(norm(x))."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: Tensor,
        context: Tensor,
        q_rope: tuple[Tensor, Tensor],
        k_rope: tuple[Tensor, Tensor],
        mask: PreparedMask,
        backend: str,
    ) -> Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), context, q_rope, k_rope, mask, backend)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class DFlashDraftModel(nn.Module):
    """The DFlash drafter: context projection (fc + hidden_norm), decoder layers over the block, final norm."""

    def __init__(self, config: DFlashConfig, attn_implementation: AttnImplementation = "auto") -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(config.num_context_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # non-persistent buffers only: not in the state dict
        self.layer_types: list[str] = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
        if len(self.layer_types) != config.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {config.num_hidden_layers} layers")
        self.attn_implementation: AttnImplementation = attn_implementation
        self.gradient_checkpointing = False
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def reset_parameters(self) -> None:
        """Reference initialisation: Linear ~ N(0, initializer_range), RMSNorm weights = 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, DFlashRMSNorm):
                nn.init.ones_(module.weight)

    def project_context(self, context_features: Tensor) -> Tensor:
        """[B, C, n * H] raw concatenated target features -> [B, C, H] = hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(context_features))

    def _backend(self, device: torch.device) -> str:
        if self.attn_implementation == "auto":
            # Measured on an H200 (benchmarks/results): flex's block-sparse kernels win for large drafters (hidden
            # 4096: 0.755 vs 1.041 s/step) and lost for small ones on the padded layout (hidden 576: 0.204 vs
            # 0.065 s/step, plus ~70 s of mask compilation per new anchor count). On the packed layout (bucketed
            # shapes) a 5-layer hidden-576 drafter's forward and backward over 1,856 blocks takes 0.057 s with
            # flex and 0.08-0.13 s with grouped SDPA, after ~60 s of compilation for the first two shapes and none
            # after (packed_attention_shapes_smollm2_cuda.json): flex pays off after ~1,300 steps. Not yet
            # measured in a whole training run, so small drafters stay on SDPA here; pass --attention flex for
            # long runs.
            large = self.config.hidden_size >= FLEX_MIN_HIDDEN_SIZE
            return "flex" if device.type == "cuda" and large else "sdpa"
        if self.attn_implementation not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attn_implementation {self.attn_implementation!r}")
        return self.attn_implementation

    def _window(self, layer_type: str) -> int | None:
        if layer_type == "full_attention":
            return None
        if layer_type == "sliding_attention":
            if self.config.sliding_window is None:
                raise ValueError("a sliding_attention layer needs config.sliding_window")
            return int(self.config.sliding_window)
        raise ValueError(f"unsupported layer type {layer_type!r}")

    def _prepare_mask(
        self, spec: MaskSpec, window: int | None, q_pos: Tensor, k_pos: Tensor, backend: str
    ) -> PreparedMask:
        """Turn a mask specification into what `backend` consumes for a layer with the given sliding window."""
        if isinstance(spec, BlockMask):
            if backend != "flex" or window is not None:
                raise ValueError("a BlockMask needs attn_implementation='flex' and full-attention layers")
            return spec
        if isinstance(spec, PackedLayout):
            if backend == "flex":
                return make_packed_block_mask(spec, window)
            if backend == "sdpa":
                return packed_groups(spec, window, head_dim=self.config.head_dim)
            return packed_dense_mask(spec, window)[:, None]  # eager: the whole mask
        if isinstance(spec, AnchorLayout):
            if backend == "flex":
                return make_block_mask(spec, window)
            if backend == "sdpa":
                group = blocks_per_group(spec.num_blocks, spec.context_len, spec.block_size)
                if group < spec.num_blocks:
                    return grouped_dense_mask(spec, window, group)
            return batch_dense_mask(spec, window)[:, None]  # eager, or one group: the whole mask
        dense = None
        if spec is not None:
            dense = spec.bool() if spec.dim() == 3 else spec.bool()[:, 0]
        if window is not None:
            in_window = window_dense_mask(q_pos, k_pos, window)
            dense = in_window if dense is None else dense & in_window
        if dense is None:
            return None
        return dense_to_block_mask(dense) if backend == "flex" else dense[:, None]

    def forward(
        self,
        noise_embeddings: Tensor,
        context_features: Tensor,
        q_position_ids: Tensor,
        k_position_ids: Tensor | None = None,
        attention_mask: MaskSpec = None,
    ) -> Tensor:
        """Draft hidden states for the block stream.

        noise_embeddings: [B, Q, H] target embeddings of the blocks ([anchor token, MASK, ...] per block).
        context_features: [B, C, n * H] raw concatenated target hidden states (fc + hidden_norm applied here).
        q_position_ids: [B, Q] positions of the block queries; k_position_ids: [B, C] context positions
        (default 0..C-1). attention_mask: see ``MaskSpec``. Returns [B, Q, H] after the final norm;
        logits = target lm_head(output), computed outside.
        """
        batch, q_len, _ = noise_embeddings.shape
        ctx_len = context_features.shape[1]
        if k_position_ids is None:
            k_position_ids = torch.arange(ctx_len, device=noise_embeddings.device).expand(batch, -1)
        backend = self._backend(noise_embeddings.device)

        context = self.project_context(context_features)
        all_k_pos = torch.cat([k_position_ids, q_position_ids], dim=1)
        q_rope = self.rotary_emb(noise_embeddings, q_position_ids)
        k_rope = self.rotary_emb(noise_embeddings, all_k_pos)
        masks = {
            layer_type: self._prepare_mask(attention_mask, self._window(layer_type), q_position_ids, all_k_pos, backend)
            for layer_type in set(self.layer_types)
        }

        hidden_states = noise_embeddings
        for layer, layer_type in zip(self.layers, self.layer_types):
            args = (hidden_states, context, q_rope, k_rope, masks[layer_type], backend)
            if self.gradient_checkpointing and self.training:
                hidden_states = checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden_states = layer(*args)
        return self.norm(hidden_states)
