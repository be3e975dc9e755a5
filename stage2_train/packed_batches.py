"""Packed micro-batches: the samples of a plan read from the cache into one flat token axis per micro-batch.

`CacheBatches` (an IterableDataset) yields the micro-batches of one rank's plan as packed dicts of CPU tensors (its
docstring lists the keys): the sequences back to back on one axis, their blocks on a second, each axis padded to a
`bucket` so that a run sees few shapes. Stores are opened lazily in each DataLoader worker; worker w of k yields plan
positions start + w, start + w + k, ..., which PyTorch's in-order round-robin merge turns back into plan order
(`packed_loader.make_loader`).

What the trainer takes from a packed batch: its `PackedLayout` (`packed_layout`), the labels and block inputs of the
DFlash objective (`packed_block_labels`, the reference's rule: z-lab/dflash), the target's top-k at the label
positions (`packed_block_topk`), all of it together as `packed_step_inputs`, which the loader's workers add to each
batch (key STEP_INPUTS, when `CacheBatches` is given the block size and mask token) so that the training loop's
process only copies them to the device; and, when a step does not fit in memory, the same batch cut into smaller
ones (`split_packed_batch`, `sequence_blocks`), whose parts the trainer builds those inputs for itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from dflash.shared import cache_format as cf
from dflash.shared.feature_codecs import manifest_codec
from dflash.stage2_train.attention_masks import PackedLayout
from dflash.stage2_train.cache_index import Sample, ShardStore, check_seed, shard_error
from dflash.stage2_train.epoch_plan import AnchorRule, sample_anchors
from dflash.stage2_train.loss import IGNORE_INDEX, selector_positions, supervised_index
from dflash.stage2_train.shape_buckets import DEFAULT_BUCKET_MULTIPLE, bucket

# The key of a packed batch's `packed_step_inputs`, where `CacheBatches` was given the block size and mask token.
STEP_INPUTS = "step_inputs"


def _read_into(array: Any, start: int, end: int, out: np.ndarray) -> None:
    """Read rows start:end of a zarr array straight into `out` (no intermediate array), or copy them from an array
    held in memory (`ShardStore`'s side arrays)."""
    from zarr.core.buffer import default_buffer_prototype

    if isinstance(array, np.ndarray):
        out[...] = array[start:end]
        return
    selection = (slice(start, end),) + (slice(None),) * (out.ndim - 1)
    array.get_basic_selection(selection, out=default_buffer_prototype().nd_buffer.from_numpy_array(out))


def _empty_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> Tensor:
    """An uninitialised tensor; in a DataLoader worker it is allocated in shared memory at once, so handing it
    to the main process does not copy it into shared memory a second time."""
    if shared:
        try:
            storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * dtype.itemsize)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - other torch versions
            pass
    return torch.empty(shape, dtype=dtype)


class CacheBatches(IterableDataset):
    """The micro-batches of one rank's plan, from position `start` on, as packed dicts of CPU tensors.

    Each item packs its B sequences back to back on one flat axis of C = `bucket`(total length) positions (the tail
    is zero padding): features [C, D] as the cache's codec stores them (`FeatureCodec.transport`: bf16 as
    bfloat16, fp8 as uint8 bits) and, for a scaled codec, feature_scales float32 [C, L] (the trainer decodes them on
    its device, so that only the stored bytes cross to the GPU); input_ids long [C], loss_mask bool [C]; lengths
    long [B] and context_starts long [B] (where each sequence starts on the flat axis); the blocks of every
    sequence on a second flat axis of N = `bucket`(blocks, 8) entries: block_anchor long [N] (the anchor's position
    inside its sequence), block_sequence long [N] (index into lengths) and block_valid bool [N] (False for the
    padding at the end), sequence by sequence with anchors sorted; sample_keys long [B, 2] (shard, row) and
    position (int: the micro-batch's index in this rank's plan). Anchors: `sample_anchors` with `rule`. A cache with
    the target's top-k adds topk_ids int32 [C, K] and topk_logprobs float16 [C, K]: at each supervised position
    (`cache_format.topk_positions`) the target's prediction for the token there, zeros elsewhere; `read_topk=False`
    leaves them unread (an objective that does not use them). Given the drafter's `block_size` and `mask_token_id`,
    each item also holds the trainer's inputs built from it, `packed_step_inputs`, under STEP_INPUTS: built in the
    DataLoader worker, off the training loop's process (DFlash 2's selector positions too, `with_selector_index`).
    """

    def __init__(self, cache_dir: Path | str, plan: Sequence[Sequence[Sample]], start: int = 0, *, epoch: int,
                 seed: int, rule: AnchorRule | None = None, bucket_multiple: int = DEFAULT_BUCKET_MULTIPLE,
                 read_topk: bool = True, block_size: int | None = None, mask_token_id: int | None = None,
                 with_selector_index: bool = False) -> None:
        super().__init__()
        if not 0 <= start <= len(plan):
            raise ValueError(f"start={start} outside 0..{len(plan)}")
        if (block_size is None) != (mask_token_id is None):
            raise ValueError("give both block_size and mask_token_id (the step inputs need both), or neither")
        self.block_size = None if block_size is None else int(block_size)
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.with_selector_index = bool(with_selector_index)
        self.cache_dir = Path(cache_dir).resolve()
        self.epoch, self.seed = int(epoch), check_seed(seed)
        self.start = int(start)
        self.rule = rule if rule is not None else AnchorRule()
        self.bucket_multiple = int(bucket_multiple)
        manifest = cf.read_manifest(self.cache_dir)
        self.codec = manifest_codec(manifest)
        self.topk = cf.TopKFormat.of_manifest(manifest) if read_topk else None
        # Compact arrays instead of Python objects: cheap to pickle into spawned workers.
        sizes = np.array([len(batch) for batch in plan], dtype=np.int64)
        self._bounds = np.zeros(len(plan) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._bounds[1:])
        flat = [sample for batch in plan for sample in batch]
        self._samples = np.array([(s.shard, s.row, s.length) for s in flat], dtype=np.int64).reshape(-1, 3)
        self._stores: dict[int, ShardStore] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        """Number of micro-batches this dataset yields (from `start` to the end of the plan)."""
        return len(self._bounds) - 1 - self.start

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_stores"] = {}  # never ship open stores to another process
        return state

    def _store(self, shard: int) -> ShardStore:
        if self._pid != os.getpid():  # a forked worker: open its own handles
            self._stores, self._pid = {}, os.getpid()
        store = self._stores.get(shard)
        if store is None:
            store = self._stores[shard] = ShardStore(self.cache_dir, shard, self.codec, hold_side_arrays=True)
        return store

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for position in range(self.start + worker, len(self._bounds) - 1, workers):
            yield self.batch(position)

    def batch(self, position: int) -> dict[str, Any]:
        """Micro-batch `position` of the plan (random access; iteration uses the same function)."""
        rows = self._samples[self._bounds[position] : self._bounds[position + 1]]
        lengths = rows[:, 2].copy()
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        width = bucket(total, self.bucket_multiple)
        first = self._store(int(rows[0, 0]))
        dim = int(first.features.shape[1])
        shared = get_worker_info() is not None
        columns = int(first.feature_scales.shape[1]) if self.codec.scaled else 0
        stored_dtype = torch.from_numpy(np.zeros(0, self.codec.stored_dtype)).dtype
        features = _empty_tensor((width, dim), stored_dtype, shared)
        feature_bits = features.numpy()  # the same memory, as numpy for zarr to read into
        scales = _empty_tensor((width, columns), torch.float32, shared) if columns else None
        input_ids = np.zeros(width, dtype=np.int32)
        loss_mask = np.zeros(width, dtype=np.uint8)
        topk = None if self.topk is None else (np.zeros((width, self.topk.k), dtype=np.int32),
                                               np.zeros((width, self.topk.k), dtype=np.float16))
        anchors: list[np.ndarray] = []
        for (shard, row, length), begin in zip(rows.tolist(), starts.tolist()):
            store = self._store(shard)
            start, end = store.bounds(row, length, self.cache_dir)
            try:
                _read_into(store.features, start, end, feature_bits[begin : begin + length])
                if scales is not None:
                    _read_into(store.feature_scales, start, end, scales.numpy()[begin : begin + length])
                _read_into(store.input_ids, start, end, input_ids[begin : begin + length])
                _read_into(store.loss_mask, start, end, loss_mask[begin : begin + length])
                if topk is not None:
                    _read_topk(store, row, loss_mask[begin : begin + length], topk[0][begin : begin + length],
                               topk[1][begin : begin + length])
            except Exception as error:  # noqa: BLE001 - a checksum failure or a vanished file
                raise shard_error(self.cache_dir, shard,
                                  f"could not be read at sample {row} ({type(error).__name__}: {error})") from error
            anchors.append(sample_anchors(loss_mask[begin : begin + length], self.rule, self.seed, self.epoch,
                                          shard, row))
        feature_bits[total:] = 0
        if scales is not None:
            scales.numpy()[total:] = 0
        counts = np.array([len(a) for a in anchors], dtype=np.int64)
        blocks = int(counts.sum())
        num_blocks = bucket(blocks, 8)
        block_anchor = np.zeros(num_blocks, dtype=np.int64)
        block_sequence = np.zeros(num_blocks, dtype=np.int64)
        if blocks:
            block_anchor[:blocks] = np.concatenate(anchors)
            block_sequence[:blocks] = np.repeat(np.arange(len(rows)), counts)
        batch: dict[str, Any] = {
            "features": self.codec.transport(features),
            "input_ids": torch.from_numpy(input_ids).long(),
            "loss_mask": torch.from_numpy(loss_mask).bool(),
            "lengths": torch.from_numpy(lengths),
            "context_starts": torch.from_numpy(starts),
            "block_anchor": torch.from_numpy(block_anchor),
            "block_sequence": torch.from_numpy(block_sequence),
            "block_valid": torch.from_numpy(np.arange(num_blocks) < blocks),
            "sample_keys": torch.from_numpy(rows[:, :2].copy()),
            "position": position,
        }
        if scales is not None:
            batch["feature_scales"] = scales
        if topk is not None:
            batch["topk_ids"], batch["topk_logprobs"] = torch.from_numpy(topk[0]), torch.from_numpy(topk[1])
        if self.block_size is not None:
            assert self.mask_token_id is not None
            batch[STEP_INPUTS] = packed_step_inputs(batch, self.block_size, self.mask_token_id,
                                                    with_selector_index=self.with_selector_index)
        return batch


def _read_topk(store: ShardStore, row: int, loss_mask: np.ndarray, ids_out: np.ndarray,
               logprobs_out: np.ndarray) -> None:
    """Sample `row`'s stored top-k rows into the rows of its `topk_positions` tokens (the other rows stay 0)."""
    start, end = int(store.topk_offsets[row]), int(store.topk_offsets[row + 1])
    positions = cf.topk_positions(loss_mask, np.array([0, len(loss_mask)]))
    if end - start != int(positions.sum()):
        raise ValueError(f"{end - start} top-k rows for {int(positions.sum())} supervised tokens")
    ids = np.empty((end - start, ids_out.shape[1]), dtype=store.topk_ids.dtype)
    logprobs = np.empty((end - start, logprobs_out.shape[1]), dtype=store.topk_logprobs.dtype)
    _read_into(store.topk_ids, start, end, ids)
    _read_into(store.topk_logprobs, start, end, logprobs)
    ids_out[positions] = ids
    logprobs_out[positions] = logprobs


def split_packed_batch(batch: dict[str, Any], ranges: Sequence[tuple[int, int]],
                       bucket_multiple: int = DEFAULT_BUCKET_MULTIPLE) -> list[dict[str, Any]]:
    """A packed batch from `CacheBatches` cut into the packed batches of the sequence ranges [a, b) (consecutive,
    covering every sequence): the same samples, anchors and order, re-padded to their own buckets. A part is built
    key by key and never carries the whole batch's STEP_INPUTS (they describe the whole; the trainer builds each
    part's own); one range returns the batch itself, with them."""
    if len(ranges) == 1:
        return [batch]
    lengths, starts = batch["lengths"], batch["context_starts"]
    sequence = batch["block_sequence"]
    valid = batch["block_valid"]
    parts = []
    for a, b in ranges:
        begin, end = int(starts[a]), int(starts[b - 1] + lengths[b - 1])
        width = bucket(end - begin, bucket_multiple)
        chosen = valid & (sequence >= a) & (sequence < b)
        blocks = int(chosen.sum())
        num_blocks = bucket(blocks, 8)

        def padded(values: Tensor, size: int, fill: int = 0) -> Tensor:
            # pinned like the loader's batch (on CUDA), so that the trainer copies the part to the device at once
            out = torch.full((size, *values.shape[1:]), fill, dtype=values.dtype, pin_memory=values.is_pinned())
            out[: len(values)] = values
            return out

        part = {
            "features": padded(batch["features"][begin:end], width),
            "input_ids": padded(batch["input_ids"][begin:end], width),
            "loss_mask": padded(batch["loss_mask"][begin:end], width),
            "lengths": lengths[a:b].clone(),
            "context_starts": starts[a:b] - begin,
            "block_anchor": padded(batch["block_anchor"][chosen], num_blocks),
            "block_sequence": padded(sequence[chosen] - a, num_blocks),
            "block_valid": torch.arange(num_blocks) < blocks,
            "sample_keys": batch["sample_keys"][a:b].clone(),
            "position": batch["position"],
        }
        for name in ("feature_scales", "topk_ids", "topk_logprobs"):
            if name in batch:
                part[name] = padded(batch[name][begin:end], width)
        parts.append(part)
    return parts


def sequence_blocks(batch: dict[str, Any]) -> np.ndarray:
    """Blocks per sequence of a packed batch."""
    counts = torch.bincount(batch["block_sequence"][batch["block_valid"]], minlength=len(batch["lengths"]))
    return counts.numpy()


def packed_layout(batch: dict[str, Any], block_size: int, inputs: dict[str, Tensor] | None = None) -> PackedLayout:
    """The `PackedLayout` of a packed batch from `CacheBatches` (on the batch's device); with the batch's
    `packed_step_inputs`, their layout tensors instead of computing them again."""
    width = int(batch["input_ids"].shape[0])
    if inputs is not None:
        context_positions, block_context_start = inputs["context_positions"], inputs["block_context_start"]
    else:
        lengths, starts = batch["lengths"], batch["context_starts"]
        positions = torch.arange(width, device=lengths.device)
        sequence_of = (torch.bucketize(positions, starts[1:], right=True) if len(starts) > 1
                       else torch.zeros_like(positions))
        inside = positions < (starts[-1] + lengths[-1])
        context_positions = torch.where(inside, positions - starts[sequence_of], torch.zeros_like(positions))
        block_context_start = starts[batch["block_sequence"]]
    return PackedLayout(block_anchor=batch["block_anchor"], block_context_start=block_context_start,
                        block_valid=batch["block_valid"], context_positions=context_positions, context_len=width,
                        block_size=block_size)


def _block_positions(batch: dict[str, Any], layout: PackedLayout) -> tuple[Tensor, Tensor]:
    """(at [N, Bk]: the flat context position p + k of each block entry, clamped into the axis; inside [N, Bk]:
    whether that position exists in the block's own sequence, for a valid block)."""
    offsets = torch.arange(layout.block_size, device=layout.device)
    ends = (batch["context_starts"] + batch["lengths"])[batch["block_sequence"]]  # one past each block's sequence
    flat = layout.block_context_start[:, None] + layout.block_anchor[:, None] + offsets  # [N, Bk]
    inside = (flat < ends[:, None]) & layout.block_valid[:, None]
    return flat.clamp(max=layout.context_len - 1), inside


def packed_block_labels(batch: dict[str, Any], layout: PackedLayout, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """Labels and block inputs of the DFlash objective for a packed batch: labels [1, N, Bk] long, the token at
    position p + k of the block's own sequence for k >= 1 where that position exists and is supervised, else -100;
    block inputs [1, N, Bk] long, [token at p, MASK, ...] (all MASK for a padding block)."""
    offsets = torch.arange(layout.block_size, device=layout.device)
    at, inside = _block_positions(batch, layout)
    tokens = batch["input_ids"][at]
    keep = inside & batch["loss_mask"][at] & (offsets >= 1)
    labels = torch.where(keep, tokens, torch.full_like(tokens, IGNORE_INDEX))
    block_ids = torch.full_like(tokens, int(mask_token_id))
    block_ids[:, 0] = torch.where(layout.block_valid, tokens[:, 0], torch.full_like(tokens[:, 0], int(mask_token_id)))
    return labels[None], block_ids[None]


def packed_block_topk(batch: dict[str, Any], layout: PackedLayout) -> tuple[Tensor, Tensor] | None:
    """The target's top-k of each label position of a packed batch, taken exactly where `packed_block_labels`
    takes the label (the stored row of position p + k is the target's prediction for the token there): ids
    [1, N, Bk, K] int32 and log-probabilities [1, N, Bk, K] float16 (zeros where nothing is supervised); None for a
    cache without top-k."""
    if "topk_ids" not in batch:
        return None
    at, _ = _block_positions(batch, layout)
    return batch["topk_ids"][at][None], batch["topk_logprobs"][at][None]


def packed_step_inputs(batch: dict[str, Any], block_size: int, mask_token_id: int, *,
                       with_selector_index: bool) -> dict[str, Tensor]:
    """Everything the trainer builds from a packed batch before copying it to the device, as a plain dict of
    tensors (DataLoader's pin_memory pins a dict's tensors, not a dataclass's): the `PackedLayout`'s own tensors
    context_positions [C] and block_context_start [N] (its block_anchor and block_valid are the batch's;
    `packed_layout(batch, block_size, inputs)` puts it together), labels and block_ids [1, N, Bk]
    (`packed_block_labels`), label_index (`loss.supervised_index` of the labels), selector_index (only
    `with_selector_index`, for a DFlash 2 drafter: the positions its selector loss scores, `loss.selector_positions`)
    and, for a batch with the target's top-k, topk_ids and topk_logprobs [1, N, Bk, K] (`packed_block_topk`)."""
    layout = packed_layout(batch, block_size)
    labels, block_ids = packed_block_labels(batch, layout, mask_token_id)
    inputs = {"context_positions": layout.context_positions, "block_context_start": layout.block_context_start,
              "labels": labels, "block_ids": block_ids, "label_index": supervised_index(labels)}
    if with_selector_index:
        inputs["selector_index"] = selector_positions(labels, block_ids)
    topk = packed_block_topk(batch, layout)
    if topk is not None:
        inputs["topk_ids"], inputs["topk_logprobs"] = topk
    return inputs
