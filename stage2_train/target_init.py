"""`dflash train --init-from-target`: start the drafter's layers and final norm from the target's.

Stage 2 never loads the target: the layers come from the cache's `target/decoder_layers.safetensors`, which
`dflash extract --export-layers` writes. Drafter layer j takes target layer `ids[j]` (`last`: the last
`--draft-layers` target layers in order, the default, which choice is best is to be measured on the H200; `first`;
or one explicit id per drafter layer), tensor by tensor (`DECODER_LAYER_TENSORS`) where the target has the tensor
and its shape equals the drafter's; the drafter's final norm takes the target's. Norm weights get the target's norm
offset added (zero-centred norms, e.g. Gemma's `(1 + w)`, become the drafter's plain `w`). The context projection
(`fc`, `hidden_norm`) and whatever was skipped keep the random initialisation of the run's seed. `init_from_target`
returns the record of what was copied and skipped (kept in RUN/target_init.json and in every export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger
from dflash.shared.target_layers import DECODER_LAYER_TENSORS, select_layers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash.stage2_train.modeling_dflash import DFlashDraftModel

log = get_logger(__name__)

DEFAULT_CHOICE = "last"  # what `--init-from-target` alone means


def layers_path(cache_dir: Path) -> Path:
    return cache_dir / cf.TARGET_DIR / cf.DECODER_LAYERS_FILE


def init_from_target(model: DFlashDraftModel, cache_dir: Path, spec: str) -> dict[str, Any]:
    """Copy target decoder layers (chosen by `spec`, see `select_layers`) and the final norm into `model` in place;
    returns {spec, source_layer_ids, copied: {drafter name: cache name}, skipped: {drafter name: why},
    norm_weight_offset, target_tensors_left_out}."""
    from safetensors import safe_open

    count = int(model.config.num_hidden_layers)
    ids = select_layers(spec, int(model.config.num_target_layers), count, "--init-from-target")
    if len(ids) != count:
        raise UserError(f"--init-from-target {spec} names {len(ids)} target layers for a drafter of {count} "
                        "(--draft-layers): name one per drafter layer")
    path = layers_path(cache_dir)
    record = cf.read_layer_record(path) if path.is_file() else {}
    held = list(record.get("layer_ids", []))
    if not set(ids) <= set(held):
        where = f"{path} holds layers {held}" if held else f"{path} does not exist"
        raise UserError(f"--init-from-target {spec} needs target layers {ids}, {where}: rerun `dflash extract` "
                        f"into this cache with --export-layers {','.join(map(str, ids))} (its finished shards are "
                        "kept)")
    offset = record.get("norm_weight_offset")
    pairs = [(f"layers.{j}.{name}", f"layers.{i}.{name}") for j, i in enumerate(ids) for name in DECODER_LAYER_TENSORS]
    pairs.append(("norm.weight", "norm.weight"))
    copied: dict[str, str] = {}
    skipped: dict[str, str] = {}
    with safe_open(str(path), framework="pt") as handle, torch.no_grad():
        available = set(handle.keys())
        for target_name, source_name in pairs:
            parameter = model.get_parameter(target_name)
            if source_name not in available:
                skipped[target_name] = f"the target has no {source_name.split('.', 2)[-1]}"
                continue
            value = handle.get_tensor(source_name)
            if tuple(value.shape) != tuple(parameter.shape):
                skipped[target_name] = f"shape {list(value.shape)} in the target, {list(parameter.shape)} here"
                continue
            if isinstance(model.get_submodule(target_name.rsplit(".", 1)[0]), Qwen3RMSNorm):
                if offset is None:
                    skipped[target_name] = "the target's norms are not plain RMSNorms (unknown weight offset)"
                    continue
                if offset:
                    value = value.float() + offset
            parameter.copy_(value)
            copied[target_name] = source_name
    log.info("--init-from-target %s: drafter layers 0..%d from target layers %s and the final norm; copied %d "
             "tensors, skipped %d%s", spec, count - 1, ids, len(copied), len(skipped),
             f" ({'; '.join(sorted(set(skipped.values())))})" if skipped else "")
    return {"spec": spec, "source_layer_ids": ids, "copied": copied, "skipped": skipped,
            "norm_weight_offset": offset, "target_tensors_left_out": list(record.get("left_out", []))}
