"""A sample's per-token side arrays (input_ids, loss_mask, feature_scales) read back from a shard of a given size:
zarr read by zarr read, as the loader did until 2026-12-07, against `ShardStore`'s whole arrays read once.

The shard is written with the cache's own layout (`cache_format.create_shard_store`, fp8 over 5 layers of the
SmolLM2 drafter, samples of ~740 tokens, random values; its features are declared but never written, so a 13 M-token
shard takes ~80 MB of disk). Both ways read the same random samples into the same preallocated arrays:

    python benchmarks/bench_side_arrays.py [--tokens 13000000] [--samples 200] --out FILE.json

Reported: milliseconds a sample each way (the median of three passes), the whole arrays' one read, and the bytes the
zarr chunks of the side arrays hold (what each per-sample read passed through).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLE_TOKENS = 740  # the mean sample of the four-times data (~13 M tokens over ~17,000 conversations)
FEATURE_DIM, LAYERS = 2880, 5  # SmolLM2-135M's hidden 576 x the drafter's 5 target layers


def write_shard(path: Path, tokens: int) -> None:
    from dflash.shared import cache_format as cf
    from dflash.shared.feature_codecs import FP8

    samples = max(1, tokens // SAMPLE_TOKENS)
    offsets = np.linspace(0, tokens, samples + 1).astype(np.int64)
    rng = np.random.default_rng(0)
    cf.create_shard_store(path, feature_dim=FEATURE_DIM, input_ids=rng.integers(0, 49152, tokens, dtype=np.int32),
                          loss_mask=rng.integers(0, 2, tokens, dtype=np.uint8), offsets=offsets,
                          sample_index=np.arange(samples), sample_ids=[str(i) for i in range(samples)],
                          attributes={}, codec=FP8, num_layers=LAYERS)
    cf.write_feature_scales(path, rng.random((tokens, FP8.scale_columns(LAYERS)), dtype=np.float32))


def time_passes(function: Any, passes: int = 3) -> float:
    seconds = []
    for _ in range(passes):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    import zarr

    from dflash.stage2_train.packed_batches import _read_into

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=13_000_000, help="tokens of the shard (default: ~4x data)")
    parser.add_argument("--samples", type=int, default=200, help="random samples read each pass")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    names = ("input_ids", "loss_mask", "feature_scales")
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "shard.zarr"
        write_shard(path, args.tokens)
        group = zarr.open_group(str(path), mode="r")
        arrays = {name: group[name] for name in names}
        rng = np.random.default_rng(1)
        starts = [int(s) for s in rng.integers(0, args.tokens - SAMPLE_TOKENS, args.samples)]
        outs = {name: np.zeros((SAMPLE_TOKENS, *a.shape[1:]), dtype=a.dtype) for name, a in arrays.items()}

        def zarr_reads() -> None:
            for start in starts:
                for name, out in outs.items():
                    _read_into(arrays[name], start, start + SAMPLE_TOKENS, out)

        started = time.perf_counter()
        whole = {name: np.asarray(a[:]) for name, a in arrays.items()}
        whole_s = time.perf_counter() - started

        def slices() -> None:
            for start in starts:
                for name, out in outs.items():
                    out[:] = whole[name][start : start + SAMPLE_TOKENS]

        zarr_s, slice_s = time_passes(zarr_reads), time_passes(slices)
        for name, out in outs.items():  # the two ways read the same values (the last sample's, both times)
            expected = out.copy()
            _read_into(arrays[name], starts[-1], starts[-1] + SAMPLE_TOKENS, out)
            if not np.array_equal(out, expected):
                raise SystemExit(f"{name}: the whole array's slice differs from zarr's read")
        chunk_bytes = {name: int(np.prod(a.chunks)) * a.dtype.itemsize for name, a in arrays.items()}
    record = {
        "tokens": args.tokens, "samples": args.samples, "sample_tokens": SAMPLE_TOKENS,
        "zarr_reads_ms_per_sample": zarr_s / args.samples * 1e3,
        "whole_arrays_slices_ms_per_sample": slice_s / args.samples * 1e3,
        "whole_arrays_read_s": whole_s,
        "whole_arrays_bytes": sum(int(a.nbytes) for a in whole.values()),
        "chunk_bytes": chunk_bytes,
        "machine": {"processor": platform.processor() or platform.machine(), "zarr": zarr.__version__},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.tokens} tokens: side arrays {record['zarr_reads_ms_per_sample']:.2f} ms a sample by zarr reads, "
          f"{record['whole_arrays_slices_ms_per_sample']:.3f} ms from the whole arrays (read once in {whole_s:.2f} s, "
          f"{record['whole_arrays_bytes'] / 1e6:.0f} MB) -> {args.out}")


if __name__ == "__main__":
    main()
