"""Several machines (docs/multinode.md), simulated on localhost: every "machine" is its own process tree, and the
shared filesystem is a common tmp directory.

Stage 1: two `dflash extract` runs with disjoint `--only-shards` ranges fill one cache at the same time; it verifies
and equals a single-run cache. Stage 2: two `accelerate launch` commands (machine rank 0 and 1, one process each,
gloo) train one run that equals a one-machine run with the same global batch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, REPO, run_dflash

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# Small: 2 optimizer steps of a 1-layer drafter over 4 micro-batches of the 14-conversation baseline cache (the
# two-machine extraction test shows a cache filled by two machines equals it).
TRAIN_ARGS = ("--max-steps", "2", "--draft-layers", "1", "--max-anchors", "24", "--batch-tokens", "256",
              "--num-workers", "0", "--eval-every", "0", "--checkpoint-every", "0", "--eval-fraction", "0.15",
              "--eval-sequences", "1", "--mixed-precision", "no")


def run_machines(commands: list[list[str]], logs: list[Path], timeout: float,
                 env: dict[str, str] | None = None) -> list[int]:
    """Run the commands at once, each in its own session (a "machine"); return their exit codes.

    If one fails, or the deadline passes (e.g. a rendezvous that never completes), every command still running is
    killed with its whole process group (accelerate launch -> torchrun -> worker), so a test never hangs.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    processes = []
    for command, log in zip(commands, logs, strict=True):
        with open(log, "w") as handle:
            processes.append(subprocess.Popen(command, cwd=REPO, env=full_env, stdout=handle,
                                              stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in processes):
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
            process.wait()
    return [-1 if p.returncode is None else p.returncode for p in processes]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def accelerate_launch(rank: int, port: int, *flags: str) -> list[str]:
    """`accelerate launch` on machine `rank` of 2, one process each (2 in all), rank 0 at 127.0.0.1:port."""
    return [ACCELERATE, "launch", *flags, "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip",
            "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2", "-m", "dflash.shared.cli", "train"]


def test_two_machines_extract_disjoint_shards_into_one_cache(chat_jsonl: Path, baseline_cache: Path,
                                                             tmp_path: Path) -> None:
    """The conftest baseline's extraction, split over two "machines" running at the same time into one directory."""
    out = tmp_path / "cache"
    ranges = ("0", "1-2")
    commands = [[sys.executable, "-m", "dflash.shared.cli", "extract", "--data", str(chat_jsonl), "--out", str(out),
                 "--only-shards", shards, "--workers", "1", *EXTRACT_ARGS] for shards in ranges]
    logs = [tmp_path / f"machine-{i}.log" for i in range(len(ranges))]
    codes = run_machines(commands, logs, timeout=600)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    for log, shards in zip(logs, ([0], [1, 2]), strict=True):  # each machine extracted its range only
        text = log.read_text()
        assert all(f"shard {i} done" in text for i in shards) and text.count(" done: ") == len(shards), text[-3000:]

    result = run_dflash("inspect", "--cache", str(out), "--verify", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    assert summary["complete"] and summary["shard_status"] == {"done": 3}
    assert summary["verify"] == {"ok": True, "problems": {}, "unfinished": {}}
    assert_same_cache(baseline_cache, out)


def _losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))


def test_accelerate_launch_on_two_machines_equals_one_machine(baseline_cache: Path, tmp_path: Path) -> None:
    two = tmp_path / "two_machines"  # one --out for both machines: a shared filesystem
    train = ["--cache", str(baseline_cache), "--out", str(two), *TRAIN_ARGS]
    port = free_port()
    logs = [tmp_path / f"machine-{rank}.log" for rank in (0, 1)]
    # HF_HOME: ignore any `accelerate config` default file of the user running the tests.
    codes = run_machines([accelerate_launch(rank, port, "--multi_gpu") + train for rank in (0, 1)], logs,
                         timeout=420, env={"HF_HOME": str(tmp_path / "hf")})
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "on 2 process(es)" in (two / "train.log").read_text()
    assert (two / "train-rank1.log").is_file() and (two / "export" / "model.safetensors").is_file()

    one = tmp_path / "one_machine"
    single = run_dflash("train", "--cache", str(baseline_cache), "--out", str(one), *TRAIN_ARGS,
                        "--processes", "1", "--grad-accum", "2")
    assert single.returncode == 0, single.stderr[-3000:]

    # One metrics line per step (only the main process writes), equal to the one-machine run's.
    assert [step for step, _ in _losses(two)] == [1, 2]
    assert [loss for _, loss in _losses(two)] == pytest.approx([loss for _, loss in _losses(one)], rel=1e-5)
    # Equal up to float summation order (all-reduce vs accumulation), as in test_train's two-process test.
    weights = [_final_weights(two), _final_weights(one)]
    assert sorted(weights[0]) == sorted(weights[1])
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_accelerate_launch_cpu_without_ranks_is_refused(baseline_cache: Path, tmp_path: Path) -> None:
    """With --cpu, Accelerate starts one process per launch and no rank: it must not train alone."""
    out = tmp_path / "run"
    log = tmp_path / "machine-0.log"
    codes = run_machines([accelerate_launch(0, free_port(), "--cpu") + ["--cache", str(baseline_cache), "--out",
                                                                        str(out), *TRAIN_ARGS]],
                         [log], timeout=240, env={"HF_HOME": str(tmp_path / "hf")})
    text = log.read_text()
    assert codes[0] != 0, text[-3000:]  # accelerate reports the child's exit code 2 as its own failure
    assert "dflash: error: `accelerate launch --cpu` started this process without a rank" in text, text[-3000:]
    assert "--multi_gpu" in text
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
