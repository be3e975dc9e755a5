"""Tiny random-weight targets of real architecture families, built from transformers' own configs (no downloads).

`build_family(name, tokenizer_dir, out)` saves a folder that `dflash extract --model` / `dflash eval --model` load
like any checkpoint: config.json, model.safetensors (bf16), generation_config.json, and a tokenizer with a chat
template. No family's own tokenizer is available offline, so every family uses the embedded SmolLM2 tokenizer (its
ChatML template, 49152 tokens) as the stand-in: the config's `vocab_size` is set to the tokenizer's size.

Sizes: 4 decoder layers (the hybrid families get one full-attention layer among linear ones), hidden 64, 4 query
heads over 2 KV heads, head_dim 16, a few tiny experts for the MoE families, a sliding window of 8 (shorter than the
test prompts, so the window is really exercised).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HIDDEN = 64
LAYERS = 4
COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": False,
}
MOE: dict[str, Any] = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}
WINDOW = 8
# The families whose sliding-window layers the decode loop needs transformers >= 5.18 for (pyproject's floor: with
# 5.17 their static and dynamic decode paths fail); the GPU machines carry 5.17, where the GPU tests run llama only.
SLIDING_WINDOW_FAMILIES = ("gemma3_text", "gpt_oss")

LINEAR_ATTENTION: dict[str, Any] = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen3": {},
    "qwen3_moe": {**MOE, "num_experts": 4},
    "qwen3_next": {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 32, **LINEAR_ATTENTION},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 128,
                                    "rope_theta": 150000.0}},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
    "deepseek_v3": {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4, "head_dim": 8},
    "glm4_moe": {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                 "first_k_dense_replace": 1},
}


# Hybrid targets for the decode tests only (not in FAMILIES: no end-to-end run), as (model type, config overrides):
# Qwen3-Next with dense MLPs in every layer, whose forwards have no expert routing (its host-side index lists,
# `nonzero`, no CUDA graph can capture), so the graphed decode path runs whole; Qwen3.5's text models, dense and MoE.
DECODE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense_hybrid": ("qwen3_next", {"mlp_only_layers": list(range(LAYERS))}),
    "qwen3_5_text": ("qwen3_5_text", LINEAR_ATTENTION),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 32,
                                              **LINEAR_ATTENTION}),
}


def family_config(name: str, vocab_size: int, special_ids: dict[str, int | None],
                  extra: dict[str, Any] | None = None) -> Any:
    from transformers import AutoConfig

    overrides = {**COMMON, **FAMILIES.get(name, {}), "vocab_size": vocab_size, **special_ids, **(extra or {})}
    return AutoConfig.for_model(name, **overrides)


def decode_families(*names: str) -> list[Any]:
    """`names` as pytest parameters, the sliding-window ones skipped under transformers < 5.18 (a GPU machine's
    5.17 runs the others)."""
    import pytest
    import transformers
    from packaging.version import Version

    old = Version(transformers.__version__) < Version("5.18")
    return [pytest.param(name, marks=pytest.mark.skipif(old and name in SLIDING_WINDOW_FAMILIES,
                                                        reason="sliding windows need transformers >= 5.18"))
            for name in names]


def build_family(name: str, tokenizer_dir: Path, out: Path, seed: int = 0, extra: dict[str, Any] | None = None) -> Path:
    """Save a random-weight `name` causal LM (its config changed by ``extra``) with the tokenizer of `tokenizer_dir`
    into `out` (once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    config = family_config(name, len(tokenizer), special, extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init at std 0.02 gives near-uniform logits; wider weights make greedy decoding decisive.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out)  # bf16 on disk, as published checkpoints are
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"],
                     pad_token_id=special["pad_token_id"]).save_pretrained(out)
    return out


def load_families(names: list[str], root: Path) -> dict:
    """{name: the tiny float32 target of each family (or DECODE_VARIANTS entry) named}, built under `root` with the
    embedded tokenizer (one torch thread: the tests compare these targets' outputs bit for bit)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target

    torch.set_num_threads(1)
    tokenizer = Path(resolve_target(None).load_path)

    def build(name: str) -> Path:
        model_type, extra = DECODE_VARIANTS.get(name, (name, {}))
        return build_family(model_type, tokenizer, root / name, extra=extra)

    return {name: AutoModelForCausalLM.from_pretrained(build(name), dtype=torch.float32).eval() for name in names}
