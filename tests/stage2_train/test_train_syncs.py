"""The training step never waits for the device: its metrics record is read one step late (trainer.StepLog), and
what it writes is what reading each record at once wrote (trainer.RECORD_LAG_STEPS = 0, the order before)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.stage2_train import trainer
from dflash.stage2_train.options import TrainOptions

# The figures of a record that measure time or memory, not the training.
MEASURED = {"step_s", "elapsed_s", "block_tokens_per_s", "memory_peak_gib"}
# What makes the host wait for a tensor's value (on CUDA, a device synchronisation).
CONVERSIONS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


def dflash2_options(cache: Path, out: Path) -> TrainOptions:
    # DFlash 2 records every kind of figure (loss terms, candidate recall); two micro-batches per step, evaluations
    # and checkpoints in between (records flushed before each), the log's figures every other step.
    return TrainOptions(cache=cache, out=out, architecture="dflash2", max_steps=4, grad_accum=2, eval_every=2,
                        checkpoint_every=3, log_every=2, draft_layers=1, max_anchors=12, batch_tokens=1024,
                        num_workers=0, eval_fraction=0.05, eval_sequences=2, test_fraction=0.0,
                        mixed_precision="no", lr=4e-3)


def records(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(line).items() if k not in MEASURED}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Tensor-to-Python conversions made by trainer.py itself, inside the step (`accumulate_gradients` and
    `update_weights`) and outside it."""
    seen: dict[str, list[str]] = {"step": [], "elsewhere": []}
    inside = [False]
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == trainer.__file__:
                seen["step" if inside[0] else "elsewhere"].append(f"{_name} at line {caller.f_lineno}")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for name in ("accumulate_gradients", "update_weights"):
        original = getattr(trainer, name)

        def in_step(*args: Any, _original: Any = original) -> Any:
            inside[0] = True
            try:
                return _original(*args)
            finally:
                inside[0] = False

        monkeypatch.setattr(trainer, name, in_step)
    return seen


def test_deferred_records_equal_eager_ones_and_the_step_reads_no_tensor(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    with monkeypatch.context() as eager:
        eager.setattr(trainer, "RECORD_LAG_STEPS", 0)
        trainer.train(dflash2_options(train_cache, tmp_path / "eager"))
    conversions = count_conversions(monkeypatch)
    trainer.train(dflash2_options(train_cache, tmp_path / "deferred"))
    assert trainer.RECORD_LAG_STEPS == 1
    # Inside the step trainer.py reads no tensor; the instrumentation sees those it reads outside (the block count
    # of each micro-batch, on the CPU before the copy, and each record one step late).
    assert conversions["step"] == [], conversions["step"]
    assert conversions["elsewhere"], "the counting caught nothing: it counts nothing"
    got, want = records(tmp_path / "deferred"), records(tmp_path / "eager")
    assert got == want  # every figure, in the same order, evaluations between the same steps
    steps = [r for r in want if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 5))
    assert {"loss_block", "loss_selector", "candidate_recall", "labels", "accuracy"} <= set(steps[0])
    assert all(isinstance(r["labels"], int) and isinstance(r["loss"], float) for r in steps)
    assert [r["step"] for r in want if "eval/tau_walk" in r] == [0, 2, 4]
    timed = [json.loads(line) for line in (tmp_path / "deferred" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_s"] > 0 for r in timed if "loss" in r)
    assert [r["step"] for r in timed if "block_tokens_per_s" in r] == [2, 4]


def test_a_loss_that_is_not_finite_stops_the_training_one_step_late_at_most(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss at step 2 (read once step 3 is queued) stops the run naming step 2, before step 3's record or
    anything after it: metrics.jsonl ends at step 1, as it did when each loss was read at once."""
    torch.set_num_threads(1)
    update_weights = trainer.update_weights

    def nan_at_step_2(run: Any, tally: Any) -> dict[str, Any]:
        record = update_weights(run, tally)
        if record["step"] == 2:
            record["loss"] = record["loss"] * float("nan")
        return record

    monkeypatch.setattr(trainer, "update_weights", nan_at_step_2)
    options = replace(dflash2_options(train_cache, tmp_path / "run"), eval_every=0, checkpoint_every=0)
    with pytest.raises(trainer.UserError, match=r"training stopped at step 2: the loss is nan"):
        trainer.train(options)
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == [1]
    assert not (tmp_path / "run" / "export").exists()
