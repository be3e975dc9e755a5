"""One loader worker's time per micro-batch on a real cache: what `dflash train --num-workers N` must beat.

Each of the loader's workers builds whole micro-batches (the zarr reads, the stored features as they are, packing,
the step's inputs: `packed_batches.CacheBatches`), and the DataLoader hands them over in plan order, so a step
waits for the loader unless one worker's time per micro-batch is under N x the step's time. This times that work
in this process (`--num-workers 0`, one thread as torch gives each worker), micro-batch by micro-batch, on the run `dflash train --cache CACHE
TRAIN_FLAGS` would set up (options parsed by the CLI itself, with its defaults):

    python benchmarks/bench_loader.py --cache CACHE [--train-flags "--batch-tokens 49152"] [--batches 40]
        [--repeats 3] [--step-s 0.043] --out FILE.json

Reported, for the repeat whose mean is the median (each repeat's figures kept beside it, `repeats`): seconds per
micro-batch (mean, median, 90th percentile, max; the first, which opens the stores, apart),
tokens and block tokens per micro-batch, and the workers one worker's mean asks for at a step of --step-s seconds
(default 0.043: the SmolLM2 drafter's median step on an H100, docs/benchmarks.md). Not counted: what a worker does
besides building (moving its batch's tensors into shared memory, ~58 MB a micro-batch of the SmolLM2 cache) and the
hand-over between processes; on a CUDA machine the pinning of each batch is counted (with no workers the loader
pins in this process).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_train import real_options  # noqa: E402


def time_batches(cache: str, train_flags: str, batches: int) -> dict[str, Any]:
    """Seconds of each of the first `batches` micro-batches of epoch 0, built in this process."""
    from dataclasses import replace

    from dflash.stage2_train.run_setup import setup_run

    torch.set_num_threads(1)  # as torch runs each DataLoader worker
    with tempfile.TemporaryDirectory() as work:
        options = replace(real_options(cache, train_flags, Path(work) / "run"), num_workers=0)
        run = setup_run(options)
        try:
            plan = run.plan(0)
            loader = iter(run.loader(0, 0, plan))
            seconds, tokens, block_tokens = [], [], []
            for _ in range(min(batches, len(plan))):
                started = time.perf_counter()
                batch = next(loader)
                seconds.append(time.perf_counter() - started)
                tokens.append(int(batch["lengths"].sum()))
                block_tokens.append(int(batch["block_valid"].sum()) * options.block_size)
        finally:
            if run.lock is not None:
                run.lock.release()
    return {"micro_batches_in_epoch": len(plan), "seconds": seconds, "tokens": tokens, "block_tokens": block_tokens,
            "batch_tokens": options.batch_tokens}


def summarize(timed: dict[str, Any], step_s: float) -> dict[str, Any]:
    """The figures of `time_batches`: the first micro-batch (opening the stores) apart from the rest."""
    rest = timed["seconds"][1:] or timed["seconds"]
    mean = statistics.fmean(rest)
    ordered = sorted(rest)
    return {
        "micro_batches": len(timed["seconds"]),
        "first_s": timed["seconds"][0],
        "mean_s": mean,
        "median_s": statistics.median(rest),
        "p90_s": ordered[min(len(ordered) - 1, math.floor(0.9 * len(ordered)))],
        "max_s": ordered[-1],
        "tokens_per_batch": statistics.fmean(timed["tokens"]),
        "block_tokens_per_batch": statistics.fmean(timed["block_tokens"]),
        "step_s": step_s,
        "workers_needed": math.ceil(mean / step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="a cache folder (or s3:// URL) as `dflash train` takes it")
    parser.add_argument("--train-flags", default="", help="more `dflash train` flags (e.g. --batch-tokens 49152)")
    parser.add_argument("--batches", type=int, default=40, help="micro-batches to time (the first included)")
    parser.add_argument("--repeats", type=int, default=3, help="times to time them, each with a fresh run and loader")
    parser.add_argument("--step-s", type=float, default=0.043, help="the step time the workers must keep up with")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args()
    if args.batches < 2:
        parser.error("--batches must be at least 2 (the first, which opens the stores, is reported apart)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from dflash.stage2_train.run_setup import cpus_per_process

    cpus = cpus_per_process(1)  # the CPUs this process may use, as the trainer counts them
    repeats = [time_batches(args.cache, args.train_flags, args.batches) for _ in range(args.repeats)]
    summaries = [summarize(timed, args.step_s) for timed in repeats]
    # The repeat of the median mean stands for them all (of an even number, the upper of the middle two); each
    # repeat's figures are kept.
    summary = {**sorted(summaries, key=lambda s: s["mean_s"])[len(summaries) // 2],
               "repeat_means_s": [s["mean_s"] for s in summaries]}
    record = {"cache": args.cache, "train_flags": args.train_flags, "summary": summary, "repeats": summaries,
              "timed": repeats,
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": cpus,
                          "torch": torch.__version__}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    means = ", ".join(f"{m:.3f}" for m in summary["repeat_means_s"])
    print(f"{summary['micro_batches']} micro-batches of ~{summary['tokens_per_batch']:.0f} tokens: "
          f"{summary['mean_s']:.3f} s each (the median repeat; repeats' means {means}; its median "
          f"{summary['median_s']:.3f}, p90 {summary['p90_s']:.3f}, first {summary['first_s']:.3f}); at {args.step_s} "
          f"s a step the loader needs >= {summary['workers_needed']} workers -> {args.out}")


if __name__ == "__main__":
    main()
