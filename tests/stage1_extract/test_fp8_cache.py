"""fp8 feature caches: the stores the fp8 codec writes, extraction with --feature-dtype fp8, training on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.shared import cache_format as cf
from dflash.shared import feature_codecs as fc
from dflash.stage1_extract.shard_writer import FeatureShardWriter
from tests.conftest import EXTRACT_ARGS, run_dflash

E4M3_RELATIVE_STEP = 2.0**-4


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=6), batch=st.integers(1, 120))
def test_fp8_store_round_trip_equals_the_quantizer(tmp_path_factory: pytest.TempPathFactory, lengths: list[int],
                                                  batch: int) -> None:
    layers, hidden = 3, 16
    total = sum(lengths)
    features = (torch.randn(total, layers * hidden) * torch.logspace(-2, 2, layers).repeat_interleave(hidden))
    features = features.to(torch.bfloat16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    arrays = {"input_ids": np.arange(total, dtype=np.int32), "loss_mask": np.ones(total, np.uint8),
              "offsets": offsets, "sample_index": np.arange(len(lengths)), "sample_ids": [f"s{i}" for i in lengths]}
    final = tmp_path_factory.mktemp("fp8") / cf.shard_name(0)
    saved = cf.SHARD_TARGET_BYTES
    cf.SHARD_TARGET_BYTES = 64 * layers * hidden  # several zarr shard files per store
    try:
        writer = FeatureShardWriter(final, feature_dim=layers * hidden, token_arrays=arrays, attributes={},
                                    codec=fc.FP8, num_layers=layers)
    finally:
        cf.SHARD_TARGET_BYTES = saved
    for start in range(0, total, batch):  # as a worker submits: encoded rows, uneven batches
        writer.submit(fc.FP8.encode(features[start : start + batch], layers))
    writer.close({"samples": len(lengths)})
    bits, scales = fc.FP8.quantize(features, layers)
    # Plain zarr reads what we wrote (our shard-file encoder for uint8 rows; the scales through zarr).
    group = zarr.open_group(str(final), mode="r")
    assert group["features"].dtype == np.uint8 and group["features"].attrs["logical_dtype"] == "float8_e4m3fn"
    np.testing.assert_array_equal(group["features"][:], bits.numpy())
    np.testing.assert_array_equal(group["feature_scales"][:], scales.numpy())
    reader = cf.ShardReader(final)
    assert cf.feature_file_problems(final, reader.features) == []
    for i in range(len(lengths)):
        expected = fc.FP8.decode(bits[offsets[i] : offsets[i + 1]], scales[offsets[i] : offsets[i + 1]],
                                     torch.bfloat16)
        assert torch.equal(reader.sample_feature_tensor(i), expected)


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory: pytest.TempPathFactory, chat_jsonl: Path) -> Path:
    out = tmp_path_factory.mktemp("fp8_cache") / "cache"
    run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *EXTRACT_ARGS,
               "--feature-dtype", "fp8", check=True)  # after EXTRACT_ARGS' bf16: the last one counts
    return out


def test_fp8_extraction_stores_the_quantized_bf16_features(fp8_cache: Path, baseline_cache: Path) -> None:
    """The same run as the bf16 baseline (same batches, same kernels), quantized: bit for bit what the quantizer
    makes of the baseline's features, at half the bytes."""
    manifest, baseline = cf.read_manifest(fp8_cache), cf.read_manifest(baseline_cache)
    layers = len(manifest["identity"]["layer_ids"])
    feature_dim = layers * manifest["identity"]["hidden_size"]
    assert manifest["identity"]["feature_dtype"] == "fp8"
    for key, entry in manifest["shards"].items():
        assert entry["status"] == cf.SHARD_DONE
        assert entry["bytes"] == entry["tokens"] * (feature_dim + 4 * layers)
        assert 2 * feature_dim / (feature_dim + 4 * layers) > 1.98  # 5760 vs 2900 bytes per token
        ours = cf.ShardReader(cf.shard_path(fp8_cache, int(key)))
        theirs = cf.ShardReader(cf.shard_path(baseline_cache, int(key)))
        np.testing.assert_array_equal(ours.offsets, theirs.offsets)
        bits, scales = fc.FP8.quantize(theirs.rows_tensor(0, theirs.num_tokens), layers)
        np.testing.assert_array_equal(np.asarray(ours.features[:]), bits.numpy())
        np.testing.assert_array_equal(np.asarray(ours.feature_scales[:]), scales.numpy())
        assert baseline["shards"][key]["tokens"] == entry["tokens"]
    verified = run_dflash("inspect", "--cache", str(fp8_cache), "--verify")
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr


def test_a_bf16_rerun_into_an_fp8_cache_is_refused(fp8_cache: Path, chat_jsonl: Path) -> None:
    refused = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(fp8_cache), "--workers", "1",
                         *EXTRACT_ARGS)
    assert refused.returncode == 3
    assert "feature_dtype: cache has 'fp8', this run has 'bf16'" in refused.stderr


def test_training_dequantizes_fp8_batches_to_the_stored_values(fp8_cache: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.cache_index import CacheIndex
    from dflash.stage2_train.epoch_plan import plan_epoch
    from dflash.stage2_train.eval_set import EvalSet
    from dflash.stage2_train.packed_batches import CacheBatches
    from dflash.stage2_train.packed_loader import make_loader

    index = CacheIndex.from_cache(fp8_cache, eval_fraction=0.2, seed=0)
    plan = plan_epoch(index, 0, 0, 256, 1)
    batch = next(iter(make_loader(CacheBatches(fp8_cache, plan, seed=0, epoch=0, bucket_multiple=8), 1,
                                  pin_memory=False)))
    assert batch["features"].dtype == torch.uint8
    assert batch["feature_scales"].shape == (batch["features"].shape[0], 5)
    decoded = fc.FP8.decode(batch["features"], batch["feature_scales"], torch.bfloat16)
    shard, row = batch["sample_keys"][0].tolist()
    stored = cf.ShardReader(cf.shard_path(fp8_cache, shard)).sample_feature_tensor(row)
    length = int(batch["lengths"][0])
    assert torch.equal(decoded[:length], stored) and not decoded[int(batch["lengths"].sum()):].any()
    assert EvalSet(index)[0]["features"].dtype == torch.bfloat16
    # And the real CLI trains on it (the trainer dequantizes on its device).
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(fp8_cache), "--out", str(run), "--max-steps", "2",
                        "--draft-layers", "1", "--max-anchors", "8", "--batch-tokens", "512", "--eval-every", "2",
                        "--eval-sequences", "2", "--num-workers", "0", "--eval-fraction", "0.2",
                        "--mixed-precision", "no")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "export" / "model.safetensors").is_file()


def test_an_fp8_store_without_its_scales_is_named_by_verify_and_by_training(fp8_cache: Path, tmp_path: Path) -> None:
    import shutil

    from dflash.shared.cache_format import CacheError
    from dflash.stage2_train.cache_index import CacheIndex

    cache = tmp_path / "cache"
    shutil.copytree(fp8_cache, cache)
    shutil.rmtree(cf.shard_path(cache, 1) / "feature_scales")
    expected = "its fp8 features need feature_scales of shape"
    assert cf.ShardReader(cf.shard_path(cache, 0)).scales_problem() is None
    verified = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert verified.returncode == 1 and f"DAMAGED shard 1 (shard-00001.zarr): {expected}" in verified.stdout
    with pytest.raises(CacheError, match=f"shard 1.*{expected}"):
        CacheIndex.from_cache(cache, eval_fraction=0.2, seed=0)
