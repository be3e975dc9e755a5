"""A disk that fills up during `dflash extract`: a clean failure, then the same command finishes the cache.

The cache goes to a small tmpfs, sized from the baseline cache so that the target files and the first shard fit
but the second shard does not. After the failure the tmpfs is remounted bigger (space freed) and the same command
is run again: it must finish, and the cache must equal one made without interruption. Needs root (mount).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, run_dflash

PAGE = 4096


@dataclass
class FullDiskRun:
    cache: Path
    size_kb: int
    failed: subprocess.CompletedProcess[str]
    manifest_after_failure: dict
    free_kb_after_failure: int
    rerun: subprocess.CompletedProcess[str]
    verify: subprocess.CompletedProcess[str]


def _pages(path: Path) -> int:
    """Bytes `path`'s files take on a tmpfs (whole pages per file)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in files)


def _free_kb(path: Path) -> int:
    return shutil.disk_usage(path).free // 1024


def _mount(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def full_disk_run(baseline_cache: Path, chat_jsonl: Path, tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (run the suite as root to test a full disk)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    stores = sorted((baseline_cache / "shards").glob("shard-*.zarr"))
    shard_bytes = max(_pages(store) for store in stores)
    other_bytes = _pages(baseline_cache) - sum(_pages(store) for store in stores)
    # The target files and one and a half shards: the first shard is written, the second runs out of space.
    size_kb = (other_bytes + shard_bytes * 3 // 2) // 1024
    mount_point = tmp_path_factory.mktemp("tmpfs")
    mounted = _mount(["-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount_point)])
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount exited {mounted.returncode}: {mounted.stderr.strip()})")
    try:
        cache = mount_point / "cache"
        command = ("extract", "--data", str(chat_jsonl), "--out", str(cache), "--workers", "1", *EXTRACT_ARGS)
        failed = run_dflash(*command, timeout=400)
        manifest = json.loads((cache / "manifest.json").read_text()) if (cache / "manifest.json").is_file() else {}
        free_kb = _free_kb(mount_point)
        remounted = _mount(["-o", f"remount,size={2 * _pages(baseline_cache) // 1024}k", str(mount_point)])
        assert remounted.returncode == 0, remounted.stderr
        rerun = run_dflash(*command, timeout=400)
        verify = run_dflash("inspect", "--cache", str(cache), "--verify", timeout=120)
        yield FullDiskRun(cache, size_kb, failed, manifest, free_kb, rerun, verify)
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _done(manifest: dict) -> list[int]:
    return sorted(int(k) for k, v in manifest.get("shards", {}).items() if v.get("status") == "done")


def test_full_disk_fails_cleanly_and_says_what_to_do(full_disk_run: FullDiskRun) -> None:
    run = full_disk_run
    stderr = run.failed.stderr
    # 1: a worker failed (its traceback goes to the log); 2: the supervisor itself hit the full disk
    # (dflash.shared.errors.user_facing_errors). Which one depends on which process writes first into the last page.
    assert run.failed.returncode in (1, 2), f"exit {run.failed.returncode}:\n{stderr[-3000:]}"
    assert "No space left on device" in stderr or "disk full" in stderr, stderr[-3000:]
    # the worker's advice, or the supervisor's own write error: "free space on that disk; rerun the same command ..."
    assert "free space" in stderr and "rerun the same command" in stderr, stderr[-3000:]
    done = _done(run.manifest_after_failure)
    assert 1 <= len(done) < 3, (f"the run did not fail partway (done shards {done}, tmpfs {run.size_kb} kB, "
                                f"{run.free_kb_after_failure} kB free after the failure)")
    assert not [k for k, v in run.manifest_after_failure["shards"].items() if v.get("status") == "done"
                and not (run.cache / "shards" / f"shard-{int(k):05d}.zarr").is_dir()]


def test_full_disk_failure_prints_no_traceback(full_disk_run: FullDiskRun) -> None:
    stderr = full_disk_run.failed.stderr
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr[-3000:]


def test_rerun_after_freeing_space_equals_an_uninterrupted_cache(full_disk_run: FullDiskRun,
                                                                  baseline_cache: Path) -> None:
    run = full_disk_run
    assert run.rerun.returncode == 0, run.rerun.stderr[-3000:]
    assert "Traceback" not in run.rerun.stderr
    assert not list((run.cache / "shards").glob(".*tmp*")), "temporary stores left behind"
    assert run.verify.returncode == 0 and "verify: OK" in run.verify.stdout, run.verify.stdout + run.verify.stderr
    assert_same_cache(baseline_cache, run.cache)
    # the shards finished before the disk filled up were kept, not redone
    manifest = json.loads((run.cache / "manifest.json").read_text())
    before = run.manifest_after_failure["shards"]
    for shard in _done(run.manifest_after_failure):
        assert manifest["shards"][str(shard)]["finished"] == before[str(shard)]["finished"]
