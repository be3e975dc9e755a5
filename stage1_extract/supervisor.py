"""`dflash extract`: plan the shards, spawn one worker process per device, supervise them, keep the manifest.

The supervisor never loads the target model. It loads the conversations once, decides which shards this run
owns (locks), hands them to worker processes through a queue, aggregates their progress into one bar, records
every finished shard in the manifest, and stops every worker (no orphans, no zombies) on error or signal.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from dflash.shared import cache_format as cf
from dflash.shared.chat_rendering import rendering_record
from dflash.shared.errors import ExtractRefused, UserError
from dflash.shared.interrupts import interrupt_signal, raise_interrupt
from dflash.shared.logs import get_logger, setup_logging
from dflash.shared.output_dirs import refuse_foreign_folder
from dflash.shared.processes import stop_processes
from dflash.shared.target_layers import default_layer_ids, validate_layer_ids
from dflash.shared.target_loading import (
    ResolvedTarget,
    inspect_target,
    load_tokenizer,
    local_model_files,
    resolve_target,
    stop_token_ids,
    target_content_hash,
)
from dflash.stage1_extract.conversations import LoadedConversations, load_conversations, template_fingerprint
from dflash.stage1_extract.options import ExtractOptions
from dflash.stage1_extract.target_export import export_target_files
from dflash.stage1_extract.worker import ShardTask, WorkerConfig, worker_main

log = get_logger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 3


def confirm_overwrite(out: Path, yes: bool) -> None:
    """--overwrite on an existing cache discards finished shards: ask on a terminal, refuse elsewhere unless --yes
    (a pasted or scripted command must not destroy a cache by accident)."""
    if yes or not (out / cf.MANIFEST_FILE).is_file():
        return
    try:
        shards = cf.read_manifest(out).get("shards", {}).values()
        done = [shard for shard in shards if shard.get("status") == cf.SHARD_DONE]
        held = (f"{len(done)} finished shard(s), {sum(s.get('samples', 0) for s in done):,} samples, "
                f"{sum(s.get('bytes', 0) for s in done) / 1e9:.2f} GB")
    except Exception:  # noqa: BLE001 - a damaged manifest: the question without the figures
        held = "its finished shards"
    question = (f"--overwrite: the cache {out} holds {held}; those this run covers are extracted again, and all "
                "of them are discarded if its settings differ. Continue?")
    if sys.stdin.isatty() and sys.stderr.isatty():
        import click

        if click.confirm(question, default=False, err=True):
            return
        raise ExtractRefused("not confirmed: nothing was changed")
    raise ExtractRefused(f"--overwrite on the existing cache {out} discards finished shards: add --yes to confirm "
                         f"(to redo only damaged shards: `dflash extract --repair --out {out}`)")


MAX_SHARDS = 100_000


def parse_shard_spec(text: str) -> list[int]:
    """'3,5-7' -> [3, 5, 6, 7]; ValueError (the message says what is wrong) for anything else or no shard."""
    chosen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not part:
            continue
        if match is None:
            raise ValueError(f"cannot read '{part}' (use e.g. 3,5-7)")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise ValueError(f"'{part}' is an empty range (write the lower shard first, e.g. {high}-{low})")
        if high >= MAX_SHARDS:
            raise ValueError(f"'{part}': shard numbers are below {MAX_SHARDS}")
        chosen.update(range(low, high + 1))
    if not chosen:
        raise ValueError(f"'{text}' selects no shard (use e.g. 3,5-7)")
    return sorted(chosen)


def parse_shard_ranges(text: str, num_shards: int) -> list[int]:
    """'3,5-7' -> [3, 5, 6, 7], checked against the number of shards."""
    try:
        chosen = parse_shard_spec(text)
    except ValueError as error:
        raise ExtractRefused(f"--only-shards: {error}") from error
    bad = sorted(i for i in chosen if not 0 <= i < num_shards)
    if bad:
        raise ExtractRefused(f"--only-shards: shards {bad} do not exist (the cache has shards 0..{num_shards - 1})")
    return chosen


DISK_FULL_ADVICE = ("the disk is full: free space and rerun the same command; finished shards are kept and the "
                    "unfinished one is redone")


def failure_summary(failed_text: str) -> str:
    """First line (who failed) + the exception line + any advice: the traceback itself stays in the log."""
    lines = [line for line in failed_text.splitlines() if line.strip()]
    head, advice = lines[0].rstrip(":"), [line for line in lines if line == DISK_FULL_ADVICE]
    exception = next((line for line in reversed(lines) if line != DISK_FULL_ADVICE and not line.startswith(" ")), "")
    exception = re.sub(r"^dflash(\.\w+)+\.(?=\w+: )", "", exception)  # our own errors by their class name only
    return "; ".join([head, exception, *advice]) if exception != head else "; ".join([head, *advice])


def wait_for_event(events: Any, processes: list[Any], log_file: Path, unfinished: str) -> tuple[Any, str | None]:
    """(the next worker event or None after 0.5 s of quiet, None) - or (None, why the run failed) when a worker
    died or every worker exited with `unfinished` work left."""
    try:
        return events.get(timeout=0.5), None
    except queue.Empty:
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead:
            return None, f"worker {dead[0].name} died with exit code {dead[0].exitcode} (see {log_file})"
        if all(p.exitcode is not None for p in processes):
            return None, f"all workers exited with {unfinished} unfinished"
        return None, None


def split_into_shards(num_items: int, num_shards: int) -> list[range]:
    """Contiguous, deterministic ranges of dataset positions; sizes differ by at most one."""
    return [range(num_items * k // num_shards, num_items * (k + 1) // num_shards) for k in range(num_shards)]


def detect_devices(workers: int | None) -> tuple[list[str], int]:
    """One worker per CUDA device; on CPU `workers` processes sharing the cores, each with OMP_NUM_THREADS threads
    where that is set (as torch itself would), else the cores divided among them. Returns (devices, threads)."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(min(count, workers or count))], 0
    workers = workers or 1
    requested = os.environ.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        return ["cpu"] * workers, int(requested)
    return ["cpu"] * workers, max(1, (os.cpu_count() or 1) // workers)


class Supervisor:
    def __init__(self, options: ExtractOptions) -> None:
        self.options = options
        self.cache_dir = options.out.resolve()
        self.log_file = self.cache_dir / cf.LOG_FILE
        self.processes: list[mp.process.BaseProcess] = []
        self.started = time.time()
        self.hold: cf.CacheHold  # taken when the run starts

    # ------------------------------------------------------------------------------------------ planning

    def prepare(self) -> tuple[dict[str, Any], LoadedConversations, ResolvedTarget, list[int]]:
        opts = self.options
        target = resolve_target(opts.model)
        folder = local_model_files(target.load_path)
        import json

        embed_scale = inspect_target(target.load_path)  # refuses a target dflash cannot work with, before any work
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
        topk = cf.TopKFormat.for_vocab(opts.store_target_topk, int(config["vocab_size"])) \
            if opts.store_target_topk else None
        if opts.target_layers:
            layer_ids = validate_layer_ids(list(opts.target_layers), num_layers)
        else:
            layer_ids = validate_layer_ids(default_layer_ids(num_layers, opts.draft_layers), num_layers)
        tokenizer = load_tokenizer(target.load_path)
        log.info("target %s: %d layers, hidden %d; capturing layers %s", target.display_name, num_layers, hidden,
                 layer_ids)
        data = load_conversations(opts.data, column=opts.column, split=opts.split, max_samples=opts.max_samples)
        log.info("data %s: %d conversations (skipped while loading: %s)", data.source, len(data.conversations),
                 data.skipped or "none")
        if not data.conversations:
            raise ExtractRefused(f"no usable conversations in {data.source} (skipped: {data.skipped})")
        existing = self._existing_manifest()
        num_shards = opts.shards or (existing["identity"]["num_shards"] if existing else None)
        num_shards = num_shards or len(detect_devices(opts.workers)[0])
        num_shards = min(num_shards, len(data.conversations))
        identity = {
            "target_source": target.source or "embedded:SmolLM2-135M-Instruct",
            "target_hash": target_content_hash(target.load_path,
                                               like=existing["identity"].get("target_hash") if existing else None),
            "layer_ids": layer_ids,
            "hidden_size": hidden,
            "feature_dtype": opts.feature_dtype,
            "tokenizer_hash": template_fingerprint(tokenizer),
            "data_fingerprint": data.fingerprint,
            "max_length": opts.max_length,
            "overlength": opts.overlength,
            "num_shards": num_shards,
            "target_topk": topk.record() if topk is not None else None,
        }
        stops = stop_token_ids(target.load_path, tokenizer)
        system_turns = sum(any(m["role"] == "system" for m in c.messages) for c in data.conversations)
        rendering = rendering_record(tokenizer, {}, stops, system_turns / len(data.conversations))
        manifest = self._open_manifest(identity, data, target, num_layers, existing, rendering)
        if not (self.cache_dir / cf.TARGET_DIR / cf.EMBEDDINGS_FILE).is_file():
            export_target_files(folder, tokenizer, self.cache_dir / cf.TARGET_DIR, stops,
                                embed_scale=embed_scale)
        return manifest, data, target, stops

    def _existing_manifest(self) -> dict[str, Any] | None:
        if (self.cache_dir / cf.MANIFEST_FILE).exists():
            return cf.read_manifest(self.cache_dir)
        return None

    def _open_manifest(self, identity: dict[str, Any], data: LoadedConversations, target: ResolvedTarget,
                       num_layers: int, existing: dict[str, Any] | None, rendering: dict[str, Any],
                       ) -> dict[str, Any]:
        extra = {
            cf.OPTIONS_KEY: self.options.recorded(list(identity["layer_ids"])),
            cf.RENDERING_KEY: rendering,
            "target": {"name": target.display_name, "num_hidden_layers": num_layers},
            "data": {"source": data.source, "conversations": len(data.conversations), "skipped_on_load": data.skipped},
        }
        with cf.manifest_lock(self.cache_dir):
            # Read again under the lock: another machine may have created the manifest since it was looked at.
            existing = cf.read_manifest(self.cache_dir) if (self.cache_dir / cf.MANIFEST_FILE).exists() else None
            if existing is not None:
                differences = cf.identity_mismatch(existing["identity"], identity)
                if not differences:
                    return existing
                if self.options.redo:
                    raise ExtractRefused(
                        f"--repair: the shards of {self.cache_dir} cannot be redone as they were made, the "
                        "recorded inputs changed:\n  " + "\n  ".join(differences)
                        + "\nrestore them, or extract the whole cache again into another --out")
                if not self.options.overwrite:
                    raise ExtractRefused(
                        f"the cache {self.cache_dir} was extracted with different settings:\n  "
                        + "\n  ".join(differences)
                        + "\nuse another --out, or pass --overwrite to discard the cache and extract again"
                    )
                if not self.hold.take_alone():  # another run holds the cache (and maybe shards): delete nothing
                    raise ExtractRefused(
                        f"--overwrite: the cache {self.cache_dir} is in use by another running `dflash extract` "
                        f"(see `dflash status --cache {self.cache_dir}`); nothing was deleted: wait for it to "
                        "finish, or extract into another --out")
                log.warning("--overwrite: discarding the existing cache (%s)", "; ".join(differences))
                shutil.rmtree(self.cache_dir / cf.SHARDS_DIR, ignore_errors=True)
                shutil.rmtree(self.cache_dir / cf.TARGET_DIR, ignore_errors=True)
            manifest = cf.new_manifest(identity, extra)
            cf.write_json_atomic(self.cache_dir / cf.MANIFEST_FILE, manifest)
            self.hold.share()
            return manifest

    def _claim_shards(self, manifest: dict[str, Any], stack: ExitStack) -> list[int]:
        """Lock the shards this run will extract; refuse if another run holds any of them."""
        from filelock import FileLock, Timeout

        num_shards = int(manifest["identity"]["num_shards"])
        wanted = (
            parse_shard_ranges(self.options.only_shards, num_shards)
            if self.options.only_shards
            else list(range(num_shards))
        )
        if not (self.options.overwrite or self.options.redo):
            wanted = [i for i in wanted if manifest["shards"][str(i)].get("status") != cf.SHARD_DONE]
        locks_dir = self.cache_dir / cf.LOCKS_DIR
        locks_dir.mkdir(parents=True, exist_ok=True)
        busy = []
        for shard in wanted:
            lock = FileLock(str(locks_dir / f"shard-{shard:05d}.lock"), timeout=0)
            try:
                lock.acquire()
                stack.callback(lock.release)
            except Timeout:
                busy.append(shard)
        if busy:
            raise ExtractRefused(
                f"shards {busy} of {self.cache_dir} are being extracted by another running `dflash extract`; "
                "wait for it, or run a disjoint --only-shards range"
            )
        for shard in wanted:  # leftovers of killed runs of these shards (we hold their locks)
            for stale in (self.cache_dir / cf.SHARDS_DIR).glob(f".{cf.shard_name(shard)}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        return wanted

    # ------------------------------------------------------------------------------------------ running

    def run(self) -> int:
        refuse_foreign_folder(self.cache_dir, cf.CACHE_ENTRIES, "dflash cache")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(self.log_file, verbose=self.options.verbose)
        print(f"dflash extract: cache directory {self.cache_dir} (log: {self.log_file})", file=sys.stderr)
        log.info("dflash extract starting (pid %d): %s", os.getpid(), self.options)
        with ExitStack() as stack:
            self.hold = cf.CacheHold(self.cache_dir)
            stack.callback(self.hold.release)
            manifest, data, target, stops = self.prepare()
            shards = self._claim_shards(manifest, stack)
            if not shards:
                log.info("every requested shard is already complete: nothing to do")
                self._summary()
                return EXIT_OK
            return self._supervise(manifest, data, target, stops, shards)
        return EXIT_OK  # pragma: no cover - ExitStack does not swallow exceptions

    def _supervise(self, manifest: dict[str, Any], data: LoadedConversations, target: ResolvedTarget,
                   stops: list[int], shards: list[int]) -> int:
        devices, threads = detect_devices(self.options.workers)
        devices = devices[: len(shards)]
        identity = manifest["identity"]
        batch_tokens = self.options.batch_tokens or (32768 if devices[0].startswith("cuda") else 4096)
        config = WorkerConfig(
            cache_dir=self.cache_dir,
            load_path=target.load_path,
            layer_ids=list(identity["layer_ids"]),
            max_length=self.options.max_length,
            overlength=self.options.overlength,
            batch_tokens=batch_tokens,
            stop_token_ids=stops,
            log_file=self.log_file,
            threads=threads,
            verbose=self.options.verbose,
            feature_dtype=identity["feature_dtype"],
            attributes={"layer_ids": identity["layer_ids"], "hidden_size": identity["hidden_size"],
                        "feature_dtype": identity["feature_dtype"]},
            topk=identity.get("target_topk"),
        )
        ranges = split_into_shards(len(data.conversations), int(identity["num_shards"]))
        context = mp.get_context("spawn")
        tasks, events = context.Queue(), context.Queue()
        total_samples = 0
        for shard in shards:
            conversations = [data.conversations[i] for i in ranges[shard]]
            total_samples += len(conversations)
            tasks.put(ShardTask(shard=shard, conversations=conversations))
        for _ in devices:
            tasks.put(None)
        log.info("extracting %d shard(s) (%d conversations) with %d worker(s) on %s, token budget %d",
                 len(shards), total_samples, len(devices), ", ".join(sorted(set(devices))), batch_tokens)
        for worker_id, device in enumerate(devices):
            process = context.Process(target=worker_main, args=(worker_id, device, config, tasks, events),
                                      name=f"dflash-extract-{worker_id}", daemon=True)
            process.start()
            self.processes.append(process)
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, raise_interrupt)}
        try:
            return self._event_loop(set(shards), total_samples, events)
        except KeyboardInterrupt as interrupt:
            signum = interrupt_signal(interrupt)
            log.warning("interrupted (%s): stopping workers", signum.name)
            self._stop_workers()
            self._reset_running_shards(shards, cf.SHARD_PENDING)
            self._write_run_status("interrupted", {})
            return 128 + int(signum)
        finally:
            self._stop_workers()
            tasks.cancel_join_thread()  # unread tasks of a stopped run must not block our exit
            tasks.close()
            events.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _event_loop(self, remaining: set[int], total_samples: int, events: Any) -> int:
        progress = Progress(total_samples)
        failed_text = None
        worker_shards: dict[int, int] = {}
        while remaining:
            event, failed_text = wait_for_event(events, self.processes, self.log_file, f"shards {sorted(remaining)}")
            if failed_text is not None:
                break
            if event is None:
                self._write_run_status("running", progress.snapshot())
                progress.tick()
                continue
            kind, worker_id, shard, *payload = event
            if kind == "progress":
                if worker_shards.get(worker_id) != shard:
                    worker_shards[worker_id] = shard
                    self._set_shard(shard, {"status": cf.SHARD_RUNNING, "worker": worker_id, "pid": os.getpid()})
                progress.add(payload[0], payload[1])
            elif kind == "shard_done":
                stats = payload[0]
                self._set_shard(shard, {"status": cf.SHARD_DONE, **stats, "finished": time.time()})
                progress.add(sum(stats["skipped"].values()), 0)
                remaining.discard(shard)
                log.info("shard %d done: %d samples, %d tokens, skipped %s, %.1f s", shard, stats["samples"],
                         stats["tokens"], stats["skipped"] or "none", stats["seconds"])
            elif kind == "error":
                failed_text = f"worker {worker_id} failed on shard {shard}:\n{payload[0]}"
                if "No space left on device" in payload[0]:
                    failed_text += DISK_FULL_ADVICE + "\n"
                self._set_shard(shard, {"status": cf.SHARD_FAILED, "error": payload[0].strip().splitlines()[-1]})
                break
        progress.close()
        if failed_text is not None:
            log.debug("run failed: %s", failed_text)  # the worker's traceback: the log file (console with -v)
            log.error("FAILED. %s (traceback in %s)", failure_summary(failed_text), self.log_file)
            self._stop_workers()
            self._reset_running_shards(sorted(remaining), cf.SHARD_PENDING)
            self._write_run_status("failed", {"error": failed_text.splitlines()[0]})
            return EXIT_FAILED
        self._write_run_status("done", progress.snapshot())
        self._summary()
        return EXIT_OK

    def _set_shard(self, shard: int, entry: dict[str, Any]) -> None:
        def change(manifest: dict[str, Any]) -> None:
            manifest["shards"][str(shard)] = entry

        cf.update_manifest(self.cache_dir, change)

    def _reset_running_shards(self, shards: list[int], status: str) -> None:
        def change(manifest: dict[str, Any]) -> None:
            for shard in shards:
                entry = manifest["shards"][str(shard)]
                if entry.get("status") != cf.SHARD_DONE and entry.get("status") != cf.SHARD_FAILED:
                    manifest["shards"][str(shard)] = {"status": status}

        cf.update_manifest(self.cache_dir, change)

    def _stop_workers(self) -> None:
        stop_processes(self.processes)

    def _write_run_status(self, state: str, progress: dict[str, Any]) -> None:
        cf.write_status(self.cache_dir, "run", {"command": "extract", "pid": os.getpid(), "state": state,
                                                "started": self.started, **progress})

    def _summary(self) -> None:
        manifest = cf.read_manifest(self.cache_dir)
        shards = manifest["shards"].values()
        done = [s for s in shards if s.get("status") == cf.SHARD_DONE]
        samples = sum(s["samples"] for s in done)
        tokens = sum(s["tokens"] for s in done)
        skipped: dict[str, int] = {}
        for entry in done:
            for reason, count in entry.get("skipped", {}).items():
                skipped[reason] = skipped.get(reason, 0) + count
        truncated = sum(s.get("truncated", 0) for s in done)
        cut = (f" (longer than --max-length {manifest['identity']['max_length']} as the chat template renders them: "
               "cut there)" if truncated else "")
        message = (f"cache {self.cache_dir}: {len(done)}/{len(manifest['shards'])} shards done, {samples} samples, "
                   f"{tokens} tokens, {truncated} truncated{cut}, skipped {skipped or 'none'}")
        log.info(message)
        print(message, file=sys.stderr)
        if samples == 0 and len(done) == len(manifest["shards"]):
            too_long = sorted(n for s in done for n in s.get(cf.SKIPPED_LENGTHS_KEY, []))
            raise UserError(empty_cache_cause(self.cache_dir, skipped, too_long, self.options.max_length,
                                              self.options.overlength))


def empty_cache_cause(cache_dir: Path, skipped: dict[str, int], too_long: list[int], max_length: int,
                      overlength: str) -> str:
    """Why an extraction that finished every shard stored no sample, and what to change. `too_long`: the sorted
    token lengths of the skipped conversations that were longer than --max-length."""
    counts = ", ".join(f"{reason}: {count}" for reason, count in sorted(skipped.items())) or "none"
    cause = f"the cache {cache_dir} holds 0 samples: every conversation was skipped ({counts})"
    if too_long:
        total = sum(skipped.values())
        which = f"all {total} are" if len(too_long) == total else f"{len(too_long)} of them are"
        fate = (" were skipped whole" if overlength == "skip"
                else ", cut there, keep no 2 assistant tokens to learn from")
        return (f"{cause}; {which} longer than --max-length {max_length} (shortest {too_long[0]} tokens, median "
                f"{statistics.median_low(too_long)}) and{fate}: raise --max-length (and rerun with --overwrite "
                "--yes)")
    return f"{cause}; check the data and its chat template (see {cache_dir / cf.LOG_FILE})"


class Progress:
    """One progress bar over all workers (samples, tokens/s, ETA); plain log lines when stderr is not a terminal.

    Samples finish in lumps (a whole generate batch at its end), tokens arrive steadily. The ETA is estimated
    when samples finish (the pace so far) and counts down between those moments, instead of growing while a
    long batch runs (once it is overdue, it is the pace so far again); before the first token it says what is
    being waited for."""

    def __init__(self, total_samples: int, desc: str = "extract") -> None:
        from tqdm import tqdm

        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total_samples, unit="sample", dynamic_ncols=True, disable=not self.interactive,
                        desc=desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}"
                                              "{postfix}]")
        self.total = total_samples
        self.samples = 0
        self.tokens = 0
        self.started = time.time()
        self.last_log = self.started
        self.estimate: tuple[float, float] | None = None  # (ETA in seconds, when it was estimated)
        self.bar.set_postfix_str(self.status(), refresh=False)

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if samples:
            elapsed = max(1e-6, time.time() - self.started)
            self.estimate = ((self.total - self.samples) * elapsed / self.samples, time.time())
        self.bar.update(samples)
        self.tick()

    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-6, time.time() - self.started)

    def eta_s(self) -> float | None:
        if self.estimate is None:
            return None
        eta, when = self.estimate
        left = eta - (time.time() - when)
        if left > 0:
            return left
        return (self.total - self.samples) * (time.time() - self.started) / self.samples  # late: the pace so far

    def status(self) -> str:
        """tok/s and ETA; before any token: that the workers are loading the target and reading the first prompts."""
        if self.tokens == 0 and self.samples == 0:
            return "loading the target, first batch (prefill)"
        return f"{self.tokens_per_s():,.0f} tok/s, ETA {_format_seconds(self.eta_s())}"

    def tick(self) -> None:
        if self.interactive:
            self.bar.set_postfix_str(self.status())
        elif time.time() - self.last_log > 10:
            self.last_log = time.time()
            log.info("progress: %d/%d samples, %d tokens, %s", self.samples, self.total, self.tokens, self.status())

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(1e-6, time.time() - self.started)
        return {"samples_done": self.samples, "samples_total": self.total, "tokens_done": self.tokens,
                "tokens_per_s": round(self.tokens / elapsed, 1), "eta_s": self.eta_s()}

    def close(self) -> None:
        self.bar.close()


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(seconds))


def run_extract(options: ExtractOptions) -> int:
    return Supervisor(options).run()
