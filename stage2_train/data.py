"""Stage 2 training data: an index over the feature cache, per-epoch token-budget plans, and a batch loader.

Everything here is a pure function of (cache contents, seed, epoch), never of the number of DataLoader workers,
the rank, or where a run was resumed:

* `CacheIndex.from_cache` reads the manifest and, for every finished shard, only the small arrays (offsets,
  loss_mask, sample_index): one `Sample(shard, row, length, n_anchor_candidates)` per sample. Samples without a
  single anchor candidate are dropped (and counted). A deterministic hash of (seed, sample_index) in [0, 1) splits
  the samples: below `eval_fraction` the validation split (periodic evaluation, checkpoint selection), the next
  `test_fraction` the test split (reported once, at the end), the rest training. A run made before the test split
  existed (test_fraction 0) keeps its split: its held-out samples are the same validation split.
* `plan_epoch` shuffles the training samples per (seed, epoch), sorts by length inside windows of
  `sort_window` (default 64) shuffled samples (less padding, still random), groups them greedily into
  micro-batches of at most `batch_tokens` padded tokens, shuffles the micro-batch order and truncates to a
  multiple of `world_size`. Micro-batch i goes
  to rank i % world_size (`rank_plan`), so a global step is `world_size * grad_accum` consecutive micro-batches
  of the one global plan, whatever the number of ranks.
* `CacheBatches` (IterableDataset) turns the micro-batches of one rank into padded CPU tensors. Stores are opened
  lazily inside each DataLoader worker; worker w of k yields plan positions start + w, start + w + k, ..., which
  PyTorch's in-order round-robin merge turns back into exact plan order. Anchors are drawn with an RNG seeded by
  (seed, epoch, shard, row): the same in every worker layout, rank count, and after a resume.
* `EvalSet` / `eval_sequences` read validation or test samples one at a time; `block_labels` builds the per-block labels and
  block inputs of the DFlash objective (the reference's, z-lab/dflash).
"""

from __future__ import annotations

import inspect
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dflash.shared import cache_format as cf
from dflash.shared.cache_format import CacheError
from dflash.shared.feature_codecs import FeatureCodec, manifest_codec
from dflash.shared.logs import get_logger
from dflash.shared.object_store import is_mirror, shard_source
from dflash.stage2_train.attention_masks import PackedLayout
from dflash.stage2_train.options import DEFAULT_ANCHOR_DENSITY, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ANCHORS

log = get_logger(__name__)

DEFAULT_BUCKET_MULTIPLE = 16  # packed lengths are rounded up to a multiple of this (at least), see `bucket`
IGNORE_INDEX = -100

# Distinct tags keep the RNG streams of the plan, of the anchors and of the split apart for the same seed.
_PLAN_STREAM = 0x706C616E  # "plan"
_ANCHOR_STREAM = 0x616E6368  # "anch"
_SPLIT_STREAM = 0x73706C74  # "splt"


class Sample(NamedTuple):
    """One cached sample: store `shard`, sample `row` inside it, its token `length`, and how many anchor
    positions it offers (p with loss_mask[p] == loss_mask[p + 1] == 1)."""

    shard: int
    row: int
    length: int
    n_anchor_candidates: int


def repair_hint(cache_dir: Path, shard: int) -> str:
    return f"re-extract it with `{cf.repair_command(cache_dir)}`"


def _shard_error(cache_dir: Path, shard: int, problem: str) -> CacheError:
    return CacheError(f"shard {shard} ({cf.shard_path(cache_dir, shard)}) {problem}; {repair_hint(cache_dir, shard)}")


def _check_seed(seed: int) -> int:
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return int(seed)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each uint64 (SplitMix64 finaliser); numpy uint64 arithmetic wraps."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_hash(sample_index: np.ndarray, seed: int) -> np.ndarray:
    """Uniform floats in [0, 1) per sample: the train/eval split and the order of the eval set.

    Keyed by the sample's position in the loaded dataset (`sample_index`, unique in a cache) and the seed only, so
    the split does not depend on the number of shards, their order, or which shards are finished."""
    key = _splitmix64(np.array([_check_seed(seed) ^ _SPLIT_STREAM], dtype=np.uint64))[0]
    mixed = _splitmix64(sample_index.astype(np.int64).view(np.uint64) ^ key)
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p of one sample with loss_mask[p] == 1 and loss_mask[p + 1] == 1 (so p + 1 < length)."""
    mask = np.asarray(loss_mask).astype(bool, copy=False)
    return np.flatnonzero(mask[:-1] & mask[1:])


def _candidate_counts(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Number of anchor candidates of every sample of a shard (vectorised over the flat token arrays)."""
    mask = loss_mask.astype(bool, copy=False)
    pair = np.zeros(len(mask), dtype=bool)
    pair[:-1] = mask[:-1] & mask[1:]
    ends = offsets[1:][offsets[1:] > offsets[:-1]] - 1
    pair[ends] = False  # the last token of a sample has no successor inside it
    cumulative = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(pair, out=cumulative[1:])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


@dataclass(frozen=True)
class AnchorRule:
    """How many anchors (blocks) a sequence gets per epoch: `density` of its anchor candidates, rounded up, at
    least 1 and at most `max_anchors` (density None: every candidate up to the cap, the reference's rule)."""

    density: float | None = DEFAULT_ANCHOR_DENSITY
    max_anchors: int = DEFAULT_MAX_ANCHORS
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"anchor density must be in (0, 1], got {self.density}")
        if self.max_anchors < 1 or self.block_size < 1:
            raise ValueError(f"max_anchors={self.max_anchors}, block_size={self.block_size}")

    def count(self, candidates: np.ndarray | int) -> np.ndarray:
        """Anchors drawn from sequences with these numbers of candidates."""
        n = np.asarray(candidates, dtype=np.int64)
        wanted = n if self.density is None else np.maximum(1, np.ceil(self.density * n - 1e-9)).astype(np.int64)
        return np.minimum(np.minimum(wanted, n), self.max_anchors)

    def cost(self, lengths: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """Tokens a sample adds to a packed micro-batch: its context plus its blocks."""
        return np.asarray(lengths, dtype=np.int64) + self.count(candidates) * self.block_size


def sample_anchors(loss_mask: np.ndarray, rule: AnchorRule, seed: int, epoch: int, shard: int, row: int) -> np.ndarray:
    """`rule.count` anchor candidates, uniformly without replacement, sorted (int64).

    The RNG is seeded by (seed, epoch, shard, row) only: the same anchors in any worker, on any rank, after a
    resume; fresh ones every epoch."""
    candidates = anchor_candidates(loss_mask)
    count = int(rule.count(len(candidates)))
    if len(candidates) <= count:
        return candidates.astype(np.int64)
    rng = np.random.default_rng([_check_seed(seed), int(epoch), int(shard), int(row), _ANCHOR_STREAM])
    chosen = rng.choice(len(candidates), size=count, replace=False)
    chosen.sort()
    return candidates[chosen].astype(np.int64)


def bucket(value: int, multiple: int = DEFAULT_BUCKET_MULTIPLE) -> int:
    """`value` rounded up to a multiple of `multiple` and of 1/16 of its power of two: padding stays under 6.25 %
    and a run sees few distinct shapes (about 16 per doubling), which compiled kernels are specialised for."""
    step = max(multiple, 1 << max(0, int(value).bit_length() - 5))
    return -(-int(value) // step) * step


# ------------------------------------------------------------------------------------------------- index


@dataclass
class CacheIndex:
    """Every usable sample of the finished shards of a cache, split into train and eval. No features are read.

    Arrays (one entry per kept sample, in (shard, row) order): `shards`, `rows`, `lengths`, `candidates`,
    `sample_index`, `is_eval` (validation split), `is_test` (test split), `split_key` (the split hash in [0, 1)).
    """

    cache_dir: Path
    manifest: dict[str, Any]
    feature_dim: int
    eval_fraction: float
    seed: int
    done_shards: tuple[int, ...]
    unfinished_shards: tuple[int, ...]
    shards: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    candidates: np.ndarray
    sample_index: np.ndarray
    split_key: np.ndarray
    is_eval: np.ndarray
    is_test: np.ndarray
    dropped_no_anchor: int
    dropped_tokens: int
    test_fraction: float = 0.0
    _train: list[Sample] | None = field(default=None, repr=False)
    _eval: list[Sample] | None = field(default=None, repr=False)
    _test: list[Sample] | None = field(default=None, repr=False)

    @classmethod
    def from_cache(cls, cache_dir: Path | str, eval_fraction: float = 0.05, seed: int = 0,
                   test_fraction: float = 0.0) -> CacheIndex:
        cache_dir = Path(cache_dir).resolve()
        if not (0.0 <= eval_fraction and 0.0 <= test_fraction and eval_fraction + test_fraction <= 1.0):
            raise ValueError(f"eval_fraction {eval_fraction} and test_fraction {test_fraction} must be >= 0 with a "
                             "sum <= 1")
        manifest = cf.read_manifest(cache_dir)
        identity = manifest["identity"]
        feature_dim = int(identity["hidden_size"]) * len(identity["layer_ids"])
        entries = {int(k): v for k, v in manifest["shards"].items()}
        done = tuple(sorted(k for k, v in entries.items() if v.get("status") == cf.SHARD_DONE))
        unfinished = tuple(sorted(k for k in entries if k not in done))
        if not done:
            raise CacheError(f"{cache_dir} has no finished shard (statuses: "
                             f"{sorted({v.get('status') for v in entries.values()})}); run `dflash extract` first")
        if unfinished:
            log.warning("%s: training on the %d finished shard(s) only; %s", cache_dir, len(done),
                        cf.finish_advice(cache_dir, cf.unfinished_shards(manifest)))
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("shards", "rows", "lengths", "candidates", "index")}
        dropped = dropped_tokens = 0
        for shard in done:
            offsets, counts, sample_index = _scan_shard(cache_dir, shard, entries[shard], feature_dim,
                                                        manifest_codec(manifest), cf.TopKFormat.of_manifest(manifest))
            lengths = np.diff(offsets)
            keep = counts > 0
            dropped += int((~keep).sum())
            dropped_tokens += int(lengths[~keep].sum())
            parts["shards"].append(np.full(int(keep.sum()), shard, dtype=np.int64))
            parts["rows"].append(np.flatnonzero(keep).astype(np.int64))
            parts["lengths"].append(lengths[keep])
            parts["candidates"].append(counts[keep])
            parts["index"].append(sample_index[keep])
        joined = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in parts.items()}
        if len(np.unique(joined["index"])) != len(joined["index"]):
            raise CacheError(f"{cache_dir}: a sample_index appears in two shards; the cache mixes two extractions "
                             "(re-extract with `dflash extract --overwrite`)")
        split_key = split_hash(joined["index"], seed)
        if dropped:
            log.info("%s: dropped %d sample(s) (%d tokens) without an anchor position", cache_dir, dropped,
                     dropped_tokens)
        is_eval = split_key < eval_fraction
        is_test = ~is_eval & (split_key < eval_fraction + test_fraction)
        return cls(cache_dir=cache_dir, manifest=manifest, feature_dim=feature_dim, eval_fraction=float(eval_fraction),
                   seed=int(seed), done_shards=done, unfinished_shards=unfinished, shards=joined["shards"],
                   rows=joined["rows"], lengths=joined["lengths"], candidates=joined["candidates"],
                   sample_index=joined["index"], split_key=split_key, is_eval=is_eval, is_test=is_test,
                   dropped_no_anchor=dropped, dropped_tokens=dropped_tokens, test_fraction=float(test_fraction))

    @property
    def codec(self) -> FeatureCodec:
        """How the cache stores its features (from its manifest)."""
        return manifest_codec(self.manifest)

    def _samples(self, positions: np.ndarray) -> list[Sample]:
        return [Sample(int(s), int(r), int(n), int(c)) for s, r, n, c in zip(
            self.shards[positions], self.rows[positions], self.lengths[positions], self.candidates[positions])]

    @property
    def is_train(self) -> np.ndarray:
        return ~(self.is_eval | self.is_test)

    @property
    def train(self) -> list[Sample]:
        """Training samples in (shard, row) order."""
        if self._train is None:
            self._train = self._samples(np.flatnonzero(self.is_train))
        return self._train

    def _in_hash_order(self, mask: np.ndarray) -> list[Sample]:
        positions = np.flatnonzero(mask)
        return self._samples(positions[np.argsort(self.split_key[positions], kind="stable")])

    @property
    def eval(self) -> list[Sample]:
        """Validation samples in split-hash order: any prefix is a uniform random subset of the split."""
        if self._eval is None:
            self._eval = self._in_hash_order(self.is_eval)
        return self._eval

    @property
    def test(self) -> list[Sample]:
        """Test samples in split-hash order."""
        if self._test is None:
            self._test = self._in_hash_order(self.is_test)
        return self._test

    def split(self, name: str) -> list[Sample]:
        """The samples of split `name`: "validation" or "test"."""
        if name not in ("validation", "test"):
            raise ValueError(f"split must be 'validation' or 'test', got {name!r}")
        return self.eval if name == "validation" else self.test

    def summary(self) -> dict[str, Any]:
        train = self.is_train
        return {
            "shards_used": len(self.done_shards),
            "shards_unfinished": list(self.unfinished_shards),
            "train_samples": int(train.sum()),
            "train_tokens": int(self.lengths[train].sum()),
            "eval_samples": int(self.is_eval.sum()),
            "eval_tokens": int(self.lengths[self.is_eval].sum()),
            "test_samples": int(self.is_test.sum()),
            "test_tokens": int(self.lengths[self.is_test].sum()),
            "dropped_no_anchor": self.dropped_no_anchor,
            "dropped_tokens": self.dropped_tokens,
            "feature_dim": self.feature_dim,
        }


def _scan_shard(cache_dir: Path, shard: int, entry: dict[str, Any], feature_dim: int, codec: FeatureCodec,
                topk: cf.TopKFormat | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, anchor-candidate counts, sample_index) of one finished shard, checked against the manifest."""
    path = shard_source(cache_dir, shard)
    if isinstance(path, Path) and not path.is_dir():
        raise _shard_error(cache_dir, shard, "is marked done in the manifest but its store is missing")
    try:
        reader = cf.ShardReader(path, codec)
        group = reader.group
        offsets = reader.offsets
        loss_mask = np.asarray(group["loss_mask"][:])
        sample_index = np.asarray(group["sample_index"][:], dtype=np.int64)
        ids_shape = tuple(group["input_ids"].shape)
        features_shape = tuple(reader.features.shape)
    except CacheError as error:
        raise _shard_error(cache_dir, shard, f"cannot be read ({error})") from error
    except Exception as error:  # noqa: BLE001 - checksum failures, missing arrays, bad metadata: all damage
        raise _shard_error(cache_dir, shard, f"cannot be read ({type(error).__name__}: {error})") from error
    samples, tokens = len(offsets) - 1, int(offsets[-1]) if len(offsets) else 0
    problems = []
    if len(offsets) == 0 or offsets[0] != 0 or bool((np.diff(offsets) < 0).any()):
        problems.append("its offsets are not a valid index")
    if samples != entry.get("samples"):
        problems.append(f"it holds {samples} samples, the manifest says {entry.get('samples')}")
    if tokens != entry.get("tokens"):
        problems.append(f"it holds {tokens} tokens, the manifest says {entry.get('tokens')}")
    if "loss_tokens" in entry and int(loss_mask.sum()) != entry["loss_tokens"]:
        problems.append(f"it holds {int(loss_mask.sum())} loss tokens, the manifest says {entry['loss_tokens']}")
    if len(loss_mask) != tokens or ids_shape != (tokens,) or len(sample_index) != samples:
        problems.append("its token arrays disagree with its offsets")
    if features_shape != (tokens, feature_dim):
        problems.append(f"its features have shape {features_shape}, expected {(tokens, feature_dim)}")
    elif isinstance(path, Path):  # a local store: its file sizes (in a bucket, checksums catch damage on read)
        problems += cf.store_file_problems(path, reader)
    if (scales_problem := reader.scales_problem()) is not None:
        problems.append(scales_problem)
    if (topk_problem := reader.topk_problem(topk)) is not None:
        problems.append(topk_problem)
    if problems:
        raise _shard_error(cache_dir, shard, "does not match the manifest: " + "; ".join(problems))
    return offsets, _candidate_counts(loss_mask, offsets), sample_index


# -------------------------------------------------------------------------------------------------- plan


def plan_epoch(index: CacheIndex, epoch: int, seed: int, batch_tokens: int, world_size: int = 1,
               rule: AnchorRule | None = None) -> list[list[Sample]]:
    """The global list of micro-batches of one epoch (every rank computes the same list).

    The training samples are shuffled per (seed, epoch) and packed greedily, in that order, into micro-batches whose
    tokens, context plus blocks (`AnchorRule.cost`; context only without a rule), stay within `batch_tokens`; a
    sample costlier than that forms a micro-batch alone. The micro-batches are shuffled again and the list is
    truncated to a multiple of `world_size`; micro-batch i belongs to rank i % world_size (see `rank_plan`). Packing
    leaves no padding to minimise, so lengths are not sorted."""
    if batch_tokens < 1 or world_size < 1:
        raise ValueError(f"batch_tokens={batch_tokens}, world_size={world_size}")
    samples = index.train
    rng = np.random.default_rng([_check_seed(seed), int(epoch), _PLAN_STREAM])
    order = rng.permutation(len(samples))
    train = index.is_train
    lengths, candidates = index.lengths[train], index.candidates[train]
    costs = rule.cost(lengths, candidates) if rule is not None else lengths.astype(np.int64)
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    filled = 0
    for position in order.tolist():
        cost = int(costs[position])
        if current and filled + cost > batch_tokens:
            batches.append(current)
            current, filled = [], 0
        current.append(samples[position])
        filled += cost
    if current:
        batches.append(current)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches[: len(batches) - len(batches) % world_size]


def rank_plan(plan: Sequence[list[Sample]], rank: int, world_size: int) -> list[list[Sample]]:
    """The micro-batches of `rank`: plan[rank], plan[rank + world_size], ..."""
    if len(plan) % world_size:
        raise ValueError(f"a plan of {len(plan)} micro-batches cannot be split over {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    return list(plan[rank::world_size])


# ------------------------------------------------------------------------------------------------ labels


def block_labels(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor, lengths: Tensor,
                 block_size: int, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """Labels and block inputs of the DFlash objective for a padded batch.

    input_ids, loss_mask: [B, S]; anchors, anchor_valid: [B, A]; lengths: [B].
    Returns labels [B, A, Bk] long: input_ids[p + k] where k >= 1, p + k < length and loss_mask[p + k], else -100
    (offset 0 and invalid anchors are never labels); block_input_ids [B, A, Bk] long: [input_ids[p], MASK, ...]
    for a valid anchor, all MASK for an invalid one."""
    batch, seq = input_ids.shape
    num_anchors = anchors.shape[1]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    positions = anchors.long()[:, :, None] + offsets  # [B, A, Bk]
    inside = (positions < lengths.long()[:, None, None]) & (positions < seq) & (positions >= 0)
    gather_at = positions.clamp(0, max(seq - 1, 0)).reshape(batch, num_anchors * block_size)
    tokens = input_ids.long().gather(1, gather_at).view(batch, num_anchors, block_size)
    supervised = loss_mask.bool().gather(1, gather_at).view(batch, num_anchors, block_size)
    keep = supervised & inside & anchor_valid.bool()[:, :, None] & (offsets >= 1)
    labels = torch.where(keep, tokens, torch.full_like(tokens, IGNORE_INDEX))
    block_input_ids = torch.full_like(tokens, int(mask_token_id))
    block_input_ids[:, :, 0] = torch.where(anchor_valid.bool() & inside[:, :, 0], tokens[:, :, 0],
                                           torch.full_like(tokens[:, :, 0], int(mask_token_id)))
    return labels, block_input_ids


# ---------------------------------------------------------------------------------------------- reading


class _Store:
    """One shard store opened read-only, with its array handles (opening an array re-reads its metadata)."""

    def __init__(self, cache_dir: Path, shard: int, codec: FeatureCodec) -> None:
        self.shard = shard
        try:
            reader = cf.ShardReader(shard_source(cache_dir, shard), codec)
            self.reader = reader
            self.offsets = reader.offsets
            self.features = reader.features
            self.feature_scales = reader.feature_scales  # scaled codecs (fp8) only
            self.input_ids = reader.group["input_ids"]
            self.loss_mask = reader.group["loss_mask"]
            self.topk_ids, self.topk_logprobs = reader.topk_ids, reader.topk_logprobs  # a cache with top-k only
            self.topk_offsets = reader.topk_offsets
            self.group = reader.group
        except Exception as error:  # noqa: BLE001
            raise _shard_error(cache_dir, shard, f"cannot be opened ({error})") from error
        self._sample_index: np.ndarray | None = None
        self._sample_ids: np.ndarray | None = None

    def sample_meta(self, row: int) -> tuple[int, str]:
        """(sample_index, sample_id) of a row (both arrays read once per store)."""
        if self._sample_index is None or self._sample_ids is None:
            self._sample_index = np.asarray(self.group["sample_index"][:], dtype=np.int64)
            self._sample_ids = np.asarray(self.group["sample_id"][:])
        return int(self._sample_index[row]), str(self._sample_ids[row])

    def bounds(self, row: int, length: int | None, cache_dir: Path) -> tuple[int, int]:
        if not 0 <= row < len(self.offsets) - 1:
            raise _shard_error(cache_dir, self.shard, f"has no sample {row}: it changed since the index was built")
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if length is not None and end - start != length:
            raise _shard_error(cache_dir, self.shard,
                               f"sample {row} has {end - start} tokens, the index says {length}: the store changed "
                               "since the index was built")
        return start, end


def _read_into(array: Any, start: int, end: int, out: np.ndarray) -> None:
    """Read rows start:end of a zarr array straight into `out` (no intermediate array)."""
    from zarr.core.buffer import default_buffer_prototype

    selection = (slice(start, end),) + (slice(None),) * (out.ndim - 1)
    array.get_basic_selection(selection, out=default_buffer_prototype().nd_buffer.from_numpy_array(out))


def _empty_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> Tensor:
    """An uninitialised tensor; in a DataLoader worker it is allocated in shared memory at once, so handing it
    to the main process does not copy it into shared memory a second time."""
    if shared:
        try:
            storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * dtype.itemsize)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - other torch versions
            pass
    return torch.empty(shape, dtype=dtype)


class CacheBatches(IterableDataset):
    """The micro-batches of one rank's plan, from position `start` on, as packed dicts of CPU tensors.

    Each item packs its B sequences back to back on one flat axis of C = `bucket`(total length) positions (the tail
    is zero padding): features [C, D] as the cache's codec stores them (`FeatureCodec.transport`: bf16 as
    bfloat16, fp8 as uint8 bits) and, for a scaled codec, feature_scales float32 [C, L] (the trainer decodes them on
    its device, so that only the stored bytes cross to the GPU); input_ids long [C], loss_mask bool [C]; lengths
    long [B] and context_starts long [B] (where each sequence starts on the flat axis); the blocks of every
    sequence on a second flat axis of N = `bucket`(blocks, 8) entries: block_anchor long [N] (the anchor's position
    inside its sequence), block_sequence long [N] (index into lengths) and block_valid bool [N] (False for the
    padding at the end), sequence by sequence with anchors sorted; sample_keys long [B, 2] (shard, row) and
    position (int: the micro-batch's index in this rank's plan). Anchors: `sample_anchors` with `rule`. A cache with
    the target's top-k adds topk_ids int32 [C, K] and topk_logprobs float16 [C, K]: at each supervised position
    (`cache_format.topk_positions`) the target's prediction for the token there, zeros elsewhere; `read_topk=False`
    leaves them unread (an objective that does not use them).
    """

    def __init__(self, cache_dir: Path | str, plan: Sequence[Sequence[Sample]], start: int = 0, *, epoch: int,
                 seed: int, rule: AnchorRule | None = None, bucket_multiple: int = DEFAULT_BUCKET_MULTIPLE,
                 read_topk: bool = True) -> None:
        super().__init__()
        if not 0 <= start <= len(plan):
            raise ValueError(f"start={start} outside 0..{len(plan)}")
        self.cache_dir = Path(cache_dir).resolve()
        self.epoch, self.seed = int(epoch), _check_seed(seed)
        self.start = int(start)
        self.rule = rule if rule is not None else AnchorRule()
        self.bucket_multiple = int(bucket_multiple)
        manifest = cf.read_manifest(self.cache_dir)
        self.codec = manifest_codec(manifest)
        self.topk = cf.TopKFormat.of_manifest(manifest) if read_topk else None
        # Compact arrays instead of Python objects: cheap to pickle into spawned workers.
        sizes = np.array([len(batch) for batch in plan], dtype=np.int64)
        self._bounds = np.zeros(len(plan) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._bounds[1:])
        flat = [sample for batch in plan for sample in batch]
        self._samples = np.array([(s.shard, s.row, s.length) for s in flat], dtype=np.int64).reshape(-1, 3)
        self._stores: dict[int, _Store] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        """Number of micro-batches this dataset yields (from `start` to the end of the plan)."""
        return len(self._bounds) - 1 - self.start

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_stores"] = {}  # never ship open stores to another process
        return state

    def _store(self, shard: int) -> _Store:
        if self._pid != os.getpid():  # a forked worker: open its own handles
            self._stores, self._pid = {}, os.getpid()
        store = self._stores.get(shard)
        if store is None:
            store = self._stores[shard] = _Store(self.cache_dir, shard, self.codec)
        return store

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for position in range(self.start + worker, len(self._bounds) - 1, workers):
            yield self.batch(position)

    def batch(self, position: int) -> dict[str, Any]:
        """Micro-batch `position` of the plan (random access; iteration uses the same function)."""
        rows = self._samples[self._bounds[position] : self._bounds[position + 1]]
        lengths = rows[:, 2].copy()
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        width = bucket(total, self.bucket_multiple)
        first = self._store(int(rows[0, 0]))
        dim = int(first.features.shape[1])
        shared = get_worker_info() is not None
        columns = int(first.feature_scales.shape[1]) if self.codec.scaled else 0
        stored_dtype = torch.from_numpy(np.zeros(0, self.codec.stored_dtype)).dtype
        features = _empty_tensor((width, dim), stored_dtype, shared)
        feature_bits = features.numpy()  # the same memory, as numpy for zarr to read into
        scales = _empty_tensor((width, columns), torch.float32, shared) if columns else None
        input_ids = np.zeros(width, dtype=np.int32)
        loss_mask = np.zeros(width, dtype=np.uint8)
        topk = None if self.topk is None else (np.zeros((width, self.topk.k), dtype=np.int32),
                                               np.zeros((width, self.topk.k), dtype=np.float16))
        anchors: list[np.ndarray] = []
        for (shard, row, length), begin in zip(rows.tolist(), starts.tolist()):
            store = self._store(shard)
            start, end = store.bounds(row, length, self.cache_dir)
            try:
                _read_into(store.features, start, end, feature_bits[begin : begin + length])
                if scales is not None:
                    _read_into(store.feature_scales, start, end, scales.numpy()[begin : begin + length])
                _read_into(store.input_ids, start, end, input_ids[begin : begin + length])
                _read_into(store.loss_mask, start, end, loss_mask[begin : begin + length])
                if topk is not None:
                    _read_topk(store, row, loss_mask[begin : begin + length], topk[0][begin : begin + length],
                               topk[1][begin : begin + length])
            except Exception as error:  # noqa: BLE001 - a checksum failure or a vanished file
                raise _shard_error(self.cache_dir, shard,
                                   f"could not be read at sample {row} ({type(error).__name__}: {error})") from error
            anchors.append(sample_anchors(loss_mask[begin : begin + length], self.rule, self.seed, self.epoch,
                                          shard, row))
        feature_bits[total:] = 0
        if scales is not None:
            scales.numpy()[total:] = 0
        counts = np.array([len(a) for a in anchors], dtype=np.int64)
        blocks = int(counts.sum())
        num_blocks = bucket(blocks, 8)
        block_anchor = np.zeros(num_blocks, dtype=np.int64)
        block_sequence = np.zeros(num_blocks, dtype=np.int64)
        if blocks:
            block_anchor[:blocks] = np.concatenate(anchors)
            block_sequence[:blocks] = np.repeat(np.arange(len(rows)), counts)
        batch: dict[str, Any] = {
            "features": self.codec.transport(features),
            "input_ids": torch.from_numpy(input_ids).long(),
            "loss_mask": torch.from_numpy(loss_mask).bool(),
            "lengths": torch.from_numpy(lengths),
            "context_starts": torch.from_numpy(starts),
            "block_anchor": torch.from_numpy(block_anchor),
            "block_sequence": torch.from_numpy(block_sequence),
            "block_valid": torch.from_numpy(np.arange(num_blocks) < blocks),
            "sample_keys": torch.from_numpy(rows[:, :2].copy()),
            "position": position,
        }
        if scales is not None:
            batch["feature_scales"] = scales
        if topk is not None:
            batch["topk_ids"], batch["topk_logprobs"] = torch.from_numpy(topk[0]), torch.from_numpy(topk[1])
        return batch


def _read_topk(store: _Store, row: int, loss_mask: np.ndarray, ids_out: np.ndarray, logprobs_out: np.ndarray) -> None:
    """Sample `row`'s stored top-k rows into the rows of its `topk_positions` tokens (the other rows stay 0)."""
    start, end = int(store.topk_offsets[row]), int(store.topk_offsets[row + 1])
    positions = cf.topk_positions(loss_mask, np.array([0, len(loss_mask)]))
    if end - start != int(positions.sum()):
        raise ValueError(f"{end - start} top-k rows for {int(positions.sum())} supervised tokens")
    ids = np.empty((end - start, ids_out.shape[1]), dtype=store.topk_ids.dtype)
    logprobs = np.empty((end - start, logprobs_out.shape[1]), dtype=store.topk_logprobs.dtype)
    _read_into(store.topk_ids, start, end, ids)
    _read_into(store.topk_logprobs, start, end, logprobs)
    ids_out[positions] = ids
    logprobs_out[positions] = logprobs


def split_packed_batch(batch: dict[str, Any], ranges: Sequence[tuple[int, int]],
                       bucket_multiple: int = DEFAULT_BUCKET_MULTIPLE) -> list[dict[str, Any]]:
    """A packed batch from `CacheBatches` cut into the packed batches of the sequence ranges [a, b) (consecutive,
    covering every sequence): the same samples, anchors and order, re-padded to their own buckets."""
    if len(ranges) == 1:
        return [batch]
    lengths, starts = batch["lengths"], batch["context_starts"]
    sequence = batch["block_sequence"]
    valid = batch["block_valid"]
    parts = []
    for a, b in ranges:
        begin, end = int(starts[a]), int(starts[b - 1] + lengths[b - 1])
        width = bucket(end - begin, bucket_multiple)
        chosen = valid & (sequence >= a) & (sequence < b)
        blocks = int(chosen.sum())
        num_blocks = bucket(blocks, 8)

        def padded(values: Tensor, size: int, fill: int = 0) -> Tensor:
            out = torch.full((size, *values.shape[1:]), fill, dtype=values.dtype)
            out[: len(values)] = values
            return out

        part = {
            "features": padded(batch["features"][begin:end], width),
            "input_ids": padded(batch["input_ids"][begin:end], width),
            "loss_mask": padded(batch["loss_mask"][begin:end], width),
            "lengths": lengths[a:b].clone(),
            "context_starts": starts[a:b] - begin,
            "block_anchor": padded(batch["block_anchor"][chosen], num_blocks),
            "block_sequence": padded(sequence[chosen] - a, num_blocks),
            "block_valid": torch.arange(num_blocks) < blocks,
            "sample_keys": batch["sample_keys"][a:b].clone(),
            "position": batch["position"],
        }
        for name in ("feature_scales", "topk_ids", "topk_logprobs"):
            if name in batch:
                part[name] = padded(batch[name][begin:end], width)
        parts.append(part)
    return parts


def sequence_blocks(batch: dict[str, Any]) -> np.ndarray:
    """Blocks per sequence of a packed batch."""
    counts = torch.bincount(batch["block_sequence"][batch["block_valid"]], minlength=len(batch["lengths"]))
    return counts.numpy()


def packed_layout(batch: dict[str, Any], block_size: int) -> PackedLayout:
    """The `PackedLayout` of a packed batch from `CacheBatches` (on the batch's device)."""
    lengths, starts = batch["lengths"], batch["context_starts"]
    width = int(batch["input_ids"].shape[0])
    positions = torch.arange(width, device=lengths.device)
    sequence_of = torch.bucketize(positions, starts[1:], right=True) if len(starts) > 1 else torch.zeros_like(positions)
    inside = positions < (starts[-1] + lengths[-1])
    context_positions = torch.where(inside, positions - starts[sequence_of], torch.zeros_like(positions))
    return PackedLayout(block_anchor=batch["block_anchor"], block_context_start=starts[batch["block_sequence"]],
                        block_valid=batch["block_valid"], context_positions=context_positions, context_len=width,
                        block_size=block_size)


def _block_positions(batch: dict[str, Any], layout: PackedLayout) -> tuple[Tensor, Tensor]:
    """(at [N, Bk]: the flat context position p + k of each block entry, clamped into the axis; inside [N, Bk]:
    whether that position exists in the block's own sequence, for a valid block)."""
    offsets = torch.arange(layout.block_size, device=layout.device)
    ends = (batch["context_starts"] + batch["lengths"])[batch["block_sequence"]]  # one past each block's sequence
    flat = layout.block_context_start[:, None] + layout.block_anchor[:, None] + offsets  # [N, Bk]
    inside = (flat < ends[:, None]) & layout.block_valid[:, None]
    return flat.clamp(max=layout.context_len - 1), inside


def packed_block_labels(batch: dict[str, Any], layout: PackedLayout, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """Labels and block inputs of the DFlash objective for a packed batch: labels [1, N, Bk] long, the token at
    position p + k of the block's own sequence for k >= 1 where that position exists and is supervised, else -100;
    block inputs [1, N, Bk] long, [token at p, MASK, ...] (all MASK for a padding block)."""
    offsets = torch.arange(layout.block_size, device=layout.device)
    at, inside = _block_positions(batch, layout)
    tokens = batch["input_ids"][at]
    keep = inside & batch["loss_mask"][at] & (offsets >= 1)
    labels = torch.where(keep, tokens, torch.full_like(tokens, IGNORE_INDEX))
    block_ids = torch.full_like(tokens, int(mask_token_id))
    block_ids[:, 0] = torch.where(layout.block_valid, tokens[:, 0], torch.full_like(tokens[:, 0], int(mask_token_id)))
    return labels[None], block_ids[None]


def packed_block_topk(batch: dict[str, Any], layout: PackedLayout) -> tuple[Tensor, Tensor] | None:
    """The target's top-k of each label position of a packed batch, taken exactly where `packed_block_labels`
    takes the label (the stored row of position p + k is the target's prediction for the token there): ids
    [1, N, Bk, K] int32 and log-probabilities [1, N, Bk, K] float16 (zeros where nothing is supervised); None for a
    cache without top-k."""
    if "topk_ids" not in batch:
        return None
    at, _ = _block_positions(batch, layout)
    return batch["topk_ids"][at][None], batch["topk_logprobs"][at][None]


# What the main process alone handles: a terminal's Ctrl-C and a scheduler's SIGTERM reach every process of the
# group, and a loader worker that died of one first made torch raise "DataLoader worker exited unexpectedly" / "is
# killed by signal" in the main process, on top of (or instead of) the interrupt: seen for SIGINT in 1 of 6 and for
# SIGTERM in 2 of 3 signals to the group of a training run whose epochs were one step long.
_MAIN_PROCESS_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def start_loader(loader: DataLoader) -> Iterator[Any]:
    """`iter(loader)`, with SIGINT and SIGTERM blocked in this thread while it forks its workers, so that none is
    born able to die of them (`_worker_signals` then sets what they do for good). A signal that arrives meanwhile
    is delivered to this process as soon as they are forked."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_PROCESS_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_loader(batches: Iterator[Any]) -> None:
    """Stop an epoch's loader workers now, from the caller, where an interrupt propagates. Left to the iterator's
    `__del__` (when the next epoch's loader replaced it), a Ctrl-C that came while it joined its workers was
    raised inside `__del__`, where Python reports it as "Exception ignored" and goes on: the run kept training and
    left a worker unreaped (seen in 1 of 5 interrupts of a run whose epochs were one step long). `_shutdown_workers`
    is torch's own method for this (what `__del__` and the end of an epoch call); it does nothing a second time."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _worker_signals(_worker_id: int) -> None:
    """A DataLoader worker's first act: ignore Ctrl-C, and end quietly (exit code 0) on a SIGTERM from anyone
    (torch's own handler does so only when the parent sends it, as it does to stop a worker that does not finish;
    a scheduler's SIGTERM killed the worker, and the main process, which took the same signal, reports it); then
    take the signals it was born with blocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: os._exit(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _MAIN_PROCESS_SIGNALS)


def make_loader(dataset: CacheBatches, num_workers: int, *, prefetch_factor: int = 2,
                pin_memory: bool | None = None, context: str | None = None) -> DataLoader:
    """A DataLoader over `dataset` that yields its micro-batches in plan order.

    Workers are forked by default: zarr-python resets its IO thread and event loop in a forked child
    (`os.register_at_fork` in zarr.core.sync), stores are opened only inside each worker (never inherited), and
    fork starts a worker at once where spawn re-imports torch and zarr in every worker of every epoch
    (persistent_workers is off because each epoch has its own plan), and the parent's plan is shared, not
    pickled. Fork is PyTorch's default on Linux and fine with CUDA initialised in the parent, as the workers never
    touch CUDA.

    Measured here (2 workers, per epoch): fork 0.15-0.4 s to the first batch, forkserver 2.2 s the first time
    (0.25 s later, with torch/zarr preloaded), spawn 4.5 s every epoch. `context="forkserver"` is the choice for a
    parent that runs threads which may hold locks at fork time; it needs the usual `if __name__ == "__main__"`
    guard in the launching script.

    Memory in flight: num_workers * prefetch_factor micro-batches of about batch_tokens * D * 2 bytes each, in
    shared memory (/dev/shm must hold them: containers often default to 64 MB).

    Default context: fork, except for a cache in object storage (shared/object_store.py): obstore's I/O runtime
    lives in threads of the parent, which a forked child does not have (its first read would wait forever), so
    workers then come from a forkserver, which has never touched the bucket.
    """
    if context is None:
        context = "forkserver" if is_mirror(dataset.cache_dir) else "fork"
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    options: dict[str, Any] = {"batch_size": None, "num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        import multiprocessing

        mp_context = multiprocessing.get_context(context)
        if context == "forkserver":
            mp_context.set_forkserver_preload(["torch", "zarr", __name__])
        options.update(persistent_workers=False, prefetch_factor=prefetch_factor, multiprocessing_context=mp_context,
                       worker_init_fn=_worker_signals)
    if "in_order" in inspect.signature(DataLoader).parameters:
        options["in_order"] = True  # the default; plan order depends on it
    return DataLoader(dataset, **options)


# ------------------------------------------------------------------------------------------------- eval


class EvalSet:
    """The validation (or test) samples of an index, readable one by one (in split-hash order, see
    `CacheIndex.eval`)."""

    def __init__(self, index: CacheIndex, split: str = "validation") -> None:
        self.cache_dir = index.cache_dir
        self.samples = index.split(split)
        self.codec = index.codec
        self._stores: dict[int, _Store] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """features bf16 [S, D], input_ids long [S], loss_mask bool [S], length, sample_key (shard, row),
        sample_index (position in the dataset) and sample_id."""
        sample = self.samples[i]
        store = self._stores.get(sample.shard)
        if store is None:
            store = self._stores[sample.shard] = _Store(self.cache_dir, sample.shard, self.codec)
        start, end = store.bounds(sample.row, sample.length, self.cache_dir)
        try:
            features = np.asarray(store.features[start:end])
            scales = None if store.feature_scales is None else np.asarray(store.feature_scales[start:end])
            input_ids = np.asarray(store.input_ids[start:end])
            loss_mask = np.asarray(store.loss_mask[start:end])
            sample_index, sample_id = store.sample_meta(sample.row)
        except Exception as error:  # noqa: BLE001
            raise _shard_error(self.cache_dir, sample.shard, f"could not be read at sample {sample.row} "
                               f"({type(error).__name__}: {error})") from error
        return {
            "features": store.reader.codec.decode_numpy(features, scales),
            "input_ids": torch.from_numpy(input_ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
            "length": sample.length,
            "sample_key": (sample.shard, sample.row),
            "sample_index": sample_index,
            "sample_id": sample_id,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]


def eval_sequences(index: CacheIndex, limit: int | None = None, split: str = "validation",
                   ) -> Iterator[dict[str, Any]]:
    """The first `limit` (all when None) samples of the validation (or test) split, one dict at a time (see
    `EvalSet.__getitem__`)."""
    eval_set = EvalSet(index, split)
    count = len(eval_set) if limit is None else min(int(limit), len(eval_set))
    for i in range(count):
        yield eval_set[i]
