"""The DFlash drafter and its speculative-decoding loop: the one definition of both.

Training (`dflash train`), offline acceptance, `dflash eval` and every export use this file; each export ships it as
`modeling_dflash.py` (named by the config's `auto_map`), so a drafter loads the way published DFlash drafters do:

    draft = AutoModel.from_pretrained(EXPORT, trust_remote_code=True)
    output_ids = draft.spec_generate(input_ids=ids, target=target, max_new_tokens=256, temperature=0.0,
                                     stop_token_ids=[...])

It imports only torch and transformers (it runs outside dflash) and borrows transformers' Qwen3 pieces (RMSNorm,
MLP, rotary embedding), as z-lab/dflash's `model.py` does. Training-only concerns (block masks of the training
layouts, grouped SDPA and flex kernels, the loss, compile) live in `draft_attention.py` and the trainer, and reach
this network through `DFlashDraftModel.attention` (how masks are prepared and attention computed); they define no
layer.

The network: a stack of Qwen3-style decoder layers whose queries come from the block ("noise") stream only, while
keys and values are concat(k/v_proj(context), k/v_proj(block stream)). The context is the same tensor for every
layer: ``hidden_norm(fc(target_features))``, where ``target_features`` concatenates the outputs of the target's
decoder layers ``target_layer_ids`` (what transformers calls ``hidden_states[i + 1]``). The drafter owns no embedding
and no LM head: the block [anchor, MASK, ...] is embedded with the target's embedding (times its scale, e.g.
Gemma's) and the logits are ``target.lm_head(draft(...))``. Weight names equal the reference export
(``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``fc.weight``, ``hidden_norm.weight``, ...), without a prefix.

The loop (`speculative_generate`, batch size 1), the semantics of z-lab's `dflash_generate`:
1. Prefill: the target runs the prompt with its KV cache; forward hooks on its decoder layers ``target_layer_ids``
   capture the context features (the raw layer outputs, exactly what stage 1 caches). The target's next token is the
   first "bonus" token. The features become the drafter's context (projected once through fc / hidden_norm and kept:
   the drafter's only cache).
2. Draft: one drafter forward over the block [bonus, MASK x (B - 1)] at positions start..start + B - 1; offsets
   1..B-1 give the draft tokens (argmax, or samples at temperature T).
3. Verify: one target forward over the whole block. Greedy: accept the longest prefix where draft token k equals the
   target's argmax at block position k - 1; emit the accepted drafts plus the target's own next token. Sampling:
   speculative rejection sampling (accept d_k with probability min(1, p(d_k) / q(d_k)); at the first rejection sample
   from norm(max(0, p - q)); if all pass, sample the extra token from p), so the output is distributed exactly as
   the target's own samples.
4. The accepted positions' target features extend the drafter context; the target cache is rolled back to the
   accepted length (`TargetRunner.rollback`): KV layers are cropped (sliding-window layers record their past until
   then); recurrent layers of hybrid linear-attention targets (Qwen3-Next, Qwen3.5), which cannot be cropped, are
   restored from a snapshot taken before the block and fed the accepted tokens again; a cache that refuses `crop` is
   rebuilt from the kept tokens. tau = mean over steps of accepted + 1.
Greedy output equals plain greedy decoding token for token, up to floating-point near-ties (the target verifies a
block of B tokens in one forward, plain decoding one token at a time).

The fast path (``decode="static"``, the default on CUDA): the target runs over a static KV cache of full-length
`StaticLayer`s (masks built from the positions, sliding windows included), so a rollback only moves the write
position back; the drafter keeps its projected context in a preallocated buffer and runs a fixed-shape block
forward over it (rows past the context masked); the verify block, the one-token step of plain decoding, the
drafter block and the prompt's forward in chunks of one width (`PREFILL_CHUNK`) are captured once as CUDA graphs
(`GraphedForward`) and replayed; the greedy acceptance runs on the device with one read-back per step, and the next
block is drafted on the device (its anchor and start taken there from the acceptance) while the host waits for that
read-back (`PIPELINED_DRAFT`). The linear-attention layers of hybrid targets (Qwen3-Next, Qwen3.5) keep their conv
and recurrent states in transformers' fixed-size `LinearAttentionLayer`s: `verify` copies them aside, and a rollback
inside the block copies them back and feeds the kept tokens again through a graphed forward of that width (captured
before the timing by `prewarm_rollbacks`); other stateful layers keep the dynamic path (`static_unsupported`). Where
graphs are captured, the drafter's block forward is compiled by torch.compile first (`COMPILE_DRAFTER`); the
target's fixed-width forwards are compiled too only where `COMPILE_TARGET` asks for it (opt-in: `dflash eval
--compile-target`, 2.2x plain decoding's tokens/s on an H100, docs/benchmarks.md).

Cache cropping: transformers >= 5.15 `Cache.crop(n)` takes the number of tokens to remove as a negative integer and
rejects a positive n (older versions read a positive n as the length to keep). `crop_cache(cache, keep)` therefore
always calls ``crop(-(length - keep))``, which means the same on both, never ``crop(0)``, and falls back to slicing
the layers' key/value tensors.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

# ---------------------------------------------------------------------------
# Configuration: the DFlash fields of a Qwen3 config
# ---------------------------------------------------------------------------


def dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash field of a drafter config: from its `dflash_config` dict, else a top-level attribute (as the
    reference loader reads them)."""
    fields = getattr(config, "dflash_config", None) or {}
    return fields[name] if name in fields else getattr(config, name, default)


# ---------------------------------------------------------------------------
# Attention: q [B, H, Q, D], k/v [B, H_kv, K, D] -> [B, H, Q, D]
# ---------------------------------------------------------------------------


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kv_heads, L, D] -> [B, kv_heads * n_rep, L, D] (GQA expansion)."""
    if n_rep == 1:
        return x
    batch, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, n_rep, length, dim).reshape(batch, kv_heads * n_rep, length, dim)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """[B, Q, K] bool: key visible iff q_position - k_position < window (not causal, like the block itself)."""
    return (q_pos[:, :, None] - k_pos[:, None, :]) < window


class DenseAttention:
    """Inference attention: an optional boolean mask [B, Q, K] (True = attend) and torch SDPA.

    ``prepare(spec, window, q_pos, k_pos)`` turns the forward's ``attention_mask`` (None: every query sees every
    key; or a boolean tensor [B, Q, K] / [B, 1, Q, K]) into what ``attend`` takes for a layer with the given sliding
    window; training swaps in `draft_attention.TrainingAttention`, which also takes the training layouts."""

    @staticmethod
    def prepare(spec: Any, window: int | None, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        dense = None
        if spec is not None:
            dense = spec.bool() if spec.dim() == 3 else spec.bool()[:, 0]
        if window is not None:
            in_window = window_mask(q_pos, k_pos, window)
            dense = in_window if dense is None else dense & in_window
        return None if dense is None else dense[:, None]

    @staticmethod
    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=scaling)


Attend = Callable[[Tensor, Tensor, Tensor, Any, float], Tensor]


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Queries from the block stream; keys/values from [context; block]; q/k RMSNorm per head; RoPE; not causal."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} not a multiple of kv heads={self.num_kv_heads}")
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden: Tensor, context: Tensor, q_rope: tuple[Tensor, Tensor], k_rope: tuple[Tensor, Tensor],
                mask: Any, attend: Attend) -> Tensor:
        """hidden [B, Q, H] (normed block stream), context [B, C, H] (projected target features) -> [B, Q, H]."""
        batch, q_len, _ = hidden.shape
        kv_input = torch.cat([context, hidden], dim=1)
        kv_len = kv_input.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, *q_rope)
        _, k = apply_rotary_pos_emb(k, k, *k_rope)
        out = attend(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x), context); then x + mlp(norm(x)). A DFlash 2 layer wraps each
    sublayer in a `GroupedDynamicConv` (`attention_conv`, `mlp_conv`: None in DFlash)."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash draft layers use SwiGLU (silu); got hidden_act={config.hidden_act!r}")
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None

    def forward(self, hidden: Tensor, context: Tensor, q_rope: tuple[Tensor, Tensor], k_rope: tuple[Tensor, Tensor],
                mask: Any, attend: Attend) -> Tensor:
        x = self.input_layernorm(hidden)
        if self.attention_conv is None:
            hidden = hidden + self.self_attn(x, context, q_rope, k_rope, mask, attend)
        else:
            x, taps = self.attention_conv.prepare(x)
            hidden = hidden + self.attention_conv.finish(self.self_attn(x, context, q_rope, k_rope, mask, attend), taps)
        x = self.post_attention_layernorm(hidden)
        if self.mlp_conv is None:
            return hidden + self.mlp(x)
        x, taps = self.mlp_conv.prepare(x)
        return hidden + self.mlp_conv.finish(self.mlp(x), taps)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter: context projection (fc + hidden_norm), decoder layers over the block, final norm."""

    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # non-persistent buffers only: not in the state dict
        self.layer_types: list[str] = list(getattr(config, "layer_types", None)
                                           or ["full_attention"] * config.num_hidden_layers)
        if len(self.layer_types) != config.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {config.num_hidden_layers} layers")
        self.attention: Any = DenseAttention  # see DenseAttention; training sets draft_attention.TrainingAttention
        self.gradient_checkpointing = False
        # While training, the first layer's input (the frozen block embedding) is made to need a gradient, as every
        # later layer's input does, so that the compiled layers' one code object takes one version per shape, not
        # two (run_setup.compile_layers sets it).
        self.layer_inputs_need_grad = False
        self.last_acceptance_lengths: list[int] = []
        self.post_init()

    @property
    def block_size(self) -> int:
        return int(dflash_value(self.config, "block_size", 16))

    @property
    def mask_token_id(self) -> int:
        return int(dflash_value(self.config, "mask_token_id"))

    @property
    def target_layer_ids(self) -> list[int]:
        ids = dflash_value(self.config, "target_layer_ids")
        if ids is None:
            raise ValueError("the drafter config has no dflash_config.target_layer_ids")
        return [int(i) for i in ids]

    @property
    def embed_scale(self) -> float:
        """The target's embedding scale the block is embedded with (1.0 unless the target scales, e.g. Gemma)."""
        return float(dflash_value(self.config, "embed_scale", 1.0))

    def _init_weights(self, module: nn.Module) -> None:
        """Reference initialisation: Linear ~ N(0, initializer_range), RMSNorm weights = 1; the rotary embedding's
        buffers by transformers' own rule (transformers 5 builds a model loaded with `from_pretrained` on the meta
        device and fills what the checkpoint lacks here: without it `rotary_emb.inv_freq` was left uninitialised
        memory in `AutoModel`-loaded exports, and decoding read garbage frequencies, at times NaN)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Qwen3RotaryEmbedding):
            super()._init_weights(module)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> DFlashDraftModel:
        """Every cast (`.to(dtype)`, `.bfloat16()`, ...) as torch does it, except that the rotary frequencies stay
        float32, as transformers builds them and training uses them: `dflash eval` casts the drafter to the target's
        bf16 on a GPU, and a bf16 `inv_freq` puts the rotary angle ~1.2 rad off at distance 1,024 (head dim 128,
        theta 1e6), so the drafter would attend over its context with positions it was not trained on."""
        super()._apply(fn, recurse)
        rotary = self.rotary_emb
        if rotary.inv_freq.dtype != torch.float32 and rotary.inv_freq.device.type != "meta":
            exact = type(rotary)(rotary.config)  # built as at construction: float32, on the CPU
            for name in ("inv_freq", "original_inv_freq"):
                setattr(rotary, name, getattr(exact, name).to(getattr(rotary, name).device))
        return self

    def window(self, layer_type: str) -> int | None:
        """The sliding window of a layer type (None: full attention)."""
        if layer_type == "full_attention":
            return None
        if layer_type == "sliding_attention":
            if self.config.sliding_window is None:
                raise ValueError("a sliding_attention layer needs config.sliding_window")
            return int(self.config.sliding_window)
        raise ValueError(f"unsupported layer type {layer_type!r}")

    def project_context(self, target_hidden: Tensor) -> Tensor:
        """[B, C, n * H] raw concatenated target features -> [B, C, H] = hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, noise_embedding: Tensor, target_hidden: Tensor, q_position_ids: Tensor,
                k_position_ids: Tensor | None = None, attention_mask: Any = None, *,
                projected: bool = False) -> Tensor:
        """Drafter hidden states [B, Q, H] (after the final norm) for the block stream.

        noise_embedding: [B, Q, H] target embeddings of the blocks ([anchor, MASK, ...] per block, times the
        target's embedding scale). target_hidden: [B, C, n * H] raw concatenated target features (or, with
        ``projected``, the context already through `project_context`). q_position_ids: [B, Q] positions of the block
        queries; k_position_ids: [B, C] context positions (default 0..C-1). attention_mask: what `self.attention`
        prepares (`DenseAttention`: None or a boolean mask). Logits = target lm_head(output), computed outside.
        """
        batch = noise_embedding.shape[0]
        context = target_hidden if projected else self.project_context(target_hidden)
        if k_position_ids is None:
            k_position_ids = torch.arange(context.shape[1], device=noise_embedding.device).expand(batch, -1)
        all_k_pos = torch.cat([k_position_ids, q_position_ids], dim=1)
        q_rope = self.rotary_emb(noise_embedding, q_position_ids)
        k_rope = self.rotary_emb(noise_embedding, all_k_pos)
        masks = {layer_type: self.attention.prepare(attention_mask, self.window(layer_type), q_position_ids,
                                                    all_k_pos)
                 for layer_type in set(self.layer_types)}
        hidden = noise_embedding
        if self.layer_inputs_need_grad and torch.is_grad_enabled() and not hidden.requires_grad:
            hidden = hidden.detach().requires_grad_()  # (a new leaf: the caller's tensor is left as it is)
        for layer, layer_type in zip(self.layers, self.layer_types):
            args = (hidden, context, q_rope, k_rope, masks[layer_type], self.attention.attend)
            if self.gradient_checkpointing and self.training:
                hidden = checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden = layer(*args)
        return self.norm(hidden)

    @torch.inference_mode()
    def spec_generate(self, input_ids: Any, target: nn.Module, max_new_tokens: int = 256,
                      temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None,
                      generator: torch.Generator | None = None, decode: str = "auto") -> Tensor:
        """Speculative decoding of one prompt (batch 1) -> [1, prompt + new] token ids (the new ones end after the
        first stop token); greedy output equals the target's own greedy decoding. ``input_ids``: ids [1, L] or [L],
        a list, or what ``tokenizer.apply_chat_template(..., return_tensors="pt")`` returns (a mapping holding
        ``input_ids`` in transformers 5). `last_acceptance_lengths` holds accepted + 1 per step (tau = its mean).
        ``decode``: "auto" (static caches and CUDA graphs on CUDA, kept on the target for later calls), "static" or
        "dynamic" (see `speculative_generate`)."""
        prompt = prompt_ids(input_ids)
        result = speculative_generate(target, self, target.get_input_embeddings().weight,
                                      target.get_output_embeddings().weight, prompt, self.target_layer_ids,
                                      max_new_tokens, stop_token_ids or [], temperature=temperature,
                                      generator=generator, embed_scale=self.embed_scale, decode=decode)
        self.last_acceptance_lengths = [a + 1 for a in result.accepted]
        device = input_ids.device if isinstance(input_ids, Tensor) else self.device
        return torch.tensor([prompt + result.tokens], dtype=torch.long, device=device)


# ---------------------------------------------------------------------------
# DFlash 2: a dynamic grouped convolution around each sublayer, and the pairwise path selector
# ---------------------------------------------------------------------------


def block_shift(x: Tensor, offset: int, block_size: int) -> Tensor:
    """x [B, Q, H] (Q a multiple of `block_size`, blocks contiguous) -> x_{t - offset} within each block: zeros where
    t - offset falls before the block's first position, so nothing crosses a block boundary."""
    if offset == 0:
        return x
    blocks = x.unflatten(1, (-1, block_size))
    return F.pad(blocks[:, :, :-offset], (0, 0, offset, 0)).flatten(1, 2)


class GroupedDynamicConv(nn.Module):
    """Two-tap dynamic grouped convolution around a sublayer (DFlash 2).

    From the sublayer's normed input x, ``kernel_projection`` (H -> 2 * K * G, G = H / group_size) gives per-group
    dynamic taps d, added to the static ``base_kernel`` [2, K, H]. Before the sublayer (`prepare`):
    y_t = sum_o (base[0, o] + d[t, 0, o, group]) * x_{t-o}; after it (`finish`), on the sublayer output f:
    z_t = sum_o (base[1, o] + d[t, 1, o, group]) * f_{t-o}. Taps stay inside a block (`block_shift`). Identity
    initialisation (`reset_identity`): unit self-tap, zero elsewhere, zero projection, so y = x and z = f."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide the hidden size {hidden_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, x: Tensor, dynamic: Tensor, base: Tensor) -> Tensor:
        """sum over taps o of (base[o] + dynamic[..., o, group]) * x_{t-o}; dynamic [B, Q, K, G], base [K, H].
        The taps' per-channel coefficients are formed once (a broadcast add), then one multiply-add per tap: half
        the ops of adding the static and dynamic products separately, 13 % faster forward + backward on 2 CPU
        cores (16K tokens x 576); exactly y = x at the identity (coefficients 1 and 0)."""
        coef = (dynamic[..., None] + base.to(x.dtype).unflatten(-1, (self.groups, self.group_size))).flatten(-2)
        out = x * coef[..., 0, :]
        for offset in range(1, self.kernel_size):
            out = torch.addcmul(out, block_shift(x, offset, self.block_size), coef[..., offset, :])
        return out

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the convolved sublayer input, the taps `finish` uses) from the normed input x [B, Q, H]."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, f: Tensor, taps: Tensor) -> Tensor:
        return self._convolve(f, taps, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """The pairwise path selector (DFlash 2).

    At each block position t the candidates are the top-k drafter logits (U_t their values); a candidate b after the
    predecessor a scores S_t(a, b) = U_t(b) + <A[a] * P(h_t), B[b]>, with codebooks A (``predecessor_codebook``) and
    B (``successor_codebook``) [V, r] and P (``hidden_projection``): H -> r. Decoding walks the block from its anchor
    (`walk`). Identity initialisation (`reset_identity`): B = 0, so S = U and the walk picks DFlash's tokens."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        rank = int(dflash_value(config, "selector_rank"))
        self.top_k = int(dflash_value(config, "selector_top_k"))
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.initializer_range = float(getattr(config, "initializer_range", 0.02))
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        nn.init.normal_(self.predecessor_codebook, mean=0.0, std=self.initializer_range)
        self.successor_codebook.zero_()
        nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=self.initializer_range)

    def candidates(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(U, candidate ids), each [..., k]: the top-k of logits [..., V], highest first."""
        return torch.topk(logits, self.top_k, dim=-1)

    def scores(self, projected: Tensor, predecessors: Tensor, unary: Tensor, candidates: Tensor) -> Tensor:
        """S(a, b) [..., k] for predecessors a [...], P(h) ``projected`` [..., r], U and candidates [..., k].
        The codebook rows are gathered with `F.embedding`, not indexing: the same forward, but indexing's backward
        (a sorted, duplicate-serialising index_put) took 19 ms of a 0.21 s DFlash 2 step on an H100 (the candidates
        repeat the frequent tokens thousands of times a step; profile in docs/benchmarks.md), and embedding's
        backward is made for such indices (the gain on the GPU is not measured yet)."""
        query = F.embedding(predecessors, self.predecessor_codebook) * projected
        successors = F.embedding(candidates, self.successor_codebook).to(query.dtype)
        return unary + torch.einsum("...r,...kr->...k", query, successors).to(unary.dtype)

    def walk(self, hidden: Tensor, logits: Tensor, anchors: Tensor, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """The path through a block: hidden [N, T, H] and logits [N, T, V] of block positions 1..T, anchors [N].
        Greedy: b_t = argmax S_t(b_{t-1}, .); at temperature T a sample from softmax(S_t / T) over the candidates.
        Returns (tokens [N, T], candidates [N, T, k], the proposal probabilities over the candidates [N, T, k] when
        sampling, else None). Logits in the compute dtype are fine: the top-k is taken on them (as training takes
        it) and only the k values are made float32, the same values as from a float32 copy of all V."""
        return self.walk_candidates(hidden, *self.candidates(logits), anchors, temperature, generator)

    def walk_candidates(self, hidden: Tensor, unary: Tensor, candidates: Tensor, anchors: Tensor,
                        temperature: float = 0.0, generator: torch.Generator | None = None
                        ) -> tuple[Tensor, Tensor, Tensor | None]:
        """`walk` from the candidates already taken (`candidates`: U and ids [N, T, k]), for a caller that takes
        them a few rows of logits at a time (the offline walk: one walk for all of a forward's blocks)."""
        unary = unary.float()
        projected = self.hidden_projection(hidden)
        predecessor = anchors
        path, proposals = [], []
        for t in range(hidden.shape[1]):
            scores = self.scores(projected[:, t], predecessor, unary[:, t], candidates[:, t]).float()
            if temperature > 0:
                probs = torch.softmax(scores / temperature, dim=-1)
                index = _sample(probs, generator).to(candidates.device)
                proposals.append(probs)
            else:
                index = scores.argmax(-1)
            predecessor = candidates[:, t].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, 1), candidates, (torch.stack(proposals, 1) if proposals else None)

    def propose(self, hidden: Tensor, logits: Tensor, anchor: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], Tensor | None]:
        """One block's draft tokens (hidden [T, H] and float logits [T, V] of positions 1..T) and, when sampling,
        the probabilities they were drawn from over the whole vocabulary [T, V] (the proposal over the candidates,
        zero elsewhere): what rejection sampling verifies against."""
        anchors = torch.tensor([anchor], device=logits.device)
        tokens, candidates, proposal = self.walk(hidden[None].to(logits.device, self.hidden_projection.weight.dtype),
                                                 logits[None], anchors, temperature, generator)
        if proposal is None:
            return tokens[0].tolist(), None
        return tokens[0].tolist(), torch.zeros_like(logits).scatter_(-1, candidates[0], proposal[0].to(logits.dtype))


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash 2 drafter: the DFlash drafter plus a `GroupedDynamicConv` around each sublayer and a
    `CandidateSelector`. Freshly built (or grown from a DFlash drafter: `reset_identity`), it computes exactly what
    its DFlash backbone computes and picks the same greedy tokens."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)  # the backbone, initialised as a DFlash drafter of the same seed is
        kernel_size = int(dflash_value(config, "conv_kernel_size"))
        group_size = int(dflash_value(config, "conv_group_size"))
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(config.hidden_size, kernel_size, group_size, self.block_size)
            layer.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel_size, group_size, self.block_size)
        self.candidate_selector = CandidateSelector(config)  # each added part starts as the identity

    def added_parameter_names(self) -> list[str]:
        """The weights DFlash 2 adds to its DFlash backbone."""
        return [name for name, _ in self.named_parameters()
                if name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name]

    def reset_identity(self) -> None:
        """Identity initialisation of the DFlash 2 parts (the backbone is left as it is)."""
        for module in self.modules():
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_identity()

    def _init_weights(self, module: nn.Module) -> None:
        # transformers initialises weights missing from a checkpoint module by module: the DFlash 2 parts get their
        # identity values (set after their Linear children, which the generic rule would otherwise randomise).
        super()._init_weights(module)
        if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
            module.reset_identity()


def drafter_for(config: Qwen3Config) -> DFlashDraftModel:
    """A freshly initialised drafter of the architecture the config names (DFlash, or DFlash 2)."""
    if "DFlash2DraftModel" in (getattr(config, "architectures", None) or []):
        return DFlash2DraftModel(config)
    return DFlashDraftModel(config)


# ---------------------------------------------------------------------------
# The target side of the loop: cache creation / cropping, layer hooks, forwards, rollback
# ---------------------------------------------------------------------------


def new_cache(model: nn.Module) -> Any:
    """An empty DynamicCache for the target (layer types from its config where the version supports it)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # versions whose DynamicCache takes no config
        cache = DynamicCache()
    # Sliding-window layers keep what a rollback needs until `crop`; recurrent layers are snapshotted instead (their
    # past recording covers only the conv state, and it grows without bound when nothing is cropped).
    for layer in getattr(cache, "layers", None) or []:
        if hasattr(layer, "activate_past_recording") and not has_recurrent_state(layer):
            layer.activate_past_recording()
    return cache


def has_recurrent_state(layer: Any) -> bool:
    """A cache layer with a state that `crop` cannot rewind: linear attention / SSM (conv and recurrent states)."""
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: Any, keep: int) -> None:
    """Cut the cache back to its first ``keep`` positions, on old and new transformers alike (see the module
    docstring); if `crop` is missing or leaves the wrong length, the layers' key/value tensors are sliced."""
    current = cache_length(cache)
    if keep > current:
        raise ValueError(f"cannot crop a cache of {current} positions to {keep}")
    remove = current - keep
    if remove == 0:
        return
    if hasattr(cache, "crop"):
        try:
            cache.crop(-remove)
        except (ValueError, RuntimeError, NotImplementedError):
            pass
        if cache_length(cache) == keep:
            return
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if any(getattr(layer, "is_sliding", False) or has_recurrent_state(layer) for layer in layers):
            raise RuntimeError(f"{type(cache).__name__} refused crop and holds windowed or recurrent layers")
        for layer in layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :keep, :]
                layer.values = layer.values[..., :keep, :]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = keep
    elif hasattr(cache, "key_cache"):  # transformers 4.4x-4.5x
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = cache.key_cache[i][..., :keep, :]
            cache.value_cache[i] = cache.value_cache[i][..., :keep, :]
        if hasattr(cache, "_seen_tokens"):
            cache._seen_tokens = keep
    if cache_length(cache) != keep:
        raise RuntimeError(f"could not crop the KV cache ({type(cache).__name__}) to {keep} positions")


def target_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM: `model.get_decoder().layers`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (`model.get_decoder().layers`)")
    return layers


# ---------------------------------------------------------------------------
# The fast path: static caches, fixed-shape forwards, CUDA graphs
# ---------------------------------------------------------------------------

DECODE_MODES = ("auto", "dynamic", "static")
STATIC_ROUNDING = 256  # static buffers hold a multiple of this many positions (the smallest one this many)


def static_capacity(needed: int, planned: bool = False) -> int:
    """The size of a static buffer that holds ``needed`` positions. ``planned`` (the caller sized it once for all
    its prompts, as `dflash eval` does): the next multiple of STATIC_ROUNDING, since attention reads the whole
    buffer at every step. Else the next power of two (at least STATIC_ROUNDING), so that a caller whose prompts grow
    (`spec_generate` without a capacity) rebuilds its buffers, graphs and compiled drafter block a few times, not at
    every multiple of 256 (each new size is one more torch.compile entry, and past its recompile limit, 8, the
    drafter block would run eagerly)."""
    if planned:
        return -(-needed // STATIC_ROUNDING) * STATIC_ROUNDING
    return max(STATIC_ROUNDING, 1 << max(0, needed - 1).bit_length())


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _target_layer_types(model: nn.Module) -> list[str]:
    config = _text_config(model)
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * int(config.num_hidden_layers)


# The hybrid linear-attention families whose recurrent states the static path keeps (one conv and one recurrent
# state per layer, gated delta-net: tested against the dynamic path and a cache-free forward). Other model types with
# linear-attention layers (Bamba, Jamba, MiniMax, ...) keep the dynamic path: some hold several states per layer, and
# transformers' cached multi-token forward of some (Jamba) does not match a cache-free one on either path.
STATIC_HYBRID_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


def static_unsupported(target: nn.Module) -> str | None:
    """Why the static path cannot run this target (None: it can): it needs transformers' `StaticLayer`, only full
    attention, sliding-window attention and linear-attention layers (the recurrent layers of hybrid targets such as
    Qwen3-Next and Qwen3.5, held in transformers' `LinearAttentionLayer`; other stateful layers keep the dynamic
    path), SDPA or eager attention, and, with sliding or linear layers, a model that takes per-layer-type masks (a
    dict)."""
    try:
        from transformers.cache_utils import Cache, StaticLayer

        Cache(layers=[StaticLayer(max_cache_len=1)])
    except (ImportError, TypeError) as error:
        return f"this transformers version builds no cache of StaticLayers ({error})"
    types = set(_target_layer_types(target))
    other = types - {"full_attention", "sliding_attention", "linear_attention"}
    if other or (getattr(target, "_is_stateful", False) and "linear_attention" not in types):
        return f"layers of type {sorted(other) or 'stateful'} (only linear-attention recurrent layers decode statically)"
    if "linear_attention" in types:
        model_type = getattr(_text_config(target), "model_type", None)
        if model_type not in STATIC_HYBRID_MODEL_TYPES:
            return (f"hybrid model type {model_type!r} (the static path's recurrent states are tested on "
                    f"{', '.join(sorted(STATIC_HYBRID_MODEL_TYPES))})")
        try:
            from transformers.cache_utils import LinearAttentionLayer  # noqa: F401
        except ImportError as error:
            return f"this transformers version has no LinearAttentionLayer for the linear-attention layers ({error})"
    implementation = getattr(_text_config(target), "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (the static path builds SDPA/eager masks)"
    if types & {"sliding_attention", "linear_attention"}:
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
        try:
            source = inspect.getsource(type(decoder).forward)
        except (OSError, TypeError):
            source = ""
        if "attention_mask, dict" not in source:
            return (f"{type(decoder).__name__} takes no per-layer-type masks (needed for its sliding-window or "
                    "linear-attention layers)")
    return None


def static_cache(target: nn.Module, capacity: int) -> Any:
    """A cache of full-length `StaticLayer`s (sliding-window layers included: their window is applied by the mask,
    so a rollback never loses a position a ring buffer would have overwritten) and, for the linear-attention layers
    of hybrid targets, transformers' `LinearAttentionLayer` (conv and recurrent states of fixed size, updated in
    place: their addresses stay fixed for CUDA graphs once the first forward has allocated them)."""
    from transformers.cache_utils import Cache, StaticLayer

    def layer(layer_type: str) -> Any:
        if layer_type == "linear_attention":
            from transformers.cache_utils import LinearAttentionLayer

            return LinearAttentionLayer()
        return StaticLayer(max_cache_len=capacity)

    return Cache(layers=[layer(layer_type) for layer_type in _target_layer_types(target)])


class GraphedForward:
    """A fixed-shape function of preallocated input buffers, run eagerly or replayed from a CUDA graph captured on
    its first call (after two warm-up runs on a side stream). Its outputs are the graph's static tensors: valid until
    the next call. A capture that fails leaves the function eager (``failure`` says why). ``prepare`` (optional) runs
    before each of the first call's runs (the warm-ups, the replay after the capture, an eager retry), outside the
    graph: it puts back state that a run advances (the recurrent states of a hybrid target), so that the first call
    computes what one run would."""

    def __init__(self, function: Callable[[], Any], graphs: bool, pool: Any = None,
                 prepare: Callable[[], None] | None = None) -> None:
        self.function = function
        self.graphs = graphs
        self.pool = pool
        self.prepare = prepare or (lambda: None)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.failure: str | None = None

    def __call__(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if not self.graphs:
            return self.function()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.prepare()
                self.function()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.function()
        except Exception as error:  # noqa: BLE001 - any failure inside the capture: the function runs eagerly
            self.graphs, self.failure = False, f"CUDA graph capture failed: {error}"
            torch.cuda.synchronize()
            self.prepare()
            return self.function()
        self.graph, self.outputs = graph, outputs
        self.prepare()
        graph.replay()
        return outputs


class CompiledForward:
    """A fixed-shape function compiled by torch.compile (full graph, static shapes) on its first call, outside any
    CUDA graph capture (`GraphedForward`'s warm-up runs), and called compiled from then on; a function torch.compile
    cannot take runs eagerly instead, and ``failure`` says why in one line (Dynamo's messages run over many)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.failure: str | None = None
        self._compiled = torch.compile(function, fullgraph=True, dynamic=False)
        self._call: Callable[..., Any] = self._first_call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def _first_call(self, *args: Any) -> Any:
        try:
            outputs = self._compiled(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure; the eager function computes the same
            self.failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
            self._call = self.function
            return self.function(*args)
        self._call = self._compiled
        return outputs


def resolve_decode(decode: str, device: torch.device) -> tuple[bool, bool]:
    """(static caches, CUDA graphs) for a `decode` mode: auto = static with graphs on CUDA, dynamic elsewhere;
    static = static caches, graphs on CUDA only; dynamic = transformers' DynamicCache, eager forwards."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode={decode!r}: choose one of {', '.join(DECODE_MODES)}")
    static = decode == "static" or (decode == "auto" and device.type == "cuda")
    return static, static and device.type == "cuda"


# Whether the static path compiles the target's fixed-width forwards (`TargetRunner._static_step` of the verify
# block and of the one-token step; not the prefill's chunks) with torch.compile (fullgraph, static shapes, one compiled
# function per width) before their CUDA graphs are captured, so the graphs replay Inductor's fused kernels instead
# of the eager modules' (~1,350 kernels a SmolLM2-135M step on an H100, ~3.5 ms). Opt-in (False, `dflash eval
# --compile-target`): 2.2x faster decoding on an H100, but a whole 20-prompt evaluation took 108 s with its ~58 s
# warm-up, and the lossless check weakens to prefixes at bf16 near-ties (docs/benchmarks.md);
# benchmarks/bench_eval_decode.py --compile-target compares it in one run. The layer-capturing hooks of `hooked()`
# are traced into the compiled forward (no graph break on the llama and gemma3_text families).
COMPILE_TARGET = False

# The width of the graphed static path's prefill chunks: a prompt of up to PREFILL_CHUNKED_UP_TO positions runs as
# ceil(L / PREFILL_CHUNK) forwards of this fixed width (the last padded; what the padding writes lies past the cache's
# length, where nothing reads before the next forwards write), so its prefill has the one shape the warm-up captured
# as a CUDA graph (eager kernels in the graph: no compilation added) instead of an eager forward of a new length.
# Why: on an H100 speculative decoding's first token, an eager prefill, took ~50 ms more than plain decoding's on
# every prompt whose length the warm-up had not met (docs/benchmarks.md, "The first token, cold, and prompt
# lookup's padded width"); with the chunks the first token took 7.3 ms for each method (H100, 2026-12-07, "The
# chunked prefill, measured"). Longer prompts keep one eager forward: in
# chunks of 64 a large target would read its weights once a chunk. Hybrid targets too (padding would advance their
# recurrent states), and a runner whose chunk could not be captured.
PREFILL_CHUNK = 64
PREFILL_CHUNKED_UP_TO = 4 * PREFILL_CHUNK


class TargetRunner:
    """Runs the target with its KV cache; captures the outputs of its decoder layers ``layer_ids`` through forward
    hooks (the raw layer outputs, as stage 1 caches them) while inside `hooked()`.

    With ``capacity`` (the static path, see `static_unsupported`), the cache is a static one of that many positions:
    every forward writes at its start position (set on the device before the forward), attention masks are built
    from the positions, rollback only moves the write position back, and forwards of a fixed width (the verify
    block, the one-token decode step) are replayed from CUDA graphs with ``graphs``, compiled first with
    `COMPILE_TARGET`. With graphs, prefills of up to `PREFILL_CHUNKED_UP_TO` positions run in chunks of
    ``prefill_chunk`` positions (`PREFILL_CHUNK`; 0: one eager forward; a test may set it without graphs), each a
    fixed-width forward like the others (graphed, not compiled); a hybrid target's run eagerly."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int] = (), capacity: int | None = None,
                 graphs: bool = False, prefill_chunk: int | None = None) -> None:
        self.target = target
        self.layer_ids = list(layer_ids)
        self.device = next(target.parameters()).device
        self.capacity = capacity
        self.graphs = graphs
        self.cache = new_cache(target) if capacity is None else static_cache(target, capacity)
        self.length = 0  # positions the static cache holds
        self._forwards: dict[tuple[int, bool], GraphedForward] = {}
        self._inputs: dict[int, Tensor] = {}
        self._start = torch.zeros((), dtype=torch.long, device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        params = set(inspect.signature(target.forward).parameters)
        self._has_cache_position = "cache_position" in params  # transformers 4.x static layers write there
        # transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._outputs: dict[int, Tensor] | None = None  # layer id -> output of the last forward, while hooked
        self.history: list[int] = []  # the token ids the cache holds, in order (for recomputation)
        self._snapshot: dict[int, Any] | None = None  # recurrent layers as they were before the block being verified
        self._block_start = 0  # the cache length when that snapshot was taken
        # The static path's recurrent states (linear-attention layers of hybrid targets): the live tensors (fixed
        # addresses once the first forward allocated them), their values before the block being verified, and their
        # values before a forward's first call (which runs it three times to capture its graph).
        self._recurrent = capacity is not None and any(has_recurrent_state(layer) for layer in self.cache.layers)
        self._states: list[Tensor] = []
        self._saved: list[Tensor] = []
        self._before_capture: list[Tensor] = []
        self._block_width = 0  # the width of the block being verified (0: none since the last rollback)
        self.static_unsupported: str | None = None  # why a dynamic runner was made where static was asked for
        # the fixed-width forwards are compiled (`COMPILE_TARGET`) while none failed to (`compile_failure`)
        self._compile = capacity is not None and COMPILE_TARGET
        self.compile_failure: str | None = None
        self._compiled_steps: dict[int, CompiledForward] = {}  # width -> its compiled `_static_step`
        # The widths compiled with COMPILE_TARGET: the one-token step and the verify blocks a loop names (DFlash's
        # block size, prompt lookup's padded width); others (a hybrid target's rollback refeeds) run eagerly in
        # their graphs. Every width of every runner is one more entry of one code object, and past torch.compile's
        # recompile limit (8) fullgraph compilation fails.
        self.compile_widths: set[int] = {1}
        self.prefill_chunk = 0 if capacity is None or self._recurrent else (
            (PREFILL_CHUNK if graphs else 0) if prefill_chunk is None else prefill_chunk)

    @contextmanager
    def hooked(self) -> Iterator[TargetRunner]:
        """Capture the outputs of `layer_ids` in every forward inside."""
        layers = target_decoder_layers(self.target)
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"layers {bad} do not exist: the target has layers 0..{len(layers) - 1}")
        outputs: dict[int, Tensor] = {}

        def keep(layer_id: int) -> Callable[..., None]:
            def hook(_module: Any, _inputs: Any, output: Any) -> None:
                outputs[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        handles = [layers[i].register_forward_hook(keep(i)) for i in self.layer_ids]
        self._outputs = outputs
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._outputs = None

    def forward(self, ids: Sequence[int] | Tensor, start: int, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """Run positions start..start + len(ids) - 1 (the cache must hold exactly ``start`` positions).

        Returns float32 logits [L, V] (or [1, V] with ``last_only``) and the captured features [1, L, n * H] (None
        without layer_ids). ``ids`` may be a tensor on the device (the static path then reads nothing back)."""
        if self.layer_ids and self._outputs is None:
            raise RuntimeError("TargetRunner.forward with layer_ids needs `with runner.hooked():`")
        if self.capacity is not None:
            self._block_width = 0  # a forward that `rollback` may cut is a `verify`
            return self._static_forward(ids, start, last_only)
        if cache_length(self.cache) != start:
            raise RuntimeError(f"target cache holds {cache_length(self.cache)} positions, expected {start}")
        ids_list = [int(t) for t in (ids.reshape(-1).tolist() if isinstance(ids, Tensor) else ids)]
        if self._outputs is not None:
            self._outputs.clear()
        out = self._run(ids_list, start, last_only)
        features = None
        if self.layer_ids:
            assert self._outputs is not None
            features = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
            self._outputs.clear()
        logits = out.logits[0]
        if last_only:
            logits = logits[-1:]
        return logits.float(), features

    def _run(self, ids: list[int], start: int, last_only: bool = False) -> Any:
        """One target forward of ``ids`` at positions start.. through the cache (extends `history`)."""
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache, "use_cache": True}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.target(input_ids=ids_t, position_ids=positions, **kwargs)
        self.history.extend(ids)
        return out

    # -- the static path ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the static cache for a new prompt (the buffers stay; what they hold past `length` is never read;
        recurrent states are zeroed, which is what a first forward without state computes)."""
        self.length = 0
        self._block_width = 0
        if self._states:
            torch._foreach_zero_(self._states)

    def _allocate_states(self) -> None:
        """Let transformers allocate the recurrent layers' states (one eager one-token forward at position 0), then
        zero them. From here on every forward takes its model's with-state branch and updates them in place, so
        one captured graph serves every prompt."""
        buffer = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._static_step(buffer, False)
        if self._outputs is not None:
            self._outputs.clear()
        self._states = [state for layer in self.cache.layers if has_recurrent_state(layer)
                        for states in (layer.conv_states, layer.recurrent_states) for state in states.values()
                        if isinstance(state, Tensor)]
        if not self._states:
            raise RuntimeError("the linear-attention layers allocated no state in their first forward")
        self._saved = [state.clone() for state in self._states]
        self._before_capture = [state.clone() for state in self._states]
        torch._foreach_zero_(self._states)

    def prewarm(self, widths: Iterable[int]) -> None:
        """Capture the CUDA graphs of these forward widths now (an untimed warm-up), each run once on dummy tokens
        at position 0; the cache is empty afterwards (what they wrote lies past `length` and is never read). Does
        nothing without graphs."""
        if self.capacity is None or not self.graphs:
            return
        if self.layer_ids and self._outputs is None:  # its graphs must capture the hooked layers' outputs
            raise RuntimeError("TargetRunner.prewarm with layer_ids needs `with runner.hooked():`")
        for width in widths:
            if (width, False) not in self._forwards and width <= self.capacity:
                self.reset()
                self._static_forward([0] * width, 0, last_only=False)
        self.reset()

    @property
    def keeps_recurrent_states(self) -> bool:
        """A hybrid target on the static path: a rollback inside a block feeds the kept tokens again."""
        return self._recurrent

    def prewarm_prefill(self) -> None:
        """Capture now the prefill's chunk (nothing without one), so that no capture falls inside a timed generation
        whatever the length of the first prompt it sees. The cache is empty afterwards."""
        if self.prefill_chunk:
            self.prewarm((self.prefill_chunk,))

    def prewarm_rollbacks(self, block_width: int) -> None:
        """On a hybrid target's graphed static path: capture now the forwards that `rollback` feeds again after a
        verify block of ``block_width`` (1 to block_width - 1 kept tokens), so that no capture falls inside a timed
        generation. Nothing on other targets (their rollback runs nothing)."""
        if self._recurrent:
            self.prewarm(range(1, block_width))

    @property
    def graph_failure(self) -> str | None:
        """Why a CUDA graph capture failed (that forward then runs eagerly), or None."""
        return next((f.failure for f in self._forwards.values() if f.failure), None)

    @property
    def path(self) -> str:
        """The decode path as it ran so far (read at the end of a generation: its captures happen during it)."""
        if self.capacity is None:
            return (f"dynamic (static unsupported: {self.static_unsupported})" if self.static_unsupported
                    else "dynamic")
        failure = self.graph_failure
        return f"static ({failure})" if failure else ("static+cuda-graphs" if self.graphs else "static")

    def _static_forward(self, ids: Sequence[int] | Tensor, start: int, last_only: bool) -> tuple[Tensor, Tensor | None]:
        assert self.capacity is not None
        if start != self.length:
            raise RuntimeError(f"target cache holds {self.length} positions, expected {start}")
        width = int(ids.numel()) if isinstance(ids, Tensor) else len(ids)
        if start + width > self.capacity:
            raise RuntimeError(f"the static cache holds {self.capacity} positions; {start + width} needed")
        chunk = self.prefill_chunk
        if (last_only and 1 < width <= PREFILL_CHUNKED_UP_TO and chunk
                and start + -(-width // chunk) * chunk <= self.capacity):
            return self._chunked_prefill(ids, start, width)
        if self._recurrent and not self._states:
            self._allocate_states()
        buffer = self._inputs.get(width)
        if buffer is None:
            buffer = self._inputs[width] = torch.zeros((1, width), dtype=torch.long, device=self.device)
        if isinstance(ids, Tensor):
            buffer.copy_(ids.reshape(1, width))
        elif width == 1:
            buffer.fill_(int(ids[0]))  # a kernel argument: no host-to-device copy
        else:
            buffer.copy_(torch.tensor([list(ids)], dtype=torch.long))
        self._start.fill_(start)
        # One-token steps, verify blocks and prefill chunks have fixed shapes (graphed); a prefill in one forward is
        # eager, logits of its last row.
        last_row = last_only and width > 1
        graphed = self.graphs and not last_row
        forward = self._forwards.get((width, last_row))
        if forward is None:
            step = (lambda: self._static_step(buffer, True)) if last_row else (lambda: self._fixed_step(buffer))
            prepare = None
            if graphed and self._states:  # a first call runs the step three times: each from the same states
                prepare = lambda: torch._foreach_copy_(self._states, self._before_capture)  # noqa: E731
            forward = GraphedForward(step, graphed, self._pool, prepare)
            if graphed:
                self._forwards[(width, last_row)] = forward
        if forward.graphs and forward.graph is None and self._states:  # (again after a first call that raised)
            torch._foreach_copy_(self._before_capture, self._states)
        logits, features = forward()
        self.length = start + width
        return logits, features

    def _chunked_prefill(self, ids: Sequence[int] | Tensor, start: int, width: int) -> tuple[Tensor, Tensor | None]:
        """`_static_forward` of a prefill (logits of its last position only) as forwards of `prefill_chunk` positions,
        the last padded with token 0: the padding's keys and values lie past the cache's length, where attention
        reads nothing and the next forwards write; its logits and features are dropped. A chunk whose graph could not
        be captured (it ran eagerly) ends the chunking for later prefills."""
        chunk = self.prefill_chunk
        flat = ids.reshape(-1) if isinstance(ids, Tensor) else torch.tensor(list(ids), dtype=torch.long)
        padded = flat.new_zeros(-(-width // chunk) * chunk)  # on the ids' device: nothing read back
        padded[:width] = flat
        features: Tensor | None = None  # the prompt's rows, copied out chunk by chunk: the next replay overwrites them
        logits = torch.empty(0)
        for offset in range(0, width, chunk):
            logits, chunk_features = self._static_forward(padded[offset:offset + chunk], start + offset, False)
            if chunk_features is not None:
                if features is None:
                    features = chunk_features.new_empty((chunk_features.shape[0], width, chunk_features.shape[2]))
                rows = min(chunk, width - offset)
                features[:, offset:offset + rows] = chunk_features[:, :rows]
        self.length = start + width
        forward = self._forwards.get((chunk, False))
        if forward is not None and forward.failure:
            self.prefill_chunk = 0
        last = (width - 1) % chunk
        return logits[last:last + 1], features

    def _masks(self, positions: Tensor) -> Any:
        """The attention mask(s) of queries at ``positions`` [W] over the whole static cache: causal, and within the
        window for sliding layers; boolean for SDPA, additive for eager attention; a dict by layer type when the
        target has sliding layers (what such models take instead of building their masks)."""
        config = _text_config(self.target)
        keys = torch.arange(int(self.capacity or 0), device=self.device)
        causal = keys[None, :] <= positions[:, None]
        masks = {"full_attention": causal[None, None]}
        types = set(_target_layer_types(self.target))
        if "sliding_attention" in types:
            in_window = (positions[:, None] - keys[None, :]) < int(config.sliding_window)
            masks["sliding_attention"] = (causal & in_window)[None, None]
        if (getattr(config, "_attn_implementation", None) or "eager") == "eager":
            dtype = next(self.target.parameters()).dtype
            masks = {name: torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(dtype).min) for name, mask in masks.items()}
        if "linear_attention" in types:
            masks["linear_attention"] = None  # no padding: what transformers builds for one unpadded sequence
        return masks if len(masks) > 1 else masks["full_attention"]

    @property
    def compiled(self) -> bool:
        return self._compile and self.compile_failure is None

    @property
    def path_note(self) -> str:
        """What the decode path's name adds for the target: ", compiled target" where its fixed-width forwards run
        compiled, the reason where compilation fell back to eager."""
        if self.compile_failure:
            return f", target not compiled ({self.compile_failure})"
        return ", compiled target" if self.compiled else ""

    def _fixed_step(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """`_static_step` of a fixed-width input buffer (a verify block, a one-token step), with `COMPILE_TARGET`
        through a `CompiledForward` per width (compiled by its first call: GraphedForward's warm-up runs)."""
        width = int(ids.shape[1])
        if not self.compiled or width not in self.compile_widths:
            return self._static_step(ids, False)
        forward = self._compiled_steps.get(width)
        if forward is None:
            forward = self._compiled_steps[width] = CompiledForward(self._static_step)
        outputs = forward(ids, False)
        if forward.failure:  # one width that does not compile leaves every width eager
            self.compile_failure = forward.failure
            self._compiled_steps.clear()
        return outputs

    def _static_step(self, ids: Tensor, last_only: bool) -> tuple[Tensor, Tensor | None]:
        """One forward of the input buffer ``ids`` [1, W] at positions start.. (``self._start``, on the device)
        through the static cache: device work only, so it can be captured."""
        positions = self._start + torch.arange(ids.shape[1], device=self.device)
        # transformers 5: a layer writes at its own counter; all set in one launch (a foreach copy), not one a layer.
        counters = [layer.cumulative_length for layer in getattr(self.cache, "layers", None) or []
                    if isinstance(getattr(layer, "cumulative_length", None), Tensor)
                    and layer.cumulative_length.device == self.device]  # no walrus: torch.compile traces this
        if counters:
            torch._foreach_copy_(counters, [self._start] * len(counters))
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache, "use_cache": True,
                                  "position_ids": positions[None], "attention_mask": self._masks(positions)}
        if self._has_cache_position:  # transformers 4.x: static layers write at cache_position
            kwargs["cache_position"] = positions
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if self._outputs is not None:
            self._outputs.clear()
        out = self.target(input_ids=ids, **kwargs)
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        features = None
        if self.layer_ids:
            assert self._outputs is not None
            features = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
            self._outputs.clear()
        return logits.float(), features

    # -- verify and rollback ------------------------------------------------------------------------------------

    def verify(self, ids: Sequence[int] | Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        """`forward` of a block that `rollback` may later cut: first snapshots the layers `crop` cannot rewind
        (recurrent states of linear-attention layers; small and of fixed size, unlike a KV cache). The static path
        needs no snapshot of its KV layers (its rollback moves the write position back); its recurrent states are
        copied into buffers of their own (device copies; no allocation)."""
        if self.capacity is not None:
            if self._recurrent:
                if not self._states:
                    self._allocate_states()
                torch._foreach_copy_(self._saved, self._states)
            logits, features = self.forward(ids, start)
            self._block_width = int(ids.numel()) if isinstance(ids, Tensor) else len(ids)
            return logits, features
        layers = getattr(self.cache, "layers", None) or []
        recurrent = {i: layer for i, layer in enumerate(layers) if has_recurrent_state(layer)}
        self._snapshot = {i: copy.deepcopy(layer) for i, layer in recurrent.items()} if recurrent else None
        self._block_start = start
        return self.forward(ids, start)

    def rollback(self, keep: int) -> None:
        """Make the cache hold exactly its first ``keep`` positions, as if only they had been fed.

        KV layers (full and, with past recording, sliding-window) are cropped. Recurrent layers are restored from the
        snapshot taken by `verify` (the state before the block) and the kept part of the block is fed again. A cache
        whose `crop` refuses is rebuilt by feeding the kept tokens from scratch. The static cache only moves its
        write position back; its recurrent states, if any, are copied back from before the block and the kept part of
        the block is fed again (a fixed-width forward per kept length, graphed like the others)."""
        if self.capacity is not None:
            if keep > self.length:
                raise ValueError(f"cannot roll a cache of {self.length} positions back to {keep}")
            width = self._block_width
            if self._recurrent and keep < self.length:
                start = self.length - width
                if not width or keep < start:
                    raise ValueError(f"cannot roll back to {keep}: the recurrent states before position {keep} "
                                     "were not kept (only those before the last verified block)")
                torch._foreach_copy_(self._states, self._saved)
                self.length = start
                if keep > start:
                    self._static_forward(self._inputs[width][:, :keep - start], start, last_only=False)
            self._block_width = 0
            self.length = keep
            return
        current = cache_length(self.cache)
        if keep > current:
            raise ValueError(f"cannot roll a cache of {current} positions back to {keep}")
        snapshot, self._snapshot = self._snapshot, None
        if keep == current:
            return
        kept = self.history[:keep]
        if snapshot is not None:
            start = self._block_start
            if keep < start:
                raise ValueError(f"cannot roll back to {keep}: the snapshot holds position {start} onwards")
            for index, layer in snapshot.items():
                self.cache.layers[index] = layer
            for index, layer in enumerate(self.cache.layers):
                if index not in snapshot and layer.get_seq_length() > start:
                    layer.crop(start - layer.get_seq_length())
            del self.history[start:]
            if keep > start:
                self._run(kept[start:], start)
        else:
            try:
                crop_cache(self.cache, keep)
                del self.history[keep:]
            except (RuntimeError, ValueError, NotImplementedError):
                if len(self.history) != current:
                    raise
                self.cache = new_cache(self.target)
                self.history = []
                self._run(kept, 0)
        if cache_length(self.cache) != keep:
            raise RuntimeError(f"could not roll the target cache ({type(self.cache).__name__}) back to {keep}")


# ---------------------------------------------------------------------------
# The drafter side of the loop
# ---------------------------------------------------------------------------


# Whether the static path compiles the drafter's block forward (`DraftRunner._eager_block`: embedding, masks, the
# layers, the greedy head) with torch.compile (fullgraph, static shapes) before its CUDA graph is captured, so the
# graph replays Inductor's fused kernels instead of the ~365 unfused ones of the eager modules. None (the default):
# where the block is captured as a CUDA graph; True / False: always / never on the static path (tests on CPU, and
# benchmarks/bench_eval_decode.py --compile-drafter, which compares both in one run). Measured on an H100 (SmolLM2,
# 5-layer drafter, 2026-12-06): the drafter's block 1.01 -> 0.36 ms, the speculative step 1.49 -> 1.32 plain steps,
# the same tokens; ~14 s of compilation once per drafter (docs/benchmarks.md, "Live evaluation speed").
COMPILE_DRAFTER: bool | None = None

# Whether the static path projects a verified block's target features into the drafter's context inside the next
# block forward (graphed, and compiled with it) instead of eagerly at `DraftRunner.extend`: fc and norm were ~9 eager
# launches a step on the host's side of the loop (the "extend" phase, 0.17 ms of a 2.47 ms speculative step on an
# H100, 2026-12-06/07), now one copy. False (read when a runner is built): the eager extension, which
# benchmarks/bench_eval_decode.py --eager-extend compares in one run.
FUSED_EXTEND = True

# Whether the static path's greedy loop drafts the next block before the host has read back how many drafts the
# target accepted (`DraftRunner.draft_block_ahead`): the block's anchor and start are taken on the device from the
# acceptance (`greedy_record`), whose read-back (`HostReadBack`) is queued before the draft, so the host's share of a
# step (the read-back, the bookkeeping, the next verify's launch: ~0.1 ms of a 2.22 ms step on an H100, the "accept",
# "extend" and "other" phases of 2026-12-07) runs while the GPU drafts instead of between the GPU's forwards. Needs
# the fused extension (the block forward projects the verified block). False (read at each step): the draft waits
# for the read-back, as before; benchmarks/bench_eval_decode.py --serial-draft compares both in one run.
PIPELINED_DRAFT = True


class DraftRunner:
    """The drafter side of the loop: its context (projected once per new feature row) and one block proposal.

    With ``capacity`` (the static path) the projected context lives in a preallocated buffer of that many rows and
    the block forward has a fixed shape (attention over the whole buffer, rows past the context masked), so it is
    replayed from a CUDA graph with ``graphs``; the greedy draft tokens are computed inside that forward, and so is
    the projection of the last verified block's features (`extend`, or `draft_block_ahead` with its anchor and start
    taken on the device), with `FUSED_EXTEND`."""

    def __init__(self, draft: DFlashDraftModel, embed_weight: Tensor, lm_head_weight: Tensor,
                 embed_scale: float = 1.0, capacity: int | None = None, graphs: bool = False) -> None:
        self.draft_model = draft
        param = next(draft.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = draft.block_size
        self.mask_token_id = draft.mask_token_id
        self.embed_weight = embed_weight
        self.embed_scale = embed_scale
        self.lm_head_weight = lm_head_weight
        self._scale = torch.tensor(embed_scale, dtype=embed_weight.dtype, device=embed_weight.device)
        self.context: Tensor | None = None  # projected [1, C, H]
        self.capacity = capacity
        self.length = 0  # context rows of the static buffer
        # the static block forward: compiled (`COMPILE_DRAFTER`; CompiledForward) or eager
        self._block_forward: Callable[[], tuple[Tensor, Tensor]] = self._eager_block
        self.fused_extend = FUSED_EXTEND and capacity is not None  # fixed for the runner: its graph depends on it
        if capacity is not None:
            self.context = torch.zeros((1, capacity, draft.config.hidden_size), dtype=self.dtype, device=self.device)
            self._start = torch.zeros((), dtype=torch.long, device=self.device)
            self._bonus = torch.zeros((1, 1), dtype=torch.long, device=embed_weight.device)
            self._masks = torch.full((1, self.block_size - 1), self.mask_token_id, dtype=torch.long,
                                     device=embed_weight.device)
            # A verified block's features wait here until the next block forward projects them into the context at
            # row `_pending_at` (`extend`, `draft_block_ahead`); between blocks that row points at the next block's
            # own rows, masked.
            self._pending = torch.zeros((1, self.block_size, draft.fc.in_features), dtype=self.dtype,
                                        device=self.device)
            self._pending_at = torch.zeros((), dtype=torch.long, device=self.device)
            self._pending_row: int | None = None  # where the pending rows go, until a block forward wrote them
            pool = torch.cuda.graph_pool_handle() if graphs else None
            if graphs if COMPILE_DRAFTER is None else COMPILE_DRAFTER:
                # compiled by its first call: GraphedForward's warm-up runs, before the capture records the compiled
                # kernels (on CPU, without graphs: the first draft)
                self._block_forward = CompiledForward(self._eager_block)
            self._block = GraphedForward(self._static_block, graphs, pool)

    @property
    def context_length(self) -> int:
        if self.capacity is not None:
            return self.length
        return 0 if self.context is None else int(self.context.shape[1])

    @property
    def graph_failure(self) -> str | None:
        return self._block.failure if self.capacity is not None else None

    @property
    def compiled(self) -> bool:
        """Whether the static block forward runs compiled (`COMPILE_DRAFTER`, and it compiled)."""
        return isinstance(self._block_forward, CompiledForward) and self._block_forward.failure is None

    @property
    def compile_failure(self) -> str | None:
        """Why the block forward fell back to eager (None where it compiled or was never meant to)."""
        return self._block_forward.failure if isinstance(self._block_forward, CompiledForward) else None

    @property
    def path_note(self) -> str:
        """What the decode path's name adds for the drafter: ", compiled drafter" where its block forward runs
        compiled, the reason where compilation fell back to eager, and a failed capture of its CUDA graph."""
        note = f", drafter not compiled ({self.compile_failure})" if self.compile_failure else (
            ", compiled drafter" if self.compiled else "")
        failure = self.graph_failure
        return note + (f", drafter {failure}" if failure else "")

    def reset(self) -> None:
        """Empty the context for a new prompt (the static buffer stays)."""
        if self.capacity is None:
            self.context = None
        else:
            self._pending_row = None
            self._pending_at.zero_()  # rows 0.. are masked until the first extension, which writes them
        self.length = 0

    def extend(self, features: Tensor, count: int | None = None) -> None:
        """Append the target features [1, n, n_layers * H] of the next ``count`` positions (default n) to the
        drafter context. The static buffer takes all n projected rows (a fixed shape; rows past ``count`` are
        overwritten by the next extension and masked until then)."""
        count = features.shape[1] if count is None else count
        if self.capacity is not None:
            assert self.context is not None
            rows = features.shape[1]
            if self.length + rows > self.capacity:
                raise RuntimeError(f"the drafter context holds {self.capacity} rows; {self.length + rows} needed")
            self._write_pending()
            if self.fused_extend and rows == self.block_size:  # a verified block: the next block forward projects it
                self._pending.copy_(features)
                self._pending_at.fill_(self.length)
                self._pending_row = self.length
            else:
                self.context[:, self.length:self.length + rows] = self.draft_model.project_context(
                    features.to(self.device, self.dtype))
                self._pending_at.fill_(self.length + count)  # the next block's own rows: masked in its forward
            self.length += count
            return
        projected = self.draft_model.project_context(features[:, :count].to(self.device, self.dtype))
        self.context = projected if self.context is None else torch.cat([self.context, projected], dim=1)

    def _write_pending(self) -> None:
        """Project the pending block into the context now (an extension that comes before the next block forward)."""
        if self._pending_row is not None:
            assert self.context is not None
            row, self._pending_row = self._pending_row, None
            self.context[:, row:row + self.block_size] = self.draft_model.project_context(self._pending)

    def _embed(self, ids: Tensor) -> Tensor:
        noise = F.embedding(ids, self.embed_weight)
        if self.embed_scale != 1.0:  # as transformers' scaled embeddings do: times the scale in the weight's dtype
            noise = noise * self._scale
        return noise.to(self.device, self.dtype)

    def block_hidden(self, bonus: int, start: int) -> Tensor:
        """Drafter hidden states [1, B, H] of the block [bonus, MASK...] at positions start..start + B - 1."""
        if self.context_length != start:
            raise RuntimeError(f"drafter context holds {self.context_length} positions, expected {start}")
        if self.capacity is not None:
            return self._run_static(bonus, start)[0]
        ids = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=self.embed_weight.device)
        ids[0, 0] = bonus
        noise = self._embed(ids)
        q_pos = torch.arange(start, start + self.block_size, device=self.device).unsqueeze(0)
        k_pos = torch.arange(start, device=self.device).unsqueeze(0)
        assert self.context is not None
        return self.draft_model(noise, self.context, q_pos, k_pos, projected=True)

    def _run_static(self, bonus: int, start: int) -> tuple[Tensor, Tensor]:
        if start + self.block_size > int(self.capacity or 0):
            raise RuntimeError(f"the drafter context holds {self.capacity} rows; {start + self.block_size} needed")
        self._bonus.fill_(bonus)
        self._start.fill_(start)
        return self._replay()

    def _replay(self) -> tuple[Tensor, Tensor]:
        """The block forward at the anchor and start set on the device (`_block`), which writes the pending rows."""
        outputs = self._block()
        self._pending_row = None
        return outputs

    def _static_block(self) -> tuple[Tensor, Tensor]:
        """(hidden [1, B, H], greedy draft tokens [B - 1]) of the block at ``self._start`` over the whole context
        buffer (rows at and after the start masked): device work only, so it can be captured. The drafter attends
        with `DenseAttention` (SDPA) meanwhile, whatever training set; the swap stays outside `_block_forward`, so
        a compiled block forward (`COMPILE_DRAFTER`) holds no module mutation."""
        attention, self.draft_model.attention = self.draft_model.attention, DenseAttention  # SDPA, not training's
        try:
            return self._block_forward()
        finally:
            self.draft_model.attention = attention

    def _eager_block(self) -> tuple[Tensor, Tensor]:
        """`_static_block`'s device work (eager; `_block_forward` is this function or its compiled form)."""
        assert self.context is not None and self.capacity is not None
        offsets = torch.arange(self.block_size, device=self.device)
        if self.fused_extend:
            # The pending block's projection (`extend`): where nothing is pending, the rows of this block, which it
            # masks and the next extension overwrites. The values an eager extension writes: fc and norm row by row.
            self.context.index_copy_(1, self._pending_at + offsets, self.draft_model.project_context(self._pending))
        noise = self._embed(torch.cat([self._bonus, self._masks], dim=1))
        q_pos = (self._start + offsets)[None]
        k_pos = torch.arange(self.capacity, device=self.device)[None]
        visible = torch.cat([k_pos < self._start, torch.ones_like(offsets, dtype=torch.bool)[None]], dim=1)
        mask = visible[:, None, :].expand(1, self.block_size, -1)
        hidden = self.draft_model(noise, self.context, q_pos, k_pos, mask, projected=True)
        return hidden, self._greedy(hidden[0, 1:], self._bonus[0].to(self.lm_head_weight.device))

    def _greedy(self, hidden: Tensor, anchor: Tensor) -> Tensor:
        """Greedy draft tokens [B - 1] (on the device) of block hidden states [B - 1, H] after the anchor [1]:
        DFlash: each position's argmax; DFlash 2: the selector's path from the anchor."""
        logits = self.logits(hidden)
        selector = getattr(self.draft_model, "candidate_selector", None)
        if selector is None:
            return logits.argmax(-1)
        hidden = hidden[None].to(logits.device, selector.hidden_projection.weight.dtype)
        return selector.walk(hidden, logits[None], anchor)[0][0]

    def draft_greedy(self, bonus: int, start: int) -> Tensor:
        """The block's greedy draft tokens [B - 1], left on the device."""
        if self.capacity is not None:
            if self.context_length != start:
                raise RuntimeError(f"drafter context holds {self.context_length} positions, expected {start}")
            return self._run_static(bonus, start)[1]
        if getattr(self.draft_model, "candidate_selector", None) is None:
            return self.propose(bonus, start).argmax(-1)
        anchor = torch.tensor([bonus], device=self.lm_head_weight.device)
        return self._greedy(self.block_hidden(bonus, start)[0, 1:], anchor)

    def draft_block(self, bonus: int, start: int) -> Tensor:
        """The verify block [bonus, the block's greedy draft tokens] [B], left on the device."""
        drafts = self.draft_greedy(bonus, start)
        return torch.cat([drafts.new_full((1,), bonus), drafts])

    def can_draft_ahead(self, verified_at: int) -> bool:
        """Whether `draft_block_ahead` may draft the block after the one verified at ``verified_at``: the static
        path with the fused extension, its context holding exactly the positions before that block, and room for the
        next block wherever it starts (at most B positions later; its rows must lie inside the buffer, since the
        device indexes them unchecked)."""
        return (self.fused_extend and self.capacity is not None and self.length == verified_at
                and verified_at + 2 * self.block_size <= self.capacity)

    def draft_block_ahead(self, features: Tensor, verified_at: int, record: Tensor) -> Tensor:
        """The next verify block [anchor, greedy draft tokens] [B] on the device, drafted before the host reads the
        acceptance ``record`` (`greedy_record`) of the block verified at ``verified_at``: the block's anchor (the
        target's argmax after the accepted drafts) and start (verified_at + accepted + 1) are read on the device, and
        the verified block's ``features`` [1, B, n_layers * H] are projected into the context inside this block's
        forward (the fused extension; rows past the accepted ones are masked and overwritten later). `advance` then
        counts the accepted rows. Only where `can_draft_ahead`."""
        assert self.context is not None and self.capacity is not None and self.fused_extend
        self.extend(features, 0)  # pending at row verified_at, for this block's forward; no row counted yet
        accepted = record[:1]
        self._bonus.copy_(record.gather(0, accepted + 1).view(1, 1))
        self._start.copy_(accepted[0] + (verified_at + 1))
        drafts = self._replay()[1]
        return torch.cat([self._bonus.view(1).to(drafts.device), drafts])

    def advance(self, verified_at: int, count: int) -> None:
        """After `draft_block_ahead`: the context holds the ``count`` accepted rows of the block verified at
        ``verified_at`` (`extend`'s bookkeeping; the block forward projected them)."""
        if self.length != verified_at:
            raise RuntimeError(f"drafter context holds {self.length} positions, expected {verified_at}")
        self.length += count

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [..., V] of drafter hidden states [..., H] (the target's LM head)."""
        weight = self.lm_head_weight
        return (hidden.to(weight.device, weight.dtype) @ weight.T).float()

    def propose(self, bonus: int, start: int) -> Tensor:
        """float32 logits [B - 1, V] of block offsets 1..B-1 (the draft positions)."""
        return self.logits(self.block_hidden(bonus, start)[0, 1:])

    def draft(self, bonus: int, start: int, temperature: float,
              generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        """The block's draft tokens (B - 1) and, when sampling, the probabilities they were drawn from [B - 1, V]
        (what rejection sampling verifies against). DFlash: each position's argmax or a sample of its softmax.
        DFlash 2: the selector's path from the anchor (probabilities: the proposal over the candidates, zero
        elsewhere)."""
        selector = getattr(self.draft_model, "candidate_selector", None)
        if selector is None:
            logits = self.propose(bonus, start)
            if temperature <= 0:
                return logits.argmax(-1).tolist(), None
            probs = torch.softmax(logits / temperature, dim=-1)
            return _sample(probs, generator).tolist(), probs
        hidden = self.block_hidden(bonus, start)[0, 1:]
        return selector.propose(hidden, self.logits(hidden), bonus, temperature, generator)


# ---------------------------------------------------------------------------
# Sampling and verification
# ---------------------------------------------------------------------------


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One sample per row of probs [N, V] -> [N] (on the generator's device when one is given)."""
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _uniform(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=gen_device)


def pick_token(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy argmax or a temperature sample from logits [V]."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    return int(_sample(torch.softmax(logits[None] / temperature, dim=-1), generator)[0])


def greedy_record(draft_tokens: Tensor, target_logits: Tensor) -> Tensor:
    """On the device, [accepted, the target's argmax at each block position] (B + 1 integers): accepted is the length
    of the longest prefix with d_k == the target's argmax at block position k - 1."""
    posterior = target_logits.argmax(-1)
    matches = draft_tokens.to(posterior.device) == posterior[: draft_tokens.shape[0]]
    accepted = matches.long().cumprod(0).sum()
    return torch.cat([accepted[None], posterior])


def greedy_outcome(record: list[int]) -> tuple[int, list[int]]:
    """(accepted, emitted tokens) of a `greedy_record` read back: the emitted tokens are the target's argmaxes at
    block positions 0..accepted (the accepted drafts equal them; the last is the target's own next token)."""
    return record[0], record[1: record[0] + 2]


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, list[int]]:
    """(accepted, emitted tokens) of a verified block, computed on the device: one read-back of B + 1 integers."""
    return greedy_outcome(greedy_record(draft_tokens, target_logits).tolist())


class HostReadBack:
    """Reads a small device tensor of integers (at most ``size``) without waiting for the work queued after it:
    `start` queues its copy to the host (on CUDA into pinned memory, with an event after it on the stream of the
    tensor's own device, which need not be the current one) and `values` waits for that event only, so work queued
    between the two (the next block's draft) runs on the GPU while the host waits and reads. Elsewhere a plain
    copy."""

    def __init__(self, size: int) -> None:
        self._host = torch.empty(size, dtype=torch.long)
        self._event: torch.cuda.Event | None = None
        self._size = 0

    def start(self, values: Tensor) -> None:
        self._size = int(values.numel())
        if values.device.type != "cuda":
            self._event = None
            self._host[: self._size].copy_(values)
            return
        if self._event is None:  # (a generation's values stay on one device)
            self._host, self._event = self._host.pin_memory(), torch.cuda.Event()
        self._host[: self._size].copy_(values, non_blocking=True)
        self._event.record(torch.cuda.current_stream(values.device))

    def values(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host[: self._size].tolist()


def verify_sampling(draft_tokens: list[int], draft_probs: Tensor, target_probs: Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling. draft_probs [B-1, V] (q), target_probs [B, V] (p at block positions 0..B-1).

    d_k is accepted with probability min(1, p_{k-1}(d_k) / q_k(d_k)); at the first rejection the next token comes
    from norm(max(0, p - q)); if all drafts pass it comes from p at the last block position."""
    n = len(draft_tokens)
    index = torch.tensor(draft_tokens, dtype=torch.long, device=draft_probs.device).unsqueeze(-1)
    q = draft_probs.gather(-1, index).squeeze(-1)
    p = target_probs[:n].to(draft_probs.device).gather(-1, index).squeeze(-1)
    ratio = (p / q.clamp_min(1e-30)).clamp(max=1.0)
    passed = (_uniform(n, generator, draft_probs.device).to(ratio.device) < ratio).tolist()
    accepted = 0
    while accepted < n and passed[accepted]:
        accepted += 1
    if accepted == n:
        return accepted, int(_sample(target_probs[n:n + 1], generator)[0])
    residual = (target_probs[accepted].to(draft_probs.device) - draft_probs[accepted]).clamp_min(0.0)
    total = residual.sum()
    if not bool(total > 0):  # p == q exactly: rejection has probability 0, kept for numerical safety
        residual, total = target_probs[accepted], target_probs[accepted].sum()
    return accepted, int(_sample((residual / total)[None], generator)[0])


def clip_step(emitted: list[int], room: int, stops: set[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens after the first stop token and to ``room`` tokens; True if generation ends here."""
    for i, token in enumerate(emitted):
        if token in stops:
            emitted = emitted[: i + 1]
            return emitted[:room], True
    if len(emitted) >= room:
        return emitted[:room], True
    return emitted, False


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


@dataclass
class SpecResult:
    """What one generation produced: new tokens only, per-step accepted draft counts, target steps, wall time (of
    which ``first_token_seconds`` went to the prompt's forward and the pick of the first token), and the decode path
    that ran (`TargetRunner.path`)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    decode: str = "dynamic"
    first_token_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length: mean over steps of accepted + 1 (nan without steps)."""
        if not self.accepted:
            return float("nan")
        return sum(a + 1 for a in self.accepted) / len(self.accepted)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_seconds(self) -> float:
        """The time after the first token."""
        return self.seconds - self.first_token_seconds


def prompt_ids(input_ids: Any) -> list[int]:
    """One prompt's token ids from a [1, L] / [L] tensor, a list, or a mapping holding `input_ids` (what
    `apply_chat_template(..., return_tensors="pt")` returns in transformers 5: a BatchEncoding)."""
    if not isinstance(input_ids, (Tensor, list, tuple)) and hasattr(input_ids, "keys") and "input_ids" in input_ids:
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size 1 only; got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    if input_ids and isinstance(input_ids[0], (list, tuple)):
        if len(input_ids) != 1:
            raise ValueError(f"batch size 1 only; got {len(input_ids)} prompts")
        input_ids = input_ids[0]
    return [int(t) for t in input_ids]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_runner(target: nn.Module, layer_ids: Sequence[int], needed: int, decode: str = "auto",
                  planned: bool = False) -> TargetRunner:
    """The target runner of one generation that holds ``needed`` positions (``planned``: see `static_capacity`): a
    static one (kept on the target and reused by later generations while it is large enough, CUDA graphs included)
    when `decode` asks for it and the target supports it (`static_unsupported`), else a fresh dynamic one (`path`
    says which, and why)."""
    device = next(target.parameters()).device
    static, graphs = resolve_decode(decode, device)
    reason = static_unsupported(target) if static else None
    if not static or reason:
        runner = TargetRunner(target, layer_ids)
        runner.static_unsupported = reason
        return runner
    runners = target.__dict__.setdefault("_dflash_static_runners", {})
    key = (tuple(layer_ids), graphs, str(device), next(target.parameters()).dtype, COMPILE_TARGET)
    runner = runners.get(key)
    if runner is None or (runner.capacity or 0) < needed:
        runners.pop(key, None)
        runner = runners[key] = TargetRunner(target, layer_ids, static_capacity(needed, planned), graphs)
    runner.reset()
    return runner


def draft_runner(draft: DFlashDraftModel, embed_weight: Tensor, lm_head_weight: Tensor, embed_scale: float,
                 needed: int, decode: str = "auto", planned: bool = False) -> DraftRunner:
    """The drafter runner of one generation: static (its context buffer and captured block forward kept on the
    drafter for later generations) when `decode` asks for it, else dynamic."""
    param = next(draft.parameters())
    static, graphs = resolve_decode(decode, param.device)
    if not static:
        return DraftRunner(draft, embed_weight, lm_head_weight, embed_scale)
    runners = draft.__dict__.setdefault("_dflash_static_runners", {})
    key = (embed_weight.data_ptr(), lm_head_weight.data_ptr(), embed_scale, graphs, str(param.device), param.dtype,
           COMPILE_DRAFTER, FUSED_EXTEND)
    runner = runners.get(key)
    if runner is None or (runner.capacity or 0) < needed:
        runners.pop(key, None)
        runner = runners[key] = DraftRunner(draft, embed_weight, lm_head_weight, embed_scale,
                                            static_capacity(needed, planned), graphs)
    runner.reset()
    return runner


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    input_ids: Any,
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    embed_scale: float = 1.0,
    decode: str = "auto",
    capacity: int = 0,
) -> SpecResult:
    """DFlash speculative decoding of one prompt (batch size 1); see the module docstring.

    ``embed_weight`` / ``lm_head_weight``: the target's input embedding and LM head matrices [V, H]; the block
    embedding is ``embed_weight`` rows times ``embed_scale``. ``layer_ids``: the target layers whose outputs form
    the drafter context (the drafter's target_layer_ids). ``decode``: "auto" (static caches and CUDA graphs on CUDA,
    transformers' DynamicCache elsewhere), "static" or "dynamic" (see `resolve_decode`); both give the same tokens.
    ``capacity``: positions the static buffers should hold at least (a warm-up sized for the longest prompt to come
    captures the graphs later generations reuse).
    Returns the new tokens (cut after the first stop token, which is kept, and to ``max_new_tokens``), and per step
    the accepted draft count (a step cut short counts what it emitted, minus one)."""
    prompt = prompt_ids(input_ids)
    if not prompt:
        raise ValueError("empty prompt")
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    stops = {int(t) for t in stop_token_ids}
    needed = max(len(prompt) + max_new_tokens + draft.block_size, capacity)
    runner = target_runner(target, layer_ids, needed, decode, planned=capacity > 0)
    runner.compile_widths.add(draft.block_size)
    # the drafter's context holds a block more: the block drafted ahead of a step's acceptance (`can_draft_ahead`)
    drafter = draft_runner(draft, embed_weight, lm_head_weight, embed_scale, needed + draft.block_size, decode,
                           planned=capacity > 0)
    tokens: list[int] = []
    accepted: list[int] = []
    readback = HostReadBack(draft.block_size + 1)
    ahead: Tensor | None = None  # the next verify block, drafted before this one's acceptance was read back
    with runner.hooked():
        runner.prewarm_rollbacks(draft.block_size)
        runner.prewarm_prefill()
        synchronize(runner.device)
        started = time.perf_counter()
        logits, features = runner.forward(prompt, 0, last_only=True)
        bonus = pick_token(logits[-1], temperature, generator)  # reads the token back: the prefill has run
        first_token_seconds = time.perf_counter() - started
        tokens.append(bonus)
        assert features is not None
        drafter.extend(features)
        start = len(prompt)
        done = bonus in stops or len(tokens) >= max_new_tokens
        while not done:
            if temperature <= 0:
                block = ahead if ahead is not None else drafter.draft_block(bonus, start)
                target_logits, features = runner.verify(block, start)
                record = greedy_record(block[1:], target_logits)
                readback.start(record)
                assert features is not None
                last = max_new_tokens - len(tokens) <= 1  # this step ends the generation, whatever it accepts
                ahead = (drafter.draft_block_ahead(features, start, record)
                         if PIPELINED_DRAFT and not last and drafter.can_draft_ahead(start) else None)
                n_acc, emitted = greedy_outcome(readback.values())
            else:
                draft_tokens, draft_probs = drafter.draft(bonus, start, temperature, generator)
                target_logits, features = runner.verify([bonus, *draft_tokens], start)
                target_probs = torch.softmax(target_logits / temperature, dim=-1)
                assert draft_probs is not None
                n_acc, next_token = verify_sampling(draft_tokens, draft_probs, target_probs, generator)
                emitted = [*draft_tokens[:n_acc], next_token]
            next_token = emitted[-1]
            emitted, done = clip_step(emitted, max_new_tokens - len(tokens), stops)
            tokens.extend(emitted)
            accepted.append(len(emitted) - 1)
            if done:
                break
            assert features is not None
            if ahead is not None:
                drafter.advance(start, n_acc + 1)
            else:
                drafter.extend(features, n_acc + 1)
            start += n_acc + 1
            runner.rollback(start)
            bonus = next_token
        synchronize(runner.device)
        seconds = time.perf_counter() - started
    return SpecResult(tokens=tokens, accepted=accepted, steps=len(accepted), seconds=seconds,
                      decode=runner.path + runner.path_note + drafter.path_note,
                      first_token_seconds=first_token_seconds)
