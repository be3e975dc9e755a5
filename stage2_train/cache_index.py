"""The training view of a feature cache: every usable sample of its finished shards, and its three splits.

`CacheIndex.from_cache` reads the manifest and, of every finished shard, only the small arrays (offsets, loss_mask,
sample_index), checked against the manifest; no features are read. Each kept sample is a `Sample(shard, row,
length, n_anchor_candidates)`; a sample without a single anchor candidate is dropped (and counted).

`split_hash`, a hash of (seed, sample_index) in [0, 1), splits the samples: below `eval_fraction` the validation
split (periodic evaluation, the choice of export_best/), the next `test_fraction` the test split (evaluated once,
at the end), the rest training; with `train_fraction` < 1 only that fraction of the rest, by the same hash (the
lowest keys), so a smaller fraction is a uniform random subset of a larger one and both are evaluated on the same
validation and test splits: a data-size question asked on one cache. It depends on the seed and on each sample's
position in the dataset only, never on the number of shards, their order or which of them are finished; a test
split leaves the validation split as it is without one.

`ShardStore` opens one shard to read samples back (the packed batches, the evaluation set); `shard_error` is the one
line that names a damaged shard and the command that repairs it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dflash.shared import cache_format as cf
from dflash.shared.cache_format import CacheError
from dflash.shared.feature_codecs import FeatureCodec, manifest_codec
from dflash.shared.logs import get_logger
from dflash.shared.object_store import shard_source

log = get_logger(__name__)

# Distinct tags keep the random streams of the data apart for one seed: the split (here), the epoch plan and the
# anchors (epoch_plan.py).
SPLIT_STREAM = 0x73706C74  # "splt"
PLAN_STREAM = 0x706C616E  # "plan"
ANCHOR_STREAM = 0x616E6368  # "anch"


class Sample(NamedTuple):
    """One cached sample: store `shard`, sample `row` inside it, its token `length`, and how many anchor
    positions it offers (p with loss_mask[p] == loss_mask[p + 1] == 1)."""

    shard: int
    row: int
    length: int
    n_anchor_candidates: int


def shard_error(cache_dir: Path, shard: int, problem: str) -> CacheError:
    """The error for a damaged or changed shard: which one, its store, the problem, and how to repair it."""
    return CacheError(f"shard {shard} ({cf.shard_path(cache_dir, shard)}) {problem}; re-extract it with "
                      f"`{cf.repair_command(cache_dir)}`")


def check_seed(seed: int) -> int:
    """`seed` as an int; a negative one is refused (the RNGs and hashes of the data take seeds >= 0)."""
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
    """Uniform floats in [0, 1) per sample: the split and the order of the validation and test samples.

    Keyed by the sample's position in the loaded dataset (`sample_index`, unique in a cache) and the seed only, so
    the split does not depend on the number of shards, their order, or which shards are finished."""
    key = _splitmix64(np.array([check_seed(seed) ^ SPLIT_STREAM], dtype=np.uint64))[0]
    mixed = _splitmix64(sample_index.astype(np.int64).view(np.uint64) ^ key)
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p of one sample with loss_mask[p] == 1 and loss_mask[p + 1] == 1 (so p + 1 < length)."""
    mask = np.asarray(loss_mask).astype(bool, copy=False)
    return np.flatnonzero(mask[:-1] & mask[1:])


def candidate_counts(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`len(anchor_candidates(...))` of every sample of a shard (vectorised over the flat token arrays)."""
    mask = loss_mask.astype(bool, copy=False)
    pair = np.zeros(len(mask), dtype=bool)
    pair[:-1] = mask[:-1] & mask[1:]
    ends = offsets[1:][offsets[1:] > offsets[:-1]] - 1
    pair[ends] = False  # the last token of a sample has no successor inside it
    cumulative = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(pair, out=cumulative[1:])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


@dataclass
class CacheIndex:
    """Every usable sample of the finished shards of a cache, and the split each belongs to. No features are read.

    Arrays (one entry per kept sample, in (shard, row) order): `shards`, `rows`, `lengths`, `candidates` (anchor
    candidates), `split_key` (`split_hash`, in [0, 1)), `is_eval` (validation split), `is_test` (test split).
    """

    cache_dir: Path
    manifest: dict[str, Any]
    done_shards: tuple[int, ...]
    unfinished_shards: tuple[int, ...]
    shards: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    candidates: np.ndarray
    split_key: np.ndarray
    is_eval: np.ndarray
    is_test: np.ndarray
    dropped_no_anchor: int
    dropped_tokens: int
    is_unused: np.ndarray  # left out of training by a train_fraction < 1

    @classmethod
    def from_cache(cls, cache_dir: Path | str, eval_fraction: float = 0.05, seed: int = 0,
                   test_fraction: float = 0.0, train_fraction: float = 1.0) -> CacheIndex:
        cache_dir = Path(cache_dir).resolve()
        if not (0.0 <= eval_fraction and 0.0 <= test_fraction and eval_fraction + test_fraction <= 1.0):
            raise ValueError(f"eval_fraction {eval_fraction} and test_fraction {test_fraction} must be >= 0 with a "
                             "sum <= 1")
        if not 0.0 < train_fraction <= 1.0:
            raise ValueError(f"train_fraction {train_fraction} must be in (0, 1]")
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
        held_out = eval_fraction + test_fraction
        is_unused = split_key >= held_out + train_fraction * (1.0 - held_out) if train_fraction < 1.0 \
            else np.zeros_like(is_eval)
        return cls(cache_dir=cache_dir, manifest=manifest, done_shards=done, unfinished_shards=unfinished,
                   shards=joined["shards"], rows=joined["rows"], lengths=joined["lengths"],
                   candidates=joined["candidates"], split_key=split_key, is_eval=is_eval, is_test=is_test,
                   dropped_no_anchor=dropped, dropped_tokens=dropped_tokens, is_unused=is_unused)

    @property
    def codec(self) -> FeatureCodec:
        """How the cache stores its features (from its manifest)."""
        return manifest_codec(self.manifest)

    def _samples(self, positions: np.ndarray) -> list[Sample]:
        return [Sample(int(s), int(r), int(n), int(c)) for s, r, n, c in zip(
            self.shards[positions], self.rows[positions], self.lengths[positions], self.candidates[positions])]

    @property
    def is_train(self) -> np.ndarray:
        return ~(self.is_eval | self.is_test | self.is_unused)

    @cached_property
    def train(self) -> list[Sample]:
        """Training samples in (shard, row) order."""
        return self._samples(np.flatnonzero(self.is_train))

    def _in_hash_order(self, mask: np.ndarray) -> list[Sample]:
        positions = np.flatnonzero(mask)
        return self._samples(positions[np.argsort(self.split_key[positions], kind="stable")])

    @cached_property
    def eval(self) -> list[Sample]:
        """Validation samples in split-hash order: any prefix is a uniform random subset of the split."""
        return self._in_hash_order(self.is_eval)

    @cached_property
    def test(self) -> list[Sample]:
        """Test samples in split-hash order."""
        return self._in_hash_order(self.is_test)

    def split(self, name: str) -> list[Sample]:
        """The samples of split `name`: "validation" or "test"."""
        if name not in ("validation", "test"):
            raise ValueError(f"split must be 'validation' or 'test', got {name!r}")
        return self.eval if name == "validation" else self.test


def _scan_shard(cache_dir: Path, shard: int, entry: dict[str, Any], feature_dim: int, codec: FeatureCodec,
                topk: cf.TopKFormat | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, anchor-candidate counts, sample_index) of one finished shard, checked against the manifest."""
    path = shard_source(cache_dir, shard)
    if isinstance(path, Path) and not path.is_dir():
        raise shard_error(cache_dir, shard, "is marked done in the manifest but its store is missing")
    try:
        reader = cf.ShardReader(path, codec)
        group = reader.group
        offsets = reader.offsets
        loss_mask = np.asarray(group["loss_mask"][:])
        sample_index = np.asarray(group["sample_index"][:], dtype=np.int64)
        ids_shape = tuple(group["input_ids"].shape)
        features_shape = tuple(reader.features.shape)
    except CacheError as error:
        raise shard_error(cache_dir, shard, f"cannot be read ({error})") from error
    except Exception as error:  # noqa: BLE001 - checksum failures, missing arrays, bad metadata: all damage
        raise shard_error(cache_dir, shard, f"cannot be read ({type(error).__name__}: {error})") from error
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
        raise shard_error(cache_dir, shard, "does not match the manifest: " + "; ".join(problems))
    return offsets, candidate_counts(loss_mask, offsets), sample_index


# What one process may hold of side arrays read whole (`ShardStore`'s `hold_side_arrays`): each loader worker and,
# while the next epoch's loader starts ahead, two of them at a time; what does not fit is read sample by sample.
SIDE_ARRAYS_BUDGET_BYTES = 512 << 20
_side_bytes_held = [0]  # this process's, counted by the stores that hold theirs and released when they are freed


def _release_side_bytes(size: int) -> None:
    _side_bytes_held[0] -= size


def side_array_bytes(tokens: int, codec: FeatureCodec, num_layers: int) -> int:
    """The bytes of a store's per-token side arrays: int32 ids, uint8 loss mask, and a scaled codec's float32 scales."""
    return tokens * (4 + 1 + 4 * codec.scale_columns(num_layers))


class ShardStore:
    """One shard store opened read-only, with its array handles (opening an array re-reads its metadata).

    With ``hold_side_arrays`` (the training loader) the per-token side arrays (`input_ids`, `loss_mask` and a scaled
    codec's `feature_scales`: 25 bytes a token for fp8 over 5 layers, under 1 % of the features) are read whole when
    the store opens and kept as numpy arrays, as far as this process's SIDE_ARRAYS_BUDGET_BYTES allows; otherwise
    they stay zarr arrays read sample by sample, as the features and the top-k always are. Why: a zarr read costs
    ~0.3 ms however small (zarr 3.1 on 2 CPU cores), and the cache's side arrays have chunks of up to 2^18-2^20
    rows, so a sample's read of them passes through whole 1-5 MB chunks: on the one-shard cache of the four-times
    data (13 M tokens) 1.7 ms a sample, against 0.002 ms sliced from memory (docs/benchmarks.md, "The loader's
    reads")."""

    def __init__(self, cache_dir: Path, shard: int, codec: FeatureCodec, hold_side_arrays: bool = False) -> None:
        self.shard = shard
        try:
            reader = cf.ShardReader(shard_source(cache_dir, shard), codec)
            self.reader = reader
            self.offsets = reader.offsets
            self.features = reader.features
            self.feature_scales: Any = reader.feature_scales  # scaled codecs (fp8) only
            self.input_ids: Any = reader.group["input_ids"]
            self.loss_mask: Any = reader.group["loss_mask"]
            self.topk_ids, self.topk_logprobs = reader.topk_ids, reader.topk_logprobs  # a cache with top-k only
            self.topk_offsets = reader.topk_offsets
            self.group = reader.group
            if hold_side_arrays:
                self._hold_side_arrays()
        except Exception as error:  # noqa: BLE001
            raise shard_error(cache_dir, shard, f"cannot be opened ({error})") from error
        self._sample_index: np.ndarray | None = None
        self._sample_ids: np.ndarray | None = None

    def _hold_side_arrays(self) -> None:
        """Read the side arrays whole, if this process's budget has room for them."""
        arrays = [a for a in (self.input_ids, self.loss_mask, self.feature_scales) if a is not None]
        size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)
        if _side_bytes_held[0] + size > SIDE_ARRAYS_BUDGET_BYTES:
            return
        held = {}
        for name in ("input_ids", "loss_mask", "feature_scales"):
            array = getattr(self, name)
            try:
                held[name] = None if array is None else np.asarray(array[:])
            except MemoryError:  # the machine's memory ran short (the budget is this process's): sample by sample
                return
            except Exception as error:  # noqa: BLE001 - a checksum failure, a vanished chunk: name the array
                raise ValueError(f"its {name} could not be read ({type(error).__name__}: {error})") from error
        for name, array in held.items():
            setattr(self, name, array)
        _side_bytes_held[0] += size
        weakref.finalize(self, _release_side_bytes, size)

    def sample_meta(self, row: int) -> tuple[int, str]:
        """(sample_index, sample_id) of a row (both arrays read once per store)."""
        if self._sample_index is None or self._sample_ids is None:
            self._sample_index = np.asarray(self.group["sample_index"][:], dtype=np.int64)
            self._sample_ids = np.asarray(self.group["sample_id"][:])
        return int(self._sample_index[row]), str(self._sample_ids[row])

    def bounds(self, row: int, length: int | None, cache_dir: Path) -> tuple[int, int]:
        """Where sample `row` lies in the store's token arrays, checked against the index's `length`."""
        if not 0 <= row < len(self.offsets) - 1:
            raise shard_error(cache_dir, self.shard, f"has no sample {row}: it changed since the index was built")
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if length is not None and end - start != length:
            raise shard_error(cache_dir, self.shard,
                              f"sample {row} has {end - start} tokens, the index says {length}: the store changed "
                              "since the index was built")
        return start, end
