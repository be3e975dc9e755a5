"""Live tau of two drafters compared prompt by prompt: two `dflash eval` outputs of the same prompts, paired.

Two drafters evaluated on the same prompts (same dataset, `--max-samples`, `--max-new-tokens` and target) differ
far less from prompt to prompt than the prompts differ from each other (an easy prompt is easy for both), so the
difference of their per-prompt tau has a smaller standard error than the difference of the two means: on
2026-12-06 (H100, 80 HumanEval prompts) the mean per-prompt difference was 0.512 +- 0.061 paired against +- 0.174
unpaired (the pooled taus, 2.651 and 2.061, differ by 0.590 +- 0.146 unpaired). This script pairs
the per-prompt records (`samples` of eval.json) by prompt id, per dataset:

    python benchmarks/compare_live.py NEW_EVAL_DIR BASELINE_EVAL_DIR [--json out.json]

Each argument is an eval output folder (its eval.json) or an eval.json itself; datasets found in both are compared.
For each: the prompts paired, both drafters' tau over them (computed as `dflash eval` computes it), the mean
per-prompt difference (new minus baseline, each prompt weighing the same) with its standard error over prompts,
and on how many prompts the new drafter is higher, lower or equal. Prompts found in only one file, or decoded in no
speculative step in either (no tau), are counted and left out; settings that differ between the two files (the
target, its dtype, the chat template and its arguments, new tokens, temperature) are refused, since they would not
be the same prompts decoded the same way. The drafters may differ in anything, their block size included.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dflash.stage2_train.acceptance import json_safe, paired_tau_difference

# Settings of eval.json that must match for per-prompt records to be comparable.
SAME_SETTINGS = ("target", "target_dtype", "chat_template", "chat_template_kwargs", "max_new_tokens", "temperature")


def load_eval(path: Path) -> dict[str, Any]:
    """An eval.json, given it or the folder that holds it."""
    file = path / "eval.json" if path.is_dir() else path
    if not file.exists():
        raise SystemExit(f"{file}: no eval.json there; pass a `dflash eval --out` folder or its eval.json")
    return json.loads(file.read_text())


def compare_dataset(new: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """One dataset's per-prompt comparison of two eval.json dataset entries (each with `samples`)."""
    new_by_id = {sample["id"]: sample for sample in new["samples"]}
    base_by_id = {sample["id"]: sample for sample in baseline["samples"]}
    paired = [prompt for prompt in new_by_id if prompt in base_by_id]
    if not paired:
        raise SystemExit(f"{new['dataset']}: no prompt id is in both evaluations")
    difference = paired_tau_difference({p: s["tau"] for p, s in new_by_id.items()},
                                       {p: s["tau"] for p, s in base_by_id.items()})  # (it pairs them by id)

    def tau(by_id: dict[str, Any]) -> float:  # mean over the paired prompts' steps of (accepted + 1), as eval's tau
        accepted = [a for prompt in paired for a in by_id[prompt]["accepted"]]
        return sum(a + 1 for a in accepted) / len(accepted) if accepted else math.nan

    return json_safe({  # (NaN, e.g. no paired prompt with a step, as None)
        "prompts_paired": difference["prompts"],
        "prompts_unpaired": len(new_by_id) + len(base_by_id) - 2 * len(paired),
        "prompts_without_steps": difference["no_steps"],
        "tau_new": tau(new_by_id),
        "tau_baseline": tau(base_by_id),
        "difference_mean": difference["mean"],
        "difference_stderr": difference["stderr"],
        "prompts_higher": difference["higher"],
        "prompts_lower": difference["lower"],
        "prompts_equal": difference["equal"],
    })


def compare(new: dict[str, Any], baseline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every dataset of both evaluations, compared prompt by prompt (settings checked first)."""
    differing = [key for key in SAME_SETTINGS if new.get(key) != baseline.get(key)]
    if differing:
        raise SystemExit("the two evaluations differ in " + ", ".join(
            f"{key} ({new.get(key)!r} vs {baseline.get(key)!r})" for key in differing)
            + ": their prompts were not decoded the same way, so they do not pair")
    shared = [name for name in new["datasets"] if name in baseline["datasets"]]
    if not shared:
        raise SystemExit(f"no dataset in both evaluations ({sorted(new['datasets'])} vs "
                         f"{sorted(baseline['datasets'])})")
    return {name: compare_dataset(new["datasets"][name], baseline["datasets"][name]) for name in shared}


def table(comparison: dict[str, dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    def number(value: float | None, sign: str = "") -> str:
        return "n/a" if value is None else f"{value:{sign}.3f}"

    lines = ["| dataset | prompts | tau new | tau baseline | per-prompt difference +- s.e. | higher / lower / equal |",
             "|---|---|---|---|---|---|"]
    for name, row in comparison.items():
        lines.append(f"| {name} | {row['prompts_paired']} | {number(row['tau_new'])} | {number(row['tau_baseline'])} "
                     f"| {number(row['difference_mean'], '+')} +- {number(row['difference_stderr'])} | "
                     f"{row['prompts_higher']} / {row['prompts_lower']} / {row['prompts_equal']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="the new drafter's eval output folder or eval.json")
    parser.add_argument("baseline", type=Path, help="the baseline drafter's eval output folder or eval.json")
    parser.add_argument("--json", type=Path, help="also write the comparison here as JSON")
    args = parser.parse_args(argv)
    comparison = compare(load_eval(args.new), load_eval(args.baseline))
    print(table(comparison))
    if args.json:
        args.json.write_text(json.dumps(comparison, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
