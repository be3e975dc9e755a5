"""The frozen parts of the target that stage 2 uses, read from the cache's `target/` folder (never the full model).

The drafter embeds its block with the target's `embed_tokens` and scores it with the target's `lm_head`; both stay
frozen. This module also chooses the mask token by the reference resolution order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError


def scaled_embedding(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """The rows the target's first decoder layer receives: `weight` times the target's embedding scale, computed in
    the weight's dtype exactly as transformers' scaled embeddings do (`embedding(ids) * embed_scale.to(dtype)`;
    a lookup commutes with the product). The one place the drafter's block embedding meets the scale: training,
    offline acceptance and `dflash eval` all embed with the matrix this returns."""
    if scale == 1.0:
        return weight
    return weight * torch.tensor(scale, dtype=weight.dtype, device=weight.device)


@dataclass
class TargetParts:
    config: dict[str, Any]  # the target's config.json (text part for multimodal configs)
    embed_tokens: torch.Tensor  # [V, H], already multiplied by embed_scale (`scaled_embedding`)
    lm_head: torch.Tensor  # [V, H]
    tokenizer_dir: Path
    stop_token_ids: list[int]
    embed_scale: float = 1.0  # the target's embedding scale (Gemma: sqrt(hidden))
    model_type: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.shape[1])


def load_target_parts(cache_dir: Path) -> TargetParts:
    from safetensors.torch import load_file

    folder = cache_dir / cf.TARGET_DIR
    path = folder / cf.EMBEDDINGS_FILE
    if not path.is_file():
        raise cf.CacheError(f"{folder} has no {cf.EMBEDDINGS_FILE}: the cache is incomplete; rerun `dflash extract`")
    tensors = load_file(str(path))
    config = json.loads((folder / "config.json").read_text())
    record = cf.read_target_record(cache_dir)
    text_config = config.get("text_config", config)
    scale = float(record["embed_scale"])
    return TargetParts(
        config=text_config,
        embed_tokens=scaled_embedding(tensors["embed_tokens.weight"], scale),
        lm_head=tensors["lm_head.weight"],
        tokenizer_dir=folder,
        stop_token_ids=list(record["stop_token_ids"]),
        embed_scale=scale,
        model_type=record["model_type"],
    )


def resolve_mask_token(parts: TargetParts, explicit: int | None = None, previous: int | None = None) -> int:
    """The id whose embedding fills not-yet-known block positions.

    Order (reference): explicit flag, an existing draft config, the tokenizer's mask token, the first embedding
    row no token uses (len(tokenizer) < vocab rows). With no free row, a special token that the chat template,
    bos/eos/pad/unk and the stop ids never use (the highest such id, e.g. SmolLM2's 16 `<empty_output>`, whose
    embedding is evidently untrained) is preferred over pad / eos, which the target does emit.
    """
    from transformers import AutoTokenizer

    for candidate in (explicit, previous):
        if candidate is not None:
            if not 0 <= candidate < parts.vocab_size:
                raise UserError(f"--mask-token-id {candidate} is outside the vocabulary (0..{parts.vocab_size - 1})")
            return int(candidate)
    tokenizer = AutoTokenizer.from_pretrained(str(parts.tokenizer_dir))
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < parts.vocab_size:
        return len(tokenizer)
    template = str(getattr(tokenizer, "chat_template", "") or "")
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
            *parts.stop_token_ids}
    special = [
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token_id not in used and token.content not in template
    ]
    if special:
        return int(max(special))
    for fallback in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if fallback is not None:
            return int(fallback)
    raise UserError("cannot choose a mask token for this tokenizer: pass --mask-token-id")
