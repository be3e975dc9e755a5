"""benchmarks/bench_loader.py on a real cache (the tests' tiny extraction), on CPU: one worker's micro-batches timed,
their sizes those of the run's own plan, and the workers a step time asks for."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_loader_batches_are_timed_and_sized_as_the_runs_plan(baseline_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "loader.json"
    flags = "--draft-layers 1 --max-anchors 8 --batch-tokens 256"
    result = subprocess.run([sys.executable, "benchmarks/bench_loader.py", "--cache", str(baseline_cache),
                             "--train-flags", flags, "--batches", "5", "--step-s", "0.001", "--out", str(out)],
                            cwd=REPO, text=True, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    timed, summary = record["timed"], record["summary"]
    assert timed["batch_tokens"] == 256 and timed["micro_batches_in_epoch"] >= 5
    assert len(timed["seconds"]) == 5 and all(s > 0 for s in timed["seconds"])
    # Every micro-batch holds tokens under the budget and at least one block.
    assert all(0 < t <= 256 for t in timed["tokens"]) and all(b > 0 and b % 16 == 0 for b in timed["block_tokens"])
    # The first (opening the stores) is apart; the figures are those of the other four.
    rest = timed["seconds"][1:]
    assert summary["first_s"] == timed["seconds"][0] and summary["mean_s"] == statistics.fmean(rest)
    assert summary["median_s"] == statistics.median(rest) and summary["max_s"] == max(rest)
    assert summary["workers_needed"] == math.ceil(summary["mean_s"] / 0.001)
    assert f"-> {out}" in result.stdout


def test_the_micro_batches_are_the_training_loaders(baseline_cache: Path, tmp_path: Path) -> None:
    """The timed batches are those the trainer's loader yields (same plan, same packing), read in this process."""
    from dataclasses import replace

    from benchmarks import bench_loader
    from dflash.stage2_train.run_setup import setup_run

    flags = "--draft-layers 1 --max-anchors 8 --batch-tokens 256"
    timed = bench_loader.time_batches(str(baseline_cache), flags, 3)
    options = replace(bench_loader.real_options(str(baseline_cache), flags, tmp_path / "run"), num_workers=0)
    run = setup_run(options)
    try:
        batches = [batch for batch, _ in zip(run.loader(0, 0), range(3))]
    finally:
        if run.lock is not None:
            run.lock.release()
    assert timed["tokens"] == [int(b["lengths"].sum()) for b in batches]
    assert timed["block_tokens"] == [int(b["block_valid"].sum()) * 16 for b in batches]
