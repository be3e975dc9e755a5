"""How cached target features are stored: one codec per feature dtype, the only place that knows each one.

A codec says what a shard store holds for the features (`features` [tokens, L * H] of `stored_dtype`, and for a
scaled format `feature_scales` [tokens, L] float32), how extraction encodes rows on the device (one tensor per
batch, so one device-to-host copy moves bits and scales together), how the shard writer splits those rows on the
host, and how stage 2 decodes stored rows on its device. The dtype of a cache is recorded in its manifest
(`identity.feature_dtype`) and in every shard store (the `logical_dtype` attribute of `features`); readers take
the codec from there, never from the presence of an array.

Adding a dtype: a new `FeatureCodec` subclass here, an entry in `CODECS`, and its tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: `dflash status` reads caches without loading it
    import torch
    from torch import Tensor

SCALES_ARRAY = "feature_scales"  # the array of per-token, per-layer scales of a scaled codec


class FeatureCodec:
    """A feature dtype: stored bits, optional float32 scales per token and captured layer."""

    name: str  # the --feature-dtype value and the manifest's identity.feature_dtype
    logical_dtype: str  # the `logical_dtype` attribute of the stored `features` array
    stored_dtype: np.dtype  # dtype of the stored `features` array (zarr has no bf16 or fp8 type)
    scaled: bool = False  # whether the store holds `feature_scales` [tokens, layers] float32

    def scale_columns(self, num_layers: int) -> int:
        return num_layers if self.scaled else 0

    def stored_row_bytes(self, feature_dim: int, num_layers: int) -> int:
        """Bytes one token's features take in the cache."""
        return feature_dim * self.stored_dtype.itemsize + 4 * self.scale_columns(num_layers)

    def encoded_row_format(self, feature_dim: int, num_layers: int) -> tuple[int, torch.dtype]:
        """(elements, torch dtype) of one row of `encode`'s output."""
        raise NotImplementedError

    def encode(self, features: Tensor, num_layers: int) -> Tensor:
        """Feature rows [n, L * H] (any float dtype, on their device) -> the rows handed to the shard writer."""
        raise NotImplementedError

    def split_rows(self, rows: Tensor, feature_dim: int) -> tuple[np.ndarray, np.ndarray | None]:
        """CPU rows from `encode` -> (stored bits [n, D] of `stored_dtype`, float32 scales [n, L] or None)."""
        raise NotImplementedError

    def transport(self, bits: Tensor) -> Tensor:
        """Stored bits as a CPU tensor of the stored dtype -> the tensor a loader hands on (the same bytes, no
        copy); `decode` takes either."""
        return bits

    def decode(self, bits: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
        """Stored bits [..., D] (a tensor of the stored dtype's width) and scales [..., L] on one device ->
        features [..., D] of `dtype`."""
        raise NotImplementedError

    def decode_numpy(self, bits: np.ndarray, scales: np.ndarray | None) -> Tensor:
        """Stored rows as read from a store (numpy) -> a bfloat16 CPU tensor (bf16 bits: zero copy)."""
        import torch

        return self.decode(torch.from_numpy(np.ascontiguousarray(bits)),
                           None if scales is None else torch.from_numpy(np.ascontiguousarray(scales)), torch.bfloat16)


class Bf16Codec(FeatureCodec):
    """Exact bfloat16, stored bit for bit as uint16 (2 bytes per value)."""

    name, logical_dtype, stored_dtype = "bf16", "bfloat16", np.dtype("uint16")

    def encoded_row_format(self, feature_dim: int, num_layers: int) -> tuple[int, torch.dtype]:
        import torch

        return feature_dim, torch.bfloat16

    def encode(self, features: Tensor, num_layers: int) -> Tensor:
        import torch

        return features.to(torch.bfloat16)

    def split_rows(self, rows: Tensor, feature_dim: int) -> tuple[np.ndarray, None]:
        return bf16_bits(rows), None

    def transport(self, bits: Tensor) -> Tensor:
        import torch

        return bits.view(torch.bfloat16)  # bfloat16 crosses to any device; uint16 tensors do not everywhere

    def decode(self, bits: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
        import torch

        values = bits.view(torch.bfloat16) if bits.dtype in (torch.uint16, torch.int16) else bits
        return values if values.dtype == dtype else values.to(dtype)


class Fp8Codec(FeatureCodec):
    """float8 e4m3 (`float8_e4m3fn`, stored as uint8 bits) with a float32 scale per token and captured layer.

    Each token's block of each layer is scaled so that its largest magnitude lands on e4m3's largest finite value,
    448: per token because massive-activation channels vary by token, per layer because layers differ in scale by
    orders of magnitude (measured: about 2.6 % relative L2 on a real target). Rows are encoded on the device
    (half the bytes cross PCIe) and decoded on the trainer's device after a half-size copy."""

    name, logical_dtype, stored_dtype, scaled = "fp8", "float8_e4m3fn", np.dtype("uint8"), True
    max_value = 448.0

    def encoded_row_format(self, feature_dim: int, num_layers: int) -> tuple[int, torch.dtype]:
        import torch

        return feature_dim + 4 * num_layers, torch.uint8  # the fp8 bits, then the bytes of the float32 scales

    def quantize(self, features: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
        """features [n, L * H] -> (uint8 fp8 bits [n, L * H], float32 scales [n, L]); an all-zero block gets
        scale 1 (its bits are zeros)."""
        import torch

        rows = features.float().view(features.shape[0], num_layers, -1)
        amax = rows.abs().amax(dim=-1)
        scales = torch.where(amax > 0, amax / self.max_value, torch.ones_like(amax))
        bits = (rows / scales.unsqueeze(-1)).clamp(-self.max_value, self.max_value).to(torch.float8_e4m3fn)
        return bits.view(torch.uint8).view(features.shape[0], -1), scales

    def encode(self, features: Tensor, num_layers: int) -> Tensor:
        import torch

        bits, scales = self.quantize(features, num_layers)
        return torch.cat([bits, scales.contiguous().view(torch.uint8)], dim=1)

    def split_rows(self, rows: Tensor, feature_dim: int) -> tuple[np.ndarray, np.ndarray]:
        packed = rows.numpy()
        return packed[:, :feature_dim], np.ascontiguousarray(packed[:, feature_dim:]).view(np.float32)

    def decode(self, bits: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
        import torch

        if scales is None:
            raise ValueError("fp8 features need their feature_scales")
        num_layers = scales.shape[-1]
        values = bits.view(torch.float8_e4m3fn).float().unflatten(-1, (num_layers, -1)) * scales.unsqueeze(-1)
        return values.flatten(-2).to(dtype)


CODECS: dict[str, FeatureCodec] = {codec.name: codec for codec in (Fp8Codec(), Bf16Codec())}
FEATURE_DTYPES = tuple(CODECS)  # the --feature-dtype choices; the first is the default
BF16, FP8 = CODECS["bf16"], CODECS["fp8"]


def codec(name: str) -> FeatureCodec:
    """The codec of a feature dtype name (as recorded in a manifest)."""
    if name not in CODECS:
        raise ValueError(f"unknown feature dtype {name!r}: this dflash knows {', '.join(FEATURE_DTYPES)} "
                         "(a cache written by a newer dflash? upgrade)")
    return CODECS[name]


def manifest_codec(manifest: dict[str, Any]) -> FeatureCodec:
    """The codec a cache was written with, from its manifest."""
    return codec(manifest["identity"]["feature_dtype"])


def logical_codec(logical_dtype: str) -> FeatureCodec:
    """The codec of a stored `features` array, from its recorded `logical_dtype` attribute."""
    for candidate in CODECS.values():
        if candidate.logical_dtype == logical_dtype:
            return candidate
    raise ValueError(f"unknown stored feature dtype {logical_dtype!r}")


def bf16_bits(tensor: Tensor) -> np.ndarray:
    """The uint16 bit pattern of a (CPU) bfloat16 tensor, for storage."""
    import torch

    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
