"""benchmarks/recipe_bench.py end to end on CPU: two variants of the real `dflash train` on the tests' tiny cache,
trained one after another at the same steps and schedule (checked from their metrics), evaluated at the same steps
on the whole validation split, then on the test split and live; a rerun after a variant's result was lost trains
that variant alone; the table is generated from bench.json. With two seeds: the first seed's runs carried over from
the one-seed bench, the second seed's trained, the figures over seeds checked against the per-run results. With one
variant at its own steps (equal time): its steps, schedule, last evaluation and training time from its metrics."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, step_records

STEPS, EVAL_EVERY, UNTIMED = 3, 2, 1
EVAL_FRACTION, TEST_FRACTION = 0.3, 0.3  # of the 14 samples: validation and test splits of a few sequences each
TRAIN_FLAGS = (f"--draft-layers 1 --max-anchors 8 --batch-tokens 1024 --num-workers 0 --mixed-precision no "
               f"--eval-fraction {EVAL_FRACTION} --test-fraction {TEST_FRACTION}")
VARIANTS = ("base=", "g4=--gamma 4 --clip 0.5")  # the plain recipe and one with another loss decay and clip


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recipe_bench", REPO / "benchmarks" / "recipe_bench.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["run", "--cache", str(cache), "--out", str(out), "--steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
            "--untimed-steps", str(UNTIMED), "--train-flags", TRAIN_FLAGS, "--live-data", "mtbench",
            "--live-samples", "1", "--live-new-tokens", "4"]
    for variant in VARIANTS:
        args += ["--variant", variant]
    return subprocess.run([sys.executable, "benchmarks/recipe_bench.py", *args, *extra], cwd=REPO, text=True,
                          capture_output=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def bench(baseline_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recipe_bench") / "bench"
    result = run_bench(baseline_cache, out)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_variants_train_at_the_same_steps_and_schedule_and_report_from_their_runs(bench: Path,
                                                                                  baseline_cache: Path) -> None:
    from dflash.stage2_train.cache_index import CacheIndex

    record = json.loads((bench / "bench.json").read_text())
    results = {r["name"]: r for r in record["results"]}
    assert list(results) == ["base", "g4"] and record["baseline"] == "base"
    assert all(r["complete"] and r["steps"] == STEPS for r in results.values())
    # The same steps and learning rate at every step (read from each run's own metrics, not from the bench).
    runs = {name: step_records(bench / "runs" / name) for name in results}
    assert sorted(runs["base"]) == sorted(runs["g4"]) == list(range(1, STEPS + 1))
    assert {s: r["lr"] for s, r in runs["base"].items()} == {s: r["lr"] for s, r in runs["g4"].items()}
    assert len({r["lr"] for r in runs["base"].values()}) == STEPS  # a schedule that moves, so equality means something
    assert results["g4"]["schedule_sha1"] == results["base"]["schedule_sha1"]
    # ... and the other flags did change the training (the loss differs from the first step on).
    assert runs["base"][1]["loss"] != runs["g4"][1]["loss"]
    # Evaluated at the same steps (every EVAL_EVERY and the end, not the untrained drafter's step 0) over the whole
    # validation split.
    validation = len(CacheIndex.from_cache(baseline_cache, EVAL_FRACTION, 0, TEST_FRACTION).eval)
    assert validation >= 2
    for name, result in results.items():
        assert [v["step"] for v in result["validation"]] == [2, 3]
        assert {v["sequences"] for v in result["validation"]} == {validation}
        best = json.loads((bench / "runs" / name / "export_best" / "best.json").read_text())
        assert (result["best_validation"]["step"], result["best_validation"]["tau"]) == (best["step"], best["tau_walk"])
        # The trainer's test report of the chosen drafter, whole test split, with its standard error.
        test = json.loads((bench / "runs" / name / "test_results.json").read_text())
        assert result["test"] == {"step": best["step"], "drafter": "export_best", "tau": test["tau_walk"],
                                  "stderr": test["tau_walk_stderr"], "sequences": test["sequences"]}
        assert test["sequences"] >= 2 and test["tau_walk_stderr"] is not None
        # Cost from the steps after the untimed ones: each step's own time and block tokens.
        steps = runs[name]
        timed = [steps[s] for s in range(UNTIMED + 1, STEPS + 1)]
        cost = result["cost"]
        assert cost["timed_steps"] == len(timed) and cost["untimed_s"] == pytest.approx(steps[1]["step_s"], abs=1e-3)
        assert cost["s_per_step"] == pytest.approx(statistics.fmean(r["step_s"] for r in timed))
        # The loader's wait, a part of each step's time, averaged over the same steps.
        assert all(0 <= r["loader_wait_s"] <= r["step_s"] + 1e-3 for r in steps.values())
        assert cost["loader_wait_s_per_step"] == pytest.approx(statistics.fmean(r["loader_wait_s"] for r in timed))
        assert cost["block_tokens_per_s"] == pytest.approx(sum(r["block_tokens"] for r in timed)
                                                           / sum(r["step_s"] for r in timed))
        assert cost["peak_memory_gib"] == max(r["memory_peak_gib"] for r in steps.values() if "memory_peak_gib" in r)
        assert all(r["block_tokens"] > 0 and 0 < r["step_s"] <= r["elapsed_s"] + 1e-3 for r in steps.values())
    # Live tau of the baseline and of the best by validation tau (the same variant when it is the best), each with
    # its standard error (none for a single prompt), from `dflash eval`'s own report.
    best_name = max(results, key=lambda n: results[n]["best_validation"]["tau"])
    assert record["best"] == best_name
    for name in results:
        live = results[name]["live"]
        if name not in ("base", best_name):
            assert live is None
            continue
        report = json.loads((bench / "live" / f"{name}--mtbench" / "eval.json").read_text())["datasets"]["mtbench"]
        assert live == {"mtbench": {"prompts": 1, "steps": report["steps"], "tau": report["tau"],
                                    "tau_stderr": report["tau_stderr"], "new_tokens": report["new_tokens"]["dflash"],
                                    "prompt_tau": {s["id"]: s["tau"] for s in report["samples"]}}}
        assert report["prompts"] == 1 and report["tau"] >= 1.0


def test_the_table_is_generated_from_the_json(bench: Path, tmp_path: Path) -> None:
    module = load_bench()
    record = json.loads((bench / "bench.json").read_text())
    assert (bench / "bench.md").read_text() == module.render_markdown(record)
    # Another figure in bench.json gives another table (`table` reads the JSON alone).
    copy = tmp_path / "bench"
    copy.mkdir()
    record["results"][1]["test"] = {**record["results"][1]["test"], "tau": 2.5, "stderr": 0.125}
    record["results"][0]["test"] = {**record["results"][0]["test"], "tau": 2.0, "stderr": 0.1}
    (copy / "bench.json").write_text(json.dumps(record))
    result = subprocess.run([sys.executable, "benchmarks/recipe_bench.py", "table", "--out", str(copy)], cwd=REPO,
                            text=True, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (copy / "bench.md").read_text()
    rows: dict[str, str] = {}  # the first table's row of each variant
    for line in table.splitlines():
        rows.setdefault(line.lstrip("| ").split(" ")[0], line)
    assert "| 2.500 +- 0.125 | 1.250x |" in rows["g4"] and "| 2.000 +- 0.100 | 1.000x |" in rows["base"]
    # A failed variant: its row says why, with as many cells as the others.
    record["results"][1] = {"name": "g4", "flags": ["--gamma", "4"], "complete": False, "exit_code": 2,
                            "error": "dflash: error: out of memory | lower --batch-tokens"}
    failed = module.render_markdown(record).splitlines()
    row = next(line for line in failed if line.startswith("| g4 "))
    header = next(line for line in failed if line.startswith("| variant | flags"))
    assert "dflash: error: out of memory / lower --batch-tokens" in row and row.count("|") == header.count("|")


def test_a_rerun_skips_finished_variants_and_refuses_other_settings(bench: Path, baseline_cache: Path,
                                                                     tmp_path: Path) -> None:
    # The machine was lost while the second variant trained: its result is gone, the first's is complete.
    out = tmp_path / "bench"
    shutil.copytree(bench, out)
    (out / "results" / "g4.json").unlink()
    # And the baseline had the lower validation tau (an edit: on 14 samples both often tie), so that the other
    # variant, once trained, is the best and is evaluated live beside the baseline's kept live result.
    base = json.loads((out / "results" / "base.json").read_text())
    base["best_validation"]["tau"] = 0.5
    (out / "results" / "base.json").write_text(json.dumps(base))
    # The baseline's live record as an older bench wrote it (without per-prompt tau, as the carried one of
    # 2026-12-06): the comparison paired by prompt reads its evaluation folder instead.
    base_live = json.loads((out / "results" / "base.live.json").read_text())
    del base_live["datasets"]["mtbench"]["prompt_tau"]
    (out / "results" / "base.live.json").write_text(json.dumps(base_live))
    kept = {path: path.stat().st_mtime_ns for path in (out / "runs" / "base" / "metrics.jsonl",
                                                      out / "results" / "base.json", out / "logs" / "base.train.out")}
    result = run_bench(baseline_cache, out)
    assert result.returncode == 0, result.stderr[-4000:]
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # the first variant was not trained again
    assert "variant base: done before" in result.stderr and "variant g4: training" in result.stderr
    assert "live base on mtbench: done before, skipped" in result.stderr
    record = json.loads((out / "bench.json").read_text())
    assert all(r["complete"] for r in record["results"])
    assert record["best"] == "g4" and "live g4 on mtbench: tau" in result.stderr
    live = {r["name"]: r["live"] for r in record["results"]}
    assert live["g4"]["mtbench"]["prompts"] == 1 and live["base"] == json.loads(
        (bench / "results" / "base.live.json").read_text())["datasets"]
    # g4's live tau against the baseline's, paired by prompt: one prompt, its difference, no standard error.
    reports = {name: json.loads((out / "live" / f"{name}--mtbench" / "eval.json").read_text())["datasets"]["mtbench"]
               for name in ("base", "g4")}
    (g4_sample,), (base_sample,) = reports["g4"]["samples"], reports["base"]["samples"]
    assert g4_sample["id"] == base_sample["id"]
    difference = {r["name"]: r.get("live_vs_baseline") for r in record["results"]}
    assert difference["base"] is None and difference["g4"]["mtbench"] == {
        "prompts": 1, "mean": pytest.approx(g4_sample["tau"] - base_sample["tau"]), "stderr": None,
        "higher": int(g4_sample["tau"] > base_sample["tau"]), "lower": int(g4_sample["tau"] < base_sample["tau"]),
        "equal": int(g4_sample["tau"] == base_sample["tau"]), "no_steps": 0}
    assert f"(higher on {difference['g4']['mtbench']['higher']} of 1)" in (out / "bench.md").read_text()
    again = step_records(out / "runs" / "g4")
    first = step_records(out / "runs" / "base")
    assert {s: r["lr"] for s, r in again.items()} == {s: r["lr"] for s, r in first.items()}
    assert (out / "bench.md").read_text() == load_bench().render_markdown(record)
    # Other settings than a kept result's are refused in one line, before anything trains; unequal flags too.
    for extra, message in ((("--seed", "1"), "base.json was made with other settings (seed differ)"),
                           (("--variant", "x=--max-steps 9"), "--variant x: --max-steps would make the variants "
                                                              "unequal"),
                           (("--train-flags", "--eval-untrained"), "--train-flags: --eval-untrained would make the "
                                                                    "variants unequal")):
        refused = run_bench(baseline_cache, out, *extra)
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, (
            refused.stderr[-3000:])
    assert {path: path.stat().st_mtime_ns for path in kept} == kept


def test_a_variant_with_its_own_steps_trains_its_own_schedule_and_its_training_time_is_measured(
        bench: Path, baseline_cache: Path, tmp_path: Path) -> None:
    # The equal-time comparison: g4 trains OWN steps (not a multiple of EVAL_EVERY) while the baseline keeps STEPS.
    own = STEPS + 2
    out = tmp_path / "bench"
    shutil.copytree(bench, out)
    kept = {path: path.stat().st_mtime_ns for path in (out / "runs" / "base" / "metrics.jsonl",
                                                      out / "results" / "base.json")}
    extra = ("--steps-of", f"g4={own}", "--live-data", "")  # (no live tau: nothing here depends on it)
    # A variant's steps are part of its run's settings: the kept g4 result of STEPS steps is refused, not reused.
    refused = run_bench(baseline_cache, out, *extra)
    assert refused.returncode == 2 and "g4.json was made with other settings (steps differ)" in refused.stderr, (
        refused.stderr[-3000:])
    (out / "results" / "g4.json").unlink()
    result = run_bench(baseline_cache, out, *extra, "--warm-up-steps", "1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "variant base: done before" in result.stderr and "variant g4: training" in result.stderr
    # --warm-up-steps: only g4 is to be trained (base is done), and on the CPU its run does not compile: no warm-up.
    assert "variant g4: no warm-up (its run does not compile)" in result.stderr and "base: no warm-up" not in (
        result.stderr) and not (out / "warm_up").exists()
    assert {path: path.stat().st_mtime_ns for path in kept} == kept
    # g4 trained its own steps on its own cosine schedule (read from its metrics): the learning rate moves until
    # its last step and reaches 0 there, where the baseline's reached 0 at STEPS.
    runs = {name: step_records(out / "runs" / name) for name in ("base", "g4")}
    assert sorted(runs["g4"]) == list(range(1, own + 1)) and sorted(runs["base"]) == list(range(1, STEPS + 1))
    lrs = {name: [runs[name][s]["lr"] for s in sorted(runs[name])] for name in runs}
    assert lrs["g4"][-1] == pytest.approx(0, abs=1e-12) and lrs["base"][-1] == pytest.approx(0, abs=1e-12)
    assert all(lr > 0 for lr in lrs["g4"][:-1]) and lrs["g4"][STEPS - 1] > 0
    record = json.loads((out / "bench.json").read_text())
    results = {r["name"]: r for r in record["results"]}
    assert results["g4"]["steps"] == results["g4"]["settings"]["steps"] == own
    assert results["base"]["steps"] == results["base"]["settings"]["steps"] == STEPS
    assert [v["name"] for v in record["variants"]] == ["base", "g4"]
    assert [v["steps"] for v in record["variants"]] == [STEPS, own]
    # Evaluated every EVAL_EVERY steps and at its last step.
    assert [v["step"] for v in results["g4"]["validation"]] == [2, 4, own]
    # Training time: every step's step_s, the untimed ones included, summed here from each run's metrics.
    seconds = {name: sum(r["step_s"] for r in runs[name].values()) for name in runs}
    assert all(results[name]["cost"]["train_s"] == pytest.approx(seconds[name], abs=1e-9) for name in runs)
    assert all(seconds[name] > results[name]["cost"]["untimed_s"] > 0 for name in runs)
    table = (out / "bench.md").read_text()
    assert table == load_bench().render_markdown(record)
    rows: dict[str, str] = {}  # the first table's row of each run
    for line in table.splitlines():
        if line.startswith(("| base ", "| g4 ")):
            rows.setdefault(line.split(" ")[1], line)
    assert (f"| {STEPS} | {seconds['base']:,.1f} | 1.000x | " in rows["base"]
            and f"| {own} | {seconds['g4']:,.1f} | {seconds['g4'] / seconds['base']:.3f}x | " in rows["g4"])
    assert rows["base"].endswith("| baseline's |") and f"| its own over {own} steps (peak lr" in rows["g4"]
    assert f"{STEPS} steps per variant (the same cosine schedule), except g4 {own} steps (their own" in table
    assert not any("warm_up_steps" in r for r in record["results"]) and "untimed warm-up" not in table


@pytest.mark.parametrize("cuda", [True, False])
def test_a_variant_compiles_as_its_flags_or_its_runs_length_say(cuda: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compiles`, which decides the warm-up: the flags' --compile / --no-compile (the last one), else the path
    `fast_path.training_path` picks for the timed run's length, device, attention, architecture and --fsdp."""
    from dflash.stage2_train.fast_path import COMPILE_MIN_STEPS, training_path

    module = load_bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    long, short = COMPILE_MIN_STEPS, COMPILE_MIN_STEPS - 1
    assert module.compiles(["--compile"], short) and module.compiles(["--no-compile", "--compile"], short)
    assert not module.compiles(["--compile", "--no-compile"], long)
    cases = [([], long), ([], short), (["--attention", "sdpa"], long), (["--attention=flex"], long),
             (["--attention", "flex"], short), (["--fsdp"], long), (["--architecture", "dflash2"], long),
             (["--lr", "1e-3", "--loss", "kl"], long)]
    for flags, steps in cases:
        attention = next((f.split("=")[1] for f in flags if f.startswith("--attention=")), None) or (
            flags[flags.index("--attention") + 1] if "--attention" in flags else "auto")
        architecture = flags[flags.index("--architecture") + 1] if "--architecture" in flags else "dflash"
        expected = training_path(attention, None, "cuda" if cuda else "cpu", steps, 576, "--fsdp" in flags,
                                 architecture)[1]
        assert module.compiles(flags, steps) == expected, (flags, steps)
    assert module.compiles([], long) == cuda  # a long run compiles on CUDA by itself, never on the CPU


def test_the_warm_up_trains_the_compiled_variants_on_their_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm_up` trains the given steps of each variant whose run compiles, with its flags, the seed and --compile
    (a long run that compiles by itself would not compile in a short warm-up), into warm_up/NAME; it skips the others
    and returns the names it warmed up (a failed warm-up is not one of them)."""
    module = load_bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = tmp_path / "calls.jsonl"
    stub = ("import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n'); "
            "sys.exit(3 if '7e-7' in sys.argv else 0)")
    monkeypatch.setattr(module, "dflash_command", lambda *args: [sys.executable, "-c", stub, str(calls), *args])
    bench = module.Bench(tmp_path / "bench")
    bench.root.mkdir()
    variants = [("auto", ["--lr", "1e-3"], 5000), ("plain", ["--no-compile"], 5000), ("short", [], 10),
                ("given", ["--compile"], 10), ("broken", ["--compile", "--lr", "7e-7"], 10)]
    warmed = module.warm_up(bench, tmp_path / "cache", variants, 3, 7)
    assert warmed == {"auto", "given"}
    commands = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c[c.index("--out") + 1] for c in commands] == [str(bench.root / "warm_up" / n)
                                                            for n in ("auto", "given", "broken")]
    for command in commands:
        assert command[0] == "train" and command[command.index("--max-steps") + 1] == "3"
        assert command[command.index("--seed") + 1] == "7" and command[-1] == "--compile"
    assert commands[0][commands[0].index("--lr") + 1] == "1e-3"
    # The table names the runs that started warm (their results carry warm_up_steps), and only those.
    assert module.warm_up_text({"results": [{"name": "auto", "warm_up_steps": 3}, {"name": "plain"}]}) == (
        " (auto: trained 3 untimed warm-up step(s) first, so that its run found the compile cache warm)")
    assert module.warm_up_text({"results": [{"name": "plain"}]}) == ""


def test_steps_of_names_a_variant_and_positive_steps() -> None:
    module = load_bench()
    for args, message in ((["--steps-of", "kl=5"], "--steps-of 'kl=5': give NAME=STEPS, NAME one of the variants "
                                                   "(base, g4)"),
                          (["--steps-of", "g4=0"], "--steps-of 'g4=0': STEPS must be a positive whole number"),
                          (["--steps-of", "g4=-3"], "STEPS must be a positive whole number"),
                          (["--steps-of", "g4=many"], "STEPS must be a positive whole number"),
                          (["--steps-of", "g4=5", "--steps-of", "g4=6"], "give each variant's steps once")):
        result = CliRunner().invoke(module.main, ["run", "--cache", str(REPO), "--out", "unused", "--steps", "3",
                                                  "--eval-every", "1", "--variant", "base=", "--variant", "g4=",
                                                  *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_seed_replicates_train_the_missing_seed_runs_and_pair_them_with_the_baseline(bench: Path, baseline_cache: Path,
                                                                                    tmp_path: Path) -> None:
    # The one-seed bench's runs are the seed-0 runs of a two-seed bench (renamed as recipe_bench.py's header says);
    # then the machine was lost while the first seed-1 run trained (its run folder, no result): both seed-1 runs are
    # trained, in the variants' order, and nothing of seed 0.
    out = tmp_path / "bench"
    shutil.copytree(bench, out)
    for name in ("base", "g4"):
        (out / "results" / f"{name}.json").rename(out / "results" / f"{name}@s0.json")
        (out / "runs" / name).rename(out / "runs" / f"{name}@s0")
    (out / "results" / "base.live.json").rename(out / "results" / "base@s0.live.json")
    (out / "results" / "g4.live.json").unlink(missing_ok=True)  # (the best at seed 0 alone need not be over seeds)
    (out / "runs" / "base@s1").mkdir()
    (out / "runs" / "base@s1" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # killed mid-way
    for stale in ("bench.json", "bench.md"):
        (out / stale).unlink()
    kept = {path: path.stat().st_mtime_ns for path in (out / "results" / "base@s0.json", out / "results" / "g4@s0.json",
                                                      out / "runs" / "base@s0" / "metrics.jsonl")}
    result = run_bench(baseline_cache, out, "--seeds", "0,1")
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stderr
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # the finished seed-0 runs were not trained
    assert "variant base@s0: done before" in log and "variant g4@s0: done before" in log
    assert log.index("variant base@s1: training") < log.index("variant g4@s1: training")
    assert "variant base@s0: training" not in log and "variant g4@s0: training" not in log
    record = json.loads((out / "bench.json").read_text())
    assert record["seeds"] == [0, 1] and "seed" not in record
    rows = {r["name"]: r for r in record["results"]}
    assert list(rows) == ["base@s0", "base@s1", "g4@s0", "g4@s1"]
    assert all(r["complete"] and r["variant"] == r["name"][:-3] and r["seed"] == int(r["name"][-1])
               for r in rows.values())
    # Each seed-1 run trained at seed 1 (another start: another first loss) on the same schedule as every other run.
    runs = {name: step_records(out / "runs" / name) for name in rows}
    assert runs["base@s1"][1]["loss"] != runs["base@s0"][1]["loss"]
    assert rows["g4@s1"]["settings"]["seed"] == 1 and rows["g4@s1"]["settings"]["flags"] == ["--gamma", "4", "--clip",
                                                                                            "0.5"]
    lrs = [{s: r["lr"] for s, r in steps.items()} for steps in runs.values()]
    assert all(lr == lrs[0] for lr in lrs) and sorted(lrs[0]) == list(range(1, STEPS + 1))
    # The figures over seeds, computed here from the per-run result files.
    per_run = {name: json.loads((out / "results" / f"{name}.json").read_text()) for name in rows}
    assert [r["name"] for r in record["replicates"]] == ["base", "g4"]
    for replicate in record["replicates"]:
        check_replicate(replicate, per_run, "base")
    means = {v: statistics.mean(per_run[f"{v}@s{s}"]["best_validation"]["tau"] for s in (0, 1))
             for v in ("base", "g4")}
    assert record["best"] == max(means, key=lambda v: means[v])
    # Live tau at the first seed only: the baseline's kept, the best's measured (when it is not the baseline).
    assert rows["base@s0"]["live"] is not None and rows["base@s1"]["live"] is None and rows["g4@s1"]["live"] is None
    assert (rows["g4@s0"]["live"] is not None) == (record["best"] == "g4")
    table = (out / "bench.md").read_text()
    assert table == load_bench().render_markdown(record)
    g4 = record["replicates"][1]["test"]
    row = next(line for line in table.splitlines() if line.startswith("| g4 "))  # the table over seeds
    assert (f"| {g4['by_seed'][0]['tau']:.3f} / {g4['by_seed'][1]['tau']:.3f} | {g4['mean']:.3f} (sd {g4['sd']:.3f}) | "
            f"{g4['vs_baseline']['mean']:+.3f} +- {g4['vs_baseline']['stderr']:.3f} (2) |") in row


def check_replicate(replicate: dict, per_run: dict[str, dict], baseline: str) -> None:
    """One variant's figures over seeds 0 and 1 against its runs' result files (the statistics module)."""
    variant = replicate["name"]
    assert replicate["flags"] == per_run[f"{variant}@s0"]["settings"]["flags"]
    for figure in ("test", "best_validation"):
        runs = [per_run[f"{variant}@s{seed}"][figure] for seed in (0, 1)]
        got = replicate[figure]
        assert got["by_seed"] == [{"seed": seed, "tau": run["tau"], "stderr": run["stderr"], "step": run["step"]}
                                  for seed, run in enumerate(runs)]
        assert got["mean"] == pytest.approx(statistics.mean(run["tau"] for run in runs))
        assert got["sd"] == pytest.approx(statistics.stdev(run["tau"] for run in runs))
        if variant == baseline:
            assert got["vs_baseline"] is None
            continue
        differences = [runs[seed]["tau"] - per_run[f"{baseline}@s{seed}"][figure]["tau"] for seed in (0, 1)]
        assert got["vs_baseline"] == {"mean": pytest.approx(statistics.mean(differences)), "seeds": 2,
                                      "stderr": pytest.approx(statistics.stdev(differences) / 2 ** 0.5)}


@settings(max_examples=30, deadline=None)
@given(taus=st.dictionaries(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from([0, 1, 2, 7])),
                            st.floats(1.0, 4.0), min_size=1))
def test_the_figures_over_seeds_pair_each_variant_with_the_baseline_at_its_finished_seeds(taus: dict) -> None:
    """Runs finished at any subset of the seeds (the rest not run yet): per variant the mean and standard deviation
    over its own finished seeds, the paired difference over the seeds both it and the baseline finished, and the
    best by the mean best validation tau over seeds (not by any one seed)."""
    import tempfile

    module = load_bench()
    seeds, variants = [0, 1, 2, 7], ["a", "b", "c"]
    with tempfile.TemporaryDirectory() as folder:
        bench = module.Bench(Path(folder))
        for (variant, seed), tau in taus.items():
            figure = {"step": 3, "tau": tau, "stderr": 0.01}
            # The test tau differs from the validation tau, so that the two figures cannot be mixed up unseen.
            bench.write(bench.result_path(f"{variant}@s{seed}"), {
                "name": f"{variant}@s{seed}", "complete": True, "best_validation": figure,
                "test": {**figure, "tau": tau / 2, "drafter": "export_best", "sequences": 3},
                "cost": {"train_s": tau * 100}})  # (a training time that varies too)
        header = {"seeds": seeds,
                  "variants": [{"name": v, "flags": [v], "steps": 3 + i} for i, v in enumerate(variants)]}
        record = module.summary(bench, header)
    for replicate in record["replicates"]:
        name = replicate["name"]
        # Steps and training time: the mean over the variant's seeds, the ratio to the baseline's paired by seed.
        mine_s = {s: taus[name, s] * 100 for s in seeds if (name, s) in taus}
        base_s = {s: taus["a", s] * 100 for s in seeds if ("a", s) in taus}
        ratios = [mine_s[s] / base_s[s] for s in mine_s if s in base_s]
        assert replicate["steps"] == 3 + variants.index(name)
        assert replicate["train_s"]["mean"] == (pytest.approx(statistics.mean(mine_s.values())) if mine_s else None)
        assert replicate["train_s"]["vs_baseline"] == ({"mean": pytest.approx(statistics.mean(ratios)),
                                                        "seeds": len(ratios)} if ratios else None)
        for figure, scale in (("best_validation", 1.0), ("test", 0.5)):
            got = replicate[figure]
            mine = {s: taus[name, s] * scale for s in seeds if (name, s) in taus}
            base = {s: taus["a", s] * scale for s in seeds if ("a", s) in taus}
            assert [(r["seed"], r["tau"]) for r in got["by_seed"]] == list(mine.items())
            if not mine:
                assert got["mean"] is None and got["sd"] is None and got["vs_baseline"] is None
                continue
            assert got["mean"] == pytest.approx(statistics.mean(mine.values()))
            assert got["sd"] == (pytest.approx(statistics.stdev(mine.values())) if len(mine) > 1 else None)
            paired = [mine[s] - base[s] for s in mine if s in base]
            if name == "a" or not paired:
                assert got["vs_baseline"] is None
                continue
            assert got["vs_baseline"]["mean"] == pytest.approx(statistics.mean(paired))
            assert got["vs_baseline"]["seeds"] == len(paired)
            assert got["vs_baseline"]["stderr"] == (
                pytest.approx(statistics.stdev(paired) / len(paired) ** 0.5) if len(paired) > 1 else None)
    # The best: the highest mean over the seeds every variant with a result finished (over each one's own seeds
    # while none is common), so that a seed only one variant has cannot decide.
    finished = {v: {s for (w, s) in taus if w == v} for v in variants if any(w == v for w, _ in taus)}
    common = set.intersection(*finished.values()) if finished else set()
    means = {v: statistics.mean(taus[v, s] for s in (common or finished[v])) for v in finished}
    assert record["best"] in means and means[record["best"]] == pytest.approx(max(means.values()))
    # The table over seeds: one row a variant, '-' for a seed not finished.
    rows = module.replicate_table(record, seeds)[4:]
    assert len(rows) == 3 and all(row.count("|") == 12 for row in rows)
    assert [row.split(" | ")[2].count("-") for row in rows] == [sum((v, s) not in taus for s in seeds)
                                                                for v in variants]


def test_runs_go_seed_by_seed_and_keep_their_names_with_one_seed() -> None:
    module = load_bench()
    variants = [("base", []), ("kl", ["--loss", "kl"])]
    assert [run[:3] for run in module.planned_runs(variants, [3, 1])] == [
        ("base@s3", "base", 3), ("kl@s3", "kl", 3), ("base@s1", "base", 1), ("kl@s1", "kl", 1)]
    assert module.planned_runs(variants, [5]) == [("base", "base", 5, []), ("kl", "kl", 5, ["--loss", "kl"])]
    # --seeds is checked before anything runs: one line, exit 2.
    for args, message in ((["--seeds", "0,x"], "--seeds '0,x': give comma-separated integers"),
                          (["--seeds", "0,1,0"], "give each seed once"),
                          (["--seeds", "0,1", "--seed", "3"], "give --seed or --seeds, not both")):
        result = CliRunner().invoke(module.main, ["run", "--cache", str(REPO), "--out", "unused", "--steps", "3",
                                                  "--eval-every", "1", "--variant", "base=", *args])
        assert result.exit_code == 2 and message in result.output, result.output


# A stand-in for `python3 benchmarks/recipe_bench.py` in the GPU driver: records its arguments and what its results
# folder held when it started, and leaves a run folder with a checkpoint and weights beside its small results.
STUB = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
held = sorted(p.name for p in (out / "results").glob("*.json"))
Path(os.environ["STUB_CALLS"]).write_text(json.dumps({"args": args, "results_held": held}))
(out / "runs" / "ce" / "checkpoints").mkdir(parents=True, exist_ok=True)
(out / "runs" / "ce" / "checkpoints" / "state.bin").write_bytes(b"x" * 1000)
(out / "runs" / "ce" / "model.safetensors").write_bytes(b"x" * 1000)
(out / "runs" / "ce" / "metrics.jsonl").write_text("{}\n")
(out / "bench.md").write_text("| the table |\n")
(out / "bench.log").write_text("bench log line\n")
'''


def test_the_gpu_driver_passes_each_variant_and_carried_results_and_packs_the_small_files(tmp_path: Path) -> None:
    import tarfile

    stub, calls = tmp_path / "stub.py", tmp_path / "calls.json"
    stub.write_text(STUB)
    work, out, carried = tmp_path / "work", tmp_path / "out", tmp_path / "prev" / "bench" / "results"
    (work / "cache_fp8").mkdir(parents=True)
    (work / "cache_fp8" / "manifest.json").write_text("{}")  # a cache made already: no extraction
    carried.mkdir(parents=True)
    (carried / "ce.json").write_text("{}")
    (carried.parent / "live" / "ce--mtbench").mkdir(parents=True)  # an earlier bench's live evaluation beside it
    (carried.parent / "live" / "ce--mtbench" / "eval.json").write_text('{"carried": true}')
    env = {**os.environ, "STUB_CALLS": str(calls), "RECIPE_BENCH": f"{sys.executable} {stub}", "OUT": str(out),
           "WORK": str(work), "SITE": str(tmp_path / "site"), "RESULTS_FROM": str(carried), "STEPS": "300",
           "VARIANTS": "ce=--loss ce; mix25=--loss mix --kl-weight 0.25;", "SEEDS": "0, 1,2",
           "VARIANT_STEPS": "mix25=710; ce=300;", "COMPILE_WARM_UP": "3"}
    result = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    call = json.loads(calls.read_text())
    args = call["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--variant"] == [
        "ce=--loss ce", "mix25=--loss mix --kl-weight 0.25"]
    assert args[args.index("--steps") + 1] == "300" and args[args.index("--out") + 1] == str(out / "bench")
    assert args[args.index("--seeds") + 1] == "0,1,2" and args[args.index("--warm-up-steps") + 1] == "3"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--steps-of"] == ["mix25=710", "ce=300"]
    assert args[args.index("--live-samples") + 1] == "80" and args[args.index("--live-new-tokens") + 1] == "512"
    assert call["results_held"] == ["ce.json"]  # the carried results were there before the bench started
    assert json.loads((out / "bench" / "live" / "ce--mtbench" / "eval.json").read_text()) == {"carried": True}
    assert "recipe bench done (exit 0)" in (out / "recipe_bench_stages.tsv").read_text()
    back = tmp_path / "back"
    back.mkdir()
    packed = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh", "pack", str(back)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0 and "| the table |" in packed.stdout and "bench log line" in packed.stdout
    with tarfile.open(back / "state.tgz") as archive:
        names = {Path(name).as_posix().lstrip("./") for name in archive.getnames()}
    assert {"bench/bench.md", "bench/runs/ce/metrics.jsonl", "bench/results/ce.json"} <= names
    assert not any("checkpoints" in name or name.endswith(".safetensors") for name in names)


@pytest.mark.parametrize("seeds", ["0", "0,1"])
def test_the_follow_ups_take_a_drafter_trained_here_when_the_best_was_carried(tmp_path: Path, seeds: str) -> None:
    """With RESULTS_FROM the best variant may be one trained in an earlier session, whose drafter is not on this
    machine: EVAL_DECODE then decodes with the best (by validation tau) of the drafters trained here, not nothing;
    with several seeds, of those at the first seed (as the best's own drafter would be), whatever the others'."""
    stub, decode_stub = tmp_path / "stub.py", tmp_path / "decode.py"
    suffix = "@s0" if "," in seeds else ""
    stub.write_text(STUB + f'''
suffix = {suffix!r}
rows = [{{"name": "carried" + suffix, "best_validation": {{"tau": 5.0}}}},
        {{"name": "aaa" + suffix, "best_validation": {{"tau": 3.0}}}},
        {{"name": "here" + suffix, "best_validation": {{"tau": 4.0}}}}]
if suffix:
    rows.append({{"name": "aaa@s1", "best_validation": {{"tau": 4.5}}}})
(out / "bench.json").write_text(json.dumps({{"best": "carried", "results": rows}}))
for name in [row["name"] for row in rows if not row["name"].startswith("carried")]:
    (out / "runs" / name / "export_best").mkdir(parents=True)
    (out / "runs" / name / "export_best" / "config.json").write_text("{{}}")
''')
    decode_stub.write_text("import json, os, sys\nopen(os.environ['STUB_DECODE'], 'w').write(json.dumps(sys.argv[1:]))\n")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "cache_fp8").mkdir(parents=True)
    (work / "cache_fp8" / "manifest.json").write_text("{}")
    env = {**os.environ, "STUB_CALLS": str(tmp_path / "calls.json"), "STUB_DECODE": str(tmp_path / "decode.json"),
           "RECIPE_BENCH": f"{sys.executable} {stub}", "BENCH_EVAL_DECODE": f"{sys.executable} {decode_stub}",
           "OUT": str(out), "WORK": str(work), "SITE": str(tmp_path / "site"),
           "VARIANTS": "carried=;aaa=--lr 5e-4;here=--lr 2e-3", "SEEDS": seeds,
           "EVAL_DECODE": "1", "EVAL_DECODE_FLAGS": "--prompts 3 --eager-extend"}
    result = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    args = json.loads((tmp_path / "decode.json").read_text())
    assert args[args.index("--draft") + 1] == str(out / "bench" / "runs" / f"here{suffix}" / "export_best")
    assert args[-3:] == ["--prompts", "3", "--eager-extend"]
    assert "eval decode bench (exit 0)" in (out / "recipe_bench_stages.tsv").read_text()


# A stand-in for benchmarks/bench_train.py in the GPU driver: appends its arguments and one environment variable.
BENCH_TRAIN_STUB = r'''
import json, os, sys
with open(os.environ["STUB_PROFILES"], "a") as calls:
    calls.write(json.dumps({"args": sys.argv[1:], "split": os.environ.get("TORCHINDUCTOR_SPLIT_REDUCTIONS")}) + "\n")
'''


def test_the_gpu_driver_runs_each_train_profile_with_its_environment_and_bench_flags(tmp_path: Path) -> None:
    stub, bench_stub = tmp_path / "stub.py", tmp_path / "bench_train.py"
    stub.write_text(STUB)
    bench_stub.write_text(BENCH_TRAIN_STUB)
    work, out, calls = tmp_path / "work", tmp_path / "out", tmp_path / "profiles.jsonl"
    (work / "cache_fp8").mkdir(parents=True)
    (work / "cache_fp8" / "manifest.json").write_text("{}")
    env = {**os.environ, "STUB_CALLS": str(tmp_path / "calls.json"), "STUB_PROFILES": str(calls),
           "RECIPE_BENCH": f"{sys.executable} {stub}", "BENCH_TRAIN": f"{sys.executable} {bench_stub}",
           "OUT": str(out), "WORK": str(work), "SITE": str(tmp_path / "site"), "VARIANTS": "ce=--loss ce",
           "TRAIN_FLAGS": "--lr 1e-3", "TRAIN_PROFILE": "--architecture dflash | --exact-windows; "
           "TORCHINDUCTOR_SPLIT_REDUCTIONS=0 --compile --attention flex;"}
    result = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = [json.loads(line) for line in calls.read_text().splitlines()]

    def value(call: dict, flag: str) -> str:
        return call["args"][call["args"].index(flag) + 1]

    assert value(first, "--train-flags").split() == ["--lr", "1e-3", "--architecture", "dflash"]
    assert "--exact-windows" in first["args"] and first["split"] is None
    assert value(first, "--name") == "architecture_dflash_exact-windows"
    assert value(second, "--train-flags").split() == ["--lr", "1e-3", "--compile", "--attention", "flex"]
    assert "--exact-windows" not in second["args"] and second["split"] == "0"
    assert value(second, "--name") == "TORCHINDUCTOR_SPLIT_REDUCTIONS_0_compile_attention_flex"
    stages = (out / "recipe_bench_stages.tsv").read_text()
    assert stages.count("train profile") == 2 and stages.rstrip().endswith("follow-ups done")


# A stand-in for `dflash` in gpu_pipeline.sh: `extract` records its arguments and makes a cache folder.
DFLASH_STUB = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
Path(os.environ["STUB_EXTRACT"]).write_text(json.dumps(args))
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True)
(out / "manifest.json").write_text("{}")
(out / "extract.log").write_text("extracted\n")
'''


def test_the_gpu_driver_makes_the_top_k_cache_from_the_carried_conversations(tmp_path: Path) -> None:
    for name, text in (("stub.py", STUB), ("dflash_stub.py", DFLASH_STUB)):
        (tmp_path / name).write_text(text)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": f"answer {i}"}]} for i in range(3)]
    (work / "carried.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))  # `model` made it
    # `python3` in gpu_pipeline.sh: this interpreter, with the project's libraries (a link would leave its venv)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "STUB_CALLS": str(tmp_path / "calls.json"), "STUB_EXTRACT": str(tmp_path / "extract.json"),
           "RECIPE_BENCH": f"{sys.executable} {tmp_path / 'stub.py'}", "DF": f"{sys.executable} "
           f"{tmp_path / 'dflash_stub.py'}", "OUT": str(out), "WORK": str(work), "SITE": str(tmp_path / "site"),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    extract = json.loads((tmp_path / "extract.json").read_text())
    assert extract[:5] == ["extract", "--data", str(work / "gen" / "finished.jsonl"), "--out", str(work / "cache_fp8")]
    assert " ".join(extract[5:]) == "--max-length 2048 --feature-dtype fp8 --store-target-topk 32"
    assert [json.loads(line)["id"] for line in (work / "gen" / "finished.jsonl").read_text().splitlines()] == [
        "c0", "c1", "c2"]
    args = json.loads((tmp_path / "calls.json").read_text())["args"]
    assert args[args.index("--cache") + 1] == str(work / "cache_fp8")
    assert [args[i + 1] for i, a in enumerate(args) if a == "--variant"] == [  # the default: question d
        "lr1e-3=", "lr2e-3=--lr 2e-3", "lr5e-4=--lr 5e-4"]
    assert args[args.index("--steps") + 1] == "600" and "--seeds" not in args and "--steps-of" not in args
    assert args[args.index("--train-flags") + 1].endswith("--attention flex --compile")  # every variant fast
    stages = (out / "recipe_bench_stages.tsv").read_text()
    assert "\tcache\n" in stages and "recipe bench done (exit 0)" in stages


def test_an_older_live_record_takes_its_per_prompt_tau_only_from_the_evaluation_it_records(tmp_path: Path) -> None:
    """A carried live record without per-prompt tau reads it from live/NAME--DATASET/eval.json, but only when that
    evaluation is the recorded one (same prompts, steps and tau): another bench's folder of the same name is not
    paired. A prompt decoded in no speculative step (tau null) is left out of the pairing and counted."""
    module = load_bench()
    bench = module.Bench(tmp_path / "bench")
    samples = [{"id": "mtbench/81", "tau": 2.5}, {"id": "mtbench/82", "tau": None}]
    report = {"datasets": {"mtbench": {"prompts": 2, "steps": 8, "tau": 2.5, "samples": samples}}}
    (bench.live / "base--mtbench").mkdir(parents=True)
    (bench.live / "base--mtbench" / "eval.json").write_text(json.dumps(report))
    bench.results.mkdir(parents=True)
    adopted = {}
    for steps in (9, 8):  # another evaluation than the recorded one (9 steps), then the recorded one
        record = {"settings": {}, "datasets": {"mtbench": {"prompts": 2, "steps": steps, "tau": 2.5,
                                                           "tau_stderr": None, "new_tokens": 20}}}
        bench.live_path("base").write_text(json.dumps(record))
        adopted[steps] = module.live_figures(bench, "base")["mtbench"].get("prompt_tau")
    assert adopted == {9: None, 8: {"mtbench/81": 2.5, "mtbench/82": None}}
    difference = module.json_safe(module.paired_tau_difference({"mtbench/81": 3.0, "mtbench/82": 1.5}, adopted[8]))
    assert (difference["prompts"], difference["mean"], difference["stderr"], difference["no_steps"]) == (1, 0.5, None, 1)
    assert module.paired_text(difference) == "+0.500 +- n/a (higher on 1 of 1)"
