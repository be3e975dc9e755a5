"""The dflash feature cache: directory layout, manifest, and the per-shard Zarr v3 stores.

This file is the single definition of the format (docs/cache-format.md describes it for readers who do not
use dflash). Layout of a cache directory:

    manifest.json          format version, identity of what was extracted, per-shard status and counts
    manifest.json.lock     lock held while the manifest is updated (read-modify-write)
    extract.log            log of every extract run into this cache (appended)
    target/                what stage 2 needs from the target: config.json, generation_config.json, tokenizer
                           files, embeddings.safetensors (embed_tokens.weight, lm_head.weight); nothing more
    shards/shard-00000.zarr  one Zarr v3 group per data shard, written by one process, published atomically
    status/                run.json (the supervising process) and worker-K.json heartbeats for `dflash status`
    locks/                 one lock file per shard, held by the run that is extracting it; cache.lock, held shared
                           by every extract run while it runs (`CacheHold`)

A shard store holds samples back to back (no padding):
    features     [tokens, n_layers * hidden], stored as its codec says (shared/feature_codecs.py; zarr has no
                 bf16 or fp8 type, so the attribute logical_dtype names it): "bf16" uint16 holding bfloat16 bits;
                 "fp8" uint8 holding float8_e4m3fn bits, and beside it
    feature_scales [tokens, n_layers] float32 (scaled codecs only): value = fp8 * scale, per token and layer.
                 Layer blocks are in the order of manifest["layer_ids"], each `hidden` wide.
    input_ids    [tokens] int32
    loss_mask    [tokens] uint8 (1 = an assistant token the drafter learns to predict)
    offsets      [samples + 1] int64: sample i is rows offsets[i]:offsets[i+1]
    sample_index [samples] int64: position of the sample in the loaded dataset
    sample_id    [samples] string: the dataset's own id of the sample
and, only in a cache extracted with `--store-target-topk K` (the manifest's identity.target_topk, `TopKFormat`):
    target_topk_ids      [rows, K] uint16 (every id < 65536) or int32: the target's K most likely next tokens
    target_topk_logprobs [rows, K] float16: their log-probabilities under the target's full softmax
    target_topk_offsets  [samples + 1] int64: sample i is rows target_topk_offsets[i]:target_topk_offsets[i+1]
    Row r is the r-th token t with a top-k (`topk_positions`: loss_mask[t] == 1 and t is not its sample's first
    token), and holds the distribution the target predicted FOR that token (its logits at t - 1): the label the
    drafter learns at t is input_ids[t], and the top-k of that label position is row r. Sorted by log-probability,
    ties by id.
Chunks hold full rows (about 2 MB); the v3 sharding codec groups ~64 MB of chunks per file; every chunk and
every shard index carries a crc32c checksum.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.shared.errors import UserError
from dflash.shared.feature_codecs import SCALES_ARRAY, FeatureCodec, logical_codec

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TARGET_DIR = "target"
SHARDS_DIR = "shards"
STATUS_DIR = "status"
LOCKS_DIR = "locks"
CACHE_LOCK_FILE = "cache.lock"  # in locks/: see `CacheHold`
LOG_FILE = "extract.log"
EMBEDDINGS_FILE = "embeddings.safetensors"
TARGET_RECORD_FILE = "dflash_target.json"  # in target/: stop token ids, embedding scale, model type
# In target/ of caches made before 2026-12-07 with `dflash extract --export-layers` (removed with `dflash train
# --init-from-target`: it trained worse, docs/benchmarks.md): nothing reads it, so a mirror does not fetch it.
RETIRED_TARGET_FILES = ("decoder_layers.safetensors",)
# Everything a cache directory may hold (anything else: the folder is not a cache; extract will not write there).
CACHE_ENTRIES = (MANIFEST_FILE, MANIFEST_FILE + ".lock", LOG_FILE, TARGET_DIR, SHARDS_DIR, STATUS_DIR, LOCKS_DIR)

CHUNK_TARGET_BYTES = 2 << 20
SHARD_TARGET_BYTES = 64 << 20

# What must be equal for two extract runs to write into the same cache.
IDENTITY_KEYS = (
    "target_source",
    "target_hash",
    "layer_ids",
    "hidden_size",
    "feature_dtype",
    "tokenizer_hash",
    "data_fingerprint",
    "max_length",
    "overlength",
    "num_shards",
    "target_topk",  # TopKFormat.record() or None
)

# The manifest's record of the options of the run that made the cache (what `dflash extract --repair` reruns).
OPTIONS_KEY = "options"
# The manifest's record of how the cache's prompts were rendered (`chat_rendering.rendering_record`: chat template
# sha256 and arguments, thinking mode, special and stop tokens, vocabulary, a probe prompt): what `dflash eval`
# checks its own prompts against. Absent in caches made before it was recorded (unknown, not wrong).
RENDERING_KEY = "rendering"
# In a done shard's manifest entry that kept no sample: the token lengths of its conversations that were longer
# than --max-length, sorted (what the error about an empty cache quotes).
SKIPPED_LENGTHS_KEY = "skipped_lengths"

SHARD_PENDING, SHARD_RUNNING, SHARD_DONE, SHARD_FAILED = "pending", "running", "done", "failed"


class CacheError(UserError):
    """The cache is missing, from another format version, or does not match what was asked."""


def repair_command(cache: Path | str) -> str:
    """The command that redoes a cache's damaged shards, as every message about one names it (safe to run as
    printed: it reads the original options from the manifest and touches no healthy shard)."""
    return f"dflash extract --repair --out {cache}"


def unfinished_shards(manifest: dict[str, Any]) -> dict[str, list[int]]:
    """The shards not done, by status (pending, running, failed), in order."""
    unfinished: dict[str, list[int]] = {}
    for key, entry in sorted(manifest["shards"].items(), key=lambda item: int(item[0])):
        status = entry.get("status", SHARD_PENDING)
        if status != SHARD_DONE:
            unfinished.setdefault(status, []).append(int(key))
    return unfinished


def finish_advice(location: Path | str, unfinished: dict[str, list[int]]) -> str:
    """How to finish a cache's unfinished shards (what `inspect` and `train` print)."""
    counts = ", ".join(f"{len(shards)} {status} {shards}" for status, shards in sorted(unfinished.items()))
    running = (f"; if an extract is still running into it, wait for it (`dflash status --cache {location}`)"
               if SHARD_RUNNING in unfinished else "")
    return (f"{sum(map(len, unfinished.values()))} shard(s) not finished ({counts}): finish them with "
            f"`{repair_command(location)}` (or rerun the extract command that made it){running}")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.zarr"


def shard_path(cache_dir: Path, index: int) -> Path:
    return cache_dir / SHARDS_DIR / shard_name(index)


# ----------------------------------------------------------------------------------------------- manifest


def read_manifest(cache_dir: Path) -> dict[str, Any]:
    path = cache_dir / MANIFEST_FILE
    if not path.is_file():
        raise CacheError(f"{cache_dir} is not a dflash cache: {MANIFEST_FILE} not found (run `dflash extract` first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CacheError(
            f"{path} is not valid JSON ({error}); restore it or re-extract with `dflash extract --overwrite`"
        ) from error
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CacheError(
            f"{path} has format version {version!r}; this dflash reads version {FORMAT_VERSION}: upgrade dflash"
        )
    # Format version 1 gained these keys after its first caches were written; their absence means no top-k is
    # stored and the run's options were not recorded (then `--repair` cannot redo a shard).
    manifest["identity"].setdefault("target_topk", None)
    manifest.setdefault(OPTIONS_KEY, None)
    return manifest


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a temporary file, fsync it, then rename over `path` (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@contextmanager
def manifest_lock(cache_dir: Path, timeout: float = 60.0) -> Iterator[None]:
    from filelock import FileLock

    with FileLock(str(cache_dir / (MANIFEST_FILE + ".lock")), timeout=timeout):
        yield


def update_manifest(cache_dir: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read-modify-write the manifest under its lock; returns the new manifest."""
    with manifest_lock(cache_dir):
        manifest = read_manifest(cache_dir)
        change(manifest)
        manifest["updated"] = time.time()
        write_json_atomic(cache_dir / MANIFEST_FILE, manifest)
        return manifest


def new_manifest(identity: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    num_shards = int(identity["num_shards"])
    return {
        "format_version": FORMAT_VERSION,
        "created": time.time(),
        "identity": identity,
        **extra,
        "shards": {str(i): {"status": SHARD_PENDING} for i in range(num_shards)},
    }


def identity_mismatch(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two identities (empty when the caches are compatible)."""
    return [
        f"{key}: cache has {old.get(key)!r}, this run has {new.get(key)!r}"
        for key in IDENTITY_KEYS
        if old.get(key) != new.get(key)
    ]


class CacheHold:
    """A running `dflash extract` holds its cache shared (flock LOCK_SH on locks/cache.lock) from start to end, so
    every run that holds a shard holds the cache too; discarding the cache (`--overwrite` with other settings) needs
    it alone (`take_alone`), so it never deletes what another run is writing. flock itself, not filelock: filelock's
    locks are exclusive only. The hold ends with the process (the kernel drops the lock), so a killed run leaves
    nothing stale behind."""

    def __init__(self, cache_dir: Path) -> None:
        import fcntl

        folder = cache_dir / LOCKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / CACHE_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # waits only while another run discards the cache (seconds)

    def take_alone(self) -> bool:
        """Hold the cache alone if no other process holds it (True), else False (and hold it no longer: a
        failed conversion drops the shared lock, and the caller refuses)."""
        import fcntl

        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def share(self) -> None:
        """Back to a shared hold (after discarding)."""
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor releases its flock


# ------------------------------------------------------------------------------------- target top-k

TOPK_IDS, TOPK_LOGPROBS, TOPK_OFFSETS = "target_topk_ids", "target_topk_logprobs", "target_topk_offsets"
# Log-probabilities are stored as float16: a plain zarr dtype, and 3 more mantissa bits than bf16 (at log p = -10
# the step is 2**-7, so p is kept to 0.4 %); values below float16's range are clamped to its lowest (p ~ 0).
TOPK_LOGPROB_DTYPE = "float16"


@dataclass(frozen=True)
class TopKFormat:
    """How a cache stores the target's top-k next-token distribution (`dflash extract --store-target-topk K`):
    K ids (uint16 when the vocabulary fits, else int32) and K float16 log-probabilities per supervised token.
    Recorded in the manifest's identity as `record()`; caches without it have None."""

    k: int
    ids_dtype: str
    logprobs_dtype: str = TOPK_LOGPROB_DTYPE

    @staticmethod
    def for_vocab(k: int, vocab_size: int) -> TopKFormat:
        if not 1 <= k <= vocab_size:
            raise UserError(f"--store-target-topk {k}: choose K between 1 and the target's vocabulary size "
                            f"({vocab_size})")
        return TopKFormat(int(k), "uint16" if vocab_size <= 1 << 16 else "int32")

    @staticmethod
    def from_record(record: dict[str, Any] | None) -> TopKFormat | None:
        return None if not record else TopKFormat(int(record["k"]), str(record["ids_dtype"]),
                                                  str(record["logprobs_dtype"]))

    @staticmethod
    def of_manifest(manifest: dict[str, Any]) -> TopKFormat | None:
        return TopKFormat.from_record(manifest["identity"]["target_topk"])

    def record(self) -> dict[str, Any]:
        return {"k": self.k, "ids_dtype": self.ids_dtype, "logprobs_dtype": self.logprobs_dtype}

    @property
    def row_bytes(self) -> int:
        """Bytes one supervised token's top-k takes in the cache."""
        return self.k * (np.dtype(self.ids_dtype).itemsize + np.dtype(self.logprobs_dtype).itemsize)


def topk_positions(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """bool [tokens]: the tokens of a shard (samples back to back, `offsets`) that have a top-k row: supervised
    (loss_mask == 1) and not the first token of their sample (nothing predicts that one). Every label the drafter
    learns is such a token."""
    positions = np.asarray(loss_mask).astype(bool, copy=True)
    starts = np.asarray(offsets[:-1])[np.diff(offsets) > 0]
    positions[starts] = False
    return positions


def topk_offsets(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """int64 [samples + 1]: sample i's top-k rows are topk_offsets[i]:topk_offsets[i + 1]."""
    cumulative = np.zeros(len(loss_mask) + 1, dtype=np.int64)
    np.cumsum(topk_positions(loss_mask, offsets), out=cumulative[1:])
    return cumulative[np.asarray(offsets, dtype=np.int64)]


# ----------------------------------------------------------------------------------------- store layout


@dataclass(frozen=True)
class StoreLayout:
    """Chunk and shard sizes (in rows) for a feature array of `feature_dim` columns of `itemsize` bytes."""

    chunk_rows: int
    shard_rows: int

    @staticmethod
    def for_feature_dim(feature_dim: int, itemsize: int = 2) -> StoreLayout:
        row_bytes = feature_dim * itemsize
        chunk_rows = 2 ** max(0, round(math.log2(max(1.0, CHUNK_TARGET_BYTES / row_bytes))))
        chunks_per_shard = max(1, round(SHARD_TARGET_BYTES / (chunk_rows * row_bytes)))
        return StoreLayout(chunk_rows=chunk_rows, shard_rows=chunk_rows * chunks_per_shard)


def create_shard_store(
    path: Path,
    *,
    feature_dim: int,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    offsets: np.ndarray,
    sample_index: np.ndarray,
    sample_ids: list[str],
    attributes: dict[str, Any],
    codec: FeatureCodec,
    num_layers: int = 1,
    topk: TopKFormat | None = None,
) -> Any:
    """Create a shard store whose token-level arrays are written now and whose features (and, for a scaled codec,
    their scales: the array `feature_scales`, filled with `write_feature_scales`; with `topk`, the arrays
    `target_topk_ids` and `target_topk_logprobs`) are filled later. Returns the zarr group."""
    import zarr
    from zarr.codecs import Crc32cCodec

    num_tokens = int(offsets[-1]) if len(offsets) else 0
    stored = codec.stored_dtype
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    group.attrs.update({**attributes, "format_version": FORMAT_VERSION, "complete": False})

    def sharded(name: str, rows: int, width: int, dtype: Any, **extra: Any) -> None:
        """A 2-D array of full-row chunks of ~2 MB in ~64 MB shard files (`zarr_shard_file` writes them)."""
        rows_layout = StoreLayout.for_feature_dim(width, np.dtype(dtype).itemsize)
        group.create_array(name, shape=(rows, width), dtype=dtype, chunks=(rows_layout.chunk_rows, width),
                           shards=(rows_layout.shard_rows, width), compressors=[Crc32cCodec()], fill_value=0,
                           **extra)

    sharded("features", num_tokens, feature_dim, stored, attributes={"logical_dtype": codec.logical_dtype})
    if codec.scaled:
        columns = codec.scale_columns(num_layers)
        group.create_array(SCALES_ARRAY, shape=(num_tokens, columns), dtype="float32",
                           chunks=(max(1, min(num_tokens, 1 << 18)), columns), compressors=[Crc32cCodec()],
                           fill_value=0.0)

    def small(name: str, values: np.ndarray) -> None:
        array = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(max(1, min(len(values), 1 << 20)),),
            compressors=[Crc32cCodec()],
        )
        if len(values):
            array[:] = values

    small("input_ids", input_ids.astype(np.int32))
    small("loss_mask", loss_mask.astype(np.uint8))
    small("offsets", offsets.astype(np.int64))
    small("sample_index", sample_index.astype(np.int64))
    ids = group.create_array("sample_id", shape=(len(sample_ids),), dtype=str, chunks=(max(1, len(sample_ids)),))
    if sample_ids:
        ids[:] = np.array(sample_ids, dtype=object)
    if topk is not None:
        rows = topk_offsets(loss_mask, offsets)
        small(TOPK_OFFSETS, rows)
        sharded(TOPK_IDS, int(rows[-1]), topk.k, topk.ids_dtype)
        sharded(TOPK_LOGPROBS, int(rows[-1]), topk.k, topk.logprobs_dtype)
    return group


def feature_file_problems(store: Path, features: Any) -> list[str]:
    """A cheap structural check of a sharded 2-D array of `store` (`features`, or a top-k array): every shard
    file exists with the exact size its uncompressed layout implies (inner chunks + 4-byte crc each, then the
    shard index), using the chunk and shard shapes recorded in the array's metadata. Catches truncated, missing or
    swapped files without reading them; `dflash inspect --verify` reads everything."""
    num_rows, feature_dim = (int(x) for x in features.shape)
    chunk_rows, shard_rows = int(features.chunks[0]), int(features.shards[0])
    chunk_bytes = chunk_rows * feature_dim * features.dtype.itemsize + 4
    index_bytes = (shard_rows // chunk_rows) * 16 + 4
    problems = []
    for k in range(-(-num_rows // shard_rows)):
        rows = min(shard_rows, num_rows - k * shard_rows)
        expected = -(-rows // chunk_rows) * chunk_bytes + index_bytes
        path = store / features.basename / "c" / str(k) / "0"
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size} bytes"
            problems.append(f"feature file {path.relative_to(store)} is {found}, expected {expected} bytes")
    return problems


def store_file_problems(store: Path, reader: ShardReader) -> list[str]:
    """`feature_file_problems` for every sharded array of a local store (the features and any top-k arrays)."""
    arrays = [reader.features] + ([reader.topk_ids, reader.topk_logprobs] if reader.topk_ids is not None else [])
    return [problem for array in arrays for problem in feature_file_problems(store, array)]


def write_feature_scales(path: Path, scales: np.ndarray) -> None:
    """Fill the `feature_scales` array of a scaled codec's store (small: 4 bytes per token and layer)."""
    import zarr

    array = zarr.open_group(str(path), mode="r+", zarr_format=3)[SCALES_ARRAY]
    if len(scales):
        array[:] = scales


def mark_store_complete(path: Path, stats: dict[str, Any]) -> None:
    import zarr

    group = zarr.open_group(str(path), mode="r+", zarr_format=3)
    group.attrs.update({"complete": True, **stats})


def fsync_tree(path: Path) -> None:
    """fsync every file and folder below `path`, so a rename that publishes it is durable."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------ reading


class ShardReader:
    """Read-only access to one published shard store (open it inside each DataLoader worker): a folder, or a
    zarr store (`object_store.shard_source`). `codec`: the cache's (from its manifest); the store's own record
    of its feature dtype must agree with it. Without one, the store's record is used."""

    def __init__(self, path: Path | Any, codec: FeatureCodec | None = None) -> None:
        import zarr

        self.path = path
        try:
            self.group = zarr.open_group(str(path) if isinstance(path, Path) else path, mode="r", zarr_format=3)
        except Exception as error:  # noqa: BLE001 - any failure to open means a damaged store
            raise CacheError(f"cannot open shard store {path}: {error}") from error
        if not self.group.attrs.get("complete", False):
            raise CacheError(f"shard store {path} is incomplete")
        self.offsets = np.asarray(self.group["offsets"][:], dtype=np.int64)
        self.features = self.group["features"]
        recorded = self.features.attrs.get("logical_dtype", "bfloat16")
        try:
            self.codec = logical_codec(recorded)
        except ValueError as error:
            raise CacheError(f"shard store {path}: {error}") from error
        if codec is not None and codec.name != self.codec.name:
            raise CacheError(f"shard store {path} holds {self.codec.name} features, its cache's manifest says "
                             f"{codec.name}: the cache mixes two extractions (re-extract it)")
        self.feature_scales = self.group[SCALES_ARRAY] if SCALES_ARRAY in self.group else None
        members = set(self.group.array_keys())
        has_topk = {TOPK_IDS, TOPK_LOGPROBS, TOPK_OFFSETS} <= members
        self.topk_ids = self.group[TOPK_IDS] if has_topk else None
        self.topk_logprobs = self.group[TOPK_LOGPROBS] if has_topk else None
        self.topk_offsets = np.asarray(self.group[TOPK_OFFSETS][:], dtype=np.int64) if has_topk else None

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def sample_tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return (
            np.asarray(self.group["input_ids"][start:end]),
            np.asarray(self.group["loss_mask"][start:end]),
        )

    def scales_problem(self) -> str | None:
        """What is wrong with a scaled store's `feature_scales` (absent, or not one row per token and a layer count
        that divides the feature width); None when sound or when the codec has no scales."""
        if not self.codec.scaled:
            return None
        tokens, width = (int(x) for x in self.features.shape)
        scales = self.feature_scales
        if scales is None or int(scales.shape[0]) != tokens or not int(scales.shape[1]) or width % int(scales.shape[1]):
            return f"its {self.codec.name} features need {SCALES_ARRAY} of shape ({tokens}, layers)"
        return None

    @property
    def topk_format(self) -> TopKFormat | None:
        """The top-k this store holds (from its arrays), or None."""
        if self.topk_ids is None or self.topk_logprobs is None:
            return None
        return TopKFormat(int(self.topk_ids.shape[1]), str(self.topk_ids.dtype), str(self.topk_logprobs.dtype))

    def topk_problem(self, expected: TopKFormat | None) -> str | None:
        """What is wrong with the store's top-k arrays against the cache's manifest (`expected`): absent, of
        another K or dtype, or not one row per `topk_positions` token; None when sound."""
        found = self.topk_format
        if found != expected:
            return (f"it holds top-k {found and found.record()}, its cache's manifest says "
                    f"{expected and expected.record()}: the cache mixes two extractions (re-extract it)")
        if expected is None or self.topk_offsets is None:
            return None
        rows = self.topk_offsets
        if len(rows) != len(self.offsets) or (len(rows) and rows[0] != 0) or bool((np.diff(rows) < 0).any()):
            return f"its {TOPK_OFFSETS} are not an index of its samples"
        if not int(self.topk_ids.shape[0]) == int(self.topk_logprobs.shape[0]) == int(rows[-1]):
            return (f"its top-k arrays have {self.topk_ids.shape[0]} / {self.topk_logprobs.shape[0]} rows, "
                    f"{TOPK_OFFSETS} says {int(rows[-1])}")
        return None

    def sample_topk(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's top-k rows: (ids [rows, K], log-probs float16 [rows, K]), one per `topk_positions` token."""
        if self.topk_offsets is None:
            raise CacheError(f"shard store {self.path} holds no target top-k")
        start, end = int(self.topk_offsets[i]), int(self.topk_offsets[i + 1])
        return np.asarray(self.topk_ids[start:end]), np.asarray(self.topk_logprobs[start:end])

    def sample_features(self, i: int) -> np.ndarray:
        """The stored rows [length, D] of the codec's stored dtype (`sample_feature_tensor` decodes them)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.features[start:end])

    def sample_feature_tensor(self, i: int) -> Any:
        """Sample i's features as a bfloat16 tensor [length, D] (decoded by the store's codec)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.rows_tensor(start, end)

    def rows_tensor(self, start: int, end: int) -> Any:
        """Feature rows start:end as a bfloat16 tensor (decoded by the store's codec)."""
        scales = None if self.feature_scales is None else np.asarray(self.feature_scales[start:end])
        if self.codec.scaled and scales is None:
            raise CacheError(f"shard store {self.path}: {self.codec.name} features without their {SCALES_ARRAY}")
        return self.codec.decode_numpy(np.asarray(self.features[start:end]), scales)


# ------------------------------------------------------------------------------------------ target folder


def read_target_record(cache_dir: Path) -> dict[str, Any]:
    """target/dflash_target.json: `stop_token_ids`, `embed_scale` (what the target's embedding module multiplies
    its rows by) and `model_type` (of its text model, or None). Format version 1 gained the last two after its first
    caches were written; absent, the embedding is unscaled and the type is the config's."""
    record = json.loads((cache_dir / TARGET_DIR / TARGET_RECORD_FILE).read_text())
    record.setdefault("embed_scale", 1.0)
    if "model_type" not in record:
        config = json.loads((cache_dir / TARGET_DIR / "config.json").read_text())
        record["model_type"] = config.get("text_config", config).get("model_type")
    return record


# ------------------------------------------------------------------------------------------------- status


def status_dir(cache_dir: Path) -> Path:
    return cache_dir / STATUS_DIR


def write_status(cache_dir: Path, name: str, data: dict[str, Any]) -> None:
    folder = status_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / f"{name}.json", {**data, "host": socket.gethostname(), "heartbeat": time.time()})


def read_status(cache_dir: Path) -> dict[str, dict[str, Any]]:
    folder = status_dir(cache_dir)
    result: dict[str, dict[str, Any]] = {}
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            try:
                result[path.stem] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
    return result
