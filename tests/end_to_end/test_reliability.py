"""Fault injection: damaged caches are detected and refused; randomly killed runs resume to the same result.

The fast cases run in `make test`. The randomized kill campaign (marked `reliability`) runs with
`make reliability`, which prints the table of faults injected, survived and data lost.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.shared import cache_format as cf
from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, REPO, assert_same_training, run_dflash

REPORT = REPO / "benchmarks" / "results" / "reliability.json"


def _copy(cache: Path, tmp_path: Path) -> Path:
    out = tmp_path / "cache"
    shutil.copytree(cache, out)
    return out


def _feature_file(cache: Path, shard: int) -> Path:
    return cf.shard_path(cache, shard) / "features" / "c" / "0" / "0"


def _assert_refused_everywhere(cache: Path, tmp_path: Path, shard: int) -> None:
    verify = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert verify.returncode == 1 and f"shard {shard}" in verify.stdout, verify.stdout + verify.stderr
    assert f"dflash extract --repair --out {cache}" in verify.stdout
    train = run_dflash("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert train.returncode == 2, train.stderr[-2000:]
    assert f"shard {shard}" in train.stderr and f"dflash extract --repair --out {cache}" in train.stderr
    assert "Traceback" not in train.stderr


def test_truncated_feature_file_is_detected_and_refused(baseline_cache: Path, tmp_path: Path) -> None:
    cache = _copy(baseline_cache, tmp_path)
    path = _feature_file(cache, 2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _assert_refused_everywhere(cache, tmp_path, 2)


def test_hand_edited_manifest_is_detected_and_refused(baseline_cache: Path, tmp_path: Path) -> None:
    cache = _copy(baseline_cache, tmp_path)

    def edit(manifest: dict) -> None:
        manifest["shards"]["1"]["tokens"] += 7

    cf.update_manifest(cache, edit)
    _assert_refused_everywhere(cache, tmp_path, 1)


def test_repair_command_from_the_message_fixes_the_cache(baseline_cache: Path, tmp_path: Path) -> None:
    cache = _copy(baseline_cache, tmp_path)
    data = bytearray(_feature_file(cache, 0).read_bytes())
    data[100] ^= 1
    _feature_file(cache, 0).write_bytes(bytes(data))
    verify = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert verify.returncode == 1
    printed = next(line for line in verify.stdout.splitlines() if line.startswith("fix: "))
    command = printed.removeprefix("fix: dflash ").split(" (")[0].split()  # run exactly what was printed
    fixed = run_dflash(*command)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert run_dflash("inspect", "--cache", str(cache), "--verify").returncode == 0
    assert_same_cache(baseline_cache, cache)


def test_cache_from_a_future_format_version_is_refused(baseline_cache: Path, chat_jsonl: Path,
                                                       tmp_path: Path) -> None:
    cache = _copy(baseline_cache, tmp_path)
    manifest = json.loads((cache / cf.MANIFEST_FILE).read_text())
    manifest["format_version"] = cf.FORMAT_VERSION + 1
    (cache / cf.MANIFEST_FILE).write_text(json.dumps(manifest))
    for args in (["inspect", "--cache", str(cache)], ["train", "--cache", str(cache), "--out", str(tmp_path / "r")],
                 ["extract", "--data", str(chat_jsonl), "--out", str(cache), *EXTRACT_ARGS]):
        result = run_dflash(*args)
        assert result.returncode == 2 and "upgrade dflash" in result.stderr, (args, result.stderr[-1500:])


def test_a_version_1_cache_without_the_keys_added_since_reads_as_what_their_absence_meant(baseline_cache: Path,
                                                                                          tmp_path: Path) -> None:
    """Format version 1 gained the manifest's `options` and `identity.target_topk` and the target record's
    `embed_scale` and `model_type` after its first caches were written; a cache without them reads (in
    cache_format.py, the one place that knows) as: no options recorded, no top-k, an unscaled embedding, the
    config's model type."""
    cache = tmp_path / "cache"
    (cache / cf.TARGET_DIR).mkdir(parents=True)
    manifest = json.loads((baseline_cache / cf.MANIFEST_FILE).read_text())
    assert manifest["format_version"] == cf.FORMAT_VERSION == 1
    del manifest[cf.OPTIONS_KEY], manifest["identity"]["target_topk"]
    (cache / cf.MANIFEST_FILE).write_text(json.dumps(manifest))
    record = json.loads((baseline_cache / cf.TARGET_DIR / cf.TARGET_RECORD_FILE).read_text())
    (cache / cf.TARGET_DIR / cf.TARGET_RECORD_FILE).write_text(json.dumps({"stop_token_ids": record["stop_token_ids"]}))
    shutil.copy(baseline_cache / cf.TARGET_DIR / "config.json", cache / cf.TARGET_DIR / "config.json")
    read = cf.read_manifest(cache)
    assert read[cf.OPTIONS_KEY] is None and read["identity"]["target_topk"] is None
    assert cf.TopKFormat.of_manifest(read) is None
    assert cf.identity_mismatch(read["identity"], cf.read_manifest(baseline_cache)["identity"]) == []
    assert cf.read_target_record(cache) == {**record, "embed_scale": 1.0} == cf.read_target_record(baseline_cache)


# ------------------------------------------------------------------------------ randomized kill campaign


def _record(kind: str, survived: bool, lost: int) -> None:
    report = json.loads(REPORT.read_text()) if REPORT.is_file() else {}
    row = report.setdefault(kind, {"injected": 0, "survived": 0, "data_lost": 0})
    row["injected"] += 1
    row["survived"] += int(survived)
    row["data_lost"] += lost
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")


def _popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_at_random(process: subprocess.Popen[str], out: Path, rng: random.Random, max_delay: float) -> str:
    """After a random delay, SIGKILL or SIGTERM the run's worker or its supervisor, then wait for the run to end;
    returns the fault as the campaign's table names it ("SIGKILL worker", ...)."""
    victim, how = rng.choice(["worker", "supervisor"]), rng.choice([signal.SIGKILL, signal.SIGTERM])
    time.sleep(rng.uniform(1.0, max_delay))
    if victim == "worker" and (out / "status" / "worker-0.json").is_file():
        try:
            os.kill(json.loads((out / "status" / "worker-0.json").read_text())["pid"], how)
        except ProcessLookupError:  # the worker had already finished its shards and exited: nothing to kill
            victim = "worker (already exited)"
    elif process.poll() is None:
        process.send_signal(how)
    process.wait(timeout=120)
    return f"{how.name} {victim}"


@pytest.mark.reliability
@pytest.mark.parametrize("attempt", range(10))
def test_extract_survives_a_random_kill(baseline_cache: Path, chat_jsonl: Path, tmp_path: Path, attempt: int) -> None:
    rng = random.Random(attempt)
    out = tmp_path / "cache"
    args = ("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *EXTRACT_ARGS)
    process = _popen(*args)
    fault = _kill_at_random(process, out, rng, max_delay=12.0)
    rerun = run_dflash(*args)
    try:
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert_same_cache(baseline_cache, out)
        _record(f"extract: {fault}", True, 0)
    except AssertionError:
        _record(f"extract: {fault}", False, 1)
        raise


@pytest.mark.reliability
@pytest.mark.parametrize("attempt", range(10))
def test_train_survives_a_random_kill(baseline_cache: Path, tmp_path: Path, attempt: int) -> None:
    rng = random.Random(100 + attempt)
    args = ("--max-steps", "6", "--eval-every", "0", "--checkpoint-every", "2", "--draft-layers", "1",
            "--max-anchors", "16", "--batch-tokens", "384", "--num-workers", "1", "--eval-fraction", "0.15",
            "--eval-sequences", "2", "--mixed-precision", "no")
    reference = tmp_path / "reference"
    assert run_dflash("train", "--cache", str(baseline_cache), "--out", str(reference), *args).returncode == 0
    run = tmp_path / "run"
    process = _popen("train", "--cache", str(baseline_cache), "--out", str(run), *args)
    how = rng.choice([signal.SIGKILL, signal.SIGTERM])
    time.sleep(rng.uniform(3.0, 25.0))
    if process.poll() is None:
        process.send_signal(how)
    process.wait(timeout=120)
    resumed = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--resume", *args)

    try:
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert_same_training(run, reference, loss_rel=1e-4)
        _record(f"train: {how.name}", True, 0)
    except AssertionError:
        _record(f"train: {how.name}", False, 1)
        raise


def _processes_in_group(group: int) -> list[int]:
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


@pytest.mark.reliability
@pytest.mark.parametrize("attempt", range(10))
def test_train_ends_cleanly_on_a_signal_to_its_group(baseline_cache: Path, tmp_path: Path, attempt: int) -> None:
    """A terminal's Ctrl-C or a scheduler's SIGTERM reaches every process of the group, DataLoader workers too:
    the run ends with 130 / 143 and its one line (no traceback), leaves no process behind, and resumes to the
    result of an uninterrupted run."""
    rng = random.Random(300 + attempt)
    args = ("--max-steps", "24", "--eval-every", "0", "--checkpoint-every", "4", "--draft-layers", "1",
            "--max-anchors", "16", "--batch-tokens", "384", "--num-workers", "2", "--eval-fraction", "0.15",
            "--eval-sequences", "2", "--mixed-precision", "no")  # ~7 steps per epoch: 3 epoch ends
    reference = tmp_path / "reference"
    assert run_dflash("train", "--cache", str(baseline_cache), "--out", str(reference), *args).returncode == 0
    run = tmp_path / "run"
    how = rng.choice([signal.SIGINT, signal.SIGTERM])
    # Its own process group, as a terminal's foreground job; SIGINT as a terminal leaves it (a shell's background
    # job, as a test runner may be, starts with it ignored).
    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", "train", "--cache", str(baseline_cache),
                                "--out", str(run), *args], cwd=REPO, text=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(rng.uniform(5.0, 13.0))  # the run lasts ~13 s on 2 cores, imports included
    signalled = process.poll() is None
    if signalled:
        os.killpg(process.pid, how)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        stderr += "\n(did not end within 120 s of the signal)"
    time.sleep(1.0)
    left = _processes_in_group(process.pid)
    resumed = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--resume", *args)
    try:
        if signalled:
            assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
            # 0 or -signal: the command had returned (its work done) and the interpreter was ending
            assert process.returncode in (128 + how, 0, -how), stderr[-3000:]
        if signalled and process.returncode == 128 + how:
            assert f"interrupted ({how.name})" in stderr and "--resume" in stderr, stderr[-3000:]
        assert not left, f"processes left running: {left}"
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert_same_training(run, reference, loss_rel=1e-4)
        if signalled:
            _record(f"train: {how.name} to the group", True, 0)
    except AssertionError:
        _record(f"train: {how.name} to the group", False, 0)
        raise


@pytest.mark.reliability
@pytest.mark.parametrize("attempt", range(10))
def test_generate_survives_a_random_kill(chat_jsonl: Path, tmp_path_factory: pytest.TempPathFactory,
                                         tmp_path: Path, attempt: int) -> None:
    from tests.stage1_extract.test_generate import GENERATE_ARGS

    reference = tmp_path_factory.getbasetemp() / "generate-reference"
    if not (reference / "conversations.jsonl").is_file():
        run_dflash("generate", "--data", str(chat_jsonl), "--out", str(reference), *GENERATE_ARGS, check=True)
    rng = random.Random(200 + attempt)
    out = tmp_path / "gen"
    args = ("generate", "--data", str(chat_jsonl), "--out", str(out), *GENERATE_ARGS)
    process = _popen(*args)
    fault = _kill_at_random(process, out, rng, max_delay=20.0)
    rerun = run_dflash(*args)
    expected = (reference / "conversations.jsonl").read_text().splitlines()
    try:
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        got = (out / "conversations.jsonl").read_text().splitlines()
        part_lines = sum(len(p.read_text().splitlines()) for p in (out / "parts").glob("*.part"))
        lost = len({json.loads(x)["id"] for x in expected} - {json.loads(x)["id"] for x in got})
        assert part_lines == len(expected), "duplicated samples"
        assert got == expected
        _record(f"generate: {fault}", True, 0)
    except AssertionError:
        _record(f"generate: {fault}", False, max(1, locals().get("lost", 1)))
        raise
