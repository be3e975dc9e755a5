"""The files of a `dflash train` run directory and of a drafter export: every name in one place.

    RUN/
      train.log, train-rankK.log   the log of the main process / of process K
      train.lock                   held by the `dflash train` writing here (a second one is refused)
      train_options.json           the options the run was started with (cache path, split fraction, seed, ...)
      draft_config.json            the drafter's config (sizes, layers, mask token)
      cache_manifest.json          the manifest of the cache it trains from (what the export records)
      metrics.jsonl                one line per step and per evaluation
      training.png, tensorboard/   plots
      checkpoints/step-NNNNNNNN/   Accelerate state + data position; `complete` marks a fully written one
      export/                      the final drafter (EXPORT: config.json, model.safetensors, dflash_target.json)
      export_best/                 the drafter of the best validation evaluation, with best.json (its step and tau)
      test_results.json            that drafter on the whole test split, evaluated once at the end of training
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.shared.errors import UserError

# An export folder (what `dflash train` and `dflash export` write, and what eval, vLLM and SGLang load).
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TARGET_INFO_FILE = "dflash_target.json"  # the target (and run) the drafter was trained for
BEST_RECORD_FILE = "best.json"  # in export_best/: the step and validation tau of that evaluation
# Written by `dflash train --init-from-target` until its removal (2026-12-07: it trained worse, docs/benchmarks.md):
# a run directory made then may hold it, and `--overwrite` discards it with the rest.
RETIRED_RUN_FILES = ("target_init.json",)
CHECKPOINT_COMPLETE_FILE = "complete"  # in a checkpoint folder: written last


@dataclass(frozen=True)
class RunFiles:
    """The paths of one run directory."""

    root: Path

    @property
    def lock(self) -> Path:
        """Held by the `dflash train` writing into the run (a second one into the same --out is refused)."""
        return self.root / "train.lock"

    def results(self) -> list[Path]:
        """What a run produced (the logs aside): what `dflash train --overwrite` discards."""
        return [self.options, self.draft_config, self.cache_manifest, self.metrics, self.plot, self.tensorboard,
                self.checkpoints, self.export, self.export_best, self.test_results,
                *(self.root / name for name in RETIRED_RUN_FILES)]

    def entries(self) -> list[str]:
        """Every name a run directory may hold (anything else: the folder is not a run; train will not write
        there)."""
        return [p.name for p in self.results()] + [self.lock.name, "train.log", "train-rank*.log"]

    def is_run(self) -> bool:
        """Whether a `dflash train` has set up a run here (it records its options before its first step)."""
        return self.options.is_file()

    def log(self, rank: int = 0) -> Path:
        return self.root / ("train.log" if rank == 0 else f"train-rank{rank}.log")

    @property
    def options(self) -> Path:
        return self.root / "train_options.json"

    @property
    def draft_config(self) -> Path:
        return self.root / "draft_config.json"

    @property
    def cache_manifest(self) -> Path:
        return self.root / "cache_manifest.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def plot(self) -> Path:
        return self.root / "training.png"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def export_best(self) -> Path:
        return self.root / "export_best"

    @property
    def test_results(self) -> Path:
        return self.root / "test_results.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        """The fully written checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.glob("step-*") if (p / CHECKPOINT_COMPLETE_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def recorded_options(self, *needed: str) -> dict[str, Any]:
        """The options the run was started with (train_options.json), refused with one line when they lack one of
        the `needed` ones."""
        record = json.loads(self.options.read_text())
        missing = [name for name in needed if name not in record]
        if missing:
            raise UserError(f"{self.options} does not record {', '.join(missing)}: this dflash cannot go on with or "
                            f"evaluate the run in {self.root}; train it afresh")
        return record

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None


def run_of_export(export_dir: Path) -> RunFiles | None:
    """The run directory an export came from: the one its target record names (written by `dflash train` and
    `dflash export`), else its parent when that is a run directory (RUN/export of a run moved since); None for a
    foreign export."""
    export_dir = Path(export_dir).resolve()
    info_path = export_dir / TARGET_INFO_FILE
    if info_path.is_file():
        try:
            recorded = json.loads(info_path.read_text()).get("run_dir")
        except json.JSONDecodeError:
            recorded = None
        if recorded and RunFiles(Path(recorded)).options.is_file():
            return RunFiles(Path(recorded))
    parent = RunFiles(export_dir.parent)
    return parent if parent.options.is_file() else None
