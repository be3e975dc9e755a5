"""How fast can one process write bf16 feature rows into a sharded, checksummed Zarr v3 array?

Compares ways of writing the same rows (D = 20480, the Qwen3-8B 5-layer width) to the same disk, each ending in
fsync: zarr-python with crc32c as shipped (its crc32c codec runs inside zarr's single event-loop thread), zarr
without checksums, zarr with crc32c encoding moved to worker threads and several zarr shards written at once,
and tensorstore (C++, multi-threaded). All produce the same standard zarr v3 metadata (codec name "crc32c").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fsync_tree(path: Path) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())


def make_zarr(path: Path, shape: tuple[int, int], chunk_rows: int, shard_rows: int, crc: bool):
    import zarr
    from zarr.codecs import Crc32cCodec

    shutil.rmtree(path, ignore_errors=True)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    return group.create_array("features", shape=shape, dtype="uint16", chunks=(chunk_rows, shape[1]),
                              shards=(shard_rows, shape[1]), compressors=[Crc32cCodec()] if crc else None)


def write_zarr(array, data: np.ndarray, shard_rows: int, threads: int) -> None:
    spans = [(s, min(s + shard_rows, len(data))) for s in range(0, len(data), shard_rows)]

    def one(span: tuple[int, int]) -> None:
        array[span[0] : span[1]] = data[span[0] : span[1]]

    if threads <= 1:
        for span in spans:
            one(span)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, spans))


def threaded_crc() -> None:
    """Make zarr's crc32c codec encode in worker threads (same codec name and bytes on disk)."""
    from zarr.codecs.crc32c_ import Crc32cCodec

    async def encode(self, chunk_bytes, chunk_spec):  # type: ignore[no-untyped-def]
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    Crc32cCodec._encode_single = encode  # type: ignore[method-assign]


def write_tensorstore(path: Path, data: np.ndarray, chunk_rows: int, shard_rows: int) -> None:
    import tensorstore as ts

    shutil.rmtree(path, ignore_errors=True)
    byte_codec = {"name": "bytes", "configuration": {"endian": "little"}}
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path / "features")},
        "metadata": {
            "shape": list(data.shape), "data_type": "uint16", "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard_rows, data.shape[1]]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [chunk_rows, data.shape[1]],
                "codecs": [byte_codec, {"name": "crc32c"}],
                "index_codecs": [byte_codec, {"name": "crc32c"}]}}],
        },
        "create": True, "delete_existing": True,
    }
    array = ts.open(spec).result()
    futures = [array[s : s + shard_rows].write(data[s : s + shard_rows]) for s in range(0, len(data), shard_rows)]
    for future in futures:
        future.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dflash-writer-bench"))
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--dim", type=int, default=20480)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from dflash.shared.cache_format import StoreLayout

    layout = StoreLayout.for_feature_dim(args.dim)
    rows = int(args.gb * 1e9 / (args.dim * 2)) // layout.shard_rows * layout.shard_rows
    data = np.random.default_rng(0).integers(0, 65535, size=(rows, args.dim), dtype=np.uint16)
    results = {}

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        path = args.dir / name
        started = time.perf_counter()
        fn(path)
        fsync_tree(path)
        seconds = time.perf_counter() - started
        results[name] = round(data.nbytes / seconds / 1e9, 3)
        print(f"{name}: {results[name]} GB/s", flush=True)
        shutil.rmtree(path, ignore_errors=True)

    shape = data.shape
    timed("zarr_crc32c_1thread", lambda p: write_zarr(make_zarr(p, shape, layout.chunk_rows, layout.shard_rows, True),
                                                      data, layout.shard_rows, 1))
    timed("zarr_nocrc_1thread", lambda p: write_zarr(make_zarr(p, shape, layout.chunk_rows, layout.shard_rows, False),
                                                     data, layout.shard_rows, 1))
    timed("zarr_nocrc_4threads", lambda p: write_zarr(make_zarr(p, shape, layout.chunk_rows, layout.shard_rows, False),
                                                      data, layout.shard_rows, 4))
    try:
        timed("tensorstore_crc32c", lambda p: write_tensorstore(p, data, layout.chunk_rows, layout.shard_rows))
    except ImportError:
        print("tensorstore not installed")
    threaded_crc()
    timed("zarr_crc32c_threaded_4threads", lambda p: write_zarr(
        make_zarr(p, shape, layout.chunk_rows, layout.shard_rows, True), data, layout.shard_rows, 4))
    # the disk itself
    path = args.dir / "raw.bin"
    args.dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(memoryview(data).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())
    results["raw_file_fsync"] = round(data.nbytes / (time.perf_counter() - started) / 1e9, 3)
    print(f"raw_file_fsync: {results['raw_file_fsync']} GB/s")
    path.unlink()
    summary = {"benchmark": "writer", "dim": args.dim, "bytes": int(data.nbytes), "chunk_rows": layout.chunk_rows,
               "shard_rows": layout.shard_rows, "gb_per_s": results, "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(summary))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"writer_{os.uname().nodename}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
