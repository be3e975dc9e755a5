"""Read whole caches with plain zarr (no dflash reader) to compare two runs array by array."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import zarr

from dflash.shared.feature_codecs import BF16

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


# Two batchings of the same samples: per-token relative difference of the features, per captured layer. Equal
# batches give bit-identical features, but CPU (oneDNN with AMX bf16) and GPU kernels are chosen by shape, so a
# sample forwarded in a batch of another size rounds differently in bf16. Measured on SmolLM2 (14 test conversations,
# batches of 256 vs 96 tokens, AMX CPU): mean <= 0.012, worst token <= 0.079. A misplaced or wrong row is ~1.
BATCHING_MEAN_RELATIVE = 0.03
BATCHING_WORST_RELATIVE = 0.2


def assert_features_close(a: np.ndarray, b: np.ndarray, layers: int, what: str) -> None:
    """Features of two batchings of the same samples agree within bf16 rounding (see BATCHING_*_RELATIVE)."""
    x, y = (BF16.decode_numpy(rows, None).float().numpy().reshape(len(rows), layers, -1) for rows in (a, b))
    relative = np.linalg.norm(x - y, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-6)  # [tokens, layers]
    assert relative.mean(axis=0).max() <= BATCHING_MEAN_RELATIVE, f"{what}: mean {relative.mean(axis=0)}"
    assert relative.max() <= BATCHING_WORST_RELATIVE, f"{what}: worst token {relative.max(axis=0)}"


def assert_same_cache(a: Path, b: Path, same_batches: bool = True) -> None:
    """Equal caches: every array bit for bit, or with ``same_batches=False`` (runs that forwarded the samples in
    different batches) every array but the features bit for bit and the features within bf16 rounding."""
    arrays_a, arrays_b = read_cache_arrays(a), read_cache_arrays(b)
    assert sorted(arrays_a) == sorted(arrays_b)
    layers = len(json.loads((a / "manifest.json").read_text())["identity"]["layer_ids"])
    for store in arrays_a:
        for name in ARRAYS:
            first, second = arrays_a[store][name], arrays_b[store][name]
            if name == "features" and not same_batches:
                assert first.shape == second.shape, f"{store}/{name}"
                assert_features_close(first, second, layers, f"{store}/{name}")
            else:
                np.testing.assert_array_equal(first, second, err_msg=f"{store}/{name}")
    assert manifest_counts(a) == manifest_counts(b)
    assert json.loads((a / "manifest.json").read_text())["identity"] == \
        json.loads((b / "manifest.json").read_text())["identity"]
