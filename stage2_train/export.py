"""Export the drafter as a Hugging Face folder that z-lab/dflash, vLLM and SGLang load unchanged.

`config.json` (the reference DFlashDraftModel config: Qwen3 sizes, `block_size`, `num_target_layers`,
`dflash_config: {mask_token_id, target_layer_ids}`, `layer_types`, `rope_theta`, `rms_norm_eps`) and
`model.safetensors` with the reference weight names and no prefix, and `modeling_dflash.py` (named by the
config's `auto_map`: `AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` returns the drafter with
`spec_generate`). A `dflash_target.json` beside them records which target and cache the drafter was trained for, so
evaluation can refuse a mismatched target, and how the cache's prompts were rendered, so evaluation can check its
own prompts against it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.shared.cache_format import RENDERING_KEY
from dflash.shared.errors import UserError, hidden_os_error
from dflash.shared.run_files import CONFIG_FILE, TARGET_INFO_FILE, WEIGHTS_FILE
from dflash.stage2_train.draft_attention import AttnImplementation, training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.modeling_dflash import DFlashDraftModel

MODELING_FILE = "modeling_dflash.py"  # the drafter and its loop (stage2_train/modeling_dflash.py), shipped with every export


def export_draft(model: DFlashDraftModel, out_dir: Path, manifest: dict[str, Any], *, run_dir: Path | None = None,
                 extra_files: dict[str, str] | None = None) -> None:
    """Write config.json + model.safetensors (bf16), the target record (with the run directory it came from) and
    any extra_files (name: text), atomically into out_dir."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    # `AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` builds the drafter from the modeling file we ship.
    config["auto_map"] = {"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.{type(model).__name__}"}
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {name: tensor.detach().to(torch.bfloat16).contiguous().cpu() for name, tensor in model.state_dict().items()}
    try:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    except SafetensorError as error:  # a full disk or a file-size limit, as safetensors words it
        cause = hidden_os_error(error, tmp / WEIGHTS_FILE)
        shutil.rmtree(tmp, ignore_errors=True)
        raise cause or error from error
    identity = manifest.get("identity", {})
    info = {
        "target_source": identity.get("target_source"),
        "target_hash": identity.get("target_hash"),
        "tokenizer_hash": identity.get("tokenizer_hash"),
        "hidden_size": identity.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "layer_ids": identity.get("layer_ids"),
        # How the cache's prompts were rendered (chat template, thinking, special tokens): what eval checks against.
        RENDERING_KEY: manifest.get(RENDERING_KEY),
        "run_dir": str(Path(run_dir).resolve()) if run_dir is not None else None,
    }
    (tmp / TARGET_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.copy(Path(__file__).with_name(MODELING_FILE), tmp / MODELING_FILE)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def read_target_info(draft_dir: Path) -> dict[str, Any]:
    """The export's record of the target it was trained for ({} when it has none, e.g. a reference export)."""
    path = draft_dir / TARGET_INFO_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON ({error}); re-export the drafter") from error


def load_draft_weights(model: DFlashDraftModel, export_dir: Path, backbone_only: bool = False) -> None:
    """Load an export's weights into `model` (of the export's config), strictly; with ``backbone_only``, a DFlash
    export into a DFlash 2 drafter, whose added parts keep their values."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(export_dir / WEIGHTS_FILE))
    except (SafetensorError, FileNotFoundError) as error:  # truncated, overwritten or gone
        raise UserError(f"{export_dir / WEIGHTS_FILE} is damaged ({error}): export the drafter again (`dflash export "
                        "--run RUN`) or copy it anew") from error
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if backbone_only:
        added = set(model.added_parameter_names())
        missing = [name for name in missing if name not in added]
    if missing or unexpected:
        raise UserError(f"{export_dir / WEIGHTS_FILE} does not match the DFlash drafter: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")


def load_draft(export_dir: Path, attn_implementation: AttnImplementation = "auto") -> DFlashDraftModel:
    """Load an exported drafter (ours or a reference export) strictly, with the training attention (the offline walk
    runs the training layouts)."""
    config_path = export_dir / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{export_dir} is not an exported drafter: config.json not found (run `dflash export`)")
    config = DFlashConfig.from_dict(json.loads(config_path.read_text()))
    model = training_drafter(config, attn_implementation)
    load_draft_weights(model, export_dir)
    return model
