"""The validation and test samples of a cache index, read one at a time: the evaluations of a training run
(`trainer.py`) and the held-out prompts of `dflash eval --data heldout` (`evaluate.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dflash.stage2_train.cache_index import CacheIndex, ShardStore, shard_error


class EvalSet:
    """The validation (or test) samples of an index, readable one by one (in split-hash order, see
    `CacheIndex.eval`)."""

    def __init__(self, index: CacheIndex, split: str = "validation") -> None:
        self.cache_dir = index.cache_dir
        self.samples = index.split(split)
        self.codec = index.codec
        self._stores: dict[int, ShardStore] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """features bf16 [S, D], input_ids long [S], loss_mask bool [S], length, sample_key (shard, row),
        sample_index (position in the dataset) and sample_id."""
        sample = self.samples[i]
        store = self._stores.get(sample.shard)
        if store is None:
            store = self._stores[sample.shard] = ShardStore(self.cache_dir, sample.shard, self.codec)
        start, end = store.bounds(sample.row, sample.length, self.cache_dir)
        try:
            features = np.asarray(store.features[start:end])
            scales = None if store.feature_scales is None else np.asarray(store.feature_scales[start:end])
            input_ids = np.asarray(store.input_ids[start:end])
            loss_mask = np.asarray(store.loss_mask[start:end])
            sample_index, sample_id = store.sample_meta(sample.row)
        except Exception as error:  # noqa: BLE001
            raise shard_error(self.cache_dir, sample.shard, f"could not be read at sample {sample.row} "
                              f"({type(error).__name__}: {error})") from error
        return {
            "features": store.reader.codec.decode_numpy(features, scales),
            "input_ids": torch.from_numpy(input_ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
            "length": sample.length,
            "sample_key": (sample.shard, sample.row),
            "sample_index": sample_index,
            "sample_id": sample_id,
        }


def eval_sequences(index: CacheIndex, limit: int | None = None, split: str = "validation",
                   ) -> Iterator[dict[str, Any]]:
    """The first `limit` (all when None) samples of the validation (or test) split, one dict at a time (see
    `EvalSet.__getitem__`)."""
    eval_set = EvalSet(index, split)
    count = len(eval_set) if limit is None else min(int(limit), len(eval_set))
    for i in range(count):
        yield eval_set[i]
