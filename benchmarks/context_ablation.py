"""Does the drafter use the target's context features? Train (and evaluate) once as usual and once with every
context feature zeroed, same cache, seed and flags; the gap in tau is what the features contribute.

    python benchmarks/context_ablation.py real --cache CACHE --out RUN_REAL [dflash train flags]
    python benchmarks/context_ablation.py zero --cache CACHE --out RUN_ZERO [same flags]

`zero` trains through the public loop (`trainer.train`) with a feature transform that zeroes the context features
of every training micro-batch and every held-out evaluation sequence, so the drafter never sees a feature value.
Result of 2026-12-03 in benchmarks/results/context_ablation_cpu.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dflash.shared.errors import user_facing_errors
from dflash.stage2_train.cli import train_command
from dflash.stage2_train.options import TrainOptions
from dflash.stage2_train.trainer import train


def main(mode: str, args: list[str]) -> None:
    params = dict(train_command.make_context("train", args).params)  # the `dflash train` flags, parsed by click
    params.pop("processes", None)
    params.pop("local_copy", None)
    params["cache"] = Path(params["cache"])
    options = TrainOptions(compile=params.pop("compile_"), **params)
    with user_facing_errors():
        train(options, feature_transform=torch.zeros_like if mode == "zero" else None)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("real", "zero"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
