"""Write one shard's features into its Zarr store from background threads, in whole zarr shard files.

The forward of the next batch runs while the collector thread waits for the device-to-host copy of the previous
one and copies its rows into a staging buffer. Threads are safe here: nothing is compiled in them and they only
touch numpy and files. Rows are buffered until a whole zarr shard file is full (a partial write would rewrite
the whole file); full buffers are encoded and written by a small pool of file-writer threads
(`zarr_shard_file`, byte-identical to zarr's own output, at disk speed). The store is written under a
temporary name and renamed into place when complete. Rows of a scaled codec (fp8) arrive with their scales packed
behind them (`FeatureCodec.encode`); the scales are kept in memory (4 bytes per token and layer) and written at the
end. A cache with the target's top-k (`--store-target-topk`) gets its two top-k arrays the same way as the
features: each batch's rows appended in order, in whole shard files by the same file threads.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.shared.cache_format import (
    TOPK_IDS,
    TOPK_LOGPROBS,
    TopKFormat,
    create_shard_store,
    fsync_tree,
    mark_store_complete,
    write_feature_scales,
)
from dflash.shared.feature_codecs import FeatureCodec
from dflash.stage1_extract.zarr_shard_file import write_shard_file


class _ShardedRows:
    """Rows of one sharded 2-D array of a store being written, appended in order: buffered into whole zarr shard
    files, which `files` (the writer's thread pool) encodes and writes; `buffers` staging buffers are recycled."""

    def __init__(self, store_dir: Path, label: str, array: Any, files: ThreadPoolExecutor, buffers: int) -> None:
        self.store_dir = store_dir
        self.label = label  # the store's published name, for messages
        self.array = array
        self.name = str(array.basename)
        self.kind = "feature" if self.name == "features" else self.name  # how messages name its rows
        self.num_rows = int(array.shape[0])
        self.chunk_rows, self.shard_rows = int(array.chunks[0]), int(array.shards[0])
        self._files = files
        shape = (min(self.shard_rows, max(self.num_rows, 1)), int(array.shape[1]))
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(buffers):
            self._free.put(np.empty(shape, dtype=array.dtype))
        self._buffer = np.empty(shape, dtype=array.dtype)
        self._buffer_start = 0  # first row the buffer holds
        self._filled = 0
        self.received = 0
        self.written: list[Future[int]] = []

    def append(self, rows: np.ndarray) -> None:
        self.received += len(rows)
        if self.received > self.num_rows:
            # zarr silently drops writes past the array end: refuse instead.
            raise RuntimeError(f"{self.label}: {self.received} {self.kind} rows written, the store has "
                               f"{self.num_rows}")
        while len(rows):
            take = min(len(rows), len(self._buffer) - self._filled)
            self._buffer[self._filled : self._filled + take] = rows[:take]
            self._filled += take
            rows = rows[take:]
            if self._filled == len(self._buffer) or self._buffer_start + self._filled == self.num_rows:
                self._flush()

    def _flush(self) -> None:
        end = self._buffer_start + self._filled
        if self._filled:
            shard_file = self.store_dir / self.name / self.array.metadata.encode_chunk_key(
                (self._buffer_start // self.shard_rows, 0))
            self.written.append(self._files.submit(self._write_file, str(shard_file), self._buffer, self._filled))
            self._buffer = self._free.get()  # waits while every buffer is still being written
        self._buffer_start, self._filled = end, 0

    def _write_file(self, path: str, buffer: np.ndarray, rows: int) -> int:
        try:
            return write_shard_file(path, buffer[:rows], self.chunk_rows, self.shard_rows)
        finally:
            self._free.put(buffer)

    def check_complete(self) -> None:
        """Re-raise a failed file write (e.g. disk full); refuse a store with rows missing."""
        for written in self.written:
            written.result()
        if self.received != self.num_rows or self._buffer_start != self.num_rows:
            raise RuntimeError(f"{self.label}: {self.received} of {self.num_rows} {self.kind} rows written")


class FeatureShardWriter:
    def __init__(self, final_path: Path, *, feature_dim: int, token_arrays: dict[str, Any], attributes: dict[str, Any],
                 codec: FeatureCodec, num_layers: int = 1, max_pending: int = 4,
                 file_threads: int = 6, topk: TopKFormat | None = None) -> None:
        self.final_path = final_path
        self.tmp_path = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp_path, ignore_errors=True)
        self.tmp_path.parent.mkdir(parents=True, exist_ok=True)
        group = create_shard_store(self.tmp_path, feature_dim=feature_dim, attributes=attributes, codec=codec,
                                   num_layers=num_layers, topk=topk, **token_arrays)
        self.features = group["features"]
        self.num_rows = int(self.features.shape[0])
        self.feature_dim = feature_dim
        self.codec = codec
        self.topk = topk
        columns = codec.scale_columns(num_layers)
        self._scales = np.zeros((self.num_rows, columns), np.float32) if columns else None
        self._files = ThreadPoolExecutor(file_threads, thread_name_prefix=f"files-{final_path.name}")
        # Staging buffers, recycled: one being filled, the others being written by the file threads.
        self._feature_rows = _ShardedRows(self.tmp_path, final_path.name, self.features, self._files,
                                          file_threads)
        self._topk_rows = [_ShardedRows(self.tmp_path, final_path.name, group[name], self._files, 2)
                           for name in (TOPK_IDS, TOPK_LOGPROBS)] if topk is not None else []
        self.topk_rows = self._topk_rows[0].num_rows if self._topk_rows else 0  # rows of each top-k array
        self._queue: queue.Queue[tuple[torch.Tensor, Any, Any, Any] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"writer-{final_path.name}", daemon=True)
        self._thread.start()

    def submit(self, rows: torch.Tensor, ready: Any = None, release: Any = None,
               topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Queue rows (CPU, from the codec's `encode`: bf16 [n, D], or fp8 bits and scales packed in uint8
        [n, D + 4 L]) and, in a cache with top-k, the batch's top-k rows (CPU: ids [m, K] of any integer dtype,
        log-probs float16 [m, K], one row per `topk_positions` token of the batch's samples, in order). `ready`: a
        CUDA event to wait for when the copies are asynchronous; `release`: called once the rows have been copied
        out, so their (pinned) memory can be reused."""
        self._raise_if_failed()
        if (topk is None) != (self.topk is None):
            raise ValueError(f"{self.final_path.name}: top-k rows {'missing' if topk is None else 'unexpected'}")
        self._queue.put((rows, ready, release, topk))

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                rows, ready, release, topk = item
                if ready is not None:
                    ready.synchronize()
                try:
                    bits, scales = self.codec.split_rows(rows, self.feature_dim)
                    start = self._feature_rows.received
                    self._feature_rows.append(bits)  # refuses rows past the end before the scales are stored
                    if scales is not None:
                        self._scales[start : start + len(scales)] = scales
                    if topk is not None:
                        ids, logprobs = topk
                        self._topk_rows[0].append(ids.numpy().astype(self.topk.ids_dtype, copy=False))
                        self._topk_rows[1].append(logprobs.numpy().astype(self.topk.logprobs_dtype, copy=False))
                finally:
                    if release is not None:
                        release()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self._error = error
            while self._queue.get() is not None:  # drain so producers never block
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.final_path.name} failed: {self._error}") from self._error

    def close(self, stats: dict[str, Any]) -> None:
        """Finish writing, check every row arrived, and publish the store atomically."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        self._files.shutdown(wait=True)
        for rows in (self._feature_rows, *self._topk_rows):
            rows.check_complete()
        if self._scales is not None:
            write_feature_scales(self.tmp_path, self._scales)
        mark_store_complete(self.tmp_path, stats)
        fsync_tree(self.tmp_path)
        if self.final_path.exists():  # an --overwrite rerun of a finished shard
            shutil.rmtree(self.final_path)
        os.replace(self.tmp_path, self.final_path)

    def abort(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        self._files.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.tmp_path, ignore_errors=True)
