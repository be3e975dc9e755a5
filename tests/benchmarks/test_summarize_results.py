"""benchmarks/summarize_results.py: every committed summary.json is the script's reading of its folder's raw files,
and what it reads (archived or not) is what the raw files hold."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dflash.stage2_train.acceptance import tau_standard_error
from tests.conftest import REPO

RESULTS = REPO / "benchmarks" / "results"
FOLDERS = sorted(p.parent for p in RESULTS.glob("*/summary.json"))


def _summarize_results():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dflash_summarize_results",
                                                  REPO / "benchmarks" / "summarize_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summarize_results = _summarize_results()


def test_every_results_folder_is_summarised_with_its_command() -> None:
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        assert (folder / "command.txt").is_file(), folder
        assert (folder / "raw.tar.xz").is_file(), folder
    assert len(FOLDERS) >= 7


def test_committed_summaries_are_the_scripts_output() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "summarize_results.py"), "--check",
                           *map(str, FOLDERS)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_recomputed_standard_error_equals_what_dflash_eval_recorded() -> None:
    """The H100 evaluations recorded tau_stderr; the per-prompt recomputation the script applies to older files
    gives the same number from the same records."""
    folder = RESULTS / "h100_packed_vs_padded_2026-12-05"
    files = summarize_results.raw_files(folder)
    checked = 0
    for name in ("eval_padded_mtbench.json", "eval_ce_humaneval.json"):
        report = json.loads(files[name])
        for dataset in report["datasets"].values():
            recorded = dataset.pop("tau_stderr")
            samples = dataset["samples"]
            assert recorded == pytest.approx(tau_standard_error(
                [sum(a + 1 for a in s["accepted"]) for s in samples], [len(s["accepted"]) for s in samples]), rel=1e-12)
            entry = summarize_results.evaluation(report)["datasets"][dataset["dataset"]]
            assert entry["tau_stderr"] == pytest.approx(recorded, rel=1e-12)
            assert entry["tau_stderr_source"].startswith("recomputed")
            checked += 1
    assert checked == 2


def test_a_folder_reads_the_same_archived_or_not(tmp_path: Path) -> None:
    plain, archived = tmp_path / "plain", tmp_path / "archived"
    records = [{"step": 0, "eval/tau_walk": 1.0, "eval/sequences": 3, "eval/tokens": 90},
               *({"step": s, "loss": 10.0 - s, "elapsed_s": s / 2} for s in range(1, 9)),
               {"step": 8, "eval/tau_walk": 1.5, "eval/tau_walk_stderr": 0.1, "eval/sequences": 3, "eval/tokens": 90}]
    raw = {
        "timings.tsv": "extract_fp8\t12 s\trc 0\n123\t/tmp/work/cache_fp8\ntrain\t40 s\trc 0\nheadline done\n",
        "run_a/metrics.jsonl": "".join(json.dumps(r) + "\n" for r in records),
        "run_a/train.log": "INFO dflash.trainer: training 8 steps (~4 per epoch) on 1 process(es), cuda, "
                           "20 train / 3 validation / 2 test samples; mask token 16\n",
        "calib_run_b.log": "INFO dflash.trainer: eval step 60: tau 1.084 +- 0.007 (walk, 227 validation sequences)\n"
                           "torch.OutOfMemoryError: CUDA out of memory.\n",
    }
    for name, text in raw.items():
        for root in (plain, archived):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    with tarfile.open(archived / "raw.tar.xz", "w:xz") as tar:
        for name in raw:
            tar.add(archived / name, arcname=name)
            (archived / name).unlink()
    (archived / "run_a").rmdir()
    summary = summarize_results.summarize(plain)
    assert {k: v for k, v in summarize_results.summarize(archived).items() if k != "folder"} == {
        k: v for k, v in summary.items() if k != "folder"}
    stages = summary["stages (timings.tsv)"]
    assert stages["stages"] == [["extract_fp8", 12, 0], ["train", 40, 0]]
    assert stages["cache_bytes"] == {"cache_fp8": 123} and stages["notes"] == ["headline done"]
    run = summary["runs"]["run_a"]
    assert run["split"] == {"train": 20, "validation": 3, "test": 2}
    assert (run["steps"], run["steps_per_s"], run["loss_mean_last_20_steps"]) == (8, 2.0, 5.5)
    assert run["eval"]["whole_validation_split"] is True
    assert run["best"] == {"step": 8, "tau_walk": 1.5, "tau_walk_stderr": 0.1}
    assert summary["logged_training"]["calib_run_b.log"] == {
        "tau_walk_by_step": [[60, 1.084, 0.007, 227]], "errors": ["torch.OutOfMemoryError: CUDA out of memory."]}


def test_a_resumed_generation_counts_each_processs_first_batch_of_a_length_apart(tmp_path: Path) -> None:
    """A worker's first batch of each KV length (compiling its decoding step) is counted apart from the rate, per
    process: a resumed run appends to generate.log under the same worker names, and compiles again."""
    line = ("2026-12-06 10:00:00,000 INFO [dflash-generate-0 {pid}] dflash.regenerate: batch of 4 answers (4 rows, "
            "longest prompt 90, {kv} KV positions): {tokens} new tokens in {seconds} s\n")
    (tmp_path / "generate.log").write_text("".join(line.format(pid=pid, kv=kv, tokens=tokens, seconds=seconds)
                                                   for pid, kv, tokens, seconds in [
                                                       (100, 1024, 40, 9.0), (100, 1024, 40, 2.0),
                                                       (100, 512, 30, 8.0), (200, 1024, 40, 7.0),
                                                       (200, 1024, 40, 2.0)]))
    batches = summarize_results.summarize(tmp_path)["generate_batches"]["generate.log"]
    assert batches["1024"] == {"batches": 2, "new_tokens": 80, "seconds": 4.0, "tokens_per_s_of_batch_time": 20.0,
                               "first_batches_s": 16.0}
    assert batches["512"] == {"batches": 0, "new_tokens": 0, "seconds": 0.0, "tokens_per_s_of_batch_time": None,
                              "first_batches_s": 8.0}


def test_step_time_puts_each_evaluation_on_the_training_time_axis() -> None:
    """Runs of different step costs compare at equal training time: each evaluated step's seconds are the sum of
    every step's own time up to it; the first steps (compilation) count there, not in the timed mean (the recipe
    bench's step cost); a run no longer than those first steps has its training seconds only."""
    steps = [{"step": s, "loss": 1.0, "block_tokens": 100,
              "step_s": 10.0 if s <= summarize_results.UNTIMED_STEPS else 0.5 + (s % 2)} for s in range(1, 101)]
    records = [{"step": 0, "eval/tau_walk": 1.0}, *steps[:60], {"step": 60, "eval/tau_walk": 1.4}, *steps[60:],
               {"step": 100, "eval/tau_walk": 1.9}]
    time = summarize_results.training_run(records, None)["step_time"]
    later = [0.5 + (s % 2) for s in range(51, 101)]
    assert time["untimed_s"] == pytest.approx(500.0)
    assert time["s_per_step"] == pytest.approx(sum(later) / len(later))
    assert time["s_per_step_median"] == pytest.approx(1.0)
    assert time["train_s"] == pytest.approx(500.0 + sum(later))
    assert time["train_s_at_eval"] == [[0, 0.0], [60, pytest.approx(500.0 + sum(later[:10]))],
                                       [100, pytest.approx(time["train_s"])]]
    assert "step_time" not in summarize_results.training_run([{"step": 1, "loss": 1.0}], None)
    short = summarize_results.training_run([*steps[:3], {"step": 3, "eval/tau_walk": 1.1}], None)["step_time"]
    assert short == {"train_s": pytest.approx(30.0), "train_s_at_eval": [[3, pytest.approx(30.0)]]}
