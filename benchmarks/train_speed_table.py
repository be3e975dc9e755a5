"""A Markdown table of benchmarks/bench_train.py results (train_*.json), one row per file, the first the baseline:

    python benchmarks/train_speed_table.py benchmarks/results/DIR/train_profile_*.json > DIR/train_speed.md

Columns: the run's train flags and bench options, the loader step (s/step, block tokens/s, its speed-up over the
first row), the in-memory step (the same micro-batch again and again), the warm-up (first steps, compilations
included), the peak memory and the share of the profiled wall time the GPU was busy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row_label(summary: dict) -> str:
    parts = [summary.get("train_flags", "")]
    if summary.get("sdpa_backends"):
        parts.append(f"SDPA backends {summary['sdpa_backends']}")
    if summary.get("exact_windows"):
        parts.append("exact windows")
    if summary.get("inductor_split_reductions") is False:
        parts.append("split reductions off")
    if summary.get("record_at_once"):
        parts.append("record read every step")
    if summary.get("inputs_in_workers") is False:
        parts.append("inputs built in the main process")
    return "; ".join(p for p in parts if p)


def table(summaries: list[dict]) -> str:
    base = summaries[0]["results"]["loader"]["step_s"]
    lines = [f"Device: {summaries[0]['device']}, torch {summaries[0]['torch']}.", "",
             "| run | loader s/step | block tok/s | speed-up | memory s/step | warm-up s | peak GB | GPU busy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for summary in summaries:
        loader, memory = summary["results"]["loader"], summary["results"]["memory"]
        busy = (summary.get("profile") or {}).get("busy_fraction")
        peak = summary.get("peak_memory_gb")
        lines.append(f"| `{row_label(summary)}` | {loader['step_s']:.4f} | {loader['block_tokens_per_s']:,.0f} | "
                     f"{base / loader['step_s']:.2f}x | {memory['step_s']:.4f} | {summary['warmup_s']:.1f} | "
                     f"{'-' if peak is None else f'{peak:.1f}'} | {'-' if busy is None else f'{busy:.0%}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="train_*.json of bench_train.py, the baseline first")
    args = parser.parse_args()
    print(table([json.loads(path.read_text()) for path in args.files]), end="")


if __name__ == "__main__":
    main()
