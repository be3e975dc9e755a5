"""benchmarks/train_step_ops.py on the stage-2 tests' training cache, on CPU (uncompiled, one drafter layer, small
batches: fast): the eager operations of one `dflash train` step by phase for DFlash and DFlash 2, the waits for the
device among them, and what a selector-loss chunk costs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.stage2_train.loss import chunk_rows, selector_chunk_rows
from tests.conftest import REPO
from tests.stage2_train import conftest as stage2_fixtures

train_cache = stage2_fixtures.train_cache  # the session's training cache (extracted once, shared with stage 2)
FAST = ("--no-compile", "--draft-layers", "1", "--batch-tokens", "1024", "--warm-steps", "1")


def count_ops(cache: Path, out: Path, *flags: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "benchmarks/train_step_ops.py", "--cache", str(cache), *FAST,
                             "--out", str(out), *flags], cwd=REPO, text=True, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def both(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One invocation for both architectures, the chunking as on CUDA."""
    return count_ops(train_cache, tmp_path_factory.mktemp("train_step_ops") / "ops.json",
                     "--architecture", "dflash", "--architecture", "dflash2")


def by_architecture(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {result["architecture"]: result for result in record["results"]}


def test_dflash2_dispatches_more_and_its_selector_loss_waits_for_nothing(both: dict[str, Any],
                                                                         train_cache: Path) -> None:
    results = by_architecture(both)
    dflash, dflash2 = results["dflash"], results["dflash2"]
    for result in (dflash, dflash2):
        assert result["total"] == sum(result["by_phase"].values()) == sum(result["by_kind"].values())
        assert {"inputs", "forward", "objective", "backward", "optimizer+record"} <= set(result["by_phase"])
        assert all(count > 0 for count in result["by_phase"].values())
        assert result["micro_batches"] >= 1 and result["supervised"] > 0
    assert dflash2["total"] > dflash["total"]
    assert "selector loss" in dflash2["by_phase"] and "selector loss" not in dflash["by_phase"]
    # Backward operations of C++ autograd nodes are traced to the forward lines that made them.
    assert any(s["kind"] == "bw" and s["source"].startswith("modeling_dflash.py:") for s in dflash["top_sources"])
    # The loader hands the selector's positions over: its loss finds nothing on the device.
    selector_waits = [s for s in dflash2["syncs"] if s["phase"] == "selector loss"
                      or s["source"].startswith(("loss.py:selector_loss:", "loss.py:chunk_loss:"))]
    assert selector_waits == []
    settings = both["settings"]
    assert settings["cache"] == str(train_cache) and settings["batch_tokens"] == 1024 and settings["draft_layers"] == 1
    assert settings["warm_steps"] == 1
    assert settings["attention"] == "sdpa" and settings["compile"] is False and settings["device"] == "cpu"
    assert settings["torch"] == torch.__version__ and settings["date"]
    # The chunking CUDA would take, not the CPU's.
    for result in (dflash, dflash2):
        assert result["compile"] is False and result["attention"] == "sdpa" and result["draft_layers"] == 1
        assert result["ce_chunk_rows"] == chunk_rows(result["vocab_size"], "cuda")
    assert dflash["selector_chunk_rows"] is None
    assert dflash2["selector_chunk_rows"] == selector_chunk_rows(dflash2["selector_top_k"], dflash2["hidden_size"],
                                                                 "cuda", 2)
    assert dflash2["selector_chunks"] == dflash2["micro_batches"]  # one chunk per micro-batch at the CUDA size


def test_each_selector_chunk_costs_operations(both: dict[str, Any], train_cache: Path, tmp_path: Path) -> None:
    one_chunk = by_architecture(both)["dflash2"]
    positions = one_chunk["selector_positions"]
    assert one_chunk["micro_batches"] == 1 and one_chunk["selector_chunks"] == 1
    assert positions >= 2, "the cache's first batch has too few scored positions to split"
    two_chunks = by_architecture(count_ops(train_cache, tmp_path / "ops.json", "--architecture", "dflash2",
                                           "--selector-chunk-rows", str(math.ceil(positions / 2))))["dflash2"]
    assert two_chunks["selector_positions"] == positions and two_chunks["selector_chunks"] == 2
    assert two_chunks["by_phase"]["selector loss"] > one_chunk["by_phase"]["selector loss"]
    assert two_chunks["total"] > one_chunk["total"]
