"""Read whole caches with plain zarr (no dflash reader) to compare two runs array by array."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import zarr

ARRAYS = ("features", "input_ids", "loss_mask", "offsets", "sample_index", "sample_id")


def read_cache_arrays(cache: Path) -> dict[str, dict[str, np.ndarray]]:
    stores = {}
    for store in sorted((cache / "shards").glob("shard-*.zarr")):
        group = zarr.open_group(str(store), mode="r")
        stores[store.name] = {name: np.asarray(group[name][:]) for name in ARRAYS}
    return stores


def manifest_counts(cache: Path) -> dict[str, tuple]:
    manifest = json.loads((cache / "manifest.json").read_text())
    return {k: (v["status"], v.get("samples"), v.get("tokens"), v.get("loss_tokens"), json.dumps(v.get("skipped")))
            for k, v in manifest["shards"].items()}


def assert_same_cache(a: Path, b: Path) -> None:
    arrays_a, arrays_b = read_cache_arrays(a), read_cache_arrays(b)
    assert sorted(arrays_a) == sorted(arrays_b)
    for store in arrays_a:
        for name in ARRAYS:
            np.testing.assert_array_equal(arrays_a[store][name], arrays_b[store][name], err_msg=f"{store}/{name}")
    assert manifest_counts(a) == manifest_counts(b)
    assert json.loads((a / "manifest.json").read_text())["identity"] == \
        json.loads((b / "manifest.json").read_text())["identity"]
