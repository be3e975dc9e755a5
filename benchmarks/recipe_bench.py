"""The recipe bench: training recipes compared cleanly, each trained alone, at equal steps and schedule.

    python benchmarks/recipe_bench.py run --cache CACHE --out BENCH --steps 600 --eval-every 200 \\
        --train-flags "--batch-tokens 49152 --num-workers 6" \\
        --variant ce="--loss ce" --variant kl="--loss kl" \\
        --variant mix="--loss mix" --variant mix25="--loss mix --kl-weight 0.25" [--seeds 0,1,2] \\
        [--steps-of NAME=STEPS ...]
    python benchmarks/recipe_bench.py table --out BENCH    # BENCH/bench.md again, from BENCH/bench.json

The first variant is the baseline. Each variant is one `dflash train` process, run one after another (never side
by side), with the same cache, `--seed`, `--max-steps` (which fixes the cosine schedule's length, so every variant
has the same learning rate at every step unless its flags change `--lr` or `--warmup`) and `--eval-every`, every
evaluation over the whole validation split (`--eval-sequences` is refused; the untrained drafter's is skipped:
`--no-eval-untrained`, about a minute of an H100 a run for a figure that is ~1.0 for every variant), then the
trainer's own report on the whole test split (`report_test_split`: the variant's best validation drafter,
`export_best/`). `--train-flags` go to every variant, before its own flags; flags that would make the comparison
unequal (steps, epochs, evaluation, seed, the split) are refused up front. Then live tau (`dflash eval
--no-baselines`, by default MT-Bench and HumanEval, 80 prompts x 512 new tokens, no time limit) for the baseline
and for the best variant by best validation tau, one process per variant and dataset, side by side (tau does not
depend on speed). 80, not 20: on
2026-12-06 one drafter's live MT-Bench tau was 2.69 +- 0.20 over the first 20 prompts and 2.54 +- 0.11 over all 80
(benchmarks/results/h100_data_size_2026-12-06); there one drafter's 80 prompts of both datasets, evaluated at
once with --compile-target, took ~110 s on an H100 with compilation (the bench's baseline and best: four at once).
The best's live tau is also compared with the baseline's prompt by prompt (the mean of the per-prompt differences
+- its standard error, and on how many prompts it is higher; `acceptance.paired_tau_difference`): easy and hard
prompts are shared, so the paired error is the smaller (0.061 against 0.174 unpaired for the mean per-prompt
difference of two drafters on 80 HumanEval prompts, 2026-12-06). Each prompt weighs the same there, so it is not
the difference of the two pooled taus beside it (0.512 against 0.590 in that case).

Replicates (`--seeds 0,1,2`, instead of `--seed`): every variant is trained once per seed, as run NAME@sSEED (every
variant at the first seed, then every variant at the next, so that a machine lost mid-way leaves whole
comparisons); the table gives each variant's test tau and best validation tau at each seed, their mean, the
standard deviation between seeds, and the difference to the baseline paired by seed (each seed's run minus the
baseline's at that seed: the mean +- its standard error over seeds, and the number of seeds). The best variant is
the one of the highest mean best validation tau over the seeds every variant finished; live tau is measured for the baseline and
the best at the first seed. Why: one run's +- is its standard error over test sequences, which leaves out how far
training the same recipe twice varies: over seeds 0-2 one recipe's test tau after 600 steps spread with a
standard deviation of 0.033-0.066, 2-5x a run's standard error (2026-12-06, benchmarks/results/
h100_anchor_seeds_and_specforge_2026-12-06; the seed draws the initial weights, the data order, the anchors and the
split). With 2-3 seeds the paired standard error has 1-2 degrees of freedom: a
difference of two of them is not a 95 % interval. With one seed, runs keep the variant's name and the output is as
without seeds; results/NAME.json of a one-seed bench at seed K is results/NAME@sK.json of a bench with several
(rename it, its .live.json and runs/NAME to reuse it).

Equal GPU time (`--steps-of NAME=STEPS`, repeatable): variant NAME trains STEPS steps instead of --steps, on its own
cosine schedule over its own length (`--max-steps STEPS`, as a user's run of that length would), still evaluated
every --eval-every steps and at its last step (the trainer evaluates the last step whatever --eval-every); its STEPS
are part of its run's settings (a result of another length is refused, never reused). This compares recipes of
different speed at equal training time, the product's claim (the better drafter per GPU-hour): e.g. the plain path
against the fast one (docs/benchmarks.md "The fast training path in whole runs": 0.196 s against 0.083 s a step on
an H100, so 600 x 0.196 / 0.083 = 1,420 steps):

    python benchmarks/recipe_bench.py run ... --steps 600 --variant plain="--attention sdpa --no-compile" \\
        --variant fast="" --steps-of fast=1420

The step counts must come from s/step measured with each variant alone on the GPU (this bench's own table, or
benchmarks/bench_train.py), never from runs sharing a GPU. The bench does not trust them: each run reports its
training time (train s: the sum of every step's step_s, the untimed first steps and their compilation included,
GPU time a user pays too; evaluations excluded) and its ratio to the baseline's run at the same seed, so that the
table shows how equal the times came out.

Cost, per variant alone, from its metrics.jsonl: `step_s` (the step's wall time in the training loop, from its
start to the next step's: the loop reads each step's figures one step late, so the host prepares the next step while
the device runs this one, and the step times add up to the loop's; evaluations and checkpoints excluded) and
`block_tokens` of each step after the first
`--untimed-steps` (default 50), which hold the compilation and warm-up and are reported apart (untimed_s);
s/step (mean and median: a mean well above the median means compilation or stalls inside the timed steps), the
mean wait for the loader's batch a step (`loader_wait_s`, a part of step_s: workers that do not keep up), block
tokens/s, and the peak memory the trainer measured (CUDA memory allocated by torch, or the CPU resident set, over
the whole process, evaluations included). Every variant shares one compile cache (TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR under BENCH/compile_cache, unless set), so a kernel compiled once is reused by later variants;
`--warm-up-steps N` trains each variant to be run whose run compiles N steps first, on its timed run's training path
(untimed, BENCH/warm_up/), so that its timed run finds it warm (its result says so, `warm_up_steps`): otherwise the
first compiled variant alone pays the first compilation (91 s on an H100, 2026-12-06).

Results: BENCH/results/NAME.json for a variant's run (NAME@sSEED.json with several seeds; written, complete, as soon
as it finishes; a failed run is written too, with its exit code and last line, and tried again on the next run),
BENCH/results/NAME.live.json (one dataset added as each live evaluation finishes, with each prompt's tau; for a
carried record from before that, the per-prompt tau is read from BENCH/live/NAME--DATASET/eval.json where that is
there), and after every one of them
BENCH/bench.json (everything) and BENCH/bench.md (the tables, generated from bench.json). Every tau comes with its
standard error. A rerun with the same flags skips every variant and live evaluation whose result is complete (copy
results/ from an earlier machine into a fresh BENCH to go on there); a variant killed mid-way is trained again from
scratch (`--overwrite`: its timing must come from one uninterrupted process), as is one whose export a live
evaluation needs but whose run folder is gone (a fresh machine). A result made with other settings (cache, steps,
seed, flags) is refused, never overwritten. Train logs: BENCH/logs/NAME.train.out; runs: BENCH/runs/NAME; live
evaluations: BENCH/live/.

On the lent GPU: benchmarks/gpu_recipe_bench.sh (the cache, then this bench, detached, results under $OUT). On the
CPU: tests/benchmarks/test_recipe_bench.py (a tiny cache, two variants, one seed and then two, and one variant
with its own steps).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError, user_facing_errors
from dflash.shared.logs import get_logger, setup_logging
from dflash.shared.run_files import BEST_RECORD_FILE, CONFIG_FILE, RunFiles
from dflash.stage2_train.acceptance import json_safe, paired_tau_difference

log = get_logger("recipe_bench")

# `dflash train` parameters the bench sets for every variant alike: refused in --train-flags and --variant flags.
SET_BY_BENCH = ("cache", "out", "max_steps", "epochs", "eval_every", "eval_sequences", "eval_untrained", "seed",
                "resume", "overwrite")
# The validation / test split must be the same for all: allowed in --train-flags only.
SAME_FOR_ALL = ("eval_fraction", "test_fraction")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # variant names become file names (and come back from the device)


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]: the seeds every variant is trained at, in this order."""
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds {text!r}: give comma-separated integers, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: give each seed once")
    return seeds


def run_name(variant: str, seed: int, seeds: list[int]) -> str:
    """The name of a variant's run at one seed: the variant's own when the bench has one seed, NAME@sSEED when it
    has several ('@' is not allowed in a variant's name, so no two runs can share one)."""
    return variant if len(seeds) == 1 else f"{variant}@s{seed}"


def planned_runs(variants: list[tuple[str, list[str]]], seeds: list[int]) -> list[tuple[str, str, int, list[str]]]:
    """(run, variant, seed, flags) of every run, in training order: every variant at the first seed, then every
    variant at the next, so that a machine lost mid-way leaves whole comparisons behind."""
    return [(run_name(name, seed, seeds), name, seed, flags) for seed in seeds for name, flags in variants]


def dflash_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash.shared.cli", *args]


def parse_steps_of(texts: tuple[str, ...], names: list[str]) -> dict[str, int]:
    """--steps-of NAME=STEPS, ... -> {NAME: STEPS}: the variants that train their own number of steps."""
    steps_of: dict[str, int] = {}
    for text in texts:
        name, _, steps = text.partition("=")
        if name not in names:
            raise UserError(f"--steps-of {text!r}: give NAME=STEPS, NAME one of the variants ({', '.join(names)})")
        if name in steps_of:
            raise UserError(f"--steps-of {text!r}: give each variant's steps once")
        if not steps.strip().isdigit() or int(steps) < 1:
            raise UserError(f"--steps-of {text!r}: STEPS must be a positive whole number of steps")
        steps_of[name] = int(steps)
    return steps_of


def parse_variant(text: str) -> tuple[str, list[str]]:
    """NAME=FLAGS -> (NAME, [flag, ...]); FLAGS may be empty (the plain recipe)."""
    name, sep, flags = text.partition("=")
    if not sep or not NAME.fullmatch(name):
        raise UserError(f"--variant {text!r}: give NAME=FLAGS, NAME of letters, digits, '.', '_' and '-' (e.g. "
                        "kl=\"--loss kl\")")
    return name, shlex.split(flags)


def parse_train_flags(flags: list[str], where: str) -> click.Context:
    """`flags` parsed as `dflash train` parses them (its options' values and where each came from)."""
    from dflash.stage2_train.cli import train_command

    try:
        return train_command.make_context("train", list(flags), default_map={"cache": "."})
    except click.exceptions.ClickException as error:
        raise UserError(f"{where}: {error.format_message()}") from None
    except click.exceptions.Exit:
        raise UserError(f"{where}: give training flags, not --help") from None


def check_train_flags(flags: list[str], refused: tuple[str, ...], where: str) -> None:
    """Parse `flags` as `dflash train` does (a typo fails now, not after the earlier variants trained) and refuse
    the parameters in `refused`."""
    from click.core import ParameterSource

    context = parse_train_flags(flags, where)
    given = [f"--{name.replace('_', '-')}" for name in refused
             if context.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    if given:
        raise UserError(f"{where}: {', '.join(given)} would make the variants unequal: the bench sets "
                        "--steps, --eval-every and --seed for all of them (and skips the untrained drafter's "
                        "evaluation), --eval-fraction / --test-fraction belong in --train-flags, and every evaluation "
                        "covers the whole validation split")


def device_name() -> str:
    """The GPU's name (nvidia-smi, so that this process holds no CUDA context), else the CPU's core count."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        if names[0].strip():
            return names[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU ({os.cpu_count()} cores)"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Bench:
    """The folder of one bench (BENCH) and what it holds."""

    def __init__(self, out: Path) -> None:
        self.root = out.resolve()
        self.results = self.root / "results"
        self.runs = self.root / "runs"
        self.logs = self.root / "logs"
        self.live = self.root / "live"
        self.json = self.root / "bench.json"
        self.table = self.root / "bench.md"

    def result_path(self, name: str) -> Path:
        return self.results / f"{name}.json"

    def live_path(self, name: str) -> Path:
        return self.results / f"{name}.live.json"

    def run(self, name: str) -> RunFiles:
        return RunFiles(self.runs / name)

    def write(self, path: Path, record: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        cf.write_json_atomic(path, record)


# ---------------------------------------------------------------------------------------------------- one variant


def train_variant(bench: Bench, name: str, command: list[str], settings: dict[str, Any]) -> dict[str, Any]:
    """Train one variant alone (its own `dflash train` process, from scratch) and return its result record."""
    for stale in (bench.result_path(name), bench.live_path(name)):
        stale.unlink(missing_ok=True)
    for folder in bench.live.glob(f"{name}--*"):
        shutil.rmtree(folder)
    bench.logs.mkdir(parents=True, exist_ok=True)
    output = bench.logs / f"{name}.train.out"
    log.info("variant %s: training (%s)", name, shlex.join(command[3:]))
    started = time.time()
    with open(output, "w", encoding="utf-8") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    wall = round(time.time() - started, 1)
    record: dict[str, Any] = {"name": name, "settings": settings, "device": device_name(), "wall_s": wall}
    if code != 0:
        lines = [line for line in output.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("dflash: error:")]
        record.update(complete=False, exit_code=code, error=(errors or lines or ["(no output)"])[-1])
        log.warning("variant %s: `dflash train` exited %d after %.0f s: %s (log: %s)", name, code, wall,
                    record["error"], output)
        return record
    record.update(complete=True, exit_code=0, **summarize_run(bench.run(name), settings["untimed_steps"]))
    best, test = record["best_validation"], record["test"]
    log.info("variant %s: done in %.0f s; best validation tau %s (step %s), test tau %s", name, wall,
             tau_text(best and best["tau"], best and best["stderr"]), best and best["step"],
             tau_text(test and test["tau"], test and test["stderr"]))
    return record


def summarize_run(run: RunFiles, untimed_steps: int) -> dict[str, Any]:
    """What the bench reports of a finished `dflash train` run: cost, schedule, validation curve, test split."""
    steps: dict[int, dict[str, Any]] = {}
    evaluations: dict[int, dict[str, Any]] = {}
    for line in run.metrics.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            steps[record["step"]] = record
        elif "eval/tau_walk" in record:
            evaluations[record["step"]] = record
    ordered = [steps[s] for s in sorted(steps)]
    validation = [{"step": s, "tau": r["eval/tau_walk"], "stderr": r["eval/tau_walk_stderr"],
                   "sequences": r["eval/sequences"]} for s, r in sorted(evaluations.items())]
    trained = [v for v in validation if v["step"] > 0]
    best = json.loads((run.export_best / BEST_RECORD_FILE).read_text()) if (
        run.export_best / BEST_RECORD_FILE).is_file() else None
    best_validation = next((v for v in trained if best is not None and v["step"] == best["step"]),
                           max(trained, key=lambda v: v["tau"]) if trained else None)
    test = read_json(run.test_results)
    schedule = [[r["step"], r["lr"]] for r in ordered]
    last = ordered[-max(1, len(ordered) // 10):]  # the last tenth of the steps: the loss the variant ended at
    return {
        "steps": len(ordered),
        "schedule_sha1": hashlib.sha1(json.dumps(schedule).encode()).hexdigest(),
        "lr_peak": max(r["lr"] for r in ordered),
        "final_loss": statistics.fmean(r["loss"] for r in last),
        "cost": step_cost(ordered, untimed_steps),
        "validation": validation,
        "best_validation": best_validation,
        "test": None if test is None else {
            "step": test["step"], "drafter": test["drafter"], "tau": test["tau_walk"],
            "stderr": test["tau_walk_stderr"], "sequences": test["sequences"]},
    }


UNTIMED_STEPS = 50  # --untimed-steps' default: the first steps, which hold the warm-up and the compilation


def step_cost(steps: list[dict[str, Any]], untimed_steps: int) -> dict[str, Any]:
    """s/step, block tokens/s and peak memory over the steps after the first `untimed_steps`; the training time
    (train_s): every step's time, the untimed ones included (compilation is GPU time a user pays too; evaluations
    and checkpoints are outside the steps' times)."""
    timed = [r for r in steps if r["step"] > untimed_steps]
    seconds = sum(r["step_s"] for r in timed)
    tokens = sum(r["block_tokens"] for r in timed)
    return {
        "untimed_steps": untimed_steps,
        "untimed_s": round(sum(r["step_s"] for r in steps if r["step"] <= untimed_steps), 3),
        "train_s": sum(r["step_s"] for r in steps),
        "timed_steps": len(timed),
        "s_per_step": seconds / len(timed),
        "s_per_step_median": statistics.median(r["step_s"] for r in timed),
        # The mean of each step's wait for the loader's batch (part of step_s); None for runs that predate it.
        "loader_wait_s_per_step": statistics.fmean(r["loader_wait_s"] for r in timed)
        if all("loader_wait_s" in r for r in timed) else None,
        "block_tokens_per_step": tokens / len(timed),
        "block_tokens_per_s": tokens / seconds if seconds else None,
        "peak_memory_gib": max((r["memory_peak_gib"] for r in steps if "memory_peak_gib" in r), default=None),
    }


# -------------------------------------------------------------------------------------------------------- live tau


def live_evaluations(bench: Bench, names: list[str], datasets: list[str], settings: dict[str, Any],
                     eval_flags: list[str]) -> None:
    """`dflash eval` of each named variant's chosen drafter on each dataset not yet done, all side by side; each
    dataset's tau is added to results/NAME.live.json as its process ends."""
    jobs = []
    for name in names:
        done = (read_json(bench.live_path(name)) or {}).get("datasets", {})
        run = bench.run(name)
        draft = run.export_best if (run.export_best / CONFIG_FILE).is_file() else run.export
        for dataset in datasets:
            if dataset in done:
                log.info("live %s on %s: done before, skipped", name, dataset)
                continue
            out = bench.live / f"{name}--{dataset}"
            out.mkdir(parents=True, exist_ok=True)
            command = dflash_command("eval", "--draft", str(draft), "--data", dataset, "--max-samples",
                                     str(settings["samples"]), "--max-new-tokens", str(settings["new_tokens"]),
                                     "--out", str(out), *eval_flags)
            log.info("live %s on %s: %s", name, dataset, shlex.join(command[3:]))
            handle = open(out / "eval.out", "w", encoding="utf-8")
            jobs.append((name, dataset, out, handle, subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                                                      stdin=subprocess.DEVNULL)))
    for name, dataset, out, handle, process in jobs:
        code = process.wait()
        handle.close()
        report = read_json(out / "eval.json")
        if code != 0 or report is None:
            log.warning("live %s on %s: `dflash eval` exited %d (log: %s)", name, dataset, code, out / "eval.out")
            continue
        figures = report["datasets"][dataset]
        record = read_json(bench.live_path(name)) or {"settings": settings, "datasets": {}}
        record["datasets"][dataset] = {key: figures[key] for key in ("prompts", "steps", "tau", "tau_stderr")}
        record["datasets"][dataset]["new_tokens"] = figures["new_tokens"]["dflash"]
        record["datasets"][dataset]["prompt_tau"] = prompt_taus(figures)
        bench.write(bench.live_path(name), record)
        log.info("live %s on %s: tau %s over %d prompts", name, dataset,
                 tau_text(figures["tau"], figures["tau_stderr"]), figures["prompts"])


def prompt_taus(figures: dict[str, Any]) -> dict[str, float]:
    """Each prompt's tau of one dataset of an eval.json, by prompt id (for the comparison paired by prompt; None for
    a prompt decoded in no speculative step)."""
    return {sample["id"]: sample["tau"] for sample in figures["samples"]}


def live_figures(bench: Bench, name: str) -> dict[str, Any] | None:
    """A run's live figures by dataset (results/NAME.live.json), each dataset's per-prompt tau read from its
    evaluation folder (live/NAME--DATASET/eval.json) where the record predates it (a carried baseline's), if that
    evaluation is the one recorded (the same prompts, steps and tau)."""
    live = read_json(bench.live_path(name))
    if live is None:
        return None
    datasets = live["datasets"]
    for dataset, figures in datasets.items():
        if "prompt_tau" in figures:
            continue
        report = (read_json(bench.live / f"{name}--{dataset}" / "eval.json") or {}).get("datasets", {}).get(dataset)
        if report is not None and all(report.get(key) == figures.get(key) for key in ("prompts", "steps", "tau")):
            figures["prompt_tau"] = prompt_taus(report)
    return datasets


# ------------------------------------------------------------------------------------------------------- the bench


def run_bench(cache: Path, out: Path, variants: list[tuple[str, list[str]]], steps: int, steps_of: dict[str, int],
              eval_every: int, seeds: list[int], train_flags: list[str], untimed_steps: int, live_data: list[str],
              live_samples: int, live_new_tokens: int, live_flags: list[str], warm_up_steps: int = 0) -> dict[str, Any]:
    """Train every variant at every seed not done before, one run after another, each `steps` steps or its own
    (`steps_of`); then live tau of the baseline and the best at the first seed."""
    bench = Bench(out)
    bench.root.mkdir(parents=True, exist_ok=True)
    setup_logging(bench.root / "bench.log")
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise UserError(f"--variant names must differ: {names}")
    variant_steps = {name: steps_of.get(name, steps) for name in names}
    if untimed_steps >= min(variant_steps.values()):
        raise UserError(f"--untimed-steps {untimed_steps} leaves none of the {min(variant_steps.values())} steps "
                        "timed: lower it")
    check_train_flags(train_flags, SET_BY_BENCH, "--train-flags")
    for name, flags in variants:
        check_train_flags(flags, SET_BY_BENCH + SAME_FOR_ALL, f"--variant {name}")
    common = {"cache_identity": cf.read_manifest(cache.resolve())["identity"], "steps": steps,
              "eval_every": eval_every, "seed": seeds[0], "train_flags": train_flags, "untimed_steps": untimed_steps}
    live_settings = {"samples": live_samples, "new_tokens": live_new_tokens, "flags": live_flags}
    runs = planned_runs(variants, seeds)
    # A run's settings name its own seed only, so that a bench given more seeds later keeps the runs it has; and its
    # variant's steps (its own with --steps-of), so that a result of another length is refused, never reused.
    settings = {run: {**common, "steps": variant_steps[variant], "seed": seed, "flags": flags}
                for run, variant, seed, flags in runs}
    done = {run: is_done(bench, run, settings[run], live_settings) for run, *_ in runs}
    header = {"cache": str(cache), **common,
              "variants": [{"name": n, "flags": f, "steps": variant_steps[n]} for n, f in variants],
              "live": {"data": live_data, **live_settings}}
    if len(seeds) > 1:
        del header["seed"]
        header["seeds"] = seeds
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(bench.root / "compile_cache" / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(bench.root / "compile_cache" / "triton"))
    log.info("recipe bench in %s: %d variants x %d steps%s (validation every %d) at seeds %s, on %s", bench.root,
             len(variants), steps, "".join(f", {n} {s}" for n, s in steps_of.items()), eval_every,
             ", ".join(map(str, seeds)), device_name())

    variant_of = {run: variant for run, variant, _, _ in runs}
    warmed: set[str] = set()  # the variants whose runs here start from the compile cache warmed for them

    def train(name: str) -> None:
        seed, flags, length = settings[name]["seed"], settings[name]["flags"], settings[name]["steps"]
        command = dflash_command("train", "--cache", str(cache), "--out", str(bench.runs / name), "--overwrite",
                                 "--max-steps", str(length), "--eval-every", str(eval_every),
                                 "--no-eval-untrained", "--seed", str(seed), "--checkpoint-every", "0",
                                 "--keep-checkpoints", "1", *train_flags, *flags)
        record = train_variant(bench, name, command, settings[name])
        if variant_of[name] in warmed:
            record["warm_up_steps"] = warm_up_steps
        bench.write(bench.result_path(name), record)
        write_summary(bench, header)

    if warm_up_steps:
        to_train = dict.fromkeys(variant for run, variant, _, _ in runs if not done[run])
        warmed = warm_up(bench, cache, [(name, train_flags + flags, variant_steps[name]) for name, flags in variants
                                        if name in to_train], warm_up_steps, seeds[0])
    for run, *_ in runs:
        if done[run]:
            log.info("variant %s: done before (%s), skipped", run, bench.result_path(run))
        else:
            train(run)
    record = write_summary(bench, header)
    if record["best"] is None or not live_data or not live_samples:
        return record
    live_names = [run_name(n, seeds[0], seeds) for n in dict.fromkeys((names[0], record["best"]))]
    live_names = [n for n in live_names if complete(bench, n)]
    for name in live_names:
        evaluated = (read_json(bench.live_path(name)) or {}).get("datasets", {})
        run = bench.run(name)
        has_export = (run.export_best / CONFIG_FILE).is_file() or (run.export / CONFIG_FILE).is_file()
        if not has_export and any(dataset not in evaluated for dataset in live_data):
            log.info("variant %s: its run folder is gone (a fresh machine?) and live tau needs its drafter: "
                     "training it again", name)
            train(name)
    live_evaluations(bench, [n for n in live_names if complete(bench, n)], live_data, live_settings, live_flags)
    return write_summary(bench, header)


def warm_up(bench: Bench, cache: Path, variants: list[tuple[str, list[str], int]], steps: int,
            seed: int) -> set[str]:
    """Each variant of `variants` (name, all its `dflash train` flags, its timed run's steps) whose run compiles
    trains `steps` steps first, into BENCH/warm_up/NAME, recorded nowhere, so that its timed run starts from the
    bench's compile cache warm (--warm-up-steps); returns the names warmed up. Without it the first compiled variant
    alone pays the first compilation on the machine in its training time (91 s of an H100 run's 170 s on
    2026-12-06, against ~12-17 s for the variants after it), which makes an equal-time comparison unequal. The
    warm-up takes the timed run's training path even where that run's length chose it (`compiles`). A warm-up that
    fails is logged and the bench goes on (its timed run will say why again)."""
    warmed = set()
    for name, flags, timed_steps in variants:
        if not compiles(flags, timed_steps):
            log.info("variant %s: no warm-up (its run does not compile)", name)
            continue
        folder = bench.root / "warm_up" / name
        command = dflash_command("train", "--cache", str(cache), "--out", str(folder), "--overwrite", "--max-steps",
                                 str(steps), "--eval-every", "0", "--checkpoint-every", "0", "--keep-checkpoints",
                                 "1", "--seed", str(seed), *flags, "--compile")
        folder.mkdir(parents=True, exist_ok=True)
        started = time.time()
        with open(bench.root / "warm_up" / f"{name}.train.out", "w", encoding="utf-8") as handle:
            code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode
        log.info("variant %s: warm-up of %d step(s) %s in %.0f s (not timed)", name, steps,
                 "done" if code == 0 else f"exited {code}", time.time() - started)
        if code == 0:
            warmed.add(name)
    return warmed


def compiles(flags: list[str], steps: int) -> bool:
    """Whether `dflash train` with `flags` for `steps` steps compiles on this machine: as given (--compile /
    --no-compile, the last one), else the path `fast_path.training_path` picks for the run's length and device."""
    import torch

    from dflash.stage2_train.fast_path import training_path

    given = parse_train_flags(flags, "the warm-up").params
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return training_path(given["attention"], given["compile_"], device, steps, 0, given["fsdp"],
                         given["architecture"])[1]


def complete(bench: Bench, name: str) -> bool:
    return bool((read_json(bench.result_path(name)) or {}).get("complete"))


def is_done(bench: Bench, name: str, settings: dict[str, Any], live_settings: dict[str, Any]) -> bool:
    """Whether the variant's result is complete (a failed run is tried again, whatever its settings); one made
    with other settings, or live tau measured otherwise, is refused before anything trains."""
    if not complete(bench, name):
        return False
    refuse_other_settings(bench.result_path(name), read_json(bench.result_path(name)), settings)
    refuse_other_settings(bench.live_path(name), read_json(bench.live_path(name)), live_settings)
    return True


def refuse_other_settings(path: Path, previous: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    if previous is None or previous.get("settings") == settings:
        return
    made = previous.get("settings", {})
    differences = [key for key in sorted(set(made) | set(settings)) if made.get(key) != settings.get(key)]
    raise UserError(f"{path} was made with other settings ({', '.join(differences)} differ): keep it and bench into "
                    "another --out, or delete it to measure again")


def bench_seeds(bench: dict[str, Any]) -> list[int]:
    """The seeds of a bench (its header or bench.json): `seeds` when it has several, else its one `seed`."""
    return bench.get("seeds") or [bench["seed"]]


def summary(bench: Bench, header: dict[str, Any]) -> dict[str, Any]:
    """bench.json's content: the bench's settings, every run's result (its live tau merged in; variant by variant,
    seed by seed), the best variant (by its mean best validation tau over seeds), and with several seeds each
    variant's figures over seeds (`replicates`)."""
    seeds = bench_seeds(header)
    rows = []
    for entry in header["variants"]:
        for seed in seeds:
            name = run_name(entry["name"], seed, seeds)
            result = read_json(bench.result_path(name)) or {"name": name, "complete": False, "error": "not run yet"}
            row = {**result, "name": name, "flags": entry["flags"], "live": live_figures(bench, name)}
            if len(seeds) > 1:
                row.update(variant=entry["name"], seed=seed)
            rows.append(row)
    baseline = header["variants"][0]["name"]
    # Each run's live tau against the baseline's run at the same seed, prompt by prompt (where both have it).
    baseline_live = {row.get("seed"): row["live"] or {} for row in rows if row.get("variant", row["name"]) == baseline}
    for row in rows:
        base = baseline_live.get(row.get("seed"), {})
        if row.get("variant", row["name"]) != baseline and row["live"]:
            row["live_vs_baseline"] = {
                dataset: json_safe(paired_tau_difference(figures["prompt_tau"], base[dataset]["prompt_tau"]))
                for dataset, figures in row["live"].items()
                if "prompt_tau" in figures and "prompt_tau" in base.get(dataset, {})}
    validation = {entry["name"]: {seed: run["tau"] for seed, run in
                                  figure_by_seed(rows, entry["name"], "best_validation", seeds[0]).items()}
                  for entry in header["variants"]}
    # The best by its mean over the seeds every variant finished (one lucky seed that the others lack cannot win);
    # over each variant's own seeds while no seed is common to all of them.
    finished = [set(taus) for taus in validation.values() if taus]
    common = set.intersection(*finished) if finished else set()
    means = {name: statistics.fmean(tau for seed, tau in taus.items() if not common or seed in common)
             for name, taus in validation.items() if taus and (not common or common & set(taus))}
    best = max(means, key=lambda name: means[name]) if means else None
    record = {**header, "baseline": baseline, "best": best, "results": rows}
    if len(seeds) > 1:
        record["replicates"] = replicates(rows, header["variants"], baseline)
    return record


def figure_by_seed(rows: list[dict[str, Any]], variant: str, figure: str,
                   first_seed: int | None = None) -> dict[int, dict[str, Any]]:
    """Seed -> `figure` ("test", "best_validation") of every finished run of `variant` that has it (the rows of a
    one-seed bench name neither variant nor seed: their run's name is the variant's, their seed `first_seed`)."""
    return {r.get("seed", first_seed): r[figure] for r in rows
            if r.get("variant", r["name"]) == variant and r.get("complete") and r.get(figure) is not None}


def train_seconds(result: dict[str, Any]) -> float | None:
    """A finished run's training time (`step_cost`'s train_s; for a result written before train_s was, the same sum
    from its untimed and timed steps' seconds); None for a run not finished."""
    if not result.get("complete"):
        return None
    cost = result.get("cost") or {}
    if "train_s" in cost:
        return cost["train_s"]
    return cost["untimed_s"] + cost["s_per_step"] * cost["timed_steps"] if "s_per_step" in cost else None


def replicates(rows: list[dict[str, Any]], variants: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each variant's test tau and best validation tau over its finished seeds: per seed, their mean, the standard
    deviation between seeds, and the difference to the baseline paired by seed (the variant's run minus the
    baseline's at the same seed: their mean, its standard error over seeds, and the number of seeds paired); and
    its steps and training time (mean over its seeds, and its ratio to the baseline's paired by seed)."""
    def trained(variant: str) -> dict[int, float]:  # seed -> the run's training seconds
        return {r["seed"]: seconds for r in rows if r["variant"] == variant
                and (seconds := train_seconds(r)) is not None}

    figures = ("test", "best_validation")
    base = {figure: figure_by_seed(rows, baseline, figure) for figure in figures}
    base_seconds = trained(baseline)
    out = []
    for entry in variants:
        seconds = trained(entry["name"])
        ratios = [seconds[seed] / base_seconds[seed] for seed in seconds if base_seconds.get(seed)]
        record: dict[str, Any] = {
            "name": entry["name"], "flags": entry["flags"], "steps": entry.get("steps"),
            "train_s": {"mean": statistics.fmean(seconds.values()) if seconds else None,
                        "vs_baseline": {"mean": statistics.fmean(ratios), "seeds": len(ratios)} if ratios else None}}
        for figure in figures:
            by_seed = figure_by_seed(rows, entry["name"], figure)
            values = list(by_seed.values())
            paired = [by_seed[seed]["tau"] - base[figure][seed]["tau"] for seed in by_seed if seed in base[figure]]
            record[figure] = {
                "by_seed": [{"seed": seed, "tau": run["tau"], "stderr": run["stderr"], "step": run["step"]}
                            for seed, run in by_seed.items()],
                "mean": statistics.fmean(v["tau"] for v in values) if values else None,
                "sd": statistics.stdev(v["tau"] for v in values) if len(values) > 1 else None,
                "vs_baseline": None if entry["name"] == baseline or not paired else {
                    "mean": statistics.fmean(paired),
                    "stderr": statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else None,
                    "seeds": len(paired)},
            }
        out.append(record)
    return out


def write_summary(bench: Bench, header: dict[str, Any]) -> dict[str, Any]:
    record = summary(bench, header)
    bench.write(bench.json, record)
    bench.table.write_text(render_markdown(record))
    return record


# ----------------------------------------------------------------------------------------------------- the tables


def warm_up_text(bench: dict[str, Any]) -> str:
    """The table header's words on the runs that started from a compile cache warmed for them (--warm-up-steps)."""
    warmed = [(r["name"], r["warm_up_steps"]) for r in bench["results"] if r.get("warm_up_steps")]
    if not warmed:
        return ""
    steps = sorted({n for _, n in warmed})
    return (f" ({', '.join(name for name, _ in warmed)}: trained {'/'.join(map(str, steps))} untimed warm-up "
            f"step(s) first, so that {'its run' if len(warmed) == 1 else 'their runs'} found the compile cache warm)")


def tau_text(tau: float | None, stderr: float | None) -> str:
    """tau +- its standard error (n/a: a single sequence or prompt has none)."""
    if tau is None:
        return "-"
    return f"{tau:.3f} +- " + ("n/a" if stderr is None or stderr != stderr else f"{stderr:.3f}")


def paired_text(difference: dict[str, Any] | None) -> str:
    """A paired live difference: mean +- its standard error (higher on k of n prompts); - where there is none."""
    if not difference or not difference["prompts"]:  # (with a prompt paired, the mean is a number)
        return "-"
    stderr = "n/a" if difference["stderr"] is None else f"{difference['stderr']:.3f}"
    return (f"{difference['mean']:+.3f} +- {stderr} (higher on {difference['higher']} of "
            f"{difference['prompts']})")


def render_markdown(bench: dict[str, Any]) -> str:
    """bench.md from bench.json's content alone."""
    results = bench["results"]
    seeds = bench_seeds(bench)
    # The baseline's run at each seed (key None with one seed: its runs carry no `seed`).
    baselines = {r.get("seed"): r for r in results if r.get("variant", r["name"]) == bench["baseline"]}
    datasets = bench["live"]["data"]
    devices = sorted({r["device"] for r in results if r.get("device")})
    if len(seeds) == 1:
        seeding = (f"seed {seeds[0]}, each variant trained alone, one after another", "the baseline and the best")
    else:
        seeding = (f"seeds {', '.join(map(str, seeds))} (each variant trained once per seed, alone, one run after "
                   "another, every variant at a seed before the next seed)",
                   f"the baseline and the best (by its mean best validation tau over seeds) at seed {seeds[0]}")
    own_steps = [f"{v['name']} {v['steps']:,}" for v in bench["variants"]
                 if v.get("steps", bench["steps"]) != bench["steps"]]
    steps = f"{bench['steps']:,} steps per variant (the same cosine schedule)" + (
        f", except {', '.join(own_steps)} steps (their own: each its own cosine schedule over its own length)"
        if own_steps else "")
    lines = [
        "# Recipe bench",
        "",
        f"Cache `{bench['cache']}`; {steps}, {seeding[0]}; "
        f"validation tau over the whole validation split every {bench['eval_every']} steps; test tau over the whole "
        f"test split for the drafter of the best validation tau; live tau (`dflash eval`, {bench['live']['samples']}"
        f" prompts x {bench['live']['new_tokens']} new tokens) for {seeding[1]}, and its difference to the "
        f"baseline's paired by prompt (the mean of the per-prompt differences, each prompt weighing the same). +- one "
        f"standard error. s/step and "
        f"block tok/s over each run's steps after the first {bench['untimed_steps']} (which hold the warm-up and "
        f"compilation: untimed s); train s: the sum of every step's time, the untimed ones included (evaluations "
        f"excluded), and its ratio to the baseline's run at the same seed, as measured"
        + warm_up_text(bench)
        + f"; peak memory of the whole run. Flags of every variant: "
        f"`{shlex.join(bench['train_flags']) or '(none)'}`. Device: {', '.join(devices) or '-'}.",
        "",
    ]
    if len(seeds) > 1:
        lines += replicate_table(bench, seeds) + [
            "", "Each run (test / baseline: to the baseline's run at the same seed):", ""]
    lines += [
        "| variant | flags | best validation tau (step) | test tau | test / baseline | "
        + "".join(f"live {d} tau | " for d in datasets)
        + "".join(f"live {d} - baseline's, paired by prompt | " for d in datasets)
        + "steps | train s | train s / baseline's | s/step (median) | loader wait s/step | block tok/s | untimed s "
        "| peak GiB | final loss | schedule |",
        "|---|---|---:|---:|---:|" + "---:|" * 2 * len(datasets) + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        variant = r.get("variant", r["name"])
        name = r["name"] + (" (baseline)" if variant == bench["baseline"] else "") + (
            " (best)" if variant == bench["best"] else "")
        flags = f"`{shlex.join(r['flags'])}`" if r["flags"] else "-"
        if not r.get("complete"):
            error = str(r.get("error", "failed")).replace("|", "/")
            lines.append(f"| {name} | {flags} | {error} |" + " |" * (12 + 2 * len(datasets)))
            continue
        best, test, cost, live = r["best_validation"], r["test"], r["cost"], r.get("live") or {}
        baseline = baselines.get(r.get("seed")) or {}
        base_test = baseline.get("test") if baseline.get("complete") else None
        ratio = f"{test['tau'] / base_test['tau']:.3f}x" if test and base_test else "-"
        seconds, base_seconds = train_seconds(r), train_seconds(baseline)
        cells = [
            name, flags,
            f"{tau_text(best['tau'], best['stderr'])} ({best['step']})" if best else "-",
            tau_text(test["tau"], test["stderr"]) if test else "-",
            ratio,
            *(tau_text(live[d]["tau"], live[d]["tau_stderr"]) + f" ({live[d]['prompts']})" if d in live else "-"
              for d in datasets),
            *(paired_text((r.get("live_vs_baseline") or {}).get(d)) for d in datasets),
            f"{r['steps']:,}",
            "-" if seconds is None else f"{seconds:,.1f}",
            f"{seconds / base_seconds:.3f}x" if seconds is not None and base_seconds else "-",
            f"{cost['s_per_step']:.4f} ({cost['s_per_step_median']:.4f})",
            "-" if cost.get("loader_wait_s_per_step") is None else f"{cost['loader_wait_s_per_step']:.4f}",
            f"{cost['block_tokens_per_s']:,.0f}" if cost["block_tokens_per_s"] else "-",
            f"{cost['untimed_s']:.1f}",
            "-" if cost["peak_memory_gib"] is None else f"{cost['peak_memory_gib']:.2f}",
            f"{r['final_loss']:.4f}",
            "baseline's" if r["schedule_sha1"] == baseline.get("schedule_sha1")
            else f"its own over {r['steps']:,} steps (peak lr {r['lr_peak']:.2e})" if r["steps"] != bench["steps"]
            else f"other (peak lr {r['lr_peak']:.2e})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    evaluated = sorted({v["step"] for r in results if r.get("complete") for v in r["validation"]})
    if evaluated:
        lines += ["", "Validation tau by step (whole validation split, +- one standard error):", "",
                  "| variant | " + " | ".join(f"step {s}" for s in evaluated) + " |",
                  "|---|" + "---:|" * len(evaluated)]
        for r in results:
            if r.get("complete"):
                at = {v["step"]: v for v in r["validation"]}
                lines.append(f"| {r['name']} | " + " | ".join(
                    tau_text(at[s]["tau"], at[s]["stderr"]) if s in at else "-" for s in evaluated) + " |")
    return "\n".join(lines) + "\n"


def replicate_table(bench: dict[str, Any], seeds: list[int]) -> list[str]:
    """The table over seeds of a bench with several: each variant's test and best validation tau at each seed,
    their mean and standard deviation between seeds, the difference to the baseline paired by seed."""
    def by_seed(figures: dict[str, Any]) -> str:
        at = {run["seed"]: run["tau"] for run in figures["by_seed"]}
        return " / ".join(f"{at[seed]:.3f}" if seed in at else "-" for seed in seeds)

    def mean(figures: dict[str, Any]) -> str:
        if figures["mean"] is None:
            return "-"
        return f"{figures['mean']:.3f} (sd " + ("n/a" if figures["sd"] is None else f"{figures['sd']:.3f}") + ")"

    def paired(figures: dict[str, Any]) -> str:
        difference = figures["vs_baseline"]
        if difference is None:
            return "-"
        stderr = "n/a" if difference["stderr"] is None else f"{difference['stderr']:.3f}"
        return f"{difference['mean']:+.3f} +- {stderr} ({difference['seeds']})"

    def train_time(variant: dict[str, Any]) -> list[str]:  # steps, mean train s, its ratio to the baseline's
        seconds = variant.get("train_s") or {}
        ratio = seconds.get("vs_baseline")
        return ["-" if variant.get("steps") is None else f"{variant['steps']:,}",
                "-" if seconds.get("mean") is None else f"{seconds['mean']:,.1f}",
                "-" if ratio is None else f"{ratio['mean']:.3f}x ({ratio['seeds']})"]

    seed_list = " / ".join(map(str, seeds))
    lines = [
        f"Over seeds ({seed_list}): tau at each seed, the mean (and the standard deviation between seeds), and "
        "the difference to the baseline paired by seed (each seed's run minus the baseline's at that seed: the mean "
        "+- its standard error over seeds, and the number of seeds). A single run's +- (over test or validation "
        "sequences) leaves out how far training on the same recipe varies between runs; the spread between seeds "
        "holds it. Steps and train s (the sum of every step's time, mean over seeds; its ratio to the baseline's run "
        "at the same seed, mean over the seeds both finished) tell whether the variants had equal steps or equal "
        "time.",
        "",
        f"| variant | flags | test tau ({seed_list}) | test tau mean (sd) | test - baseline (seeds) | "
        f"best validation tau ({seed_list}) | best validation mean (sd) | best validation - baseline (seeds) | "
        "steps | train s mean | train s / baseline's (seeds) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in bench["replicates"]:
        name = variant["name"] + (" (baseline)" if variant["name"] == bench["baseline"] else "") + (
            " (best)" if variant["name"] == bench["best"] else "")
        flags = f"`{shlex.join(variant['flags'])}`" if variant["flags"] else "-"
        test, validation = variant["test"], variant["best_validation"]
        lines.append("| " + " | ".join([name, flags, by_seed(test), mean(test), paired(test), by_seed(validation),
                                         mean(validation), paired(validation), *train_time(variant)]) + " |")
    return lines


# ------------------------------------------------------------------------------------------------------------ CLI


@click.group()
def main() -> None:
    """The recipe bench (its recipe: this file's header)."""


@main.command("run")
@click.option("--cache", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="The feature cache every variant trains on.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The bench folder: results/, bench.json, bench.md, runs/, logs/, live/.")
@click.option("--variant", "variants", multiple=True, required=True, metavar="NAME=FLAGS",
              help="A variant: its name and its own `dflash train` flags (quoted); repeat; the first is the baseline.")
@click.option("--steps", type=click.IntRange(min=1), required=True,
              help="Optimizer steps of every variant (`dflash train --max-steps`: the schedule's length).")
@click.option("--steps-of", "steps_of", multiple=True, metavar="NAME=STEPS",
              help="Variant NAME trains STEPS steps instead (its own cosine schedule over its own length): the "
                   "equal-time comparison; repeat.")
@click.option("--eval-every", type=click.IntRange(min=1), required=True,
              help="Validation evaluations (whole split) every N steps, and at the end.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every variant (split, data, weights).")
@click.option("--seeds", default=None, metavar="SEED,SEED,...",
              help="Train every variant once per seed (runs NAME@sSEED; every variant at a seed before the next "
                   "seed) and report each variant's mean over seeds and its difference to the baseline paired by "
                   "seed. Instead of --seed.")
@click.option("--train-flags", default="", help="`dflash train` flags of every variant (quoted), before its own.")
@click.option("--untimed-steps", type=click.IntRange(min=0), default=UNTIMED_STEPS, show_default=True,
              help="The first N steps of each variant are left out of its s/step and block tokens/s (warm-up, "
                   "compilation) and reported apart.")
@click.option("--warm-up-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="Before the timed runs, each variant to train whose run compiles trains this many steps into "
                   "BENCH/warm_up (not recorded), so that its timed run finds the compile cache warm (0: none; the "
                   "first compiled variant then pays the first compilation in its training time).")
@click.option("--live-data", default="mtbench,humaneval", show_default=True,
              help="`dflash eval --data` datasets of the live evaluations, comma-separated (empty: none).")
@click.option("--live-samples", type=click.IntRange(min=0), default=80, show_default=True,
              help="Prompts per dataset (0: no live evaluation).")
@click.option("--live-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="New tokens per prompt.")
@click.option("--live-flags", default="--no-baselines", show_default=True,
              help="More `dflash eval` flags (quoted), e.g. \"--no-baselines --threads 2\".")
def run_command(cache: Path, out: Path, variants: tuple[str, ...], steps: int, steps_of: tuple[str, ...],
                eval_every: int, seed: int, seeds: str | None, train_flags: str, untimed_steps: int,
                warm_up_steps: int, live_data: str, live_samples: int, live_new_tokens: int, live_flags: str) -> None:
    """Train each variant alone, at the same steps and schedule; test split, live tau; bench.json and bench.md."""
    from click.core import ParameterSource

    seed_given = click.get_current_context().get_parameter_source("seed") == ParameterSource.COMMANDLINE
    with user_facing_errors():
        if seeds is not None and seed_given:
            raise UserError("give --seed or --seeds, not both")
        parsed = [parse_variant(v) for v in variants]
        record = run_bench(cache, out, parsed, steps, parse_steps_of(steps_of, [name for name, _ in parsed]),
                           eval_every, [seed] if seeds is None else parse_seeds(seeds), shlex.split(train_flags),
                           untimed_steps, [d for d in live_data.split(",") if d.strip()], live_samples,
                           live_new_tokens, shlex.split(live_flags), warm_up_steps)
    click.echo(render_markdown(record))


@main.command("table")
@click.option("--out", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="The bench folder.")
def table_command(out: Path) -> None:
    """Write BENCH/bench.md again from BENCH/bench.json (and print it)."""
    bench = Bench(out)
    record = read_json(bench.json)
    with user_facing_errors():
        if record is None:
            raise UserError(f"no readable bench.json in {out}: give the --out of a `recipe_bench.py run`")
    bench.table.write_text(render_markdown(record))
    click.echo(bench.table.read_text())


if __name__ == "__main__":
    main()
