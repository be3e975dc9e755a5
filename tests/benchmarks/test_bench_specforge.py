"""benchmarks/bench_specforge.py, SpecForge 0.2.0's own DFlash training step, on CPU: it runs end to end and writes
its result; its work per step is bench_train's for the same arguments (the same block tokens, the same FLOPs by
bench_train's own count), so the GPU comparison is like for like; and SpecForge's loss on the tiny input is finite
with a gradient in every drafter parameter.

SpecForge is imported from `.venv/reference_specforge/` (`make install` unzips the wheel there, without its
dependencies). The shape: 4 sequences of 96 tokens whose first 64 are prompt, i.e. 31 anchor candidates each, fewer
than the 512 anchors allowed: both implementations take every candidate, so their anchors are the same."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bench_train import LAYER_IDS, TINY, random_options, step_flops
from tests.conftest import REPO

LENGTH, BATCH = 96, 4


@pytest.fixture(scope="module")
def specforge_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("specforge")
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_specforge.py", "--tiny", "--length", str(LENGTH), "--batch", str(BATCH),
         "--steps", "2", "--warmup", "1", "--profile", "1", "--work-dir", str(out / "work"), "--out", str(out)],
        cwd=REPO, text=True, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    # On CPU: SpecForge's SDPA path (flex attention has no backward there) in its DDP wrapper (NO_SHARD; FSDP
    # needs an accelerator); its defaults on a GPU.
    return json.loads((out / "train_specforge_tiny_sdpa_no_shard_cpu.json").read_text()), out


def test_the_tiny_shape_runs_end_to_end_and_writes_its_result(specforge_result: tuple[dict, Path]) -> None:
    summary, out = specforge_result
    assert summary["benchmark"] == "train_specforge" and summary["specforge"] == "0.2.0"
    assert (summary["attention"], summary["wrapper"], summary["fsdp_sharding"]) == ("sdpa", "ddp", "NO_SHARD")
    assert summary["target_layer_ids"] == LAYER_IDS and summary["block_size"] == 16
    assert summary["objective_chunk_blocks"] == 128  # SpecForge's default, read from its config
    memory = summary["results"]["memory"]
    assert memory["step_s"] > 0 and memory["tflops"] > 0 and memory["mfu_vs_peak"] > 0
    assert memory["block_tokens_per_s"] == pytest.approx(summary["block_tokens_per_step"] / memory["step_s"])
    assert memory["samples_per_s"] == pytest.approx(BATCH / memory["step_s"])
    assert memory["tflops"] * 1e12 == pytest.approx(summary["flops_per_step"] / memory["step_s"])
    assert all(math.isfinite(summary["losses"][k]) for k in ("first", "last"))
    assert (out / "profile_specforge_tiny_sdpa_no_shard_cpu.txt").is_file()
    assert sum(summary["profile"]["share"].values()) > 0.99


def test_the_work_per_step_is_bench_trains(specforge_result: tuple[dict, Path], tmp_path: Path) -> None:
    from dflash.stage2_train.run_setup import setup_run
    from dflash.stage2_train.trainer import micro_batch_inputs

    summary, _ = specforge_result
    # bench_train's random-cache run with the same arguments (--tiny --length 96 --batch 4), its first micro-batch.
    run = setup_run(random_options(tmp_path, TINY, samples=BATCH, length=LENGTH, batch=BATCH, workers=0,
                                   attention="sdpa", compile=False))
    micro = micro_batch_inputs(run, next(iter(run.loader(0, 0))))
    assert micro.sequences == BATCH
    assert summary["block_tokens_per_step"] == float(micro.layout.block_valid.sum()) * 16 == BATCH * 31 * 16
    assert summary["flops_per_step"] == step_flops(run.config, micro)
    assert summary["trainable_params"] == sum(p.numel() for p in run.model.parameters() if p.requires_grad)


def test_specforge_loss_is_finite_and_reaches_every_drafter_parameter(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_specforge as bench

    bench.import_specforge()
    import torch.distributed as dist
    from specforge.training.strategies.base import StepContext

    # The one-process group SpecForge's run sets up, with its environment restored afterwards.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "FSDP_SHARDING": "NO_SHARD"}.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    bench.write_target(tmp_path / "target", TINY)
    run = bench.specforge_run(tmp_path / "target", BATCH, "sdpa", "NO_SHARD", total_steps=1)
    try:
        batch = bench.random_batch(TINY, BATCH, LENGTH, torch.device("cpu"))
        out = run.core.strategy.forward_loss(batch, StepContext())
        assert torch.isfinite(out.loss) and out.loss.item() > 0
        run.backend.backward(out.loss)
        missing = [name for name, p in run.model.draft_model.named_parameters() if p.requires_grad
                   and (p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0)]
        assert not missing, missing
        assert not any(p.requires_grad for p in run.model.lm_head.parameters())  # the target's head stays frozen
    finally:
        dist.destroy_process_group()
