"""Checkpoints of a training run: saving one (Accelerate state + the data position), verifying one, and exporting
the drafter of one as a Hugging Face folder (`dflash export --run`).

A checkpoint is written into a hidden temporary folder (`checkpoints/.step-NNNNNNNN.partial`), its `complete` file
last (the size and sha256 of every file, as JSON), checked against the disk, then renamed to `step-NNNNNNNN`: a
folder of that name is whole or was damaged afterwards. `--resume` and `dflash export --run` take the newest one
whose files still match what was recorded, naming any damaged one they pass over."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.shared.errors import UserError, hidden_os_error
from dflash.shared.logs import get_logger
from dflash.shared.run_files import CHECKPOINT_COMPLETE_FILE, RunFiles
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.export import export_draft

log = get_logger(__name__)


def save_checkpoint(accelerator: Any, files: RunFiles, step: int, keep: int) -> None:
    """Save a run's Accelerate state at `step` (every process takes part): into a temporary folder, the record of
    its files written last and checked, then renamed into place, and all but the newest `keep` deleted
    (--keep-checkpoints). A failed write leaves the previous checkpoints as they were and the disk error as one
    line."""
    path = files.checkpoint(step)
    partial = partial_checkpoint(path)
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(partial))
    except Exception as error:  # noqa: BLE001 - torch and safetensors hide the OS error behind their own
        cause = error if isinstance(error, OSError) else hidden_os_error(error, partial)
        shutil.rmtree(partial, ignore_errors=True)  # the space it took, back
        if cause is None or cause is error:
            raise
        raise cause from error
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {"step": step, "files": file_digests(partial)}
        (partial / CHECKPOINT_COMPLETE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        damage = checkpoint_damage(partial, digests=False)
        if damage:
            raise UserError(f"checkpoint {path} reads back otherwise than it was written ({damage}): check that "
                            "disk; the previous checkpoints are kept")
        if path.exists():  # a damaged checkpoint of this step, passed over by the --resume that led here
            shutil.rmtree(path)
        os.replace(partial, path)
        log.info("checkpoint %s", path)
        prune_checkpoints(files, keep)
    accelerator.wait_for_everyone()  # every process sees the checkpoint (`has_checkpoint`)


def partial_checkpoint(path: Path) -> Path:
    """The temporary folder a checkpoint is written into before it is renamed to `path`."""
    return path.with_name(f".{path.name}.partial")


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file below `folder`, by relative path."""
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_damage(checkpoint: Path, digests: bool = True) -> str | None:
    """What is wrong with a checkpoint's files against its `complete` record (None: intact): a file missing, of
    another size, or (with `digests`) of other bytes. A checkpoint saved before dflash recorded its files
    (`complete` holds only the step) cannot be checked and counts as intact."""
    try:
        record = json.loads((checkpoint / CHECKPOINT_COMPLETE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        return f"its {CHECKPOINT_COMPLETE_FILE} record cannot be read ({error})"
    if not isinstance(record, dict):
        return None
    for name, written in record["files"].items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != written["bytes"]:
            return f"{name} has {size:,} bytes, {written['bytes']:,} were written"
        if digests and sha256_of(path) != written["sha256"]:
            return f"{name} differs from what was written (sha256)"
    return None


def intact_checkpoint(files: RunFiles, purpose: str) -> Path | None:
    """The newest complete checkpoint whose files are as written (None when the run has none); each damaged one
    passed over is named in a warning, and a run whose checkpoints are all damaged is refused with the list."""
    damaged = []
    for checkpoint in reversed(files.complete_checkpoints()):
        damage = checkpoint_damage(checkpoint)
        if damage is None:
            if damaged:
                log.warning("%s: damaged checkpoint passed over in %s: %s; using %s, the newest intact one", purpose,
                            files.checkpoints, "; ".join(damaged), checkpoint.name)
            return checkpoint
        damaged.append(f"{checkpoint.name} ({damage})")
    if damaged:
        raise UserError(f"{purpose}: every checkpoint in {files.checkpoints} is damaged: {'; '.join(damaged)}: "
                        "train afresh with --overwrite (or into another --out)")
    return None


def prune_checkpoints(files: RunFiles, keep: int) -> list[Path]:
    """--keep-checkpoints: delete all but the newest `keep` complete checkpoints (0 = keep all), and the unfinished
    ones older than the newest complete one and any temporary folder (left by a killed save); returns what was
    deleted."""
    complete = files.complete_checkpoints()
    if not complete:
        return []
    newest = int(complete[-1].name.split("-")[1])
    unfinished = [p for p in files.checkpoints.glob("step-*") if p not in complete
                  and p.name.split("-")[1].isdigit() and int(p.name.split("-")[1]) < newest]
    doomed = (complete[:-keep] if keep else []) + unfinished + sorted(files.checkpoints.glob(".step-*.partial"))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log.debug("--keep-checkpoints %d: deleted %s", keep, ", ".join(p.name for p in doomed))
    return doomed


def has_checkpoint(files: RunFiles, step: int) -> bool:
    """Whether `step` is already saved (by --checkpoint-every, or the checkpoint a resume started from), whole: a
    damaged one a --resume passed over is saved again (sizes compared, which is cheap)."""
    path = files.checkpoint(step)
    return (path / CHECKPOINT_COMPLETE_FILE).is_file() and checkpoint_damage(path, digests=False) is None


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of an `accelerate save_state` folder: model.safetensors under DDP; under FSDP (full
    state dict, Accelerate's default for FSDP1) the main process's torch.save file pytorch_model_fsdp.bin."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from safetensors.torch import load_file

    from safetensors import SafetensorError

    if (checkpoint / "model.safetensors").is_file():
        try:
            return load_file(str(checkpoint / "model.safetensors"))
        except SafetensorError as error:  # a checkpoint saved before dflash recorded its files' digests
            raise UserError(f"{checkpoint / 'model.safetensors'} is damaged ({error}): export another checkpoint "
                            "(--checkpoint)") from error
    if (checkpoint / f"{FSDP_MODEL_NAME}.bin").is_file():
        return torch.load(checkpoint / f"{FSDP_MODEL_NAME}.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{checkpoint} holds neither model.safetensors nor {FSDP_MODEL_NAME}.bin (a sharded FSDP "
                    "checkpoint? its run's own export/ folder has the weights)")


def export_checkpoint(run_dir: Path, checkpoint: Path | None = None, out: Path | None = None) -> Path:
    """Export the weights of a checkpoint (default: the newest intact one) of a run."""
    files = RunFiles(run_dir.resolve())
    if checkpoint is None:
        checkpoint = intact_checkpoint(files, "dflash export")
        if checkpoint is None:
            raise UserError(f"{files.root} has no complete checkpoint under {files.checkpoints.name}/")
    elif (damage := checkpoint_damage(checkpoint)) is not None and (checkpoint / CHECKPOINT_COMPLETE_FILE).is_file():
        raise UserError(f"--checkpoint {checkpoint} is damaged ({damage}): export another one (leave --checkpoint "
                        "out for the newest intact one)")
    config = DFlashConfig.from_dict(json.loads(files.draft_config.read_text()))
    model = training_drafter(config)
    model.load_state_dict(checkpoint_weights(checkpoint))
    manifest = json.loads(files.cache_manifest.read_text())
    out = out or files.export
    export_draft(model, out, manifest, run_dir=files.root)
    return out
