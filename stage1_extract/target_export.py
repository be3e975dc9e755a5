"""Write the cache's `target/` folder: exactly what stage 2 needs from the target, and nothing more.

config.json, generation_config.json, the tokenizer files, dflash_target.json (stop ids, the embedding scale, the
model type), and embeddings.safetensors with the input embedding
(`embed_tokens.weight`) and the LM head (`lm_head.weight`). With `--export-layers`, also decoder_layers.safetensors:
the chosen decoder layers and the final norm, for `dflash train --init-from-target` (`export_decoder_layers`). The
tensors are read straight from the checkpoint's safetensors files, so neither this stage's supervisor nor stage 2
ever loads the full target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dflash.shared.cache_format import DECODER_LAYERS_FILE, EMBEDDINGS_FILE, TARGET_RECORD_FILE, read_layer_record
from dflash.shared.errors import UserError
from dflash.shared.target_layers import DECODER_LAYER_TENSORS

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


def _text_prefix(files: list[Path]) -> str:
    """The name prefix of the text decoder's tensors (`model.`, `model.language_model.`, ...): that of its
    `embed_tokens.weight`, found as `_find_tensors` finds the embedding."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(EMBED_SUFFIX) and "vision" not in key:
                    return key[: -len(EMBED_SUFFIX)]
    raise KeyError(f"no '*{EMBED_SUFFIX}' tensor in {files[0].parent}")


def export_decoder_layers(model_folder: Path, layer_ids: list[int], target_dir: Path,
                          norm_weight_offset: float | None) -> int:
    """Write target_dir/decoder_layers.safetensors: `layers.{i}.NAME` for each target layer i of `layer_ids` and each
    NAME of `DECODER_LAYER_TENSORS` the checkpoint has, and `norm.weight` (the final norm), in the checkpoint's
    dtype. Layers an earlier run exported there are kept. The metadata records the layer ids, the norms' weight
    offset (`target_layers.norm_weight_offset`) and the names of the layer tensors left out (biases, experts, ...).
    Returns the bytes of the tensors written (0 when every layer was there already)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = target_dir / DECODER_LAYERS_FILE
    previous = read_layer_record(path).get("layer_ids", []) if path.is_file() else []
    if set(layer_ids) <= set(previous):
        return 0
    wanted = sorted(set(previous) | set(layer_ids))
    files = sorted(model_folder.glob("*.safetensors"))
    prefix = _text_prefix(files)
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.+)")
    tensors: dict[str, Any] = {}
    left_out: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key == f"{prefix}norm.weight":
                    tensors["norm.weight"] = handle.get_tensor(key)
                match = pattern.fullmatch(key)
                if match is None or int(match.group(1)) not in wanted:
                    continue
                if match.group(2) in DECODER_LAYER_TENSORS:
                    tensors[f"layers.{match.group(1)}.{match.group(2)}"] = handle.get_tensor(key)
                else:
                    left_out.add(re.sub(r"\.\d+\.", ".*.", match.group(2)))
    missing = [i for i in wanted if not any(k.startswith(f"layers.{i}.") for k in tensors)]
    if missing or "norm.weight" not in tensors:
        raise UserError(f"--export-layers: {model_folder} has no tensors named {prefix}layers.N.* for layers "
                        f"{missing}" + ("" if "norm.weight" in tensors else f" and no final norm {prefix}norm.weight")
                        + ": this target's layers cannot be exported; leave out --export-layers")
    metadata = {"layer_ids": json.dumps(wanted), "norm_weight_offset": json.dumps(norm_weight_offset),
                "left_out": json.dumps(sorted(left_out))}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())
