"""benchmarks/recipe_bench.py end to end on CPU: two variants of the real `dflash train` on the tests' tiny cache,
trained one after another at the same steps and schedule (checked from their metrics), evaluated at the same steps
on the whole validation split, then on the test split and live; a rerun after a variant's result was lost trains
that variant alone; the table is generated from bench.json."""

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
    # Evaluated at the same steps (0, every EVAL_EVERY, the end) over the whole validation split.
    validation = len(CacheIndex.from_cache(baseline_cache, EVAL_FRACTION, 0, TEST_FRACTION).eval)
    assert validation >= 2
    for name, result in results.items():
        assert [v["step"] for v in result["validation"]] == [0, 2, 3]
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
                                    "tau_stderr": report["tau_stderr"], "new_tokens": report["new_tokens"]["dflash"]}}
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
    again = step_records(out / "runs" / "g4")
    first = step_records(out / "runs" / "base")
    assert {s: r["lr"] for s, r in again.items()} == {s: r["lr"] for s, r in first.items()}
    assert (out / "bench.md").read_text() == load_bench().render_markdown(record)
    # Other settings than a kept result's are refused in one line, before anything trains; unequal flags too.
    for extra, message in ((("--seed", "1"), "base.json was made with other settings (seed differ)"),
                           (("--variant", "x=--max-steps 9"), "--variant x: --max-steps would make the variants "
                                                              "unequal")):
        refused = run_bench(baseline_cache, out, *extra)
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, (
            refused.stderr[-3000:])
    assert {path: path.stat().st_mtime_ns for path in kept} == kept


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
    work, out, carried = tmp_path / "work", tmp_path / "out", tmp_path / "carried"
    (work / "cache_fp8").mkdir(parents=True)
    (work / "cache_fp8" / "manifest.json").write_text("{}")  # a cache made already: no extraction
    carried.mkdir()
    (carried / "ce.json").write_text("{}")
    env = {**os.environ, "STUB_CALLS": str(calls), "RECIPE_BENCH": f"{sys.executable} {stub}", "OUT": str(out),
           "WORK": str(work), "SITE": str(tmp_path / "site"), "RESULTS_FROM": str(carried), "STEPS": "300",
           "VARIANTS": "ce=--loss ce; mix25=--loss mix --kl-weight 0.25;"}
    result = subprocess.run(["bash", "benchmarks/gpu_recipe_bench.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    call = json.loads(calls.read_text())
    args = call["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--variant"] == [
        "ce=--loss ce", "mix25=--loss mix --kl-weight 0.25"]
    assert args[args.index("--steps") + 1] == "300" and args[args.index("--out") + 1] == str(out / "bench")
    assert args[args.index("--live-samples") + 1] == "20" and args[args.index("--live-new-tokens") + 1] == "512"
    assert call["results_held"] == ["ce.json"]  # the carried results were there before the bench started
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
    assert " ".join(extract[5:]) == ("--max-length 2048 --feature-dtype fp8 --store-target-topk 32 "
                                     "--export-layers last:5")
    assert [json.loads(line)["id"] for line in (work / "gen" / "finished.jsonl").read_text().splitlines()] == [
        "c0", "c1", "c2"]
    args = json.loads((tmp_path / "calls.json").read_text())["args"]
    assert args[args.index("--cache") + 1] == str(work / "cache_fp8")
    assert [args[i + 1] for i, a in enumerate(args) if a == "--variant"] == [  # the default: question b, anchors
        "density6=", "fixed64=--anchor-density 1 --max-anchors 64",
        "density3=--anchor-density 0.3333 --max-anchors 100000"]
    assert args[args.index("--steps") + 1] == "600"
    assert args[args.index("--train-flags") + 1].endswith("--attention flex --compile")  # every variant fast
    stages = (out / "recipe_bench_stages.tsv").read_text()
    assert "\tcache\n" in stages and "recipe bench done (exit 0)" in stages
