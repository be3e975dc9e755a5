"""The feature codecs (shared/feature_codecs.py): each dtype's encoded rows, the split on the host, the decode, and
the fp8 quantizer's error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.shared import feature_codecs as fc

# e4m3 keeps 3 mantissa bits: a normal number is off by at most 2**-4 of itself after rounding.
E4M3_RELATIVE_STEP = 2.0**-4


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_encoded_rows_have_the_declared_format_and_split_back(dtype: str) -> None:
    layers, hidden, tokens = 3, 16, 5
    features = torch.randn(tokens, layers * hidden).to(torch.bfloat16)
    codec = fc.codec(dtype)
    rows = codec.encode(features, layers)
    width, row_dtype = codec.encoded_row_format(layers * hidden, layers)
    assert rows.shape == (tokens, width) and rows.dtype == row_dtype
    assert codec.stored_row_bytes(layers * hidden, layers) == rows[0].numel() * rows.element_size()
    bits, scales = codec.split_rows(rows, layers * hidden)
    assert bits.dtype == codec.stored_dtype and bits.shape == (tokens, layers * hidden)
    if dtype == "fp8":
        expected_bits, expected_scales = fc.FP8.quantize(features, layers)
        assert np.array_equal(bits, expected_bits.numpy()) and np.array_equal(scales, expected_scales.numpy())
    else:
        assert scales is None and torch.equal(fc.BF16.decode_numpy(bits, None), features)
    # Decoding what was stored gives the features back: exactly for bf16, within e4m3's rounding for fp8.
    decoded = codec.decode_numpy(bits, scales)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == features.shape
    tolerance = 0 if dtype == "bf16" else E4M3_RELATIVE_STEP * float(features.float().abs().max())
    assert float((decoded.float() - features.float()).abs().max()) <= tolerance


def test_every_codec_is_known_by_name_and_by_its_stored_record() -> None:
    assert fc.FEATURE_DTYPES[0] == "fp8"  # the --feature-dtype default
    for name in fc.FEATURE_DTYPES:
        codec = fc.codec(name)
        assert codec.name == name and fc.logical_codec(codec.logical_dtype) is codec
        assert fc.manifest_codec({"identity": {"feature_dtype": name}}) is codec
    with pytest.raises(ValueError, match="unknown feature dtype"):
        fc.codec("int4")


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), layers=st.integers(1, 4), hidden=st.sampled_from([8, 64]),
       log_scale=st.floats(-6, 6), outlier=st.floats(0, 5), seed=st.integers(0, 2**16))
def test_quantization_error_is_bounded_per_token_and_layer(tokens: int, layers: int, hidden: int, log_scale: float,
                                                           outlier: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, layers, hidden, generator=generator) * 10.0**log_scale
    values[:, 0, 0] *= 10.0**outlier  # a massive-activation channel in layer 0 only
    features = values.flatten(1).to(torch.bfloat16)
    bits, scales = fc.FP8.quantize(features, layers)
    assert bits.dtype == torch.uint8 and bits.shape == features.shape
    assert scales.dtype == torch.float32 and scales.shape == (tokens, layers)
    back = fc.FP8.decode(bits, scales, torch.float32).view(tokens, layers, hidden)
    source = features.float().view(tokens, layers, hidden)
    # Each block's largest magnitude maps to 448 and comes back (to float32 rounding of amax / 448 * 448), so
    # no value is clipped ...
    torch.testing.assert_close(back.abs().amax(-1), source.abs().amax(-1), rtol=1e-6, atol=0)
    # ... and the error of every block is a few percent of its own size: an outlier in layer 0 costs the
    # other layers nothing (they have their own scales).
    error = (back - source).norm(dim=-1) / source.norm(dim=-1)
    assert bool((error <= E4M3_RELATIVE_STEP).all()), error.max()


def test_zero_blocks_stay_zero_and_representable_values_are_exact() -> None:
    exact = torch.tensor([[448.0, -448.0, 0.5, -3.25, 0.0, 2.0**-6, 96.0, 1.0]])  # all e4m3 numbers
    features = torch.cat([exact * 2.0**-3, torch.zeros(1, 8)], dim=1)  # layer 0: scale 1/8; layer 1: zeros
    bits, scales = fc.FP8.quantize(features, 2)
    assert scales.tolist() == [[2.0**-3, 1.0]]
    assert torch.equal(fc.FP8.decode(bits, scales, torch.float32), features)
