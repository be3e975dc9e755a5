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
MEASURED = {"step_s", "loader_wait_s", "elapsed_s", "block_tokens_per_s", "memory_peak_gib"}
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
    """Tensor-to-Python conversions made by trainer.py itself, inside the step (`accumulate_parts` and
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
    for name in ("accumulate_parts", "update_weights"):
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
    # Inside the step trainer.py reads no tensor; the instrumentation sees those it reads outside (each record one
    # step late). The block count of a micro-batch is read on the host through `.numpy()`, which refuses a device
    # tensor, and is not counted.
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_takes_the_supervised_positions_found_on_the_cpu(seed: int) -> None:
    """`MicroBatch.label_index` (built on the CPU with the labels) gives the loss, its gradients and its stats that
    the loss finding the positions itself gives, for the cross-entropy and the distillation path."""
    from dflash.stage2_train.loss import IGNORE_INDEX, block_loss, position_weights, supervised_index

    generator = torch.Generator().manual_seed(seed)
    blocks, block, hidden_size, vocab, k = 5, 4, 16, 40, 6
    labels = torch.randint(0, vocab, (1, blocks, block), generator=generator)
    labels[torch.rand(labels.shape, generator=generator) < 0.4] = IGNORE_INDEX
    labels[..., 0] = IGNORE_INDEX
    head = torch.randn(vocab, hidden_size, generator=generator)
    topk_ids = torch.randint(0, vocab, (1, blocks, block, k), generator=generator)
    topk_logprobs = torch.log_softmax(torch.randn(1, blocks, block, k, generator=generator), -1)
    weights = position_weights(block, 2.0)
    outcomes = []
    for index in (None, supervised_index(labels)):
        hidden = torch.randn(1, blocks * block, hidden_size, generator=torch.Generator().manual_seed(seed),
                             requires_grad=True)
        loss, stats = block_loss(hidden, head, labels, weights, 7.0, topk_ids=topk_ids, topk_logprobs=topk_logprobs,
                                 ce_weight=0.5, kl_weight=0.5, candidates=3, label_index=index)
        loss.backward()
        outcomes.append((loss.detach(), hidden.grad, stats))
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = outcomes
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    for name in ("weighted_ce_sum", "weighted_kl_sum", "correct_by_position", "count_by_position", "candidates"):
        assert torch.equal(stats_a[name], stats_b[name]), name


def test_micro_batches_carry_their_supervised_positions(train_cache: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.loss import supervised_index
    from dflash.stage2_train.run_setup import setup_run

    options = TrainOptions(cache=train_cache, out=tmp_path / "run", max_steps=2, draft_layers=1, batch_tokens=1024,
                           num_workers=0, eval_fraction=0.0, test_fraction=0.0, mixed_precision="no")
    run = setup_run(options)
    try:
        batch = next(iter(run.loader(0, 0)))
        micro = trainer.micro_batch_inputs(run, batch)
        assert micro.label_index is not None and micro.label_index.numel() > 0
        assert torch.equal(micro.label_index, supervised_index(micro.labels))
    finally:
        if run.lock is not None:
            run.lock.release()


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_every_input_of_a_micro_batch_reaches_the_device_through_to_device(
        train_cache: Path, tmp_path: Path, architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No input is copied around `trainer.to_device` (which pins CPU tensors before a CUDA copy, so that the copy
    does not make the host wait): every tensor of the micro-batch is one it returned, or the features decoded from
    one."""
    from dflash.stage2_train.run_setup import setup_run

    options = TrainOptions(cache=train_cache, out=tmp_path / "run", max_steps=2, draft_layers=1, batch_tokens=1024,
                           num_workers=0, eval_fraction=0.0, test_fraction=0.0, mixed_precision="no",
                           architecture=architecture)
    run = setup_run(options)
    moved: list[torch.Tensor] = []
    original = trainer.to_device

    def recorded(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved.append(original(tensor, device))
        return moved[-1]

    monkeypatch.setattr(trainer, "to_device", recorded)
    try:
        batch = next(iter(run.loader(0, 0)))
        micro = trainer.micro_batch_inputs(run, batch)
    finally:
        if run.lock is not None:
            run.lock.release()
    carried = [micro.block_ids, micro.labels, micro.label_index, micro.layout.block_anchor,
               micro.layout.block_context_start, micro.layout.block_valid, micro.layout.context_positions]
    # DFlash 2's selector positions: copied for its selector loss, neither built nor copied for DFlash
    assert (micro.selector_index is not None) == (architecture == "dflash2")
    carried += [micro.selector_index] if micro.selector_index is not None else []
    carried += [t for t in (micro.topk_ids, micro.topk_logprobs) if t is not None]
    assert all(any(tensor is m for m in moved) for tensor in carried)
    # and the features' stored bytes (with their scales, for a scaled codec), decoded on the device
    assert len(moved) == len(carried) + 1 + ("feature_scales" in batch)


def test_to_device_pins_a_pageable_tensor_before_a_cuda_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a pageable tensor is pinned, then copied without blocking; a pinned one is copied as it is; with
    PIN_INPUTS off (bench_train.py --pageable-inputs) it is copied from pageable memory. On the CPU: a plain copy.
    (This machine has no GPU: the pinning and the copy are recorded instead of done.)"""
    calls: list[tuple[str, Any]] = []
    pinned: list[torch.Tensor] = []  # kept alive, so that no other tensor takes one's identity

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        calls.append(("pin", None))
        pinned.append(self.clone())
        return pinned[-1]

    def to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        calls.append(("to", (str(device), non_blocking, any(self is t for t in pinned))))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: any(self is t for t in pinned))
    monkeypatch.setattr(torch.Tensor, "to", to)
    cuda = torch.device("cuda", 0)
    trainer.to_device(torch.zeros(3), cuda)
    assert calls == [("pin", None), ("to", ("cuda:0", True, True))]
    calls.clear()
    already = pin_memory(torch.zeros(3))
    calls.clear()
    trainer.to_device(already, cuda)
    assert calls == [("to", ("cuda:0", True, True))]
    calls.clear()
    monkeypatch.setattr(trainer, "PIN_INPUTS", False)
    trainer.to_device(torch.zeros(3), cuda)
    assert calls == [("to", ("cuda:0", True, False))]
    calls.clear()
    trainer.to_device(torch.zeros(3), torch.device("cpu"))
    assert calls == [("to", ("cpu", True, False))]


def test_stored_features_are_copied_on_a_side_stream_the_compute_stream_waits_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the stored features and scales are copied (through `to_device`) while the side stream is current; then
    the compute stream waits for the side stream and each copy is marked as used on the compute stream, in that
    order; before each copy the compute stream's position is marked, and from the second copy on the host first
    waits for the previous mark (at most two micro-batches' copies held); with COPY_FEATURES_ASIDE off
    (bench_train.py --features-on-compute-stream), and on the CPU, they are copied on the current stream. (This
    machine has no GPU: the stream and event calls are recorded instead of made.)"""
    events: list[tuple[str, Any]] = []
    marks = [0]

    class FakeEvent:
        def __init__(self) -> None:
            marks[0] += 1
            self.number = marks[0]

        def record(self, stream: FakeStream) -> None:
            events.append(("mark", (self.number, stream.name)))

        def synchronize(self) -> None:
            events.append(("host waits", self.number))

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: FakeStream) -> None:
            events.append(("wait", (self.name, other.name)))

    current = [FakeStream("compute")]

    class StreamContext:
        def __init__(self, stream: FakeStream) -> None:
            self.stream, self.saved = stream, None

        def __enter__(self) -> None:
            self.saved, current[0] = current[0], self.stream

        def __exit__(self, *exc: Any) -> None:
            current[0] = self.saved

    def copied(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        events.append(("copy", (current[0].name, str(device), tuple(tensor.shape))))
        return tensor.clone()

    monkeypatch.setattr(trainer, "to_device", copied)
    monkeypatch.setattr(trainer, "copy_stream", lambda device: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: events.append(("record", (tuple(self.shape), stream.name))))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(trainer, "_PREVIOUS_COPY_MARKS", {})
    batch = {"features": torch.zeros(5, 12, dtype=torch.uint8), "feature_scales": torch.ones(5, 3)}
    cuda = torch.device("cuda", 0)
    features, scales = trainer.stored_features(batch, cuda)
    assert torch.equal(features, batch["features"]) and scales is not None and torch.equal(scales, batch["feature_scales"])
    assert events == [("mark", (1, "compute")), ("copy", ("side", "cuda:0", (5, 12))),
                      ("copy", ("side", "cuda:0", (5, 3))), ("wait", ("compute", "side")),
                      ("record", ((5, 12), "compute")), ("record", ((5, 3), "compute"))]
    events.clear()
    assert trainer.stored_features({"features": batch["features"]}, cuda)[1] is None  # an unscaled codec
    assert events[:2] == [("host waits", 1), ("mark", (2, "compute"))]
    assert [e[0] for e in events[2:]] == ["copy", "wait", "record"]
    events.clear()
    monkeypatch.setattr(trainer, "COPY_FEATURES_ASIDE", False)
    trainer.stored_features(batch, cuda)
    assert events == [("copy", ("compute", "cuda:0", (5, 12))), ("copy", ("compute", "cuda:0", (5, 3)))]
    events.clear()
    monkeypatch.setattr(trainer, "COPY_FEATURES_ASIDE", True)
    trainer.stored_features(batch, torch.device("cpu"))
    assert events == [("copy", ("compute", "cpu", (5, 12))), ("copy", ("compute", "cpu", (5, 3)))]


@pytest.mark.gpu
def test_features_copied_aside_train_as_those_copied_on_the_compute_stream(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (float32, two micro-batches a step): the run with the features copied on the side stream has the
    losses of the run that copies them on the compute stream, step for step (to float rounding: the same kernels on
    the same inputs, some with atomics)."""
    options = replace(dflash2_options(train_cache, tmp_path / "aside"), eval_every=0, checkpoint_every=0,
                      log_every=1, max_steps=6)
    trainer.train(options)
    monkeypatch.setattr(trainer, "COPY_FEATURES_ASIDE", False)
    trainer.train(replace(options, out=tmp_path / "compute"))
    aside, compute = records(tmp_path / "aside"), records(tmp_path / "compute")
    losses = [(a["loss"], c["loss"]) for a, c in zip(aside, compute, strict=True) if "loss" in a]
    assert len(losses) == 6
    assert all(abs(a - c) <= 1e-4 * abs(c) for a, c in losses), losses


def test_the_last_epochs_loader_workers_stop_before_the_final_evaluation_and_export(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends inside an epoch stops that epoch's loader workers when its steps are done, not when the
    iterator is collected (after the evaluation, export and test split; a Ctrl-C there was swallowed)."""
    events: list[str] = []
    stop, evaluate, export = trainer.stop_loader, trainer.evaluate, trainer.export_draft
    monkeypatch.setattr(trainer, "stop_loader", lambda batches: (events.append("stop"), stop(batches))[1])
    monkeypatch.setattr(trainer, "evaluate", lambda *args: (events.append("evaluate"), evaluate(*args))[1])
    monkeypatch.setattr(trainer, "export_draft", lambda *args, **kw: (events.append("export"), export(*args, **kw))[1])
    options = TrainOptions(cache=train_cache, out=tmp_path / "run", max_steps=2, draft_layers=1, batch_tokens=1024,
                           num_workers=1, eval_fraction=0.05, eval_sequences=2, eval_every=0, test_fraction=0.0,
                           mixed_precision="no")
    trainer.train(options)
    # (the epoch holds more than 2 steps; the evaluation exports export_best/, then the run its export/)
    assert events == ["stop", "evaluate", "export", "export"], events


@pytest.mark.gpu
def test_stored_features_overlap_the_compute_stream_and_arrive_before_their_use() -> None:
    """On a GPU: with the compute stream busy (a sleep kernel), the features are copied on the side stream while it
    runs and the host does not wait; with the side stream busy instead, the compute stream's first use waits for
    the copy (the bytes it reads are the source's)."""
    import time

    device = torch.device("cuda")
    cycles = int(2e9)  # ~1 s of GPU clock
    source = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).pin_memory()
    compute = torch.cuda.current_stream(device)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    started = time.perf_counter()
    features, _ = trainer.stored_features({"features": source}, device)
    copied = torch.cuda.Event()
    copied.record(trainer.copy_stream(device))
    assert time.perf_counter() - started < 0.1  # queued, not waited for
    reader = torch.cuda.Stream(device)  # reads the copy as soon as the copy stream is done, whatever compute does
    reader.wait_event(copied)
    with torch.cuda.stream(reader):
        total = features.to(torch.int64).sum()
    read = torch.cuda.Event()
    read.record(reader)
    read.synchronize()
    assert not compute.query()  # read while the compute stream still sleeps: the copy was not behind the sleep
    torch.cuda.synchronize()
    assert int(total) == int(source.to(torch.int64).sum())  # (a copy queued behind the sleep was not there yet)

    with torch.cuda.stream(trainer.copy_stream(device)):
        torch.cuda._sleep(cycles)
    fresh = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).pin_memory()
    features, _ = trainer.stored_features({"features": fresh}, device)
    first_use = features.clone()  # on the compute stream, which must wait for the sleeping side stream's copy
    torch.cuda.synchronize()
    assert torch.equal(first_use.cpu(), fresh)
