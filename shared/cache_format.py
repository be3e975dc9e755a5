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
    locks/                 one lock file per shard, held by the run that is extracting it

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
LOG_FILE = "extract.log"
EMBEDDINGS_FILE = "embeddings.safetensors"
DECODER_LAYERS_FILE = "decoder_layers.safetensors"  # in target/, only with `dflash extract --export-layers`
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
)

# The manifest's record of the options of the run that made the cache (what `dflash extract --repair` reruns).
OPTIONS_KEY = "options"

SHARD_PENDING, SHARD_RUNNING, SHARD_DONE, SHARD_FAILED = "pending", "running", "done", "failed"


class CacheError(UserError):
    """The cache is missing, from another format version, or does not match what was asked."""


def repair_command(cache: Path | str) -> str:
    """The command that redoes a cache's damaged shards, as every message about one names it (safe to run as
    printed: it reads the original options from the manifest and touches no healthy shard)."""
    return f"dflash extract --repair --out {cache}"


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
) -> Any:
    """Create a shard store whose token-level arrays are written now and whose features (and, for a scaled codec,
    their scales: the array `feature_scales`, filled with `write_feature_scales`) are filled later."""
    import zarr
    from zarr.codecs import Crc32cCodec

    num_tokens = int(offsets[-1]) if len(offsets) else 0
    stored = codec.stored_dtype
    layout = StoreLayout.for_feature_dim(feature_dim, stored.itemsize)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    group.attrs.update({**attributes, "format_version": FORMAT_VERSION, "complete": False})
    features = group.create_array(
        "features",
        shape=(num_tokens, feature_dim),
        dtype=stored,
        chunks=(layout.chunk_rows, feature_dim),
        shards=(layout.shard_rows, feature_dim),
        compressors=[Crc32cCodec()],
        fill_value=0,
        attributes={"logical_dtype": codec.logical_dtype},
    )
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
    return features


def feature_file_problems(store: Path, features: Any) -> list[str]:
    """A cheap structural check of the `features` array (the zarr array of `store`): every shard file exists with
    the exact size its uncompressed layout implies (inner chunks + 4-byte crc each, then the shard index), using
    the chunk and shard shapes recorded in the array's metadata. Catches truncated, missing or swapped files
    without reading them; `dflash inspect --verify` reads everything."""
    num_rows, feature_dim = (int(x) for x in features.shape)
    chunk_rows, shard_rows = int(features.chunks[0]), int(features.shards[0])
    chunk_bytes = chunk_rows * feature_dim * features.dtype.itemsize + 4
    index_bytes = (shard_rows // chunk_rows) * 16 + 4
    problems = []
    for k in range(-(-num_rows // shard_rows)):
        rows = min(shard_rows, num_rows - k * shard_rows)
        expected = -(-rows // chunk_rows) * chunk_bytes + index_bytes
        path = store / "features" / "c" / str(k) / "0"
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size} bytes"
            problems.append(f"feature file {path.relative_to(store)} is {found}, expected {expected} bytes")
    return problems


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


def read_layer_record(path: Path) -> dict[str, Any]:
    """The record in the metadata of a target/decoder_layers.safetensors (`dflash extract --export-layers`):
    `layer_ids` (the target layers it holds), `norm_weight_offset` (what the target's RMSNorms add to their weight:
    0, 1 for zero-centred norms, None if unknown) and `left_out` (the layer tensors not exported, e.g. biases)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return {key: json.loads(metadata[key]) for key in ("layer_ids", "norm_weight_offset", "left_out")
            if key in metadata}


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
