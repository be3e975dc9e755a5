"""The second bad-input tour (issue 32), stage 1 and first-day cases: each ends in one clear line (or a warning that
names the way on) with the exit code it documents, and leaves what is on disk intact."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash.shared import cache_format as cf
from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, REPO, run_dflash
from tests.end_to_end.test_bad_input_tour import TRAIN_ARGS, one_line_error, tree_bytes


def refused_line(stderr: str, command: str) -> str:
    """The refusal of a supervised command (extract, generate): the only such line, and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(f"dflash {command}: refused:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def wait_for(condition, what: str, timeout: float = 300) -> None:  # noqa: ANN001 - a predicate
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ----------------------------------------------------------------------- --overwrite while another run writes


def test_overwrite_while_another_extract_runs_deletes_nothing(baseline_cache: Path, chat_jsonl: Path,
                                                              tmp_path: Path) -> None:
    """Two real processes: the first extract holds the cache and its shards (stopped with SIGSTOP while it does, so
    the timing cannot decide the test); the second, `--overwrite --yes` with other settings, is refused with one line
    before it deletes anything; the first then finishes, and its cache equals the baseline and verifies."""
    cache = tmp_path / "cache"
    args = ["extract", "--data", str(chat_jsonl), "--out", str(cache), "--workers", "1", *EXTRACT_ARGS]
    first = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # The supervisor writes status/run.json once its shards are claimed and its workers started.
        wait_for(lambda: (cache / cf.STATUS_DIR / "run.json").is_file() or first.poll() is not None,
                 "the first extract to start its workers")
        os.killpg(first.pid, signal.SIGSTOP)
        assert first.poll() is None, "the first extract ended before the second one could start"
        manifest_before = (cache / cf.MANIFEST_FILE).read_bytes()
        before = {name: digest for name, digest in tree_bytes(cache).items()
                  if not name.startswith((cf.STATUS_DIR, cf.LOG_FILE))}
        second = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(cache), "--workers", "1",
                            *EXTRACT_ARGS, "--max-length", "64", "--overwrite", "--yes")
        assert second.returncode == 3, second.stderr[-3000:]
        line = refused_line(second.stderr, "extract")
        assert "in use by another running `dflash extract`" in line and "nothing was deleted" in line
        assert "discarding" not in second.stderr
        assert (cache / cf.MANIFEST_FILE).read_bytes() == manifest_before
        after = tree_bytes(cache)
        assert all(after.get(name) == digest for name, digest in before.items())
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-3000:]
    assert_same_cache(cache, baseline_cache)
    verify = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert verify.returncode == 0 and "verify: OK (3 shards re-read)" in verify.stdout, verify.stdout


def test_generate_overwrite_while_another_generate_runs_deletes_nothing(chat_jsonl: Path, tmp_path: Path) -> None:
    """`dflash generate --overwrite` takes the output's lock before it looks at (or discards) anything."""
    from filelock import FileLock

    out = tmp_path / "generated"
    (out / "parts").mkdir(parents=True)
    (out / "generate.json").write_text(json.dumps({"identity": {"max_length": 1}, "data_source": "x"}))
    (out / "parts" / "worker-0.jsonl.part").write_text(json.dumps({"id": "conv-0", "skipped": "prompt_too_long"})
                                                       + "\n")
    before = tree_bytes(out)
    with FileLock(str(out / ".generate.lock")):  # what a running `dflash generate` holds
        result = run_dflash("generate", "--data", str(chat_jsonl), "--out", str(out), "--max-samples", "2",
                            "--overwrite")
    assert result.returncode == 3, result.stderr[-3000:]
    assert "another `dflash generate` is writing to" in refused_line(result.stderr, "generate")
    after = tree_bytes(out)
    assert all(after[name] == digest for name, digest in before.items())


# --------------------------------------------------------------------------------- inspect: unfinished, missing


def set_shard_status(cache: Path, statuses: dict[int, str]) -> None:
    """What an interrupted or failed extract leaves: these shards pending / failed, their stores gone."""
    manifest = json.loads((cache / cf.MANIFEST_FILE).read_text())
    for shard, status in statuses.items():
        manifest["shards"][str(shard)] = {"status": status, **({"error": "RuntimeError: boom"}
                                                                if status == cf.SHARD_FAILED else {})}
        shutil.rmtree(cf.shard_path(cache, shard))
    (cache / cf.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_verify_counts_unfinished_shards_and_names_the_command_that_finishes_them(
        baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    set_shard_status(cache, {0: cf.SHARD_PENDING, 2: cf.SHARD_FAILED})
    before = tree_bytes(cache)
    result = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert result.returncode == 1, result.stdout
    assert "verify: OK" not in result.stdout and "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("NOT FINISHED")]
    assert lines == [f"NOT FINISHED: 2 shard(s) not finished (1 failed [2], 1 pending [0]): finish them with "
                     f"`dflash extract --repair --out {cache}` (or rerun the extract command that made it)"]
    assert tree_bytes(cache) == before
    # Plain inspect describes it (exit 0) and says the same.
    plain = run_dflash("inspect", "--cache", str(cache))
    assert plain.returncode == 0 and "note: 2 shard(s) not finished" in plain.stdout
    # The command it names finishes the cache: then it verifies and equals the uninterrupted extraction.
    run_dflash("extract", "--repair", "--out", str(cache), check=True)
    verify = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert verify.returncode == 0 and "verify: OK (3 shards re-read)" in verify.stdout, verify.stdout
    assert_same_cache(cache, baseline_cache)


def test_verify_of_a_cache_with_every_shard_pending_is_not_ok(baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    set_shard_status(cache, {0: cf.SHARD_PENDING, 1: cf.SHARD_PENDING, 2: cf.SHARD_PENDING})
    result = run_dflash("inspect", "--cache", str(cache), "--verify", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)["verify"]
    assert report == {"ok": False, "problems": {}, "unfinished": {"pending": [0, 1, 2]}}


def test_plain_inspect_reports_a_finished_shard_whose_store_metadata_is_gone(baseline_cache: Path,
                                                                             tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    (cf.shard_path(cache, 1) / "zarr.json").unlink()
    shutil.rmtree(cf.shard_path(cache, 2))
    before = tree_bytes(cache)
    result = run_dflash("inspect", "--cache", str(cache))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    damaged = [line for line in result.stdout.splitlines() if line.startswith("DAMAGED")]
    assert damaged == ["DAMAGED shard 1 (shard-00001.zarr): zarr.json missing",
                       "DAMAGED shard 2 (shard-00002.zarr): store is missing"]
    assert f"fix: dflash extract --repair --out {cache} (redoes shards [1, 2]" in result.stdout
    assert tree_bytes(cache) == before
    healthy = run_dflash("inspect", "--cache", str(baseline_cache))
    assert healthy.returncode == 0 and "DAMAGED" not in healthy.stdout


def test_training_on_a_half_extracted_cache_names_the_command_that_finishes_it(baseline_cache: Path,
                                                                               tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    set_shard_status(cache, {2: cf.SHARD_PENDING})
    result = run_dflash("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "1",
                        *TRAIN_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"training on the 2 finished shard(s) only; 1 shard(s) not finished (1 pending [2]): finish them with "
            f"`dflash extract --repair --out {cache.resolve()}`") in result.stderr


# ------------------------------------------------------------------------------------------ first-day friction


def test_missing_model_names_a_download_command_that_exists_here(chat_jsonl: Path, tmp_path: Path) -> None:
    result = run_dflash("extract", "--model", "someorg/no-such-model", "--data", str(chat_jsonl), "--out",
                        str(tmp_path / "cache"))
    assert result.returncode == 2
    line = one_line_error(result.stderr)
    command = re.search(r"download it first, e\.g\. `([^`]+)`", line)
    assert command is not None, line
    program, *args = command[1].split()
    assert args == ["download", "someorg/no-such-model"]
    # The program is installed beside this Python (the environment dflash runs in), and knows that subcommand.
    executable = Path(sys.executable).parent / program
    assert executable.is_file(), f"{program} is not installed in {executable.parent}"
    assert subprocess.run([str(executable), "download", "--help"], capture_output=True).returncode == 0


# ---------------------------------------------------------------------- skipped files and samples, up front


def test_a_data_folder_names_the_files_it_skips(chat_jsonl: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "more").mkdir(parents=True)
    shutil.copy(chat_jsonl, data / "chats.jsonl")
    (data / "README.txt").write_text("conversations from the support desk\n")
    (data / "more" / "notes.md").write_text("# notes\n")
    before = tree_bytes(data)
    result = run_dflash("extract", "--data", str(data), "--out", str(tmp_path / "cache"), "--max-samples", "3",
                        "--shards", "1", "--max-length", "96", "--batch-tokens", "256")
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "skipped 2 file(s) that are not data files" in warnings[0], result.stderr[-3000:]
    assert "README.txt, more/notes.md" in warnings[0] and ".jsonl" in warnings[0]
    assert tree_bytes(data) == before


# First prompts of the test chats are 47 to 88 tokens (SmolLM2's template, its default system prompt included): with
# these limits 6 of them do not fit, and the answers of the others are cut where the conversation reaches
# --max-length (before the change, generate left no room for the template's 2 end-of-turn tokens there, and extract
# with the same --max-length truncated those conversations).
GENERATE_LIMITS = ("--max-length", "60", "--max-new-tokens", "12")


def test_generate_says_up_front_what_it_skips_and_extract_with_its_max_length_truncates_nothing(
        chat_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "generated"
    result = run_dflash("generate", "--data", str(chat_jsonl), "--out", str(out), *GENERATE_LIMITS,
                        "--chunk-size", "16", "--batch-tokens", "2000")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "generate.json").read_text())["summary"]
    assert summary["skip_reasons"] == {"prompt_too_long": 6} and summary["conversations"] == 8
    assert summary["finish_reasons"].get("length", 0) > 0
    up_front = ("6 of 14 conversations are skipped (prompt_too_long): their first prompt has 71 to 88 tokens, and "
                "--max-length 60 leaves room for prompts of at most 56")
    assert up_front in result.stderr
    log = (out / "generate.log").read_text()
    assert log.index(up_front) < log.index("chunk 0 done"), "said only after answers were generated"
    # No conversation ends in a turn that was not answered.
    records = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert all(record["messages"][-1]["role"] == "assistant" for record in records)

    cache = tmp_path / "cache"
    extract = run_dflash("extract", "--data", str(out / "conversations.jsonl"), "--out", str(cache), "--max-length",
                         "60", "--shards", "1", "--batch-tokens", "512")
    assert extract.returncode == 0, extract.stderr[-3000:]
    assert "8 samples" in extract.stderr and " 0 truncated" in extract.stderr, extract.stderr[-2000:]
