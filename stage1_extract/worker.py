"""One extraction worker process: owns one device, takes shards from a queue, writes one store per shard.

Spawned by the supervisor (never a thread). Messages to the supervisor go through `events`:
    ("ready", worker_id)
    ("progress", worker_id, shard, samples, tokens)
    ("shard_done", worker_id, shard, stats)
    ("error", worker_id, shard, traceback_text)
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.shared.cache_format import SKIPPED_LENGTHS_KEY, TopKFormat, shard_path, topk_positions, write_status
from dflash.shared.errors import UserError, is_out_of_memory
from dflash.shared.feature_codecs import codec
from dflash.shared.logs import get_logger, setup_logging
from dflash.shared.processes import die_with_parent
from dflash.shared.target_layers import LayerCapture, check_embedding_path, embedding_scale
from dflash.shared.target_loading import load_target_model, load_tokenizer
from dflash.stage1_extract.conversations import (
    Conversation,
    TokenizedSample,
    chat_token_ids,
    tokenize_conversation,
)
from dflash.stage1_extract.shard_writer import FeatureShardWriter
from dflash.stage1_extract.target_topk import TargetTopK

log = get_logger(__name__)

# Skip reasons a longer --max-length can cure (tokenize_conversation).
LENGTH_SKIPS = ("too_long", "no_assistant_tokens")


class SampleOutOfMemory(UserError):
    """One sample (one conversation in `dflash generate`) needs more memory than the device has."""


@dataclass(frozen=True)
class WorkerConfig:
    cache_dir: Path
    load_path: str
    layer_ids: list[int]
    max_length: int
    overlength: str
    batch_tokens: int
    stop_token_ids: list[int]
    log_file: Path
    threads: int = 0  # CPU threads per worker (0 = torch default)
    feature_dtype: str = "bf16"  # how the features are stored: a codec of shared/feature_codecs.py
    verbose: bool = False
    attributes: dict[str, Any] = field(default_factory=dict)
    topk: dict[str, Any] | None = None  # `TopKFormat.record()` of a cache with the target's top-k (else None)


@dataclass(frozen=True)
class ShardTask:
    shard: int
    conversations: list[Conversation]


class PinnedSlots:
    """A few pinned host buffers of one batch each, allocated once and recycled.

    Allocating pinned memory per batch (a new size almost every batch) costs more than the copy itself; taking
    a slot blocks while the writer still holds all of them, which also bounds host memory.
    """

    def __init__(self, count: int, rows: int, width: int, dtype: torch.dtype) -> None:
        import queue

        self.rows = rows
        self.width = width
        self.dtype = dtype
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            self.free.put(torch.empty((rows, width), dtype=dtype, pin_memory=True))

    def take(self, rows: int) -> tuple[torch.Tensor, Any]:
        if rows > self.rows:  # one sample longer than the batch budget: a one-off buffer
            return torch.empty((rows, self.width), dtype=self.dtype, pin_memory=True), None
        slot = self.free.get()
        return slot, lambda: self.free.put(slot)


def plan_batches(lengths: list[int], batch_tokens: int, pad_multiple: int) -> list[list[int]]:
    """Group sample positions (already sorted longest first) into batches of at most `batch_tokens` padded tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    for position, length in enumerate(lengths):
        padded = _round_up(max([lengths[i] for i in current] + [length]), pad_multiple)
        if current and padded * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(position)
    if current:
        batches.append(current)
    return batches


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ShardExtractor:
    """Turns one shard's conversations into a published store; holds the model between shards."""

    def __init__(self, config: WorkerConfig, device: torch.device, report: Any, model: Any = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.device = device
        self.report = report
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.load_path)
        self.model = model if model is not None else load_target_model(config.load_path, str(device))
        check_embedding_path(self.model, embedding_scale(self.model))
        self.topk = TopKFormat.from_record(config.topk)
        # Without top-k the forward ends after the deepest captured layer; with it, it runs to the final norm.
        self.capture = LayerCapture(self.model, config.layer_ids, stop_after_last=self.topk is None)
        self.topk_head = TargetTopK(self.model, self.topk.k) if self.topk is not None else None
        if self.topk_head is not None:
            self.topk_head.check()
        self.hidden_size = int(self.model.config.hidden_size)
        self.feature_dim = self.hidden_size * len(config.layer_ids)
        self.batch_tokens = config.batch_tokens
        self.pad_multiple = 64 if device.type == "cuda" else 8
        self.oom_retries = 0
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.num_layers = len(config.layer_ids)
        self.codec = codec(config.feature_dtype)
        row_width, row_dtype = self.codec.encoded_row_format(self.feature_dim, self.num_layers)
        self.pinned = PinnedSlots(4, self.batch_tokens, row_width, row_dtype) if device.type == "cuda" else None

    def tokenize(self, task: ShardTask) -> tuple[list[TokenizedSample], dict[str, int], list[int]]:
        """The shard's samples (longest first), its skip counts by reason, and the token lengths of the
        conversations skipped because they were longer than --max-length (why a shard may keep nothing)."""
        samples: list[TokenizedSample] = []
        skipped: dict[str, int] = {}
        too_long: list[int] = []
        for conversation in task.conversations:
            result = tokenize_conversation(
                self.tokenizer,
                conversation,
                max_length=self.config.max_length,
                overlength=self.config.overlength,
                stop_token_ids=self.config.stop_token_ids,
            )
            if isinstance(result, str):
                skipped[result] = skipped.get(result, 0) + 1
                if result in LENGTH_SKIPS:  # tokenized again: only skipped conversations pay for it
                    length = len(chat_token_ids(self.tokenizer, [dict(m) for m in conversation.messages],
                                                add_generation_prompt=False))
                    if length > self.config.max_length:
                        too_long.append(length)
            else:
                samples.append(result)
        # Longest first (ties by dataset index): batches pad little, and an OOM shows up at once.
        samples.sort(key=lambda s: (-len(s.input_ids), s.index))
        return samples, skipped, sorted(too_long)

    def run(self, task: ShardTask) -> dict[str, Any]:
        started = time.time()
        samples, skipped, too_long = self.tokenize(task)
        stats = self.write_shard(task.shard, samples, skipped, started)
        if not samples and too_long:  # the manifest keeps them only where they explain an empty shard
            stats[SKIPPED_LENGTHS_KEY] = too_long
        return stats

    def write_shard(self, shard: int, samples: list[TokenizedSample], skipped: dict[str, int],
                    started: float) -> dict[str, Any]:
        """Forward `samples` (sorted longest first) in token-budget batches and publish the shard's store."""
        lengths = [len(s.input_ids) for s in samples]
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        token_arrays = {
            "input_ids": np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int32),
            "loss_mask": np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, np.uint8),
            "offsets": offsets,
            "sample_index": np.array([s.index for s in samples], dtype=np.int64),
            "sample_ids": [s.sample_id for s in samples],
        }
        writer = FeatureShardWriter(
            shard_path(self.config.cache_dir, shard),
            feature_dim=self.feature_dim,
            token_arrays=token_arrays,
            attributes={**self.config.attributes, "shard": shard},
            codec=self.codec,
            num_layers=self.num_layers,
            topk=self.topk,
        )
        try:
            for batch in plan_batches(lengths, self.batch_tokens, self.pad_multiple):
                self._forward_with_backoff([samples[i] for i in batch], writer, shard)
            stats = {
                "samples": len(samples),
                "tokens": int(offsets[-1]),
                "loss_tokens": int(token_arrays["loss_mask"].sum()),
                "truncated": sum(s.truncated for s in samples),
                "skipped": skipped,
                "seconds": round(time.time() - started, 3),
                "oom_retries": self.oom_retries,
            }
            writer.close(stats)
        except BaseException:
            writer.abort()
            raise
        stats["bytes"] = int(stats["tokens"]) * self.codec.stored_row_bytes(self.feature_dim, self.num_layers)
        if self.topk is not None:
            stats["topk_bytes"] = int(writer.topk_rows) * self.topk.row_bytes
        return stats

    def _forward_with_backoff(self, batch: list[TokenizedSample], writer: FeatureShardWriter, shard: int) -> None:
        """Forward one batch; on out-of-memory halve it and retry both halves (in order), instead of dying; a single
        sample that does not fit stops the run with what to change (finished shards are kept)."""
        try:
            self._forward(batch, writer)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            if len(batch) == 1:
                sample = batch[0]
                raise SampleOutOfMemory(
                    f"sample {sample.sample_id} ({len(sample.input_ids):,} tokens) does not fit in the memory of "
                    f"{self.device} even alone: lower --max-length (now {self.config.max_length}; a new --out, or "
                    "--overwrite) or extract on a device with more memory") from error
            self.oom_retries += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.batch_tokens = max(self.pad_multiple, self.batch_tokens // 2)
            log.warning("out of memory on %d samples: retrying as two halves (token budget now %d)",
                        len(batch), self.batch_tokens)
            half = len(batch) // 2
            self._forward_with_backoff(batch[:half], writer, shard)
            self._forward_with_backoff(batch[half:], writer, shard)
            return
        self.report("progress", shard, len(batch), sum(len(s.input_ids) for s in batch))

    def _forward(self, batch: list[TokenizedSample], writer: FeatureShardWriter) -> None:
        width = _round_up(max(len(s.input_ids) for s in batch), self.pad_multiple)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, sample in enumerate(batch):
            ids[row, : len(sample.input_ids)] = sample.input_ids
            mask[row, : len(sample.input_ids)] = 1
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        attention_mask = torch.from_numpy(mask).to(self.device, non_blocking=True)
        topk = None
        if self.topk_head is None:
            features = self.capture.decoder_features(input_ids, attention_mask)  # [B, width, D]
        else:
            features, final = self.capture.decoder_features_and_final(input_ids, attention_mask)
            # The stored top-k of token t is the target's prediction from position t - 1: score the positions
            # whose next token has a top-k row, samples in order (the store's row order).
            source = torch.from_numpy(self._topk_sources(batch, width)).to(self.device, non_blocking=True)
            topk = self.topk_head(final[source])
        rows = features[attention_mask.bool()]  # drop padding on the device: [tokens, D], samples back to back
        rows = self.codec.encode(rows, self.num_layers)  # fp8: quantized here, on the device
        if self.device.type == "cuda":
            # Copy to pinned host memory on a side stream so the next forward overlaps the transfer;
            # the writer thread waits on the event before touching the rows, then hands the slot back.
            slot, release = self.pinned.take(rows.shape[0])
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host = slot[: rows.shape[0]]
                host.copy_(rows, non_blocking=True)
                rows.record_stream(self.copy_stream)
                if topk is not None:  # small (K * 6 bytes per row): pinned buffers from torch's caching allocator
                    topk = tuple(_to_pinned_host(t, self.copy_stream) for t in topk)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            writer.submit(host, ready, release, topk=topk)
        else:
            writer.submit(rows, topk=topk)

    @staticmethod
    def _topk_sources(batch: list[TokenizedSample], width: int) -> np.ndarray:
        """bool [B, width]: the positions t of the padded batch whose next token t + 1 has a top-k row."""
        source = np.zeros((len(batch), width), dtype=bool)
        for row, sample in enumerate(batch):
            positions = topk_positions(sample.loss_mask, np.array([0, len(sample.input_ids)]))
            source[row, : len(positions) - 1] = positions[1:]
        return source


def _to_pinned_host(tensor: torch.Tensor, stream: Any) -> torch.Tensor:
    """An asynchronous copy of a device tensor into pinned host memory, on `stream` (the caller records the event)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    tensor.record_stream(stream)
    return host


def worker_main(worker_id: int, device_name: str, config: WorkerConfig, tasks: Any, events: Any) -> None:
    """Entry point of a spawned worker process."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the supervisor, which stops us
    setup_logging(config.log_file, verbose=config.verbose, console=False)
    shard = -1
    progress = {"samples": 0, "tokens": 0}
    last_heartbeat = 0.0

    def report(kind: str, shard_index: int, *payload: Any) -> None:
        nonlocal last_heartbeat
        events.put((kind, worker_id, shard_index, *payload))
        if kind == "progress":
            progress["samples"] += payload[0]
            progress["tokens"] += payload[1]
        if time.time() - last_heartbeat > 2.0:
            last_heartbeat = time.time()
            write_status(config.cache_dir, f"worker-{worker_id}",
                         {"pid": os.getpid(), "device": device_name, "shard": shard_index, **progress})

    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        log.info("worker %d on %s: loading the target", worker_id, device_name)
        extractor = ShardExtractor(config, device, report)
        events.put(("ready", worker_id, -1))
        while (task := tasks.get()) is not None:
            shard = task.shard
            write_status(config.cache_dir, f"worker-{worker_id}",
                         {"pid": os.getpid(), "device": device_name, "shard": shard, **progress})
            log.info("worker %d: shard %d (%d conversations)", worker_id, shard, len(task.conversations))
            stats = extractor.run(task)
            events.put(("shard_done", worker_id, shard, stats))
            shard = -1
    except BaseException:  # noqa: BLE001 - every failure goes to the supervisor with its traceback
        text = traceback.format_exc()
        log.error("worker %d failed on shard %d:\n%s", worker_id, shard, text)
        events.put(("error", worker_id, shard, text))
        raise SystemExit(1)
