"""The feature store writer: byte-identical to zarr's own encoding, complete, atomic."""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import Crc32cCodec

from dflash.shared import cache_format as cf
from dflash.shared.feature_codecs import BF16
from dflash.stage1_extract.shard_writer import FeatureShardWriter
from dflash.stage1_extract.zarr_shard_file import write_shard_file


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 130), width=st.sampled_from([4, 24, 96]), chunk=st.sampled_from([1, 8, 16]),
       chunks_per_shard=st.integers(1, 5))
def test_shard_files_are_byte_identical_to_zarr(tmp_path_factory: pytest.TempPathFactory, rows: int, width: int,
                                                chunk: int, chunks_per_shard: int) -> None:
    shard = chunk * chunks_per_shard
    data = np.random.default_rng(rows * width).integers(1, 65535, size=(rows, width), dtype=np.uint16)
    root = tmp_path_factory.mktemp("z")
    arrays = {}
    for name in ("zarr", "ours"):
        group = zarr.open_group(str(root / name), mode="w", zarr_format=3)
        arrays[name] = group.create_array("f", shape=data.shape, dtype="uint16", chunks=(chunk, width),
                                          shards=(shard, width), compressors=[Crc32cCodec()], fill_value=0)
    arrays["zarr"][:] = data
    for start in range(0, rows, shard):
        key = arrays["ours"].metadata.encode_chunk_key((start // shard, 0))
        write_shard_file(str(root / "ours" / "f" / key), np.ascontiguousarray(data[start : start + shard]), chunk,
                         shard)
    for index in range(-(-rows // shard)):
        key = arrays["zarr"].metadata.encode_chunk_key((index, 0))
        assert filecmp.cmp(root / "zarr" / "f" / key, root / "ours" / "f" / key, shallow=False)
    np.testing.assert_array_equal(zarr.open_array(str(root / "ours" / "f"), mode="r")[:], data)


def _token_arrays(lengths: list[int]) -> dict:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    return {"input_ids": np.arange(total, dtype=np.int32), "loss_mask": np.ones(total, np.uint8),
            "offsets": offsets, "sample_index": np.arange(len(lengths)), "sample_ids": [f"s{i}" for i in lengths]}


@pytest.mark.parametrize("feature_dim", [64, 2880])
def test_writer_round_trip_in_uneven_batches(tmp_path: Path, feature_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cf, "SHARD_TARGET_BYTES", 64 * feature_dim * 2 * 3)  # several zarr shards per store
    lengths = [70, 3, 151, 1, 99, 40]
    total = sum(lengths)
    features = torch.randn(total, feature_dim).to(torch.bfloat16)
    final = tmp_path / "shards" / cf.shard_name(0)
    writer = FeatureShardWriter(final, feature_dim=feature_dim, token_arrays=_token_arrays(lengths), attributes={},
                                codec=BF16)
    start = 0
    for size in (5, 100, 1, 200, total):
        writer.submit(features[start : start + size])
        start += size
        if start >= total:
            break
    assert not final.exists()  # nothing visible before close
    writer.close({"samples": len(lengths)})
    reader = cf.ShardReader(final)
    assert reader.num_samples == len(lengths) and reader.num_tokens == total
    stored = reader.rows_tensor(0, reader.num_tokens)
    assert torch.equal(stored, features)  # bit-exact bf16
    assert torch.equal(reader.sample_feature_tensor(2), features[73:224])
    assert not list(final.parent.glob(".*tmp*"))


def test_writer_refuses_more_rows_than_the_store_holds(tmp_path: Path) -> None:
    final = tmp_path / cf.shard_name(0)
    writer = FeatureShardWriter(final, feature_dim=8, token_arrays=_token_arrays([4]), attributes={}, codec=BF16)
    writer.submit(torch.zeros(6, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="feature rows"):
        writer.close({})
    writer.abort()
    assert not final.exists()


def test_writer_refuses_a_store_with_missing_rows(tmp_path: Path) -> None:
    final = tmp_path / cf.shard_name(0)
    writer = FeatureShardWriter(final, feature_dim=8, token_arrays=_token_arrays([4, 4]), attributes={}, codec=BF16)
    writer.submit(torch.zeros(5, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="5 of 8"):
        writer.close({})
    writer.abort()
    assert not final.exists() and not list(tmp_path.glob(".*tmp*"))
