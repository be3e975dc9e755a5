"""`dflash generate`: one worker process per device regenerates conversations; the output resumes by sample id.

Output directory:
    conversations.jsonl        the result, in dataset order; feed it to `dflash extract --data`
    generate.json              the settings the output was made with (a rerun with other settings is refused)
    parts/worker-K.jsonl.part  what each worker has finished, one JSON line per conversation, fsynced per chunk
    generate.log, status/      log file (created first) and heartbeats for `dflash status --cache DIR`

Workers append whole chunks of finished conversations to their part file. A kill can leave at most a partial
last line, which the next run cuts off before anything is appended; conversations already in a part file are
never generated again, so a rerun of the same command neither loses nor duplicates a sample.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.shared import cache_format as cf
from dflash.shared.interrupts import interrupt_signal, raise_interrupt
from dflash.shared.logs import get_logger, setup_logging
from dflash.shared.output_dirs import refuse_foreign_folder
from dflash.shared.processes import die_with_parent, stop_processes
from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target, stop_token_ids, target_content_hash
from dflash.stage1_extract.conversations import Conversation, load_conversations, template_fingerprint
from dflash.stage1_extract.generate_parts import (
    LOCK_FILE,
    LOG_FILE,
    OUTPUT_ENTRIES,
    OUTPUT_FILE,
    PARTS_DIR,
    SETTINGS_FILE,
    append_records,
    read_finished,
    repair_part_file,
)
from dflash.stage1_extract.options import GenerateOptions
from dflash.stage1_extract.regenerate import (
    MIN_ANSWER_TOKENS,
    SKIP_NOTHING,
    SKIP_TOO_LONG,
    ConversationRegenerator,
    GenerateSettings,
    end_of_turn_tokens,
    first_prompt_tokens,
    prompt_fits,
)
from dflash.stage1_extract.supervisor import (
    EXIT_FAILED,
    EXIT_OK,
    ExtractRefused,
    Progress,
    detect_devices,
    failure_summary,
    wait_for_event,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class _WorkerConfig:
    out_dir: Path
    load_path: str
    stop_token_ids: list[int]
    settings: GenerateSettings
    log_file: Path
    threads: int
    verbose: bool


def sample_keys(conversations: list[Conversation]) -> list[str]:
    """Output keys: the sample id, made unique with '#n' where a dataset repeats an id."""
    seen: dict[str, int] = {}
    keys = []
    for conversation in conversations:
        count = seen.get(conversation.sample_id, 0)
        seen[conversation.sample_id] = count + 1
        keys.append(conversation.sample_id if count == 0 else f"{conversation.sample_id}#{count}")
    return keys


class GenerateRun:
    def __init__(self, options: GenerateOptions) -> None:
        self.options = options
        self.out_dir = options.out.resolve()
        self.log_file = self.out_dir / LOG_FILE
        self.processes: list[mp.process.BaseProcess] = []
        self.started = time.time()
        self.tokenizer: Any = None  # the target's, loaded by _prepare

    def run(self) -> int:
        from filelock import FileLock, Timeout

        refuse_foreign_folder(self.out_dir, OUTPUT_ENTRIES, "dflash generate output")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(self.log_file, verbose=self.options.verbose)
        print(f"dflash generate: output directory {self.out_dir} (log: {self.log_file})", file=sys.stderr)
        log.info("dflash generate starting (pid %d): %s", os.getpid(), self.options)
        with ExitStack() as stack:
            lock = FileLock(str(self.out_dir / LOCK_FILE), timeout=0)
            try:
                lock.acquire()
            except Timeout as error:
                raise ExtractRefused(f"another `dflash generate` is writing to {self.out_dir}; wait for it or use "
                                     "another --out") from error
            stack.callback(lock.release)
            keys, conversations, config = self._prepare()
            finished = read_finished(self.out_dir)
            pending = [(key, c) for key, c in zip(keys, conversations) if key not in finished]
            log.info("%d conversations: %d already generated, %d to go", len(keys), len(keys) - len(pending),
                     len(pending))
            code = self._supervise(pending, config) if pending else EXIT_OK
            if code == EXIT_OK:
                self._write_output(keys)
            return code
        return EXIT_OK  # pragma: no cover - ExitStack does not swallow exceptions

    def _prepare(self) -> tuple[list[str], list[Conversation], _WorkerConfig]:
        opts = self.options
        target = resolve_target(opts.model)
        tokenizer = load_tokenizer(target.load_path)
        data = load_conversations(opts.data, column=opts.column, split=opts.split, max_samples=opts.max_samples)
        log.info("data %s: %d conversations (skipped while loading: %s)", data.source, len(data.conversations),
                 data.skipped or "none")
        settings = GenerateSettings(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, seed=opts.seed,
                                    max_length=opts.max_length, max_turns=opts.max_turns, batch_tokens=1)
        identity = {
            "target_source": target.source or "embedded:SmolLM2-135M-Instruct",
            "target_hash": target_content_hash(target.load_path, like=self._recorded_target_hash()),
            "tokenizer_hash": template_fingerprint(tokenizer),
            "data_fingerprint": data.fingerprint,
            **settings.identity(),
        }
        self._check_settings(identity, data.source)
        devices, threads = self._devices()
        on_gpu = devices[0].startswith("cuda")
        batch_tokens = opts.batch_tokens or (262144 if on_gpu else 16384)
        settings = GenerateSettings(**{**settings.identity(), "batch_tokens": batch_tokens,
                                       "static_cache": opts.static_cache,
                                       "continuous_batching": opts.continuous_batching})
        config = _WorkerConfig(self.out_dir, target.load_path, stop_token_ids(target.load_path, tokenizer), settings,
                               self.log_file, threads, opts.verbose)
        self.tokenizer = tokenizer
        return sample_keys(data.conversations), data.conversations, config

    def _recorded_target_hash(self) -> str | None:
        """The target hash an earlier run of this output recorded (compared by its own rule: `target_content_hash`)."""
        path = self.out_dir / SETTINGS_FILE
        return json.loads(path.read_text())["identity"].get("target_hash") if path.is_file() else None

    def _check_settings(self, identity: dict[str, Any], source: str) -> None:
        path = self.out_dir / SETTINGS_FILE
        parts = self.out_dir / PARTS_DIR
        if path.exists():
            existing = json.loads(path.read_text())
            differences = [f"{key}: the output has {existing['identity'].get(key)!r}, this run has {value!r}"
                           for key, value in identity.items() if existing["identity"].get(key) != value]
            if differences and not self.options.overwrite:
                raise ExtractRefused(f"{self.out_dir} was generated with different settings:\n  "
                                     + "\n  ".join(differences)
                                     + "\nuse another --out, or pass --overwrite to discard it and generate again")
            if differences:
                log.warning("--overwrite: discarding the earlier output (%s)", "; ".join(differences))
                shutil.rmtree(parts, ignore_errors=True)
                (self.out_dir / OUTPUT_FILE).unlink(missing_ok=True)
        elif parts.exists() and any(parts.iterdir()):
            raise ExtractRefused(f"{parts} holds part files but {path} is missing; delete {parts} to start over")
        cf.write_json_atomic(path, {"identity": identity, "data_source": source})
        parts.mkdir(exist_ok=True)
        for part in parts.glob("*.jsonl.part"):
            cut = repair_part_file(part)
            if cut:
                log.warning("%s: cut off a partial last line (%d bytes) left by an interrupted run", part.name, cut)

    def _devices(self) -> tuple[list[str], int]:
        """Worker devices: `workers_per_gpu` workers share each GPU (decoding a small target is bound by the
        host's per-step overhead, not by the GPU, so several processes per GPU multiply throughput)."""
        devices, threads = detect_devices(self.options.workers)
        if devices[0].startswith("cuda"):
            devices = [device for device in devices for _ in range(self.options.workers_per_gpu)]
        return devices, threads

    def _supervise(self, pending: list[tuple[str, Conversation]], config: _WorkerConfig) -> int:
        devices, _ = self._devices()
        chunk_size = self.options.chunk_size or (1024 if devices[0].startswith("cuda") else 32)
        chunk_count = -(-len(pending) // chunk_size)
        devices = devices[:chunk_count]
        context = mp.get_context("spawn")
        tasks, events = context.Queue(), context.Queue()
        settings = config.settings
        static = (f", static cache: {max(1, settings.batch_tokens // settings.cache_len)} rows x up to "
                  f"{settings.cache_len} positions per batch" if settings.static_cache else
                  ", continuous batching" if settings.continuous_batching else "")
        log.info("generating %d conversations in %d chunk(s) with %d worker(s) on %s, token budget %d, "
                 "up to %d new tokens per turn%s", len(pending), chunk_count, len(devices),
                 ", ".join(sorted(set(devices))), settings.batch_tokens, settings.max_new_tokens, static)
        for worker_id, device in enumerate(devices):
            process = context.Process(target=_worker_main, args=(worker_id, device, config, tasks, events),
                                      name=f"dflash-generate-{worker_id}", daemon=True)
            process.start()
            self.processes.append(process)
        previous = signal.signal(signal.SIGTERM, raise_interrupt)
        try:
            # Counted while the workers load the target; then the chunks, longest first prompts first, so that a
            # chunk's (and a batch's) prompts are of similar length: less left padding, and with --static-cache a
            # shorter KV cache for most batches (`GenerateSettings.batch_cache_len`). Ties keep the data order; the
            # output is written in data order whatever the order of generation.
            prompt_tokens, skipped = self._announce_skipped([conversation for _, conversation in pending], settings)
            order = sorted(range(len(pending)), key=lambda i: -prompt_tokens[i])
            for number in range(chunk_count):
                tasks.put((number, [pending[i] for i in order[number * chunk_size:(number + 1) * chunk_size]]))
            for _ in devices:
                tasks.put(None)
            return self._event_loop(chunk_count, len(pending) - skipped, events)
        except KeyboardInterrupt as interrupt:
            signum = interrupt_signal(interrupt)
            log.warning("interrupted (%s): stopping workers", signum.name)
            stop_processes(self.processes)
            self._write_run_status("interrupted", {})
            return 128 + int(signum)
        finally:
            stop_processes(self.processes)
            tasks.cancel_join_thread()
            tasks.close()
            events.close()
            signal.signal(signal.SIGTERM, previous)

    def _announce_skipped(self, conversations: list[Conversation], settings: GenerateSettings
                          ) -> tuple[list[int], int]:
        """Say how many conversations the workers will skip, and why, before any answer is generated (while the
        workers load the target); returns each conversation's first prompt tokens (0 where it has none) and the
        number skipped (the progress counts the others)."""
        end_tokens = end_of_turn_tokens(self.tokenizer)
        too_long: list[int] = []
        prompt_tokens: list[int] = []
        nothing = 0
        for number, conversation in enumerate(conversations):
            if number % 1000 == 0:  # a heartbeat for `dflash status` while a large dataset is counted
                self._write_run_status("running", {"samples_done": 0, "samples_total": len(conversations)})
            tokens = first_prompt_tokens(self.tokenizer, conversation)
            prompt_tokens.append(tokens or 0)
            if tokens is None:
                nothing += 1
            elif not prompt_fits(settings, tokens, end_tokens):
                too_long.append(tokens)
        if too_long:
            longest_fit = settings.max_length - end_tokens - MIN_ANSWER_TOKENS
            log.warning("%d of %d conversations are skipped (%s): their first prompt has %s to %s tokens, and "
                        "--max-length %d leaves room for prompts of at most %d (an answer of %d tokens or more and "
                        "its %d end-of-turn tokens must fit too); raise --max-length to keep them", len(too_long),
                        len(conversations), SKIP_TOO_LONG, f"{min(too_long):,}", f"{max(too_long):,}",
                        settings.max_length, longest_fit, MIN_ANSWER_TOKENS, end_tokens)
        if nothing:
            log.warning("%d of %d conversations are skipped (%s): no assistant turn follows a prompt",
                        nothing, len(conversations), SKIP_NOTHING)
        if too_long or nothing:
            log.info("generating answers for the other %d", len(conversations) - len(too_long) - nothing)
        return prompt_tokens, len(too_long) + nothing

    def _event_loop(self, chunks: int, total: int, events: Any) -> int:
        progress = Progress(total, desc="generate")
        failed_text = None
        while chunks:
            event, failed_text = wait_for_event(events, self.processes, self.log_file, f"{chunks} chunk(s)")
            if failed_text is not None:
                break
            if event is None:
                self._write_run_status("running", progress.snapshot())
                progress.tick()
                continue
            kind, worker_id, *payload = event
            if kind == "progress":
                progress.add(payload[0], payload[1])
            elif kind == "chunk_done":
                chunks -= 1
            elif kind == "error":
                failed_text = f"worker {worker_id} failed:\n{payload[0]}"
                break
        progress.close()
        if failed_text is not None:
            log.debug("run failed: %s", failed_text)  # the worker's traceback: the log file (console with -v)
            log.error("FAILED. %s (traceback in %s); finished conversations are kept: rerun the same command to "
                      "resume", failure_summary(failed_text), self.log_file)
            self._write_run_status("failed", {"error": failed_text.splitlines()[0]})
            return EXIT_FAILED
        self._write_run_status("done", progress.snapshot())
        return EXIT_OK

    def _write_output(self, keys: list[str]) -> None:
        """conversations.jsonl in dataset order, written to a temporary file and renamed (never half written)."""
        finished = read_finished(self.out_dir)
        missing = [key for key in keys if key not in finished]
        if missing:
            raise ExtractRefused(f"{len(missing)} conversations are not generated (e.g. {missing[:3]}); rerun")
        records = [finished[key] for key in keys]
        kept = [r for r in records if "skipped" not in r]
        path = self.out_dir / OUTPUT_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as handle:
            for record in kept:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        reasons: dict[str, int] = {}
        for record in kept:
            reason = record["dflash"]["finish_reason"]
            reasons[reason] = reasons.get(reason, 0) + 1
        skips: dict[str, int] = {}
        for record in records:
            if "skipped" in record:
                skips[record["skipped"]] = skips.get(record["skipped"], 0) + 1
        tokens = sum(record["dflash"]["generated_tokens"] for record in kept)
        summary = {"conversations": len(kept), "skipped": len(records) - len(kept), "skip_reasons": skips,
                   "generated_tokens": tokens, "finish_reasons": reasons}
        settings = json.loads((self.out_dir / SETTINGS_FILE).read_text())
        cf.write_json_atomic(self.out_dir / SETTINGS_FILE, {**settings, "summary": summary})
        message = (f"generated {len(kept)} conversations ({tokens} new tokens; ends: {reasons}; skipped "
                   f"{len(records) - len(kept)}{f' {skips}' if skips else ''}) -> {path}\n"
                   f"next: dflash extract --data {path}")
        log.info(message)

    def _write_run_status(self, state: str, progress: dict[str, Any]) -> None:
        cf.write_status(self.out_dir, "run", {"command": "generate", "pid": os.getpid(), "state": state,
                                              "started": self.started, **progress})


def _worker_main(worker_id: int, device_name: str, config: _WorkerConfig, tasks: Any, events: Any) -> None:
    """Entry point of a spawned generation worker: load the target once, then take chunks until told to stop."""
    import torch

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor handles Ctrl-C and stops us
    setup_logging(config.log_file, verbose=config.verbose, console=False)
    part_file = config.out_dir / PARTS_DIR / f"worker-{worker_id}.jsonl.part"
    done = {"samples": 0, "tokens": 0, "chunk": -1}

    def heartbeat() -> None:  # `dflash status` reads it; written per batch and before the model loads
        cf.write_status(config.out_dir, f"worker-{worker_id}", {"pid": os.getpid(), "device": device_name, **done})

    def report(conversations: int, tokens: int, skipped: int) -> None:
        events.put(("progress", worker_id, conversations, tokens))
        done["samples"] += conversations + skipped
        done["tokens"] += tokens
        heartbeat()

    try:
        heartbeat()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        log.info("worker %d on %s: loading the target", worker_id, device_name)
        model = load_target_model(config.load_path, device_name)
        if device.type == "cpu":
            # bf16 matmuls are ~1.7x slower than fp32 on CPUs without bf16 units; the text barely changes (near-ties).
            model = model.float()
        tokenizer = load_tokenizer(config.load_path)
        regenerator = ConversationRegenerator(model, tokenizer, config.stop_token_ids, config.settings, report)
        while (task := tasks.get()) is not None:
            number, chunk = task
            done["chunk"] = number
            started = time.time()
            records = regenerator.regenerate(chunk)
            append_records(part_file, records)
            log.info("worker %d: chunk %d done (%d conversations, %.1f s)", worker_id, number, len(chunk),
                     time.time() - started)
            events.put(("chunk_done", worker_id, number))
    except BaseException:  # noqa: BLE001 - every failure goes to the supervisor with its traceback
        text = traceback.format_exc()
        log.error("worker %d failed:\n%s", worker_id, text)
        events.put(("error", worker_id, text))
        raise SystemExit(1)


def run_generate(options: GenerateOptions) -> int:
    return GenerateRun(options).run()
