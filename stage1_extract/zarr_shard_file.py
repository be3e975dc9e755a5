"""Encode one file of a Zarr v3 sharded array (sharding_indexed codec) directly, at disk speed.

Written by hand because zarr-python's own write path runs its codecs in one event-loop thread and copies each
shard several times: measured 0.2-0.4 GB/s on these machines (benchmarks/bench_writer.py), far below the disk
(1.2 GB/s fsynced on the H200 machine). The layout is the standard one the array's zarr.json declares, so plain
zarr (or tensorstore) reads it and checks its checksums; tests compare our files byte for byte with zarr's.

Layout for codecs [sharding_indexed(chunk_shape=[r, D], codecs=[bytes(little), crc32c],
index_codecs=[bytes(little), crc32c], index_location=end)] of a 2-D array whose chunks span all columns:
    chunk 0 bytes | crc32c(chunk 0) | chunk 1 bytes | crc32c(chunk 1) | ... |
    index: uint64 little-endian (offset, nbytes) per inner chunk, (2**64-1, 2**64-1) for a chunk past the array end
    | crc32c(index)
Inner chunks that reach past the array's last row are padded with the fill value (0), as zarr writes them.
"""

from __future__ import annotations

import os
import struct

import google_crc32c
import numpy as np

EMPTY = 2**64 - 1


def _crc(data: np.ndarray | bytes) -> bytes:
    """crc32c, little-endian (google_crc32c takes read-only buffers: a read-only numpy view, no copy)."""
    if isinstance(data, np.ndarray):
        data = data.view()
        data.flags.writeable = False
    return struct.pack("<I", google_crc32c.value(data))


def shard_file_pieces(rows: np.ndarray, chunk_rows: int, shard_rows: int) -> list[bytes | memoryview]:
    """The byte pieces of one shard file holding `rows` ([n <= shard_rows, D] of a little-endian dtype of the array
    `bytes(little)` codec: uint8, uint16, int32, float16, ...) in order."""
    if rows.dtype.byteorder == ">" or rows.dtype.kind not in "uif" or not rows.flags.c_contiguous:
        raise ValueError("rows must be a C-contiguous little-endian integer or float array")
    n, width = rows.shape
    inner = shard_rows // chunk_rows
    index = np.full((inner, 2), EMPTY, dtype="<u8")
    pieces: list[bytes | memoryview] = []
    offset = 0
    for j in range(inner):
        start = j * chunk_rows
        if start >= n:
            break
        block = rows[start : start + chunk_rows]
        if len(block) < chunk_rows:  # edge chunk: zarr stores it at full size, padded with the fill value
            padded = np.zeros((chunk_rows, width), dtype=rows.dtype)
            padded[: len(block)] = block
            block = padded
        pieces += [memoryview(block).cast("B"), _crc(block)]
        index[j] = (offset, block.nbytes + 4)
        offset += block.nbytes + 4
    index_bytes = index.tobytes()
    pieces += [index_bytes, _crc(index_bytes)]
    return pieces


def write_shard_file(path: str, rows: np.ndarray, chunk_rows: int, shard_rows: int, fsync: bool = True) -> int:
    """Write one shard file (create folders as needed); returns bytes written.

    fsync right away: otherwise the kernel keeps gigabytes dirty (its background threshold is a share of RAM)
    and the final flush of the store stalls the run instead of overlapping the next forwards.
    """
    pieces = shard_file_pieces(rows, chunk_rows, shard_rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = sum(len(p) for p in pieces)
        written = 0
        while pieces:
            count = os.writev(fd, pieces[:512])
            written += count
            pieces = _advance(pieces, count)
        if written != total:
            raise OSError(f"short write to {path}: {written} of {total} bytes")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _advance(pieces: list[bytes | memoryview], count: int) -> list[bytes | memoryview]:
    """Drop `count` written bytes from the front of `pieces` (writev may write less than asked)."""
    while pieces and count >= len(pieces[0]):
        count -= len(pieces[0])
        pieces = pieces[1:]
    if count:
        pieces = [memoryview(pieces[0])[count:], *pieces[1:]]
    return pieces
