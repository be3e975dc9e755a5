"""Distillation end to end on the embedded SmolLM2: a cache extracted with `--store-target-topk` (the session's
`topk_cache`) trains with `--loss kl` and `--loss mix`; a cache without top-k is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import run_dflash, step_records

TRAIN_ARGS = ("--draft-layers", "1", "--max-anchors", "24", "--batch-tokens", "1024", "--num-workers", "0",
              "--eval-fraction", "0.15", "--eval-every", "0", "--eval-sequences", "2", "--mixed-precision", "no",
              "--lr", "3e-3", "--warmup", "0.1", "--max-steps", "6")


@pytest.mark.parametrize("loss", ["kl", "mix"])
def test_distillation_trains_and_logs_its_terms(topk_cache: Path, tmp_path: Path, loss: str) -> None:
    run = tmp_path / "run"
    run_dflash("train", "--cache", str(topk_cache), "--out", str(run), "--loss", loss, *TRAIN_ARGS, check=True)
    records = [record for _, record in sorted(step_records(run).items())]
    assert len(records) == 6
    for record in records:
        assert all(math.isfinite(record[key]) and record[key] >= 0 for key in ("loss", "loss_ce", "loss_kl"))
        weight = 1.0 if loss == "kl" else 0.5  # --kl-weight's default
        assert record["loss"] == pytest.approx((1 - weight) * record["loss_ce"] + weight * record["loss_kl"],
                                               rel=1e-5)
    first, last = records[0]["loss_kl"], sum(r["loss_kl"] for r in records[-3:]) / 3
    assert last < 0.5 * first, [r["loss_kl"] for r in records]
    assert (run / "export" / "model.safetensors").is_file()


def test_kl_on_a_cache_without_topk_names_the_cache_and_the_flag(baseline_cache: Path, tmp_path: Path) -> None:
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(tmp_path / "run"), "--loss", "kl")
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert str(baseline_cache) in message and "--store-target-topk K" in message
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_a_kl_weight_that_the_loss_would_ignore_is_refused(baseline_cache: Path, tmp_path: Path, loss: str) -> None:
    """--kl-weight weighs --loss mix only: given with another loss it is refused (exit 2) rather than silently
    ignored, before the run directory is made."""
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(tmp_path / "run"), "--loss", loss,
                        "--kl-weight", "0.3")
    assert result.returncode == 2
    assert "--kl-weight" in result.stderr and f"--loss {loss} would ignore it" in result.stderr
    assert not (tmp_path / "run").exists()
