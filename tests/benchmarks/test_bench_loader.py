"""benchmarks/bench_loader.py on a real cache (the tests' tiny extraction), on CPU: one worker's micro-batches timed,
their sizes those of the run's own plan, and the workers a step time asks for."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_loader_batches_are_timed_and_sized_as_the_runs_plan(baseline_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "loader.json"
    flags = "--draft-layers 1 --max-anchors 8 --batch-tokens 256"
    result = subprocess.run([sys.executable, "benchmarks/bench_loader.py", "--cache", str(baseline_cache),
                             "--train-flags", flags, "--batches", "5", "--repeats", "2", "--step-s", "0.001",
                             "--out", str(out)],
                            cwd=REPO, text=True, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert len(record["timed"]) == len(record["repeats"]) == 2
    summary = record["summary"]
    assert summary["repeat_means_s"] == [r["mean_s"] for r in record["repeats"]]
    timed = record["timed"][[r["mean_s"] for r in record["repeats"]].index(summary["mean_s"])]
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


def test_each_timed_second_is_the_building_of_one_micro_batch(baseline_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A micro-batch that takes a known time more to build shows it in its own timed second, and only there."""
    from benchmarks import bench_loader
    from dflash.stage2_train.packed_batches import CacheBatches

    build = CacheBatches.batch
    slow = {1: 0.3, 2: 0.0, 3: 0.15}  # by plan position: the second micro-batch 0.3 s more, the fourth 0.15 s

    def slowed(self: CacheBatches, position: int) -> dict:
        time.sleep(slow.get(position, 0.0))
        return build(self, position)

    monkeypatch.setattr(CacheBatches, "batch", slowed)
    flags = "--draft-layers 1 --max-anchors 8 --batch-tokens 256"
    seconds = bench_loader.time_batches(str(baseline_cache), flags, 5)["seconds"]
    assert seconds[1] >= 0.3 and seconds[3] >= 0.15
    # The neighbours carry no sleep (their own building: milliseconds for 256 tokens; a margin for a loaded machine).
    assert max(seconds[2], seconds[4]) < 0.15


def test_side_arrays_bench_reads_a_shard_of_the_caches_layout_both_ways(tmp_path: Path) -> None:
    """benchmarks/bench_side_arrays.py: a shard written with the cache's layout, the per-sample zarr reads and the
    whole arrays' slices timed (the script fails where the two read different values) and the chunk sizes those
    the cache format chose for that many tokens."""
    out = tmp_path / "side.json"
    result = subprocess.run([sys.executable, "benchmarks/bench_side_arrays.py", "--tokens", "300000", "--samples",
                             "5", "--out", str(out)], cwd=REPO, text=True, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["tokens"] == 300000 and record["samples"] == 5
    assert record["zarr_reads_ms_per_sample"] > 0 and record["whole_arrays_slices_ms_per_sample"] > 0
    assert record["whole_arrays_bytes"] == 300000 * (4 + 1 + 4 * 5)  # int32 ids, uint8 mask, 5 float32 scales
    assert record["chunk_bytes"] == {"input_ids": 4 * 300000, "loss_mask": 300000,
                                     "feature_scales": 4 * 5 * min(300000, 1 << 18)}
