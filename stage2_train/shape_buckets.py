"""The rounding rule for the sizes of training tensors that vary from micro-batch to micro-batch (packed lengths,
block counts, attention windows): rounded up to few distinct values, so that what is built per shape (compiled
graphs, cuDNN attention plans, flex block masks) is built a few times per run rather than every step."""

from __future__ import annotations

DEFAULT_BUCKET_MULTIPLE = 16  # packed lengths are rounded up to a multiple of this (at least), see `bucket`


def bucket(value: int, multiple: int = DEFAULT_BUCKET_MULTIPLE) -> int:
    """`value` rounded up to a multiple of `multiple` and of 1/16 of its power of two: padding stays under 6.25 %
    once 1/16 of the power of two is at least `multiple` (below that, up to `multiple` - 1: 200 becomes 256 with a
    multiple of 128), and a run sees few distinct shapes (about 16 per doubling), which compiled kernels are
    specialised for."""
    step = max(multiple, 1 << max(0, int(value).bit_length() - 5))
    return -(-int(value) // step) * step
