"""Does the drafter use the target's context features? Train (and evaluate) once as usual and once with every
context feature zeroed, same cache, seed and flags; the gap in tau is what the features contribute.

    python benchmarks/context_ablation.py real --cache CACHE --out RUN_REAL [dflash train flags, --num-workers 0]
    python benchmarks/context_ablation.py zero --cache CACHE --out RUN_ZERO [same flags]

`zero` patches the trainer's device-side micro-batch and the evaluation's feature decoding (both in this process,
hence --num-workers 0), so the drafter never sees a feature value. Result of 2026-12-03 in
benchmarks/results/context_ablation_cpu.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash.shared.cache_format as cf  # noqa: E402
from dflash.stage2_train.trainer import Trainer  # noqa: E402


def zero_the_features() -> None:
    decode, inputs = cf.decode_features, Trainer._micro_batch_inputs

    def zero_decode(stored, scales):  # noqa: ANN001, ANN202
        return decode(stored, scales) * 0

    def zero_inputs(self, batch):  # noqa: ANN001, ANN202
        micro = inputs(self, batch)
        micro["features"] = micro["features"] * 0
        return micro

    cf.decode_features = zero_decode
    Trainer._micro_batch_inputs = zero_inputs


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("real", "zero"):
        sys.exit(__doc__)
    if sys.argv[1] == "zero":
        zero_the_features()
    from dflash.shared.cli import main

    sys.argv = ["dflash", "train", *sys.argv[2:]]
    main()
