"""The modeling file every export ships (as `modeling_dflash.py`, named by the config's `auto_map`), so that a
drafter loads the way published DFlash drafters do:

    draft = AutoModel.from_pretrained(EXPORT, trust_remote_code=True)
    output_ids = draft.spec_generate(input_ids=ids, target=target, max_new_tokens=256, temperature=0.0,
                                     stop_token_ids=[...])

It imports only torch and transformers (it runs outside dflash). The drafter is the same network as
`draft_model.DFlashDraftModel` at inference (one block, every query sees the whole context; sliding-window layers
see the last `sliding_window` positions), built from transformers' Qwen3 pieces, and `spec_generate` is the loop of
`speculative.speculative_generate` (batch size 1): target features are `hidden_states[i + 1]` of the target's own
forward, the block is embedded by the target's embedding module (so its scale, e.g. Gemma's, applies), the target's
cache is cropped after each step, or, for recurrent (linear-attention) layers that cannot be cropped, restored from a
snapshot and fed the accepted tokens again. `last_acceptance_lengths` holds accepted + 1 per step (tau = its mean).
tests/stage2_train/test_export_modeling.py checks tokens and tau against `speculative_generate`.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context; block]; q/k RMSNorm per head; RoPE; not causal."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden: Tensor, context: Tensor, q_rope: tuple[Tensor, Tensor], k_rope: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        batch, q_len, _ = hidden.shape
        kv_input = torch.cat([context, hidden], dim=1)
        kv_len = kv_input.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, *q_rope)
        _, k = apply_rotary_pos_emb(k, k, *k_rope)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: Tensor, context: Tensor, q_rope: tuple[Tensor, Tensor], k_rope: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, q_rope, k_rope, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _recurrent(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        self.block_size = int(config.block_size)
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.last_acceptance_lengths: list[int] = []
        self.post_init()

    def forward(self, noise_embedding: Tensor, target_hidden: Tensor, position_ids: Tensor) -> Tensor:
        """noise_embedding [1, B, H] (the block), target_hidden [1, C, n * H] (raw context features), position_ids
        [1, C + B] (context then block) -> drafter hidden states [1, B, H]."""
        context = self.hidden_norm(self.fc(target_hidden))
        q_pos = position_ids[:, context.shape[1]:]
        q_rope, k_rope = self.rotary_emb(noise_embedding, q_pos), self.rotary_emb(noise_embedding, position_ids)
        masks: dict[str, Tensor | None] = {"full_attention": None}
        if "sliding_attention" in self.layer_types:
            window = int(self.config.sliding_window)
            masks["sliding_attention"] = ((q_pos[:, :, None] - position_ids[:, None, :]) < window)[:, None]
        hidden = noise_embedding
        for layer, layer_type in zip(self.layers, self.layer_types):
            hidden = layer(hidden, context, q_rope, k_rope, masks[layer_type])
        return self.norm(hidden)

    # ------------------------------------------------------------------------------------------ generation

    def _target_step(self, target: Any, cache: Any, ids: list[int], start: int) -> tuple[Tensor, Tensor]:
        device = target.get_input_embeddings().weight.device
        name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        out = target(input_ids=torch.tensor([ids], device=device), **{name: cache}, use_cache=True,
                     position_ids=torch.arange(start, start + len(ids), device=device)[None],
                     output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        return out.logits[0].float(), features

    def _rollback(self, target: Any, cache: Any, snapshot: dict[int, Any], start: int, kept: list[int]) -> None:
        """Cache back to `start + len(kept)` positions: crop KV layers to `start`, restore recurrent ones, refeed."""
        if snapshot:
            for index, layer in enumerate(cache.layers):
                if index in snapshot:
                    cache.layers[index] = snapshot[index]
                elif layer.get_seq_length() > start:
                    layer.crop(start - layer.get_seq_length())
            if kept:
                self._target_step(target, cache, kept, start)
        else:
            cache.crop(start + len(kept) - cache.get_seq_length())

    def draft_logits(self, target: Any, bonus: int, context: Tensor, start: int) -> Tensor:
        """float32 logits [B - 1, V] of the drafts after `bonus` at position `start`, from the raw context features
        [1, start, n * H]: the block [bonus, MASK...] embedded by the target's own embedding module, scored by its
        LM head."""
        embed, device = target.get_input_embeddings(), next(self.parameters()).device
        block = torch.full((1, self.block_size), self.mask_token_id, device=embed.weight.device)
        block[0, 0] = bonus
        noise = embed(block).to(device, self.dtype)
        positions = torch.arange(start + self.block_size, device=device)[None]
        hidden = self(noise, context.to(device, self.dtype), positions)[0, 1:]
        head = target.get_output_embeddings().weight
        return (hidden.to(head.device, head.dtype) @ head.T).float()

    @torch.inference_mode()
    def spec_generate(self, input_ids: Tensor, target: Any, max_new_tokens: int = 256, temperature: float = 0.0,
                      stop_token_ids: list[int] | None = None) -> Tensor:
        """Speculative decoding of one prompt (batch 1) -> [1, prompt + new] token ids (the new ones end after the
        first stop token); greedy output equals the target's own greedy decoding."""
        stops = {int(t) for t in (stop_token_ids or [])}
        prompt = [int(t) for t in input_ids.reshape(-1).tolist()]
        cache = DynamicCache(config=target.config)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording") and not _recurrent(layer):
                layer.activate_past_recording()

        def pick(logits: Tensor) -> Tensor:
            if temperature <= 0:
                return logits.argmax(-1)
            return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(-1)

        logits, features = self._target_step(target, cache, prompt, 0)
        tokens = [int(pick(logits[-1]))]
        context, start = features, len(prompt)
        self.last_acceptance_lengths = []
        while tokens[-1] not in stops and len(tokens) < max_new_tokens:
            draft_logits = self.draft_logits(target, tokens[-1], context, start)
            if temperature > 0:
                draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
                drafts = torch.multinomial(draft_probs, 1).squeeze(-1).tolist()
            else:
                drafts = draft_logits.argmax(-1).tolist()
            layers = getattr(cache, "layers", [])
            snapshot = {i: copy.deepcopy(layer) for i, layer in enumerate(layers) if _recurrent(layer)}
            target_logits, block_features = self._target_step(target, cache, [tokens[-1], *drafts], start)
            accepted = 0
            if temperature > 0:
                target_probs = torch.softmax(target_logits / temperature, dim=-1)
                while accepted < len(drafts):
                    d = drafts[accepted]
                    ratio = target_probs[accepted, d] / draft_probs[accepted, d].clamp_min(1e-30)
                    if torch.rand(()) >= ratio.clamp(max=1.0):
                        break
                    accepted += 1
                if accepted < len(drafts):
                    residual = (target_probs[accepted] - draft_probs[accepted].to(target_probs.device)).clamp_min(0)
                    residual = residual if residual.sum() > 0 else target_probs[accepted]
                    following = int(torch.multinomial(residual / residual.sum(), 1))
                else:
                    following = int(torch.multinomial(target_probs[accepted], 1))
            else:
                posterior = target_logits.argmax(-1).tolist()
                while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
                    accepted += 1
                following = posterior[accepted]
            emitted = [*drafts[:accepted], following]
            for i, token in enumerate(emitted):
                if token in stops:
                    emitted = emitted[: i + 1]
                    break
            emitted = emitted[: max_new_tokens - len(tokens)]
            tokens.extend(emitted)
            self.last_acceptance_lengths.append(len(emitted))
            if tokens[-1] in stops or len(tokens) >= max_new_tokens:
                break
            kept = [tokens[-len(emitted) - 1], *drafts[:accepted]]  # the bonus token and the accepted drafts
            context = torch.cat([context, block_features[:, : accepted + 1]], dim=1)
            if accepted + 1 < self.block_size:
                self._rollback(target, cache, snapshot, start, kept)
            start += accepted + 1
        return torch.tensor([prompt + tokens], dtype=torch.long, device=input_ids.device)
