"""Write one shard's features into its Zarr store from a background thread, in whole zarr shards.

The forward of the next batch runs while this thread waits for the device-to-host copy of the previous one and
writes it. A thread is safe here: nothing is compiled in it and it only touches numpy and zarr. Rows are buffered
until a whole zarr shard is full, because a partial write rewrites the whole shard file (5x slower, see
docs/cache-format.md). The store is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.cache_format import StoreLayout, bf16_bits, create_shard_store, fsync_tree, mark_store_complete


class FeatureShardWriter:
    def __init__(self, final_path: Path, *, feature_dim: int, token_arrays: dict[str, Any], attributes: dict[str, Any],
                 max_pending: int = 4) -> None:
        self.final_path = final_path
        self.tmp_path = final_path.with_name(f".{final_path.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp_path, ignore_errors=True)
        self.tmp_path.parent.mkdir(parents=True, exist_ok=True)
        self.features = create_shard_store(self.tmp_path, feature_dim=feature_dim, attributes=attributes, **token_arrays)
        self.num_rows = int(self.features.shape[0])
        self.layout = StoreLayout.for_feature_dim(feature_dim)
        self._buffer = np.empty((min(self.layout.shard_rows, max(self.num_rows, 1)), feature_dim), dtype=np.uint16)
        self._buffer_start = 0  # first row the buffer holds
        self._filled = 0
        self._queue: queue.Queue[tuple[torch.Tensor, Any] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"writer-{final_path.name}", daemon=True)
        self._thread.start()

    def submit(self, rows: torch.Tensor, ready: Any = None) -> None:
        """Queue rows [n, D] (CPU bf16; `ready` is a CUDA event to wait for when the copy is asynchronous)."""
        self._raise_if_failed()
        self._queue.put((rows, ready))

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                rows, ready = item
                if ready is not None:
                    ready.synchronize()
                self._append(bf16_bits(rows))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self._error = error
            while self._queue.get() is not None:  # drain so producers never block
                pass

    def _append(self, rows: np.ndarray) -> None:
        while len(rows):
            take = min(len(rows), len(self._buffer) - self._filled)
            self._buffer[self._filled : self._filled + take] = rows[:take]
            self._filled += take
            rows = rows[take:]
            if self._filled == len(self._buffer) or self._buffer_start + self._filled == self.num_rows:
                self._flush()

    def _flush(self) -> None:
        end = self._buffer_start + self._filled
        if end > self.num_rows:
            # zarr silently drops writes past the array end: refuse instead.
            raise RuntimeError(f"{self.final_path.name}: {end} feature rows written, the store has {self.num_rows}")
        if self._filled:
            self.features[self._buffer_start : end] = self._buffer[: self._filled]
        self._buffer_start, self._filled = end, 0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.final_path.name} failed: {self._error}") from self._error

    def close(self, stats: dict[str, Any]) -> None:
        """Finish writing, check every row arrived, and publish the store atomically."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        if self._buffer_start != self.num_rows:
            raise RuntimeError(f"{self.final_path.name}: {self._buffer_start} of {self.num_rows} feature rows written")
        mark_store_complete(self.tmp_path, stats)
        fsync_tree(self.tmp_path)
        if self.final_path.exists():  # an --overwrite rerun of a finished shard
            shutil.rmtree(self.final_path)
        os.replace(self.tmp_path, self.final_path)

    def abort(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        shutil.rmtree(self.tmp_path, ignore_errors=True)
