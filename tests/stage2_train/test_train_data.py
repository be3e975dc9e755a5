"""Stage 2 data pipeline over a real (synthetic-content) feature cache: index, split, plans, loader, labels."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.shared import cache_format as cf
from dflash.shared.cache_format import CacheError
from dflash.shared.feature_codecs import BF16
from dflash.stage1_extract.shard_writer import FeatureShardWriter
from dflash.stage2_train import packed_batches
from dflash.stage2_train.cache_index import CacheIndex, Sample, anchor_candidates, candidate_counts, split_hash
from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch, rank_plan, sample_anchors
from dflash.stage2_train.eval_set import eval_sequences
from dflash.stage2_train.loss import IGNORE_INDEX
from dflash.stage2_train.packed_batches import (CacheBatches, bucket, packed_block_labels, packed_block_topk,
                                                packed_layout, split_packed_batch)
from dflash.stage2_train.packed_loader import make_loader, start_loader, stop_loader
from tests.stage2_train.reference_labels import block_labels

DIM = 48
PAD = 16


# ------------------------------------------------------------------------------------------ synthetic cache


def _loss_mask(rng: np.random.Generator, length: int, kind: str) -> np.ndarray:
    mask = np.zeros(length, np.uint8)
    if kind == "none":  # no assistant token at all
        return mask
    if kind == "alternating":  # assistant tokens, but never two in a row: no anchor candidate
        mask[1::2] = 1
        return mask
    if kind == "last":  # only the last two tokens: exactly one candidate, p = length - 2
        mask[-2:] = 1
        return mask
    prompt = int(rng.integers(0, max(1, length // 3)))  # a prompt, then turns with some holes
    mask[prompt:] = 1
    mask[rng.random(length) < 0.1] = 0
    return mask


def build_cache(root: Path, shard_samples: list[int], *, dim: int = DIM, seed: int = 0, min_len: int = 1,
                max_len: int = 300, pending: int = 0, order: list[int] | None = None,
                rows_per_chunk: int | None = 16, kinds: bool = True, topk: int = 0) -> Path:
    """A cache written the way `dflash extract` writes one: samples sorted longest first in each shard, stores
    by FeatureShardWriter, manifest entries with the stats a worker reports. Sample i of the dataset is fully
    determined by (seed, i), so caches with another shard count hold the same samples. With `topk`, a synthetic
    target top-k (`synthetic_topk`) beside the features."""
    root.mkdir(parents=True, exist_ok=True)
    num_shards = len(shard_samples) + pending
    identity = {"target_source": "synthetic", "target_hash": "0" * 16, "layer_ids": [1, 2, 3],
                "hidden_size": dim // 3, "feature_dtype": "bf16", "tokenizer_hash": "t", "data_fingerprint": "d",
                "max_length": max_len, "overlength": "truncate", "num_shards": num_shards,
                "target_topk": cf.TopKFormat.for_vocab(topk, 1000).record() if topk else None}
    manifest = cf.new_manifest(identity, {"target": {"name": "synthetic", "num_hidden_layers": 4},
                                          "data": {"source": "synthetic", "conversations": sum(shard_samples)}})
    saved = cf.CHUNK_TARGET_BYTES, cf.SHARD_TARGET_BYTES
    if rows_per_chunk:  # small chunks and zarr shards, so one sample spans several of each
        cf.CHUNK_TARGET_BYTES, cf.SHARD_TARGET_BYTES = rows_per_chunk * dim * 2, 3 * rows_per_chunk * dim * 2
    try:
        for shard in order if order is not None else range(len(shard_samples)):
            count = shard_samples[shard]
            indices = list(range(sum(shard_samples[:shard]), sum(shard_samples[:shard + 1])))
            samples = []
            for index in indices:
                rng = np.random.default_rng([seed, index])
                length = int(rng.integers(min_len, max_len + 1))
                kind = ["none", "alternating", "last", "normal"][index % 7] if kinds and index % 7 < 3 else "normal"
                if kind == "last" and length < 2:
                    kind = "normal"
                samples.append((index, rng.integers(0, 1000, length).astype(np.int32), _loss_mask(rng, length, kind),
                                torch.randn(length, dim, generator=torch.Generator().manual_seed(index))
                                .to(torch.bfloat16)))
            samples.sort(key=lambda s: (-len(s[1]), s[0]))
            lengths = [len(s[1]) for s in samples]
            offsets = np.zeros(count + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            loss_mask = np.concatenate([s[2] for s in samples])
            token_arrays = {"input_ids": np.concatenate([s[1] for s in samples]), "loss_mask": loss_mask,
                            "offsets": offsets, "sample_index": np.array([s[0] for s in samples], np.int64),
                            "sample_ids": [f"conv-{s[0]}" for s in samples]}
            topk_format = cf.TopKFormat.of_manifest(manifest)
            writer = FeatureShardWriter(cf.shard_path(root, shard), feature_dim=dim, token_arrays=token_arrays,
                                        attributes={"layer_ids": [1, 2, 3], "shard": shard}, codec=BF16,
                                        topk=topk_format)
            rows = torch.cat([s[3] for s in samples])
            positions = cf.topk_positions(loss_mask, offsets)
            before = np.concatenate([[0], np.cumsum(positions)])  # top-k rows before each token
            topk_rows = synthetic_topk(token_arrays["input_ids"], loss_mask, offsets, token_arrays["sample_index"],
                                       topk) if topk else None
            for begin in range(0, len(rows), 37):  # uneven batches, as a worker submits them
                end = min(begin + 37, len(rows))
                part = None if topk_rows is None else tuple(torch.from_numpy(a[before[begin] : before[end]])
                                                            for a in topk_rows)
                writer.submit(rows[begin:end], topk=part)
            stats = {"samples": count, "tokens": int(offsets[-1]), "loss_tokens": int(loss_mask.sum()),
                     "truncated": 0, "skipped": {}, "seconds": 0.1, "oom_retries": 0}
            writer.close(stats)
            manifest["shards"][str(shard)] = {"status": cf.SHARD_DONE, **stats, "bytes": int(offsets[-1]) * dim * 2,
                                              "finished": time.time()}
    finally:
        cf.CHUNK_TARGET_BYTES, cf.SHARD_TARGET_BYTES = saved
    cf.write_json_atomic(root / cf.MANIFEST_FILE, manifest)
    return root


def synthetic_topk(input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, sample_index: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """A made-up target top-k, one row per `topk_positions` token of a shard: ids (token + j) % 1000 (so the top-1
    is the token itself: the label), log-probs -(j + (7 * sample_index + t) % 50) / 8 at position t of the sample
    (exact in float16: each row says where it belongs)."""
    position = np.arange(len(input_ids)) - np.repeat(offsets[:-1], np.diff(offsets))
    index = np.repeat(sample_index, np.diff(offsets))
    ids = (input_ids[:, None].astype(np.int64) + np.arange(k)) % 1000
    logprobs = -(np.arange(k) + ((7 * index + position) % 50)[:, None]) / 8
    rows = cf.topk_positions(loss_mask, offsets)
    return ids[rows].astype(np.uint16), logprobs[rows].astype(np.float16)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Three finished shards and one still pending (no store): the pending one must simply be left out.
    return build_cache(tmp_path_factory.mktemp("train") / "cache", [40, 33, 47], pending=1)


@pytest.fixture(scope="module")
def index(cache: Path) -> CacheIndex:
    return CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3)


def stored_samples(cache: Path) -> dict[tuple[int, int], dict]:
    """Every sample of every finished store, read plainly with ShardReader."""
    result = {}
    manifest = cf.read_manifest(cache)
    for key, entry in manifest["shards"].items():
        if entry["status"] != cf.SHARD_DONE:
            continue
        reader = cf.ShardReader(cf.shard_path(cache, int(key)))
        index = np.asarray(reader.group["sample_index"][:])
        for row in range(reader.num_samples):
            ids, mask = reader.sample_tokens(row)
            result[(int(key), row)] = {"features": reader.sample_feature_tensor(row), "input_ids": ids,
                                       "loss_mask": mask, "sample_index": int(index[row])}
    return result


def split_sizes(index: CacheIndex) -> dict[str, int]:
    """Samples per split, counted from the index's split masks (its sample lists must agree)."""
    return {"train_samples": int(index.is_train.sum()), "eval_samples": int(index.is_eval.sum()),
            "test_samples": int(index.is_test.sum())}


def reference_candidates(mask: np.ndarray) -> list[int]:
    return [p for p in range(len(mask) - 1) if mask[p] == 1 and mask[p + 1] == 1]


def collect(dataset: CacheBatches, num_workers: int) -> list[dict]:
    return list(make_loader(dataset, num_workers, pin_memory=False))


def same_batch(a: dict, b: dict) -> bool:
    keys = ("input_ids", "loss_mask", "lengths", "context_starts", "block_anchor", "block_sequence", "block_valid",
            "sample_keys")
    inputs_a, inputs_b = a.get(packed_batches.STEP_INPUTS, {}), b.get(packed_batches.STEP_INPUTS, {})
    return (a["position"] == b["position"] and a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) for k in keys if k in a)
            and torch.equal(a["features"].view(torch.int16), b["features"].view(torch.int16))
            and inputs_a.keys() == inputs_b.keys() and all(torch.equal(inputs_a[k], inputs_b[k]) for k in inputs_a))


# ------------------------------------------------------------------------------------------------ index


def test_index_lists_usable_samples_of_finished_shards(cache: Path, index: CacheIndex) -> None:
    stored = stored_samples(cache)
    usable = {key for key, s in stored.items() if reference_candidates(s["loss_mask"])}
    assert index.done_shards == (0, 1, 2) and index.unfinished_shards == (3,)
    listed = index.train + index.eval
    assert {(s.shard, s.row) for s in listed} == usable and len(listed) == len(usable)
    for sample in listed:
        reference = stored[(sample.shard, sample.row)]
        assert sample.length == len(reference["input_ids"])
        assert sample.n_anchor_candidates == len(reference_candidates(reference["loss_mask"]))
    assert index.dropped_no_anchor == len(stored) - len(usable) > 0
    assert index.dropped_tokens == sum(len(s["input_ids"]) for k, s in stored.items() if k not in usable)
    summary = split_sizes(index)
    assert summary["train_samples"] + summary["eval_samples"] == len(usable)


def test_split_is_disjoint_deterministic_and_independent_of_sharding(cache: Path, index: CacheIndex,
                                                                     tmp_path: Path) -> None:
    train = {(s.shard, s.row) for s in index.train}
    held_out = {(s.shard, s.row) for s in index.eval}
    assert train and held_out and not train & held_out
    again = CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3)
    assert again.train == index.train and again.eval == index.eval
    assert CacheIndex.from_cache(cache, eval_fraction=0.15, seed=4).eval != index.eval
    assert not CacheIndex.from_cache(cache, eval_fraction=0.0, seed=3).eval
    # The same 120 dataset samples extracted as 2 shards, written in reverse order: the same split by sample.
    other = build_cache(tmp_path / "two", [60, 60], order=[1, 0])
    other_index = CacheIndex.from_cache(other, eval_fraction=0.15, seed=3)
    stored, other_stored = stored_samples(cache), stored_samples(other)
    eval_ids = sorted(stored[(s.shard, s.row)]["sample_index"] for s in index.eval)
    other_eval_ids = sorted(other_stored[(s.shard, s.row)]["sample_index"] for s in other_index.eval)
    assert eval_ids == other_eval_ids


def test_validation_and_test_splits_are_disjoint_bands_of_the_split_hash(cache: Path, index: CacheIndex) -> None:
    """Validation = hash < eval_fraction (what a run without a test split held out), test = the next test_fraction,
    training = the rest; each read in hash order, the test split also through `eval_sequences`."""
    three = CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3, test_fraction=0.2)

    def keys(samples: list) -> set:
        return {(s.shard, s.row) for s in samples}

    train, validation, test = keys(three.train), keys(three.eval), keys(three.test)
    assert validation and test and not (train & validation or train & test or validation & test)
    assert train | validation | test == keys(index.train + index.eval)
    assert three.eval == index.eval  # the same validation split as without a test split
    stored = stored_samples(cache)
    hashes = {key: float(split_hash(np.array([s["sample_index"]]), 3)[0]) for key, s in stored.items()}
    assert test == {key for key in train | validation | test if 0.15 <= hashes[key] < 0.35}
    assert [hashes[(s.shard, s.row)] for s in three.test] == sorted(hashes[key] for key in test)
    summary = split_sizes(three)
    assert (summary["train_samples"], summary["eval_samples"], summary["test_samples"]) == (
        len(train), len(validation), len(test))
    assert [item["sample_key"] for item in eval_sequences(three, None, "test")] == [(s.shard, s.row)
                                                                                      for s in three.test]
    assert Counter(s for batch in plan_epoch(three, 0, 1, 640) for s in batch) == Counter(three.train)
    with pytest.raises(ValueError, match="sum <= 1"):
        CacheIndex.from_cache(cache, eval_fraction=0.6, seed=3, test_fraction=0.5)


@given(fractions=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=4))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_train_fractions_are_nested_hash_bands_with_the_same_held_out_splits(cache: Path, fractions: list[float]) -> None:
    """--train-fraction F trains on the rest's samples whose split hash lies in its lowest F part (a uniform random
    subset); a smaller fraction's samples are among a larger one's, the validation and test splits never change, and
    the left-out samples are counted apart (no split holds them). F = 1 is every training sample."""
    whole = CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3, test_fraction=0.2)
    stored = stored_samples(cache)
    hashes = {key: float(split_hash(np.array([s["sample_index"]]), 3)[0]) for key, s in stored.items()}
    previous: set | None = None
    for fraction in sorted(fractions):
        part = CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3, test_fraction=0.2, train_fraction=fraction)
        train = {(s.shard, s.row) for s in part.train}
        assert part.eval == whole.eval and part.test == whole.test
        assert train == {(s.shard, s.row) for s in whole.train if hashes[(s.shard, s.row)] < 0.35 + fraction * 0.65}
        assert int(part.is_unused.sum()) == len(whole.train) - len(train)
        assert previous is None or previous <= train
        previous = train
    assert CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3, test_fraction=0.2, train_fraction=1.0).train \
        == whole.train
    with pytest.raises(ValueError, match="train_fraction"):
        CacheIndex.from_cache(cache, eval_fraction=0.15, seed=3, train_fraction=0.0)


# ------------------------------------------------------------------------------------------------- plans


def test_plan_covers_each_train_sample_once_within_the_token_budget(index: CacheIndex) -> None:
    budget = 640
    plan = plan_epoch(index, epoch=0, seed=1, batch_tokens=budget, world_size=1)
    assert Counter(s for batch in plan for s in batch) == Counter(index.train)
    for batch in plan:
        assert sum(s.length for s in batch) <= budget or len(batch) == 1
    assert plan == plan_epoch(index, epoch=0, seed=1, batch_tokens=budget, world_size=1)
    assert plan != plan_epoch(index, epoch=1, seed=1, batch_tokens=budget, world_size=1)
    # With an anchor rule a sample costs its context plus its blocks.
    rule = AnchorRule(density=0.25, max_anchors=6, block_size=4)
    with_blocks = plan_epoch(index, epoch=0, seed=1, batch_tokens=budget, rule=rule)
    assert Counter(s for batch in with_blocks for s in batch) == Counter(index.train)
    for batch in with_blocks:
        cost = sum(s.length + int(rule.count(s.n_anchor_candidates)) * 4 for s in batch)
        assert cost <= budget or len(batch) == 1
    # A budget below the longest sample: that sample forms a micro-batch alone.
    small = plan_epoch(index, epoch=0, seed=1, batch_tokens=64, world_size=1)
    assert all(len(b) == 1 for b in small if b[0].length > 64)
    # Several ranks: a multiple of world_size micro-batches; only the remainder is left out.
    for world_size in (2, 3, 5):
        truncated = plan_epoch(index, epoch=0, seed=1, batch_tokens=budget, world_size=world_size)
        assert len(truncated) % world_size == 0 and len(plan) - len(truncated) < world_size
        assert truncated == plan[: len(truncated)]
        covered = Counter(s for batch in truncated for s in batch)
        assert max(covered.values()) == 1
        assert sum(covered.values()) == len(index.train) - sum(len(b) for b in plan[len(truncated):])


def test_two_ranks_see_the_global_steps_of_one_process(cache: Path, index: CacheIndex) -> None:
    single = plan_epoch(index, epoch=2, seed=5, batch_tokens=700, world_size=1)
    global_plan = plan_epoch(index, epoch=2, seed=5, batch_tokens=700, world_size=2)
    ranks = [rank_plan(global_plan, rank, 2) for rank in range(2)]
    interleaved = [ranks[i % 2][i // 2] for i in range(len(global_plan))]
    assert interleaved == single[: len(interleaved)]
    # The tensors too: micro-batch j of rank r is micro-batch 2 j + r of the single process.
    options = {"epoch": 2, "seed": 5, "rule": AnchorRule(None, 8, 4), "bucket_multiple": PAD}
    one = collect(CacheBatches(cache, single, **options), 0)
    for rank in range(2):
        for item in collect(CacheBatches(cache, ranks[rank], **options), 0):
            reference = dict(one[2 * item["position"] + rank], position=item["position"])
            assert same_batch(item, reference)


# ------------------------------------------------------------------------------------------------ loader


@pytest.fixture(scope="module")
def epoch_plan(index: CacheIndex) -> list[list[Sample]]:
    return plan_epoch(index, epoch=0, seed=1, batch_tokens=640, world_size=1)


def test_batches_hold_the_stored_rows_bit_exactly(cache: Path, epoch_plan: list[list[Sample]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    stored = stored_samples(cache)
    empty = packed_batches._empty_tensor
    monkeypatch.setattr(packed_batches, "_empty_tensor",  # dirty memory: every padding byte must be written
                        lambda shape, dtype, shared: empty(shape, dtype, shared).fill_(255))
    dataset = CacheBatches(cache, epoch_plan, epoch=0, seed=1, rule=AnchorRule(0.3, 16, 4), bucket_multiple=PAD)
    items = collect(dataset, 0)
    assert [item["position"] for item in items] == list(range(len(epoch_plan)))
    for item, batch in zip(items, epoch_plan):
        total = sum(s.length for s in batch)
        width = item["features"].shape[0]
        assert width == bucket(total, PAD) and width % PAD == 0 and width - total < max(PAD, total / 16)
        assert item["features"].dtype == torch.bfloat16 and item["features"].shape == (width, DIM)
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.bool
        assert item["sample_keys"].tolist() == [[s.shard, s.row] for s in batch]
        assert item["lengths"].tolist() == [s.length for s in batch]
        assert item["context_starts"].tolist() == np.concatenate([[0], np.cumsum(item["lengths"])[:-1]]).tolist()
        assert not item["features"][total:].view(torch.int16).any()  # zero padding, exactly
        assert not item["input_ids"][total:].any() and not item["loss_mask"][total:].any()
        for b, sample in enumerate(batch):
            reference, length = stored[(sample.shard, sample.row)], sample.length
            begin = int(item["context_starts"][b])
            rows = slice(begin, begin + length)
            assert torch.equal(item["features"][rows].view(torch.int16), reference["features"].view(torch.int16))
            assert item["input_ids"][rows].tolist() == reference["input_ids"].tolist()
            assert item["loss_mask"][rows].tolist() == reference["loss_mask"].astype(bool).tolist()
        # Blocks: sequence after sequence, no padding between them, the bucket's padding at the end.
        valid = item["block_valid"]
        blocks = int(valid.sum())
        assert valid.tolist() == [True] * blocks + [False] * (len(valid) - blocks)
        assert len(valid) == bucket(blocks, 8)
        sequence = item["block_sequence"][:blocks]
        assert bool((sequence[1:] >= sequence[:-1]).all())
        assert sorted(set(sequence.tolist())) == list(range(len(batch)))  # every sequence has a block


def test_anchors_follow_the_rule_and_change_every_epoch(cache: Path, index: CacheIndex) -> None:
    max_anchors = 6
    per_epoch = []
    for epoch in (0, 1):
        plan = plan_epoch(index, epoch=epoch, seed=1, batch_tokens=640, world_size=1)
        anchors = {}
        for item in collect(CacheBatches(cache, plan, epoch=epoch, seed=1, rule=AnchorRule(None, max_anchors, 4),
                                         bucket_multiple=PAD), 0):
            for b, (shard, row) in enumerate(item["sample_keys"].tolist()):
                begin, length = int(item["context_starts"][b]), int(item["lengths"][b])
                mask = item["loss_mask"][begin : begin + length].to(torch.uint8).numpy()
                chosen = item["block_anchor"][item["block_valid"] & (item["block_sequence"] == b)].tolist()
                candidates = reference_candidates(mask)
                assert len(chosen) == min(len(candidates), max_anchors)
                assert chosen == sorted(set(chosen)) and set(chosen) <= set(candidates)
                anchors[(shard, row)] = chosen
        assert len(anchors) == len(index.train)
        per_epoch.append(anchors)
    many = [(s.shard, s.row) for s in index.train if s.n_anchor_candidates > max_anchors]
    assert len(many) > 10
    assert sum(per_epoch[0][key] != per_epoch[1][key] for key in many) > 0.8 * len(many)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_loader_order_and_content_do_not_depend_on_workers(cache: Path, epoch_plan: list[list[Sample]]) -> None:
    def dataset() -> CacheBatches:
        return CacheBatches(cache, epoch_plan, epoch=0, seed=1, rule=AnchorRule(None, 8, 4), bucket_multiple=PAD)

    reference = collect(dataset(), 0)
    assert [item["position"] for item in reference] == list(range(len(epoch_plan)))
    for workers in (1, 2, 3):
        items = collect(dataset(), workers)
        assert len(items) == len(reference)
        assert all(same_batch(a, b) for a, b in zip(items, reference))
    # Workers that do not inherit the parent's memory: the dataset is pickled without open stores.
    items = list(make_loader(dataset(), 2, pin_memory=False, context="forkserver"))
    assert len(items) == len(reference) and all(same_batch(a, b) for a, b in zip(items, reference))


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_loader_workers_ignore_ctrl_c(cache: Path, epoch_plan: list[list[Sample]], context: str) -> None:
    """A terminal's Ctrl-C reaches every process of the group: the loader's workers take no notice (the main process
    alone handles it), so an interrupted epoch is never cut short by a dying worker; the main process's own
    handling of SIGINT is left as it was."""
    def dataset() -> CacheBatches:
        return CacheBatches(cache, epoch_plan, epoch=0, seed=1, rule=AnchorRule(None, 8, 4), bucket_multiple=PAD)

    reference = collect(dataset(), 0)
    handler, mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, set())
    batches = start_loader(make_loader(dataset(), 2, pin_memory=False, context=context))
    assert signal.getsignal(signal.SIGINT) is handler and signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask
    first = next(batches)
    workers = batches._workers  # type: ignore[attr-defined] # the loader's worker processes (a private field)
    for worker in workers:
        os.kill(worker.pid, signal.SIGINT)
    items = [first, *batches]
    assert len(items) == len(reference) and all(same_batch(a, b) for a, b in zip(items, reference))
    assert all(worker.exitcode == 0 for worker in workers)


def test_loader_workers_end_quietly_on_sigterm(cache: Path, epoch_plan: list[list[Sample]]) -> None:
    """A scheduler's SIGTERM to the whole group: each worker exits with code 0 (a worker killed by the signal made
    torch raise "is killed by signal" in the main process on top of its own interrupt)."""
    dataset = CacheBatches(cache, epoch_plan, epoch=0, seed=1, rule=AnchorRule(None, 8, 4), bucket_multiple=PAD)
    batches = start_loader(make_loader(dataset, 2, pin_memory=False))
    next(batches)
    workers = batches._workers  # type: ignore[attr-defined] # the loader's worker processes (a private field)
    # From another process, as a scheduler's: torch's own handler ends a worker quietly only when its parent sends it.
    subprocess.run(["kill", "-TERM", *(str(worker.pid) for worker in workers)], check=True)
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    stop_loader(batches)


def test_an_interrupt_while_an_epoch_ends_reaches_the_loop(cache: Path, epoch_plan: list[list[Sample]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that arrives while the loop stops an epoch's workers propagates (it was raised in the iterator's
    __del__, where Python swallows it: the run went on training); the workers are stopped either way, those of the
    next epoch's loader (started ahead) too."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    from dflash.stage2_train.trainer import step_batches

    stopped = []
    shutdown = _MultiProcessingDataLoaderIter._shutdown_workers

    def interrupted_shutdown(self: _MultiProcessingDataLoaderIter) -> None:
        first = not self._shutdown
        shutdown(self)
        if first:
            stopped.append(self._workers)
            raise KeyboardInterrupt  # as if Ctrl-C came while the workers were joined

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", interrupted_shutdown)
    run = SimpleNamespace(
        state=SimpleNamespace(epoch=0, position=0, step=0), options=SimpleNamespace(grad_accum=1), total_steps=4,
        plan=lambda epoch: epoch_plan, steps_in_epoch=lambda epoch, plan: 2,
        loader=lambda epoch, position, plan: make_loader(
            CacheBatches(cache, plan, epoch=epoch, seed=1, rule=AnchorRule(None, 8, 4), bucket_multiple=PAD), 2,
            pin_memory=False))
    batches = step_batches(run)  # type: ignore[arg-type]
    for _ in range(2):  # the first epoch's two steps, counted as the trainer does (the second epoch's loader starts)
        next(batches)
        run.state.step += 1
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    assert run.state.epoch == 0 and len(stopped) == 2  # this epoch's loader and the next one's
    assert all(worker.exitcode is not None for workers in stopped for worker in workers)


@pytest.mark.parametrize("lead", [0, 2, 50])
def test_the_next_epochs_loader_starts_before_this_epoch_ends_and_the_batches_stay_the_same(
        cache: Path, index: CacheIndex, lead: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next epoch's loader is started `NEXT_EPOCH_LEAD_STEPS` steps before this epoch's last (its workers fork
    and read while those steps run: ~0.6 s an epoch on an H100 machine), never for an epoch the run will not reach;
    the batches are those of one loader per epoch started when needed (lead 0), and closing the steps early stops the
    workers of both loaders."""
    from dflash.stage2_train import trainer

    def plan(epoch: int) -> list[list[Sample]]:
        return plan_epoch(index, epoch=epoch, seed=1, batch_tokens=640, world_size=1)

    steps_per_epoch, epochs = 4, 3
    events: list[tuple[str, int]] = []
    loaders: list[Any] = []
    run = SimpleNamespace(
        state=SimpleNamespace(epoch=0, position=0, step=0), options=SimpleNamespace(grad_accum=1),
        total_steps=steps_per_epoch * epochs, plan=plan, steps_in_epoch=lambda epoch, plan: steps_per_epoch)

    def loader(epoch: int, position: int, plan: list[list[Sample]]) -> Any:
        events.append(("loader", epoch))
        made = make_loader(CacheBatches(cache, plan, position, epoch=epoch, seed=1, rule=AnchorRule(None, 8, 4),
                                        bucket_multiple=PAD), 2, pin_memory=False)
        loaders.append(made)
        return made

    run.loader = loader
    started = []
    monkeypatch.setattr(trainer, "start_loader", lambda made: (started.append(iter(made)), started[-1])[1])
    monkeypatch.setattr(trainer, "NEXT_EPOCH_LEAD_STEPS", lead)
    batches = trainer.step_batches(run)  # type: ignore[arg-type]
    got = []
    while run.state.step < run.total_steps:  # as the trainer's loop: the step count moves after each step
        got.append(next(batches)[0])
        events.append(("step", run.state.step + 1))
        run.state.step += 1
        run.state.position += 1
    expected = [batch for epoch in range(epochs) for batch in collect(
        CacheBatches(cache, plan(epoch), epoch=epoch, seed=1, rule=AnchorRule(None, 8, 4), bucket_multiple=PAD),
        0)[:steps_per_epoch]]
    assert len(got) == len(expected) and all(same_batch(a, b) for a, b in zip(got, expected))
    # Each later epoch's loader: made before the step `lead` steps before its epoch starts (at the epoch's start at
    # the latest, with lead 0); none for a fourth epoch.
    ahead = min(lead, steps_per_epoch)
    for epoch in range(1, epochs):
        made_before = epoch * steps_per_epoch - ahead + 1 if ahead else epoch * steps_per_epoch + 1
        assert events.index(("loader", epoch)) < events.index(("step", made_before))
        if ahead and made_before > 1:
            assert events.index(("loader", epoch)) > events.index(("step", made_before - 1))
    assert [event for event in events if event[0] == "loader"] == [("loader", e) for e in range(epochs)]
    batches.close()
    assert all(iterator._shutdown for iterator in started)  # type: ignore[attr-defined]

    # Closed early, inside the lead of the first epoch's end: the loader started ahead is stopped too.
    run.state = SimpleNamespace(epoch=0, position=0, step=0)
    started.clear()
    batches = trainer.step_batches(run)  # type: ignore[arg-type]
    for _ in range(steps_per_epoch):
        next(batches)
        run.state.step += 1
        run.state.position += 1
    batches.close()
    assert len(started) == (2 if lead else 1) and all(iterator._shutdown for iterator in started)  # type: ignore[attr-defined]

    # Resumed inside its first epoch (as a checkpoint's position says) and stopped by an error at the last step of
    # that epoch: the tail of the epoch, then the error; both loaders stopped.
    run.state = SimpleNamespace(epoch=0, position=1, step=1)
    started.clear()
    batches = trainer.step_batches(run)  # type: ignore[arg-type]
    tail = []
    for _ in range(steps_per_epoch - 1):
        tail.append(next(batches)[0])
        run.state.step += 1
        run.state.position += 1
    assert all(same_batch(a, b) for a, b in zip(tail, expected[1:steps_per_epoch], strict=True))
    with pytest.raises(RuntimeError, match="the step failed"):
        batches.throw(RuntimeError("the step failed"))
    assert len(started) == (2 if lead else 1) and all(iterator._shutdown for iterator in started)  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_resume_yields_exactly_the_tail_without_reading_skipped_features(
        cache: Path, epoch_plan: list[list[Sample]], monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"epoch": 0, "seed": 1, "rule": AnchorRule(None, 8, 4), "bucket_multiple": PAD}
    full = collect(CacheBatches(cache, epoch_plan, **options), 0)
    start = 5
    reads = []
    original = packed_batches._read_into
    monkeypatch.setattr(packed_batches, "_read_into",
                        lambda array, a, b, out: (reads.append(b - a), original(array, a, b, out)))
    resumed = CacheBatches(cache, epoch_plan, start, **options)
    assert len(resumed) == len(epoch_plan) - start
    tail = collect(resumed, 0)
    assert len(tail) == len(full) - start and all(same_batch(a, b) for a, b in zip(tail, full[start:]))
    assert sum(reads) == 3 * sum(s.length for batch in epoch_plan[start:] for s in batch)  # features, ids, mask
    monkeypatch.undo()
    for workers in (2, 3):
        items = collect(CacheBatches(cache, epoch_plan, start, **options), workers)
        assert all(same_batch(a, b) for a, b in zip(items, full[start:])) and len(items) == len(full) - start
    # With the step inputs built in the workers (what `dflash train` asks for), the resumed tail equals too.
    with_inputs = {**options, "block_size": 4, "mask_token_id": 0}
    full = collect(CacheBatches(cache, epoch_plan, **with_inputs), 0)
    items = collect(CacheBatches(cache, epoch_plan, start, **with_inputs), 2)
    assert all(packed_batches.STEP_INPUTS in item for item in items)
    assert all(same_batch(a, b) for a, b in zip(items, full[start:])) and len(items) == len(full) - start
    assert collect(CacheBatches(cache, epoch_plan, len(epoch_plan), **options), 2) == []


# -------------------------------------------------------------------------------------------------- eval


def test_eval_sequences_hold_the_held_out_samples(cache: Path, index: CacheIndex) -> None:
    stored = stored_samples(cache)
    items = list(eval_sequences(index))
    assert [item["sample_key"] for item in items] == [(s.shard, s.row) for s in index.eval]
    for item in items:
        reference = stored[item["sample_key"]]
        assert item["features"].dtype == torch.bfloat16 and item["features"].shape == (item["length"], DIM)
        assert torch.equal(item["features"].view(torch.int16), reference["features"].view(torch.int16))
        assert item["input_ids"].tolist() == reference["input_ids"].tolist()
        assert item["loss_mask"].tolist() == reference["loss_mask"].astype(bool).tolist()
        assert item["sample_index"] == reference["sample_index"] and item["sample_id"] == f"conv-{item['sample_index']}"
    assert [i["sample_key"] for i in eval_sequences(index, limit=3)] == [i["sample_key"] for i in items[:3]]


# ------------------------------------------------------------------------------------------------ labels


def reference_block_labels(input_ids, loss_mask, anchors, anchor_valid, lengths, block_size, mask_token_id):
    batch, count = anchors.shape
    labels = torch.full((batch, count, block_size), -100, dtype=torch.long)
    inputs = torch.full((batch, count, block_size), mask_token_id, dtype=torch.long)
    for b in range(batch):
        for a in range(count):
            if not anchor_valid[b, a]:
                continue
            p = int(anchors[b, a])
            inputs[b, a, 0] = input_ids[b, p]
            for k in range(1, block_size):
                if p + k < lengths[b] and loss_mask[b, p + k]:
                    labels[b, a, k] = input_ids[b, p + k]
    return labels, inputs


@settings(max_examples=80, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), seq=st.integers(1, 24), count=st.integers(1, 6),
       block_size=st.integers(1, 6))
def test_block_labels_match_a_plain_loop(data, batch: int, seq: int, count: int, block_size: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lengths = torch.from_numpy(rng.integers(1, seq + 1, batch))
    input_ids = torch.from_numpy(rng.integers(0, 50, (batch, seq)))
    loss_mask = torch.from_numpy(rng.random((batch, seq)) < 0.7)
    anchors = torch.stack([torch.from_numpy(rng.integers(0, int(n), count)) for n in lengths])
    anchor_valid = torch.from_numpy(rng.random((batch, count)) < 0.8)
    anchors[~anchor_valid] = torch.from_numpy(rng.integers(0, seq, int((~anchor_valid).sum())))  # junk
    got = block_labels(input_ids, loss_mask, anchors, anchor_valid, lengths, block_size, mask_token_id=99)
    want = reference_block_labels(input_ids, loss_mask, anchors, anchor_valid, lengths, block_size, 99)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6), data=st.data())
def test_candidate_counts_match_the_rule(lengths: list[int], data) -> None:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = np.array(data.draw(st.lists(st.integers(0, 1), min_size=int(offsets[-1]), max_size=int(offsets[-1]))),
                    dtype=np.uint8)
    counts = candidate_counts(mask, offsets)
    for i in range(len(lengths)):
        piece = mask[offsets[i] : offsets[i + 1]]
        assert counts[i] == len(reference_candidates(piece)) == len(anchor_candidates(piece))


# ---------------------------------------------------------------------------------------------- damage


def _copy(cache: Path, tmp_path: Path) -> Path:
    target = tmp_path / "cache"
    shutil.copytree(cache, target)
    return target


def _assert_names_shard(error: pytest.ExceptionInfo, cache: Path, shard: int) -> None:
    message = str(error.value)
    assert f"shard {shard}" in message and cf.shard_name(shard) in message
    assert f"dflash extract --repair --out {cache}" in message


def test_missing_shard_store_is_named(cache: Path, tmp_path: Path) -> None:
    copy = _copy(cache, tmp_path)
    shutil.rmtree(cf.shard_path(copy, 1))
    with pytest.raises(CacheError) as error:
        CacheIndex.from_cache(copy, 0.1, 0)
    _assert_names_shard(error, copy.resolve(), 1)


def test_manifest_count_mismatch_is_named(cache: Path, tmp_path: Path) -> None:
    copy = _copy(cache, tmp_path)
    manifest = json.loads((copy / cf.MANIFEST_FILE).read_text())
    manifest["shards"]["2"]["samples"] += 1
    cf.write_json_atomic(copy / cf.MANIFEST_FILE, manifest)
    with pytest.raises(CacheError, match="samples") as error:
        CacheIndex.from_cache(copy, 0.1, 0)
    _assert_names_shard(error, copy.resolve(), 2)


def test_unreadable_or_incomplete_store_is_named(cache: Path, tmp_path: Path) -> None:
    copy = _copy(cache, tmp_path)
    loss_mask_chunk = next(p for p in (cf.shard_path(copy, 0) / "loss_mask").rglob("*") if p.is_file()
                           and p.name != "zarr.json")
    raw = bytearray(loss_mask_chunk.read_bytes())
    raw[3] ^= 0xFF  # the crc32c no longer matches
    loss_mask_chunk.write_bytes(bytes(raw))
    with pytest.raises(CacheError) as error:
        CacheIndex.from_cache(copy, 0.1, 0)
    _assert_names_shard(error, copy.resolve(), 0)
    shutil.rmtree(cf.shard_path(copy, 0))
    shutil.copytree(cf.shard_path(cache, 0), cf.shard_path(copy, 0))
    meta = cf.shard_path(copy, 1) / "zarr.json"
    group = json.loads(meta.read_text())
    group["attributes"]["complete"] = False
    meta.write_text(json.dumps(group))
    with pytest.raises(CacheError, match="incomplete") as error:
        CacheIndex.from_cache(copy, 0.1, 0)
    _assert_names_shard(error, copy.resolve(), 1)


def _loader_fails_on_a_damaged_array(cache: Path, tmp_path: Path, array: str, offset: int, match: str | None) -> None:
    """Flip a byte of every chunk file of shard 2's `array` in a copy of the cache: the loader of that shard's
    samples stops with the shard named (and `match` in the message), in the main process and in workers."""
    copy = _copy(cache, tmp_path)
    index = CacheIndex.from_cache(copy, 0.1, 0)
    plan = [[s] for s in index.train if s.shard == 2]
    for path in (cf.shard_path(copy, 2) / array).rglob("*"):
        if path.is_file() and path.name != "zarr.json":
            raw = bytearray(path.read_bytes())
            raw[offset] ^= 0xFF
            path.write_bytes(bytes(raw))
    for workers in (0, 2):
        with pytest.raises(CacheError, match=match) as error:
            collect(CacheBatches(copy, plan, epoch=0, seed=0, rule=AnchorRule(None, 4, 4), bucket_multiple=PAD),
                    workers)
        _assert_names_shard(error, copy.resolve(), 2)


def test_damaged_features_fail_in_the_loader_naming_the_shard(cache: Path, tmp_path: Path) -> None:
    _loader_fails_on_a_damaged_array(cache, tmp_path, "features", 10, None)


def test_damaged_token_ids_fail_in_the_loader_naming_the_shard_and_the_array(cache: Path, tmp_path: Path) -> None:
    """The loader reads a store's side arrays whole when it opens it: a damaged chunk of its token ids (which the
    index does not read) stops it with the shard and the array named."""
    _loader_fails_on_a_damaged_array(cache, tmp_path, "input_ids", 3, "input_ids could not be read")


def test_side_arrays_held_within_the_budget_give_the_batches_read_sample_by_sample(
        cache: Path, epoch_plan: list[list[Sample]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's stores hold their side arrays in memory while the process's budget has room, and read them
    sample by sample past it, with the same batches; the bytes held are counted while the stores live and
    released when they are freed (the loader of the next epoch opens its own)."""
    import gc

    from dflash.stage2_train import cache_index

    options = {"epoch": 0, "seed": 1, "rule": AnchorRule(None, 8, 4), "bucket_multiple": PAD}
    gc.collect()  # stores of earlier tests freed before counting, and none freed while this test counts
    gc.disable()
    try:
        before = cache_index._side_bytes_held[0]
        held = CacheBatches(cache, epoch_plan, **options)
        batches = collect(held, 0)
        assert held._stores and all(isinstance(s.input_ids, np.ndarray) for s in held._stores.values())
        tokens = sum(len(s.input_ids) for s in held._stores.values())
        assert cache_index._side_bytes_held[0] - before == tokens * (4 + 1)  # int32 ids, uint8 mask (bf16: no scales)
        # room for some of the second loader's stores beside the first loader's, which still hold theirs
        monkeypatch.setattr(cache_index, "SIDE_ARRAYS_BUDGET_BYTES", cache_index._side_bytes_held[0] + tokens * 5 // 2)
        partly = CacheBatches(cache, epoch_plan, **options)
        assert all(same_batch(a, b) for a, b in zip(collect(partly, 0), batches)) and len(batches) == len(epoch_plan)
        kinds = {isinstance(s.input_ids, np.ndarray) for s in partly._stores.values()}
        assert kinds == {True, False}  # the first stores held, the later ones read sample by sample
        del held, partly
    finally:
        gc.enable()
    gc.collect()
    assert cache_index._side_bytes_held[0] == before


def test_side_arrays_that_run_out_of_memory_are_read_sample_by_sample(
        cache: Path, epoch_plan: list[list[Sample]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose side arrays cannot be read whole for want of memory (the budget is one process's; the machine
    is shared) reads them sample by sample, with the same batches, instead of reporting the shard as damaged."""
    import zarr

    options = {"epoch": 0, "seed": 1, "rule": AnchorRule(None, 8, 4), "bucket_multiple": PAD}
    batches = collect(CacheBatches(cache, epoch_plan, **options), 0)
    read = zarr.Array.__getitem__

    def short_of_memory(self: zarr.Array, selection: object) -> object:
        if self.basename == "loss_mask" and selection == slice(None):  # the whole array, not a sample's rows
            raise MemoryError
        return read(self, selection)

    monkeypatch.setattr(zarr.Array, "__getitem__", short_of_memory)
    short = CacheBatches(cache, epoch_plan, **options)
    assert all(same_batch(a, b) for a, b in zip(collect(short, 0), batches)) and len(batches) == len(epoch_plan)
    assert short._stores and not any(isinstance(s.input_ids, np.ndarray) for s in short._stores.values())


# ---------------------------------------------------------------------------------------------- anchors


@settings(max_examples=200, deadline=None)
@given(candidates=st.integers(0, 4000), density=st.one_of(st.none(), st.floats(1e-3, 1.0)),
       cap=st.integers(1, 600))
def test_anchor_counts_follow_the_density_and_the_cap(candidates: int, density: float | None, cap: int) -> None:
    rule = AnchorRule(density, cap, 16)
    count = int(rule.count(candidates))
    wanted = candidates if density is None else max(1, -(-int(round(density * candidates * 1e9)) // 10**9))
    assert count == min(cap, candidates, wanted)
    assert int(rule.cost(100, candidates)) == 100 + 16 * count
    # Drawn from a mask with exactly that many candidates: that many distinct sorted candidates, the same draw for
    # the same (seed, epoch, shard, row) and another one for another epoch.
    mask = np.ones(candidates + 1, np.uint8)
    chosen = sample_anchors(mask, rule, 3, 1, 2, 7)
    assert len(chosen) == count and (np.diff(chosen) > 0).all() and (chosen < candidates).all()
    assert np.array_equal(chosen, sample_anchors(mask, rule, 3, 1, 2, 7))
    if 4 <= count <= candidates - 4:
        assert not np.array_equal(chosen, sample_anchors(mask, rule, 3, 2, 2, 7))


@settings(max_examples=200, deadline=None)
@given(value=st.integers(0, 10**7), multiple=st.sampled_from([1, 8, 16, 128]))
def test_buckets_pad_little_and_keep_few_shapes(value: int, multiple: int) -> None:
    rounded = bucket(value, multiple)
    assert rounded >= value and rounded % multiple == 0
    assert rounded - value < max(multiple, value / 16 + 1)


# ---------------------------------------------------------------------------------------- the target's top-k


def test_topk_reaches_each_label_position_through_batches_and_splits(tmp_path: Path) -> None:
    """A cache with the target's top-k: at every supervised block position the micro-batch carries the stored row
    of that very token (the synthetic top-1 is the label itself, the log-probs name the sample and position),
    through packing and through the memory plan's splits of a batch."""
    cache = build_cache(tmp_path / "cache", [23, 17], max_len=120, topk=3)
    stored = stored_samples(cache)
    sample_index = {key: value["sample_index"] for key, value in stored.items()}
    index = CacheIndex.from_cache(cache, eval_fraction=0.0, seed=0)
    plan = plan_epoch(index, epoch=0, seed=0, batch_tokens=500, rule=AnchorRule(0.3, 16, 4))
    dataset = CacheBatches(cache, plan, epoch=0, seed=0, rule=AnchorRule(0.3, 16, 4), bucket_multiple=PAD)
    checked = 0
    for item in collect(dataset, 0):
        count = len(item["lengths"])
        for part in split_packed_batch(item, [(0, 1), (1, count)] if count > 1 else [(0, 1)]):
            layout = packed_layout(part, 4)
            labels, _ = packed_block_labels(part, layout, mask_token_id=999)
            ids, logprobs = packed_block_topk(part, layout)
            assert ids.dtype == torch.int32 and logprobs.dtype == torch.float16
            assert ids.shape == logprobs.shape == (*labels.shape, 3)
            keys = part["sample_keys"].tolist()
            for n, k in (labels[0] != IGNORE_INDEX).nonzero().tolist():
                label = int(labels[0, n, k])
                sequence = int(part["block_sequence"][n])
                position = int(part["block_anchor"][n]) + k
                expected = -(np.arange(3) + (7 * sample_index[tuple(keys[sequence])] + position) % 50) / 8
                assert ids[0, n, k].tolist() == [(label + j) % 1000 for j in range(3)]
                assert logprobs[0, n, k].tolist() == expected.tolist()
                checked += 1
    assert checked > 500


def test_a_store_without_the_topk_its_manifest_records_is_refused(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "cache", [5])
    manifest = cf.read_manifest(cache)
    manifest["identity"]["target_topk"] = cf.TopKFormat.for_vocab(4, 1000).record()
    cf.write_json_atomic(cache / cf.MANIFEST_FILE, manifest)
    with pytest.raises(CacheError, match="mixes two extractions"):
        CacheIndex.from_cache(cache)
