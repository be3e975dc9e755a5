"""The second bad-input tour (issue 32), stage 1 and first-day cases: each ends in one clear line (or a warning that
names the way on) with the exit code it documents, and leaves what is on disk intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash.shared import cache_format as cf
from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, REPO, run_dflash
from tests.end_to_end.test_bad_input_tour import tree_bytes


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
