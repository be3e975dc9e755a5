"""Checkpoints of a training run: saving one (Accelerate state + the data position), and exporting the drafter
of one as a Hugging Face folder (`dflash export --run`). Finding them: `RunFiles.latest_checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger
from dflash.shared.run_files import CHECKPOINT_COMPLETE_FILE, RunFiles
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.export import export_draft

if TYPE_CHECKING:
    from dflash.stage2_train.run_setup import TrainingRun

log = get_logger(__name__)


def save_checkpoint(run: TrainingRun) -> None:
    """Save the run's state at its current step (every process takes part); `complete` is written last."""
    path = run.files.checkpoint(run.state.step)
    run.accelerator.wait_for_everyone()
    run.accelerator.save_state(str(path))
    run.accelerator.wait_for_everyone()
    if run.is_main:
        (path / CHECKPOINT_COMPLETE_FILE).write_text(str(run.state.step))
        log.info("checkpoint %s", path)
        prune_checkpoints(run.files, run.options.keep_checkpoints)


def prune_checkpoints(files: RunFiles, keep: int) -> list[Path]:
    """--keep-checkpoints: delete all but the newest `keep` complete checkpoints (0 = keep all), and the unfinished
    ones older than the newest complete one (left by a killed save); returns what was deleted."""
    import shutil

    complete = files.complete_checkpoints()
    if not complete:
        return []
    newest = int(complete[-1].name.split("-")[1])
    unfinished = [p for p in files.checkpoints.glob("step-*") if p not in complete
                  and p.name.split("-")[1].isdigit() and int(p.name.split("-")[1]) < newest]
    doomed = (complete[:-keep] if keep else []) + unfinished
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log.debug("--keep-checkpoints %d: deleted %s", keep, ", ".join(p.name for p in doomed))
    return doomed


def has_checkpoint(run: TrainingRun) -> bool:
    """Whether the current step is already saved (by --checkpoint-every, or the checkpoint a resume started from)."""
    return (run.files.checkpoint(run.state.step) / CHECKPOINT_COMPLETE_FILE).is_file()


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of an `accelerate save_state` folder: model.safetensors under DDP; under FSDP (full
    state dict, Accelerate's default for FSDP1) the main process's torch.save file pytorch_model_fsdp.bin."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from safetensors.torch import load_file

    if (checkpoint / "model.safetensors").is_file():
        return load_file(str(checkpoint / "model.safetensors"))
    if (checkpoint / f"{FSDP_MODEL_NAME}.bin").is_file():
        return torch.load(checkpoint / f"{FSDP_MODEL_NAME}.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{checkpoint} holds neither model.safetensors nor {FSDP_MODEL_NAME}.bin (a sharded FSDP "
                    "checkpoint? its run's own export/ folder has the weights)")


def export_checkpoint(run_dir: Path, checkpoint: Path | None = None, out: Path | None = None) -> Path:
    """Export the weights of a checkpoint (default: the latest complete one) of a run."""
    files = RunFiles(run_dir.resolve())
    if checkpoint is None:
        checkpoint = files.latest_checkpoint()
        if checkpoint is None:
            raise UserError(f"{files.root} has no complete checkpoint under {files.checkpoints.name}/")
    config = DFlashConfig.from_dict(json.loads(files.draft_config.read_text()))
    model = training_drafter(config)
    model.load_state_dict(checkpoint_weights(checkpoint))
    manifest = json.loads(files.cache_manifest.read_text())
    out = out or files.export
    export_draft(model, out, manifest, run_dir=files.root)
    return out
