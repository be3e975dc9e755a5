"""When a path with a costly start (compilation) overtakes a plain one, from two whole training runs' metrics.

    python benchmarks/break_even.py FAST/metrics.jsonl PLAIN/metrics.jsonl [--steady-from 200] [--at 50,100,600]

Each run's `step_s` (the step alone: loader wait, forward, backward, optimizer; no evaluations) summed from step 1:
the time each run needed to reach a step, the steady step time of each (mean from --steady-from to the end) and the
first step from which the fast run's total time stays at or below the plain one's (extrapolated with the steady
step times when the fast run is still behind at the end). Written for `fast_path.COMPILE_MIN_STEPS`
(docs/benchmarks.md); prints Markdown, or JSON with --json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any


def step_seconds(metrics: Path) -> list[float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"step_s"' in line]
    return [float(r["step_s"]) for r in sorted(records, key=lambda r: r["step"])]


def break_even(fast: list[float], plain: list[float], steady_from: int) -> dict[str, Any]:
    steps = min(len(fast), len(plain))
    if steady_from >= steps:
        raise SystemExit(f"--steady-from {steady_from}: the runs have only {steps} steps in common")
    fast_total, plain_total = list(itertools.accumulate(fast[:steps])), list(itertools.accumulate(plain[:steps]))
    fast_steady, plain_steady = statistics.mean(fast[steady_from:steps]), statistics.mean(plain[steady_from:steps])
    behind = [i + 1 for i in range(steps) if fast_total[i] > plain_total[i]]  # steps the fast run is still behind
    crossing: int | None = (behind[-1] + 1 if behind else 1)
    extrapolated = bool(behind) and behind[-1] == steps
    if extrapolated:
        crossing = (steps + round((fast_total[-1] - plain_total[-1]) / (plain_steady - fast_steady))
                    if plain_steady > fast_steady else None)
    return {"steps": steps, "steady_from": steady_from, "fast_steady_s": fast_steady, "plain_steady_s": plain_steady,
            "steady_speedup": plain_steady / fast_steady, "fast_total_s": fast_total, "plain_total_s": plain_total,
            "break_even_step": crossing, "extrapolated": extrapolated}


def markdown(result: dict[str, Any], at: list[int]) -> str:
    rows = ["| step | fast run, s from step 1 | plain run, s from step 1 |", "|---:|---:|---:|"]
    rows += [f"| {n} | {result['fast_total_s'][n - 1]:.1f} | {result['plain_total_s'][n - 1]:.1f} |"
             for n in at if n <= result["steps"]]
    crossing = result["break_even_step"]
    rows.append("")
    rows.append(f"Steady step (steps {result['steady_from'] + 1}-{result['steps']}): fast {result['fast_steady_s']:.4f}"
                f" s, plain {result['plain_steady_s']:.4f} s ({result['steady_speedup']:.2f}x). Break-even: "
                + ("never (the fast run is not faster)" if crossing is None else
                   f"step {crossing}" + (" (extrapolated with the steady steps)" if result["extrapolated"] else "")))
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fast", type=Path)
    parser.add_argument("plain", type=Path)
    parser.add_argument("--steady-from", type=int, default=200, help="steps before this hold warm-up and recompiles")
    parser.add_argument("--at", default="50,100,200,400,600", help="steps to list")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = break_even(step_seconds(args.fast), step_seconds(args.plain), args.steady_from)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_total_s")}, indent=2))
    else:
        print(markdown(result, [int(n) for n in args.at.split(",")]))


if __name__ == "__main__":
    main()
