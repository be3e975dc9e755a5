"""The cache in S3-compatible object storage, against a real S3 server on localhost (moto in server mode)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr

from dflash.shared import cache_format as cf
from dflash.shared import object_store as osx
from tests.conftest import EXTRACT_ARGS, REPO, assert_same_training, run_dflash
from tests.stage2_train.test_train_data import build_cache

ARRAYS = ("features", "input_ids", "loss_mask", "offsets", "sample_index", "sample_id")


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on a free localhost port, and the environment a client needs to reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ALLOW_HTTP": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # for the in-process clients of these tests
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="caches")
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


def remote_arrays(cache_dir: Path, shard: int) -> dict[str, np.ndarray]:
    group = zarr.open_group(osx.shard_source(cache_dir, shard), mode="r")
    return {name: np.asarray(group[name][:]) for name in ARRAYS}


def local_arrays(cache_dir: Path, shard: int) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(cf.shard_path(cache_dir, shard)), mode="r")
    return {name: np.asarray(group[name][:]) for name in ARRAYS}


@pytest.fixture(scope="module")
def two_machine_cache(s3_env: dict[str, str], chat_jsonl: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two "machines" (own staging folders) extract disjoint shard ranges into one bucket prefix, at once."""
    url = "s3://caches/two-machines"
    root = tmp_path_factory.mktemp("machines")
    launches = [subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", "extract", "--data", str(chat_jsonl), "--out",
                                  url, "--staging", str(root / name), "--only-shards", shards, "--workers", "1",
                                  *EXTRACT_ARGS], cwd=REPO, env={**os.environ, **s3_env}, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for name, shards in (("a", "0"), ("b", "1-2"))]
    for launch in launches:
        _, stderr = launch.communicate(timeout=600)
        assert launch.returncode == 0, stderr[-3000:]
        assert "published to " + url in stderr
    return url


def test_two_machines_publish_one_cache_equal_to_a_local_run(two_machine_cache: str, baseline_cache: Path) -> None:
    mirror = osx.resolve_cache(two_machine_cache)
    manifest = cf.read_manifest(mirror)
    baseline = cf.read_manifest(baseline_cache)
    assert manifest["identity"] == baseline["identity"]
    assert {k: e["status"] for k, e in manifest["shards"].items()} == {"0": "done", "1": "done", "2": "done"}
    for shard in range(3):
        ours, theirs = remote_arrays(mirror, shard), local_arrays(baseline_cache, shard)
        for name in ARRAYS:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=f"shard {shard} {name}")
    assert sorted(p.name for p in (mirror / cf.TARGET_DIR).iterdir()) == \
        sorted(p.name for p in (baseline_cache / cf.TARGET_DIR).iterdir())
    verified = run_dflash("inspect", "--cache", two_machine_cache, "--verify")
    assert verified.returncode == 0 and "verify: OK (3 shards re-read)" in verified.stdout, verified.stderr[-2000:]


def test_a_rerun_on_a_new_machine_resumes_from_the_bucket(two_machine_cache: str, chat_jsonl: Path,
                                                         tmp_path: Path) -> None:
    before = osx.read_remote_json(osx.open_bucket(two_machine_cache), cf.MANIFEST_FILE)[0]
    rerun = run_dflash("extract", "--data", str(chat_jsonl), "--out", two_machine_cache, "--staging",
                       str(tmp_path / "new-machine"), "--workers", "1", *EXTRACT_ARGS)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "seeded the staging cache" in rerun.stderr and "0 shards published" in rerun.stderr
    assert not list((tmp_path / "new-machine" / cf.SHARDS_DIR).glob("shard-*"))  # nothing extracted again
    after = osx.read_remote_json(osx.open_bucket(two_machine_cache), cf.MANIFEST_FILE)[0]
    assert after["shards"] == before["shards"]
    refused = run_dflash("extract", "--data", str(chat_jsonl), "--out", two_machine_cache, "--staging",
                         str(tmp_path / "other-settings"), "--workers", "1", *EXTRACT_ARGS, "--feature-dtype", "fp8")
    assert refused.returncode == 3 and "feature_dtype: cache has 'bf16', this run has 'fp8'" in refused.stderr


def test_training_from_the_bucket_equals_training_from_the_local_cache(two_machine_cache: str, baseline_cache: Path,
                                                                       tmp_path: Path) -> None:
    args = ("--max-steps", "2", "--draft-layers", "1", "--max-anchors", "8", "--batch-tokens", "256",
            "--eval-every", "2", "--eval-sequences", "2", "--num-workers", "1", "--mixed-precision", "no",
            "--eval-fraction", "0.2")
    evals = {}
    for name, cache, extra in (("local", str(baseline_cache), ()), ("bucket", two_machine_cache, ("--local-copy",))):
        result = run_dflash("train", "--cache", cache, "--out", str(tmp_path / name), *args, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        evals[name] = [(r["step"], r["eval/tau_walk"]) for r in lines if "eval/tau_walk" in r]
    assert_same_training(tmp_path / "bucket", tmp_path / "local", loss_rel=1e-5)
    assert [step for step, _ in evals["bucket"]] == [step for step, _ in evals["local"]] == [0, 2]
    assert [tau for _, tau in evals["bucket"]] == pytest.approx([tau for _, tau in evals["local"]], abs=0.02)
    copies = list(osx.default_root("remote", two_machine_cache).glob("read_through/*/shards/*/features/c/0/0"))
    assert copies  # --local-copy kept the shard files it read


def test_an_interrupted_upload_never_shows_a_shard_as_done(s3_env: dict[str, str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    staging = build_cache(tmp_path / "staging", [12, 9])
    (staging / cf.TARGET_DIR).mkdir()
    (staging / cf.TARGET_DIR / "config.json").write_text("{}")
    url = "s3://caches/interrupted"
    real_put, calls = osx._upload_files, []

    def failing_put(bucket: object, files: list[tuple[Path, str]], threads: int = 16) -> int:
        calls.append(files)
        if len(calls) == 3:  # shard 0's data went up; its group zarr.json (which says complete) fails
            raise OSError("connection reset")
        return real_put(bucket, files, threads)

    monkeypatch.setattr(osx, "_upload_files", failing_put)
    with pytest.raises(OSError):
        osx.publish(staging, url, log=lambda _: None)
    manifest = osx.read_remote_json(osx.open_bucket(url), cf.MANIFEST_FILE)[0]
    assert manifest is None  # nothing was published: the manifest appears with the first finished shard
    monkeypatch.setattr(osx, "_upload_files", real_put)
    counts = osx.publish(staging, url, log=lambda _: None)
    assert counts["published"] == 2
    manifest = osx.read_remote_json(osx.open_bucket(url), cf.MANIFEST_FILE)[0]
    assert [manifest["shards"][k]["status"] for k in ("0", "1")] == ["done", "done"]
    assert osx.publish(staging, url, log=lambda _: None)["already"] == 2  # idempotent


def test_a_target_file_made_after_the_first_publish_goes_up_with_the_next(s3_env: dict[str, str],
                                                                         tmp_path: Path) -> None:
    """A target file the staging cache gained after its first publish goes up with the next one."""
    staging = build_cache(tmp_path / "staging", [5])
    (staging / cf.TARGET_DIR).mkdir()
    (staging / cf.TARGET_DIR / "config.json").write_text("{}")
    url = "s3://caches/later-target-file"
    assert osx.publish(staging, url, log=lambda _: None)["published"] == 1
    (staging / cf.TARGET_DIR / "generation_config.json").write_bytes(b"{ }")
    assert osx.publish(staging, url, log=lambda _: None)["already"] == 1
    mirror = osx.mirror(url, tmp_path / "mirror")
    assert (mirror / cf.TARGET_DIR / "generation_config.json").read_bytes() == b"{ }"
    assert (mirror / cf.TARGET_DIR / "config.json").read_text() == "{}"
    # A cache made before 2026-12-07 with --export-layers (removed) holds decoder layers nothing reads: not fetched.
    (staging / cf.TARGET_DIR / cf.RETIRED_TARGET_FILES[0]).write_bytes(b"layers")
    osx.publish(staging, url, log=lambda _: None)
    mirror = osx.mirror(url, tmp_path / "mirror2")
    assert sorted(p.name for p in (mirror / cf.TARGET_DIR).iterdir()) == ["config.json", "generation_config.json"]


def test_conditional_manifest_updates_lose_no_writer(s3_env: dict[str, str]) -> None:
    bucket = osx.open_bucket("s3://caches/race")
    start = {"format_version": cf.FORMAT_VERSION, "identity": {}, "shards": {}}

    def writer(name: str) -> None:
        for i in range(5):
            osx.update_remote_manifest(bucket, lambda m: m["shards"].__setitem__(f"{name}-{i}", {"status": "done"}),
                                       create=start)

    threads = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    manifest = osx.read_remote_json(bucket, cf.MANIFEST_FILE)[0]
    assert sorted(manifest["shards"]) == sorted(f"w{n}-{i}" for n in range(4) for i in range(5))


def test_a_missing_remote_cache_gives_a_clear_error(s3_env: dict[str, str], tmp_path: Path) -> None:
    result = run_dflash("train", "--cache", "s3://caches/nothing-here", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "is not a dflash cache" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def bucket_objects(bucket: object, prefix: str = "") -> dict[str, tuple[str, object]]:
    """Every object under `prefix` -> (sha256 of its bytes, when it was last written)."""
    import hashlib

    import obstore

    return {meta["path"]: (hashlib.sha256(bytes(obstore.get(bucket, meta["path"]).bytes())).hexdigest(),
                           meta["last_modified"])
            for batch in obstore.list(bucket, prefix or None) for meta in batch}


def test_repair_in_a_bucket_redoes_exactly_the_damaged_shard(s3_env: dict[str, str], baseline_cache: Path,
                                                            tmp_path: Path) -> None:
    import obstore

    url = "s3://caches/repair"
    osx.publish(baseline_cache, url, log=lambda _: None)  # a cache in a bucket, as extracting machines leave it
    bucket = osx.open_bucket(url)
    damaged = f"{cf.SHARDS_DIR}/{cf.shard_name(1)}/"
    key = damaged + "features/c/0/0"
    data = bytearray(bytes(obstore.get(bucket, key).bytes()))
    data[100] ^= 1
    obstore.put(bucket, key, bytes(data))
    obstore.put(bucket, damaged + "stray-object", b"left by something else")
    before = bucket_objects(bucket)
    verified = run_dflash("inspect", "--cache", url, "--verify")
    assert verified.returncode == 1 and "DAMAGED shard 1" in verified.stdout, verified.stdout[-2000:]
    command = f"dflash extract --repair --out {url}"
    assert f"fix: {command} (redoes shards [1]" in verified.stdout
    # Run as printed, on a machine without the staging cache of the extraction (--staging: a fresh folder).
    repaired = run_dflash(*command.split()[1:], "--staging", str(tmp_path / "new-machine"))
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert f"repairing shards [1] of {url}" in repaired.stderr and f"1 repaired shards published to {url}" in \
        repaired.stderr
    after = bucket_objects(bucket)
    healthy = {k: v for k, v in before.items() if not k.startswith(damaged) and k != cf.MANIFEST_FILE}
    assert {k: after.get(k) for k in healthy} == healthy  # the same bytes, not even written again
    assert sorted(k for k in after if k.startswith(damaged)) == \
        sorted(f"{damaged}{p.relative_to(cf.shard_path(baseline_cache, 1)).as_posix()}"
               for p in cf.shard_path(baseline_cache, 1).rglob("*") if p.is_file())  # the stray object is gone
    mirror = osx.resolve_cache(url)
    for shard in range(3):
        ours, theirs = remote_arrays(mirror, shard), local_arrays(baseline_cache, shard)
        for name in ARRAYS:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=f"shard {shard} {name}")
    assert run_dflash("inspect", "--cache", url, "--verify").returncode == 0
    assert run_dflash(*command.split()[1:], "--staging", str(tmp_path / "new-machine")).stderr.endswith(
        f"dflash extract: every shard of {url} is sound: nothing to repair\n")
