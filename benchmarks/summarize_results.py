"""Summarise a GPU results folder of benchmarks/results into its summary.json, reading its raw files.

A folder of a GPU session (benchmarks/gpu_pipeline.sh or gpu_ablation.sh output) keeps what a reader needs in
plain sight: `command.txt` (the command, the machine, the date), `summary.json` (written by this script) and the
files later runs or scripts read (e.g. `generated.jsonl.gz`); the raw logs, metrics and evaluation outputs lie in
one archive beside them, `raw.tar.xz`. This script reads the raw files from the archive or, before archiving, from
the folder itself, so every number in a summary is read, never typed:

    python benchmarks/summarize_results.py benchmarks/results/h200_headline_anchors   # writes its summary.json
    python benchmarks/summarize_results.py --check benchmarks/results/*/               # exit 1 if one is stale

Archive a new folder's raw files after summarising it (from inside the folder; keep what later runs read):

    tar -cJf raw.tar.xz --remove-files $(ls | grep -vx -e summary.json -e command.txt -e generated.jsonl.gz)

What it reads: `timings.tsv` (stage times, cache sizes, generation counts), `run_*/metrics.jsonl` and
`metrics_*.jsonl` (training runs: steps, speed, the held-out tau curve), `train.log` / `*.out` / `*.log` (the split
sizes, and the tau curve of runs whose metrics did not come back), `eval*.json` (`dflash eval` per dataset, with
tau's standard error over prompts recomputed from the per-prompt records where the file predates it),
`inspect_*.json`, `extract*.log`, `generate.log` and `smi.csv`.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from dflash.stage2_train.acceptance import tau_standard_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_bench import UNTIMED_STEPS, step_cost  # noqa: E402

ARCHIVE = "raw.tar.xz"
SUMMARY = "summary.json"
NOT_RAW = {SUMMARY, "command.txt", ARCHIVE}


def raw_files(folder: Path) -> dict[str, bytes]:
    """Every raw file of `folder` by its path relative to it: the archive's members and the plain files beside it
    (binary data such as `.gz` and `.png` left out)."""
    files: dict[str, bytes] = {}
    archive = folder / ARCHIVE
    if archive.exists():
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    files[str(PurePosixPath(member.name.removeprefix("./")))] = tar.extractfile(member).read()
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_file() and relative not in NOT_RAW:
            files[relative] = path.read_bytes()
    return {name: files[name] for name in sorted(files) if not name.endswith((".gz", ".png", ".tgz"))}


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _json_prefix(data: bytes) -> Any:
    """The JSON value at the start of a file (some have a log line appended after it)."""
    value, _ = json.JSONDecoder().raw_decode(_text(data).lstrip())
    return value


def stages(text: str) -> dict[str, Any]:
    """timings.tsv: `NAME\\tN s\\trc R` stage lines, `BYTES\\tPATH` cache sizes, the `generated` counts, and every
    other line as a note."""
    out: dict[str, Any] = {"stages": [], "cache_bytes": {}, "notes": []}
    for line in text.splitlines():
        fields = line.split("\t")
        if m := re.fullmatch(r"(\S+)\t(\d+) s\trc (-?\d+)", line):
            out["stages"].append([m.group(1), int(m.group(2)), int(m.group(3))])
        elif re.fullmatch(r"\d+\t\S+", line):
            out["cache_bytes"][PurePosixPath(fields[1]).name] = int(fields[0])
        elif m := re.fullmatch(r"generated\t(\d+) conversations\t(\d+) new tokens\t(\d+) skipped\t(\{.*\})", line):
            out["generated"] = {"conversations": int(m.group(1)), "new_tokens": int(m.group(2)),
                                "skipped": int(m.group(3)), "finish_reasons": ast.literal_eval(m.group(4))}
        elif line.strip():
            out["notes"].append(line)
    return {key: value for key, value in out.items() if value}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def training_run(records: list[dict], log: str | None) -> dict[str, Any]:
    """One run's metrics.jsonl records (and its train.log, for the split sizes)."""
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/tau_walk" in r]
    run: dict[str, Any] = {}
    if log and (m := re.search(r"training (\d+) steps .*?, (\d+) train / (\d+) (?:eval|validation)"
                               r"(?: / (\d+) test)? samples", log)):
        run["planned_steps"] = int(m.group(1))
        run["split"] = {"train": int(m.group(2)), "validation": int(m.group(3))}
        if m.group(4):
            run["split"]["test"] = int(m.group(4))
    if steps:
        last = steps[-1]
        run["steps"] = last["step"]
        if "elapsed_s" in last:
            run["elapsed_s"] = last["elapsed_s"]
            run["steps_per_s"] = last["step"] / last["elapsed_s"]
        run["loss_mean_last_20_steps"] = _mean([r["loss"] for r in steps[-20:]])
        if all("step_s" in r for r in steps):
            run["step_time"] = step_time(steps, [r["step"] for r in evals])
    if evals:
        sequences = {r.get("eval/sequences") for r in evals}
        run["eval"] = {
            "sequences": sequences.pop() if len(sequences) == 1 else sorted(sequences),
            "tokens": evals[-1].get("eval/tokens"),
            "whole_validation_split": (run.get("split", {}).get("validation") == evals[-1].get("eval/sequences")
                                       if "split" in run else None),
            "tau_walk_by_step": [[r["step"], r["eval/tau_walk"], r.get("eval/tau_walk_stderr")] for r in evals],
            "tau_random_anchors_last": evals[-1].get("eval/tau_random_anchors"),
        }
        trained = [r for r in evals if r["step"] > 0] or evals
        best = max(trained, key=lambda r: r["eval/tau_walk"])
        run["best"] = {"step": best["step"], "tau_walk": best["eval/tau_walk"],
                       "tau_walk_stderr": best.get("eval/tau_walk_stderr")}
        run["last"] = {"step": evals[-1]["step"], "tau_walk": evals[-1]["eval/tau_walk"],
                       "tau_walk_stderr": evals[-1].get("eval/tau_walk_stderr")}
    tests = [r for r in records if any(k.startswith("test/") for k in r)]
    if tests:
        run["test"] = {k: v for k, v in tests[-1].items() if not isinstance(v, list)}
    return run


def step_time(steps: list[dict], eval_steps: list[int]) -> dict[str, Any]:
    """The run's step cost as the recipe bench reports it (`recipe_bench.step_cost`: s/step after the first
    UNTIMED_STEPS steps, which hold the warm-up and compilation, and those steps' seconds apart; for a run longer than
    them), its training seconds (every step's own `step_s`, evaluations excluded), and the training seconds spent
    by each evaluated step (the sum of every step's time up to it, compilation included), which puts runs of
    different step costs on one time axis."""
    spent, train_s_at = 0.0, {0: 0.0}
    for r in steps:
        spent += r["step_s"]
        train_s_at[r["step"]] = spent
    out = step_cost(steps, UNTIMED_STEPS) if steps[-1]["step"] > UNTIMED_STEPS else {"train_s": spent}
    out["train_s_at_eval"] = [[step, train_s_at.get(step)] for step in eval_steps]  # None: its step not recorded
    return out


EVAL_LINE = re.compile(r"eval step (\d+): tau ([\d.]+)(?: \+- ([\d.]+))? \(walk(?:, (\d+) \w+ sequences)?")


def logged_evals(text: str) -> list[list]:
    """[step, tau_walk, stderr or None, sequences or None] of every trainer evaluation a log printed."""
    return [[int(m.group(1)), float(m.group(2)), float(m.group(3)) if m.group(3) else None,
             int(m.group(4)) if m.group(4) else None] for m in EVAL_LINE.finditer(text)]


def evaluation(report: dict) -> dict[str, Any]:
    """A `dflash eval` eval.json: per dataset the pooled tau with its standard error over prompts, speeds,
    greedy checks and the offline walk of the same sequences."""
    out: dict[str, Any] = {key: report.get(key) for key in ("draft_dir", "created", "device", "target_dtype",
                                                            "max_new_tokens", "temperature")}
    datasets = {}
    for name, d in report["datasets"].items():
        samples = d.get("samples") or []
        stderr = d.get("tau_stderr")
        source = "recorded"
        if stderr is None and samples and all("accepted" in s for s in samples):
            stderr = tau_standard_error([sum(a + 1 for a in s["accepted"]) for s in samples],
                                        [len(s["accepted"]) for s in samples])
            source = "recomputed from the per-prompt records"
        entry = {key: d.get(key) for key in ("prompts", "steps", "tau") if key in d}
        entry["tau_stderr"] = stderr
        entry["tau_stderr_source"] = source if stderr is not None else None
        for key in ("tokens_per_second", "speedup", "greedy_identical", "tie_divergences"):
            if d.get(key) is not None:
                entry[key] = d[key]
        if d.get("offline"):
            entry["offline_walk"] = {k: d["offline"][k] for k in ("tau_walk", "sequences", "steps")
                                     if k in d["offline"]}
        datasets[name] = entry
    out["datasets"] = datasets
    if report.get("training"):
        out["training"] = {k: v for k, v in report["training"].items() if k in ("trained_tau_walk", "trained_step")}
    return out


def markdown_rows(text: str) -> dict[str, dict[str, Any]]:
    """The first table of an eval.md, one dict per dataset row keyed by the table's column names."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        values = [float(c.removesuffix("x")) if re.fullmatch(r"[\d.]+x?", c) else c for c in cells]
        rows[str(values[0])] = dict(zip(header[1:], values[1:]))
    return rows


def gpu_samples(text: str) -> dict[str, Any]:
    """nvidia-smi --query-gpu samples (timestamp, utilization.gpu [%], memory.used [MiB])."""
    rows = [line.split(",") for line in text.splitlines()[1:] if line.count(",") >= 2]
    busy = [float(r[1].strip().rstrip(" %")) for r in rows]
    memory = [float(r[2].strip().split()[0]) for r in rows]
    active = [u for u, m in zip(busy, memory) if m > 0]
    return {"samples": len(rows), "first": rows[0][0].strip() if rows else None,
            "last": rows[-1][0].strip() if rows else None,
            "utilization_pct_mean_while_memory_held": _mean(active), "memory_used_mib_max": max(memory, default=None)}


def summarize(folder: Path) -> dict[str, Any]:
    files = raw_files(folder)
    summary: dict[str, Any] = {"folder": folder.resolve().name, "made_by": "benchmarks/summarize_results.py"}
    for name in ("timings.tsv", "padded/timings.tsv", "padded_timings.tsv"):
        if name in files:
            summary[f"stages ({name})"] = stages(_text(files[name]))
    if "ablation_stages.tsv" in files:
        times = [line.split("\t", 1) for line in _text(files["ablation_stages.tsv"]).splitlines() if "\t" in line]
        summary["ablation_stages_s"] = [[label, int(t) - int(times[0][0])] for t, label in times]
    if "cache_bytes.txt" in files:
        summary["cache_bytes"] = {PurePosixPath(p).name: int(b) for b, p in
                                  (line.split("\t") for line in _text(files["cache_bytes.txt"]).splitlines())}
    for name, data in files.items():
        if re.fullmatch(r"(.*/)?inspect(_\w+)?\.json", name):
            record = _json_prefix(data)
            summary.setdefault("caches", {})[name] = {k: record.get(k) for k in
                                                      ("samples", "tokens", "feature_dtype", "feature_bytes")}
        elif re.fullmatch(r"(.*/)?extract(_\w+)?\.log", name):
            text = _text(data)
            if m := re.search(r"(\d+)/(\d+) shards done, (\d+) samples, (\d+) tokens(?:, (\d+) truncated)?", text):
                shard_s = [float(s) for s in re.findall(r"shard \d+ done: .*?, ([\d.]+) s", text)]
                summary.setdefault("extract", {})[name] = {
                    "samples": int(m.group(3)), "tokens": int(m.group(4)), "truncated": int(m.group(5) or 0),
                    "seconds_in_shards": shard_s}
        elif name.endswith("generate.log"):
            chunks = [[int(c), float(s)] for c, s in re.findall(r"chunk \d+ done \((\d+) conversations, ([\d.]+) s\)",
                                                                  _text(data))]
            if chunks:
                summary.setdefault("generate_chunks", {})[name] = {"conversations_and_seconds": chunks}
            # Static-cache batches by their KV cache length (regenerate.py logs each batch): new tokens per second
            # of batch time, so that one run compares its short and long caches on the same GPU. A worker's first
            # batch of a length compiles its decoding step: counted apart (first_batches_s), not in the rate. A
            # worker is its name and process id (a resumed run appends to the log with the same names).
            by_length: dict[str, list[float]] = {}
            seen: set[tuple[str, str]] = set()
            for worker, positions, tokens, seconds in re.findall(
                    r"\[(\S+ \d+)\] dflash\.regenerate: batch of \d+ answers \(\d+ rows, longest prompt \d+, (\d+) KV "
                    r"positions\): (\d+) new tokens in ([\d.]+) s", _text(data)):
                totals = by_length.setdefault(positions, [0, 0, 0.0, 0.0])
                if (worker, positions) in seen:
                    totals[0] += 1
                    totals[1] += int(tokens)
                    totals[2] += float(seconds)
                else:
                    seen.add((worker, positions))
                    totals[3] += float(seconds)
            if by_length:
                summary.setdefault("generate_batches", {})[name] = {
                    positions: {"batches": n, "new_tokens": tokens, "seconds": round(seconds, 1),
                                "tokens_per_s_of_batch_time": round(tokens / seconds, 1) if seconds else None,
                                "first_batches_s": round(first, 1)}
                    for positions, (n, tokens, seconds, first) in sorted(by_length.items(),
                                                                        key=lambda kv: int(kv[0]))}
        elif name.endswith("smi.csv"):
            summary.setdefault("gpu", {})[name] = gpu_samples(_text(data))
    runs: dict[str, Any] = {}
    for name, data in files.items():
        path = PurePosixPath(name)
        if path.name == "metrics.jsonl":
            run_name = path.parent.as_posix()
            log = files.get((path.parent / "train.log").as_posix())
        elif re.fullmatch(r"metrics_.+\.jsonl", path.name):
            run_name = path.stem.removeprefix("metrics_")
            log = files.get(f"train_{run_name}.log")
        else:
            continue
        records = [json.loads(line) for line in _text(data).splitlines() if line.strip()]
        runs[run_name] = training_run(records, _text(log) if log else None)
    if runs:
        summary["runs"] = runs
    logged = {}
    for name, data in files.items():
        path = PurePosixPath(name)
        if not path.name.endswith((".log", ".out")) or "eval" in path.name:
            continue
        # a run whose metrics came back is summarised from them; its logs repeat the same evaluations
        run = path.stem.removeprefix("train_")
        metrics = [path.parent / "metrics.jsonl", path.parent / run / "metrics.jsonl", path.parent / f"metrics_{run}.jsonl"]
        if path.name in ("train.log",) or path.name.startswith("train_"):
            if any(m.as_posix() in files for m in metrics):
                continue
        text = _text(data)
        curve = logged_evals(text)
        errors = [line.strip() for line in text.splitlines() if re.match(r"\s*[\w.]*(Error|Exception)\b.*:", line)]
        if curve or errors:
            logged[name] = {"tau_walk_by_step": curve} if curve else {}
            if errors:
                logged[name]["errors"] = [line[:200] for line in errors]
    if logged:
        summary["logged_training"] = logged
    evals = {}
    for name, data in files.items():
        if re.fullmatch(r"(.*/)?eval[^/]*\.json", name):
            key = name.removesuffix("/eval.json").removesuffix(".json")
            evals[key] = evaluation(json.loads(data))
    for name, data in files.items():
        key = name.removesuffix("/eval.md").removesuffix(".md")
        if name.endswith(".md") and re.fullmatch(r"(.*/)?eval[^/]*", key) and key not in evals:
            evals[key] = {"source": f"{name} (its eval.json did not come back)", "datasets": markdown_rows(_text(data))}
    if evals:
        summary["evals"] = dict(sorted(evals.items()))
    return summary


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with one key per line and lists of scalars (or of short scalar lists) on one line."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, list) and value and any(isinstance(v, dict) or (isinstance(v, list) and len(v) > 4)
                                                 for v in value):
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in value) + "\n" + " " * indent + "]"
    return json.dumps(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a summary.json differs")
    args = parser.parse_args()
    stale = []
    for folder in args.folders:
        summary = summarize(folder)
        if set(summary) == {"folder", "made_by"}:
            print(f"nothing to summarise in {folder}: its benchmark JSON files are its summary")
            continue
        text = dumps(summary) + "\n"
        target = folder / SUMMARY
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(str(target))
        else:
            target.write_text(text)
            print(f"wrote {target}")
    if stale:
        print("stale (rerun benchmarks/summarize_results.py on them): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
