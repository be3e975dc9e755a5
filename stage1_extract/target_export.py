"""Write the cache's `target/` folder: exactly what stage 2 needs from the target, and nothing more.

config.json, generation_config.json, the tokenizer files, dflash_target.json (stop ids, the embedding scale, the
model type), and embeddings.safetensors with the input embedding (`embed_tokens.weight`) and the LM head
(`lm_head.weight`). The tensors are read straight from the checkpoint's safetensors files, so neither this stage's
supervisor nor stage 2 ever loads the full target.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dflash.shared.cache_format import EMBEDDINGS_FILE, TARGET_RECORD_FILE

EMBED_SUFFIX = "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


def _find_tensors(folder: Path) -> dict[str, Any]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no .safetensors weights; dflash reads the embedding and LM head from safetensors "
            "(convert the checkpoint with `save_pretrained(..., safe_serialization=True)`)"
        )
    found: dict[str, Any] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(EMBED_SUFFIX) and "embed_tokens" not in found and "vision" not in key:
                    found["embed_tokens"] = handle.get_tensor(key)
                elif key == LM_HEAD_KEY:
                    found["lm_head"] = handle.get_tensor(key)
    return found


def export_target_files(model_folder: Path, tokenizer: Any, target_dir: Path, stop_token_ids: list[int],
                        embed_scale: float = 1.0) -> None:
    """Create target_dir (atomically) unless it already exists. `embed_scale`: the factor the target's embedding
    module multiplies its rows by (recorded in dflash_target.json; embeddings.safetensors keeps the raw weight)."""
    if (target_dir / EMBEDDINGS_FILE).is_file():
        return
    from safetensors.torch import save_file

    config = json.loads((model_folder / "config.json").read_text())
    tensors = _find_tensors(model_folder)
    if "embed_tokens" not in tensors:
        raise KeyError(f"no '*{EMBED_SUFFIX}' tensor in the safetensors files of {model_folder}")
    if "lm_head" not in tensors:
        text_config = config.get("text_config", config)
        if not text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            raise KeyError(f"no '{LM_HEAD_KEY}' in {model_folder} and the config does not tie it to the embedding")
        tensors["lm_head"] = tensors["embed_tokens"]
    tmp = target_dir.with_name(f".{target_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(model_folder / "config.json", tmp / "config.json")
    generation = model_folder / "generation_config.json"
    if generation.is_file():
        shutil.copy(generation, tmp / "generation_config.json")
    tokenizer.save_pretrained(tmp)
    save_file(
        {
            "embed_tokens.weight": tensors["embed_tokens"].contiguous(),
            "lm_head.weight": tensors["lm_head"].clone().contiguous(),
        },
        str(tmp / EMBEDDINGS_FILE),
    )
    text_config = config.get("text_config", config)
    record = {"stop_token_ids": stop_token_ids, "embed_scale": float(embed_scale),
              "model_type": text_config.get("model_type", config.get("model_type"))}
    (tmp / TARGET_RECORD_FILE).write_text(json.dumps(record, indent=2))
    shutil.rmtree(target_dir, ignore_errors=True)
    os.replace(tmp, target_dir)
