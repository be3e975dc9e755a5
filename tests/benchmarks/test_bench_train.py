"""benchmarks/bench_train.py on a real cache (the tests' tiny extraction), on CPU: the trainer's step timed, then
phase by phase, then profiled; the result file names the model, the architecture and the attention backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PHASES = ("loader wait", "inputs", "forward", "objective", "selector loss", "backward", "optimizer")


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "benchmarks/bench_train.py", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_real_cache_steps_are_timed_by_phase(baseline_cache: Path, tmp_path: Path) -> None:
    flags = "--architecture dflash2 --draft-layers 1 --max-anchors 8 --batch-tokens 1024 --num-workers 0"
    result = run_bench("--cache", str(baseline_cache), "--train-flags", flags, "--steps", "2", "--warmup", "1",
                       "--profile", "1", "--profile-source", "loader", "--sdpa-backends", "math,efficient",
                       "--exact-windows", "--record-at-once", "--pageable-inputs", "--small-loss-chunks", "--foreach-adamw",
                       "--inputs-in-main", "--features-on-compute-stream",
                       "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-4000:]
    name = "smollm2-135m-instruct-real_dflash2_sdpa_cpu"
    summary = json.loads((tmp_path / "out" / f"train_{name}.json").read_text())
    assert (tmp_path / "out" / f"profile_{name}.txt").is_file()
    assert summary["architecture"] == "dflash2" and summary["batch_tokens"] == 1024
    # What the run really had (read from torch and the module, not echoed from the flags):
    assert summary["exact_windows"] is True and summary["record_at_once"] is True
    assert summary["pinned_inputs"] is False and summary["loss_chunk_rows"] == 1024
    assert summary["adamw_fused"] is False  # (the CPU never fuses it)
    assert summary["inputs_in_workers"] is False and summary["features_copied_aside"] is False
    assert summary["sdpa_backends_enabled"] == {"cudnn": False, "efficient": True, "flash": False, "math": True}
    assert "not counted" in summary["flops_counted"]  # DFlash 2's own parts are left out of the FLOPs, and said so
    for variant in ("memory", "loader"):
        assert summary["results"][variant]["step_s"] > 0 and summary["results"][variant]["tflops"] > 0
        assert summary["results"][variant]["block_tokens_per_s"] > 0
    phases = summary["phases"]
    assert set(phases["phase_s"]) == set(PHASES) and all(phases["phase_s"][p] > 0 for p in PHASES)
    assert abs(sum(phases["phase_s"].values()) - phases["phased_step_s"]) < 1e-6
    assert abs(sum(phases["share"].values()) - 1) < 1e-6
    # On CPU the synchronisations cost nothing: the phased step is the timed step, up to the noise of a shared CPU
    # (and the batches, which differ in size from step to step).
    assert 1 / 3 < phases["phased_step_s"] / summary["results"]["loader"]["step_s"] < 3
    assert sum(summary["profile"]["share"].values()) > 0.99 and summary["profile"]["source"] == "loader"
    # The Markdown table of results is generated from such files: one row each, speed-up over the first.
    result_file = str(tmp_path / "out" / f"train_{name}.json")
    table = subprocess.run([sys.executable, "benchmarks/train_speed_table.py", result_file, result_file], cwd=REPO,
                           text=True, capture_output=True, timeout=60)
    rows = [line for line in table.stdout.splitlines() if line.startswith("| `")]
    assert table.returncode == 0 and len(rows) == 2 and all("| 1.00x |" in row for row in rows), table.stderr
    assert "SDPA backends math,efficient; exact windows; record read every step; inputs built in the main process" \
        in rows[0]


def test_bad_train_flags_stop_in_one_line(baseline_cache: Path) -> None:
    result = run_bench("--cache", str(baseline_cache), "--train-flags", "--batch-tokenz 8")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "--train-flags: No such option '--batch-tokenz'. (Did you mean one of: '--batch-tokens', '--mask-token-id'?)"]
