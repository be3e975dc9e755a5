"""The trainer's inputs of a micro-batch (layout, labels, label positions, the target's top-k rows) are built in the
loader's workers (`packed_batches.packed_step_inputs`, under STEP_INPUTS) and are exactly what the main process
built from the same batch before: through a real DataLoader, through the memory plan's splits of a batch (each part
builds its own), through `TrainingRun.loader`, and over a short training run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dflash.shared.feature_codecs import manifest_codec
from dflash.shared import cache_format as cf
from dflash.stage2_train import memory_plan as mp
from dflash.stage2_train import run_setup, trainer
from dflash.stage2_train.cache_index import CacheIndex
from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch
from dflash.stage2_train.loss import selector_positions, supervised_index
from dflash.stage2_train.objective import MicroBatch
from dflash.stage2_train.options import TrainOptions
from dflash.stage2_train.packed_batches import (STEP_INPUTS, CacheBatches, packed_block_labels, packed_block_topk,
                                                packed_layout, sequence_blocks, split_packed_batch)
from dflash.stage2_train.packed_loader import make_loader
from tests.stage2_train.test_train_data import PAD, build_cache

BLOCK, MASK = 4, 999
RULE = AnchorRule(0.3, 16, BLOCK)


def cpu_run(cache: Path, memory: mp.MemoryPlan | None = None, trains_selector: bool = False) -> Any:
    """What `trainer.micro_batch_inputs` and `trainer.micro_batches` read of a TrainingRun, on the CPU."""
    return SimpleNamespace(device=torch.device("cpu"), options=SimpleNamespace(block_size=BLOCK, fsdp=False),
                           step_input_settings={"block_size": BLOCK, "mask_token_id": MASK,
                                                "with_selector_index": trains_selector},
                           mask_token_id=MASK, codec=manifest_codec(cf.read_manifest(cache)),
                           compute_dtype=torch.float32, memory=memory, bucket_multiple=PAD)


def main_process_micro_batch(run: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch's tensors as `trainer.micro_batch_inputs` built them in the main process before the workers
    did (its calls, in its order, on a batch without STEP_INPUTS)."""
    assert STEP_INPUTS not in batch
    layout = packed_layout(batch, run.options.block_size)
    labels, block_ids = packed_block_labels(batch, layout, run.mask_token_id)
    topk = packed_block_topk(batch, layout)
    scales = batch.get("feature_scales")
    return {"features": run.codec.decode(batch["features"], scales, run.compute_dtype)[None], "labels": labels,
            "block_ids": block_ids, "label_index": supervised_index(labels), "block_anchor": layout.block_anchor,
            "block_context_start": layout.block_context_start, "block_valid": layout.block_valid,
            "context_positions": layout.context_positions, "context_len": layout.context_len,
            "block_size": layout.block_size, "sequences": len(batch["lengths"]),
            "valid_blocks": int(layout.block_valid.sum()),
            "topk_ids": None if topk is None else topk[0], "topk_logprobs": None if topk is None else topk[1],
            "selector_index": (selector_positions(labels, block_ids)
                               if run.step_input_settings["with_selector_index"] else None)}


def tensors_of(micro: MicroBatch) -> dict[str, Any]:
    layout = micro.layout
    return {"features": micro.features, "labels": micro.labels, "block_ids": micro.block_ids,
            "label_index": micro.label_index, "block_anchor": layout.block_anchor,
            "block_context_start": layout.block_context_start, "block_valid": layout.block_valid,
            "context_positions": layout.context_positions, "context_len": layout.context_len,
            "block_size": layout.block_size, "sequences": micro.sequences, "valid_blocks": micro.valid_blocks,
            "topk_ids": micro.topk_ids, "topk_logprobs": micro.topk_logprobs, "selector_index": micro.selector_index}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[name], torch.Tensor) and got[name].dtype == value.dtype, name
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def loader_batches(cache: Path, workers_build_inputs: bool, trains_selector: bool = False) -> list[dict[str, Any]]:
    """One epoch of packed batches through a real DataLoader with 2 workers."""
    index = CacheIndex.from_cache(cache, eval_fraction=0.0, seed=0)
    plan = plan_epoch(index, epoch=0, seed=0, batch_tokens=500, rule=RULE)
    step_inputs = ({"block_size": BLOCK, "mask_token_id": MASK, "with_selector_index": trains_selector}
                   if workers_build_inputs else {})
    dataset = CacheBatches(cache, plan, epoch=0, seed=0, rule=RULE, bucket_multiple=PAD, **step_inputs)
    return list(make_loader(dataset, 2, pin_memory=False))


def refuse_to_build(*_args: Any, **_options: Any) -> None:
    raise AssertionError("the main process built step inputs the batch already had")


@pytest.mark.parametrize("topk,trains_selector", [(0, False), (3, False), (3, True)])
def test_inputs_built_in_the_workers_equal_those_the_main_process_built(
        tmp_path: Path, topk: int, trains_selector: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors either way; DFlash 2's selector positions only for a DFlash 2 run (a DFlash run neither
    builds nor copies them)."""
    cache = build_cache(tmp_path / "cache", [23, 17], max_len=120, topk=topk)
    run = cpu_run(cache, trains_selector=trains_selector)
    from_workers, plain = loader_batches(cache, True, trains_selector), loader_batches(cache, False)
    assert len(from_workers) == len(plain) > 3
    for with_inputs, without in zip(from_workers, plain):
        assert with_inputs["position"] == without["position"] and STEP_INPUTS not in without
        inputs = with_inputs[STEP_INPUTS]
        assert all(isinstance(t, torch.Tensor) for t in inputs.values())  # a plain dict: pin_memory pins each
        assert ("topk_ids" in inputs) == ("topk_logprobs" in inputs) == bool(topk)
        assert ("selector_index" in inputs) == trains_selector
        want = main_process_micro_batch(run, without)
        assert_same(tensors_of(trainer.micro_batch_inputs(run, without)), want)  # the same function, built here
        with monkeypatch.context() as patched:  # the workers' inputs are taken as they are
            patched.setattr(trainer, "packed_step_inputs", refuse_to_build)
            assert_same(tensors_of(trainer.micro_batch_inputs(run, with_inputs)), want)
    if topk:  # the top-k of supervised positions is carried (not only zeros)
        assert any(bool(b[STEP_INPUTS]["topk_logprobs"].ne(0).any()) for b in from_workers)
    if trains_selector:  # and the selector's positions are there to be compared (not all empty)
        assert all(b[STEP_INPUTS]["selector_index"].numel() > 0 for b in from_workers)


@pytest.mark.parametrize("trains_selector", [False, True])
def test_a_split_batch_builds_each_parts_inputs_for_itself(tmp_path: Path, trains_selector: bool) -> None:
    """A memory plan that cuts each loader batch into several parts: no part carries the whole batch's inputs, and
    each part's micro-batch is what the main process built from that part before (with DFlash 2's selector
    positions for a DFlash 2 run)."""
    cache = build_cache(tmp_path / "cache", [23, 17], max_len=120, topk=3)
    shape = mp.DrafterShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2,
                            context_dim=48, vocab=1000, block_size=BLOCK, element_bytes=4, trainable_params=10_000)
    batches = loader_batches(cache, True, trains_selector)
    lengths = np.concatenate([b["lengths"].numpy() for b in batches])
    blocks = np.concatenate([sequence_blocks(b) for b in batches])
    # a budget of about two sequences: every batch of three or more is cut into parts
    budget = int(mp.step_bytes(shape, 2 * int(np.median(lengths)), 2 * int(np.median(blocks))))
    run = cpu_run(cache, mp.MemoryPlan(shape=shape, limit_bytes=budget, budget_bytes=budget, planned_peak_bytes=0),
                  trains_selector)
    split = 0
    for batch in batches:
        ranges = run.memory.parts(batch["lengths"].numpy(), sequence_blocks(batch))
        parts = split_packed_batch(batch, ranges, PAD)
        micros = trainer.micro_batches(run, batch)
        assert len(micros) == len(parts) == len(ranges)
        if len(parts) == 1:
            assert parts[0] is batch
            assert_same(tensors_of(micros[0]), main_process_micro_batch(run, {k: v for k, v in batch.items()
                                                                             if k != STEP_INPUTS}))
            continue
        split += 1
        for part, micro in zip(parts, micros):
            assert STEP_INPUTS not in part
            assert_same(tensors_of(micro), main_process_micro_batch(run, part))
        # the parts together hold the whole batch's supervised labels, no more, no fewer
        whole = int((batch[STEP_INPUTS]["labels"] != -100).sum())
        assert sum(int((m.labels != -100).sum()) for m in micros) == whole
    assert split >= 3


def short_run(cache: Path, out: Path, **changes: Any) -> TrainOptions:
    return replace(TrainOptions(cache=cache, out=out, max_steps=3, grad_accum=2, draft_layers=1, max_anchors=12,
                                batch_tokens=1024, num_workers=2, eval_every=0, checkpoint_every=0,
                                eval_fraction=0.05, eval_sequences=2, test_fraction=0.0, mixed_precision="no",
                                lr=4e-3), **changes)


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_the_run_loader_builds_the_inputs_in_its_workers(train_cache: Path, tmp_path: Path, architecture: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`TrainingRun.loader` gives its workers the run's block size, mask token and whether the drafter has a
    selector: the batches carry the inputs the main process builds with STEP_INPUTS_IN_WORKERS off (bench_train.py
    --inputs-in-main), DFlash 2's selector positions for a DFlash 2 run only."""
    run = run_setup.setup_run(short_run(train_cache, tmp_path / "run", block_size=8, architecture=architecture))
    try:
        assert run.mask_token_id != MASK
        batches = [b for _, b in zip(range(3), run.loader(0, 0))]
        with monkeypatch.context() as patched:
            patched.setattr(run_setup, "STEP_INPUTS_IN_WORKERS", False)
            plain = [b for _, b in zip(range(3), run.loader(0, 0))]
        for with_inputs, without in zip(batches, plain):
            assert STEP_INPUTS in with_inputs and STEP_INPUTS not in without
            assert with_inputs[STEP_INPUTS]["block_ids"].shape[-1] == 8
            assert ("selector_index" in with_inputs[STEP_INPUTS]) == (architecture == "dflash2")
            assert_same(tensors_of(trainer.micro_batch_inputs(run, with_inputs)),
                        tensors_of(trainer.micro_batch_inputs(run, without)))
    finally:
        if run.lock is not None:
            run.lock.release()


def test_a_training_run_is_the_same_with_the_inputs_built_in_the_main_process(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    trainer.train(short_run(train_cache, tmp_path / "workers"))
    with monkeypatch.context() as patched:
        patched.setattr(run_setup, "STEP_INPUTS_IN_WORKERS", False)
        trainer.train(short_run(train_cache, tmp_path / "main"))

    def steps(run: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in record.items() if k not in ("step_s", "loader_wait_s", "elapsed_s",
                                                                "block_tokens_per_s", "memory_peak_gib")}
                for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in record]

    got, want = steps(tmp_path / "workers"), steps(tmp_path / "main")
    assert [r["step"] for r in want] == [1, 2, 3] and all(r["labels"] > 0 for r in want)
    assert got == want  # every figure of every step, losses included, exactly
