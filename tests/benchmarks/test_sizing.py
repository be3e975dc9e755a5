"""benchmarks/sizing.py: runs on the repository's real result files, and its numbers follow the stated formulas
and reproduce the measurements they are scaled from."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
HEADLINE = RESULTS / "h200_headline"


def _load_sizing():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dflash_sizing", REPO / "benchmarks" / "sizing.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sizing = _load_sizing()


@pytest.fixture(scope="module")
def rates():  # type: ignore[no-untyped-def]
    return sizing.load_rates(RESULTS)


def _json(path: Path) -> dict:
    parsed, _ = json.JSONDecoder().raw_decode(path.read_text())
    return parsed


def test_script_runs_on_the_real_results(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sizing.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(sizing.KNOWN_TARGETS) * 3  # 100M, 1B, recipe for each target
    for name in sizing.KNOWN_TARGETS:
        assert sum(line.startswith(f"| {name} |") for line in table) == 3
    assert "23,662 tok/s" in done.stdout  # the measured extraction rate, quoted


def test_custom_target_matches_the_known_one(rates) -> None:  # type: ignore[no-untyped-def]
    q = sizing.KNOWN_TARGETS["Qwen3-8B"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "sizing.py"), "--name", "Qwen3-8B", "--hidden", "4096", "--layers",
         "36", "--params", str(q.params), "--vocab", "151936", "--tokens", "100M", "1B"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    known = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sizing.py"), "--targets", "Qwen3-8B",
                            "--no-recipe"], capture_output=True, text=True, timeout=60)
    assert known.returncode == 0, known.stderr
    rows = lambda text: [line for line in text.splitlines() if line.startswith("| Qwen3-8B")]  # noqa: E731
    assert rows(done.stdout) == rows(known.stdout) and len(rows(done.stdout)) == 2
    incomplete = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sizing.py"), "--hidden", "4096"],
                                capture_output=True, text=True, timeout=60)
    assert incomplete.returncode == 2 and "needs all of" in incomplete.stderr


def test_fp8_cache_is_about_half_of_bf16() -> None:
    for target in sizing.KNOWN_TARGETS.values():
        data = sizing.Data("x", 1e9, 800, 0.5)
        ratio = sizing.cache_bytes(target, data, "fp8") / sizing.cache_bytes(target, data, "bf16")
        assert 0.5 < ratio < 0.502, (target.name, ratio)


def test_predicted_cache_size_matches_the_measured_smollm2_cache() -> None:
    # `du -sb` of the H200 run's two caches of the same conversations, as the pipeline logged them
    disk = {match.group(2): int(match.group(1)) for line in (HEADLINE / "timings.tsv").read_text().splitlines()
            if (match := re.fullmatch(r"(\d+)\t\S*cache_(bf16|fp8)", line))}
    assert disk == {"bf16": 10340185689, "fp8": 5271924818}
    for dtype, size in disk.items():
        inspect = _json(HEADLINE / f"inspect_{dtype}.json")
        data = sizing.Data("headline", inspect["tokens"], inspect["tokens"] / inspect["samples"], 0.5)
        assert inspect["layer_ids"] == sizing.default_layer_ids(sizing.SMOLLM2.layers, 5)
        assert inspect["feature_bytes"] == inspect["tokens"] * sizing.feature_bytes_per_token(sizing.SMOLLM2, dtype)
        predicted = sizing.cache_bytes(sizing.SMOLLM2, data, dtype)
        assert abs(predicted / size - 1) < 0.002, (dtype, predicted)  # the rest: zarr metadata, indexes, tokenizer


def test_reference_rows_reproduce_the_measurements(rates) -> None:  # type: ignore[no-untyped-def]
    extract = json.loads((RESULTS / "extract_qwen3-8b-random_cuda.json").read_text())
    measured = sum(run["dflash_tok_s"] for run in extract["runs"]) / len(extract["runs"])
    capture = sum(run["capture_only_tok_s"] for run in extract["runs"]) / len(extract["runs"])
    q = sizing.KNOWN_TARGETS["Qwen3-8B"]
    assert sizing.default_layer_ids(q.layers, 5) == extract["layer_ids"]
    row = sizing.size(q, sizing.Data("x", 1e9, 794, 0.5), rates)
    assert 1e9 / (row.extract_h_bf16 * 3600) == pytest.approx(measured, rel=1e-6)
    # fp8 halves the bytes, so the write bound lifts above the measured compute (capture-only) rate
    assert 1e9 / (row.extract_h_fp8 * 3600) == pytest.approx(capture, rel=1e-6)
    for attention in ("flex", "sdpa"):
        train = json.loads((RESULTS / f"train_qwen3-8b_{attention}_cuda.json").read_text())
        attention_rates = sizing.load_rates(RESULTS, attention)
        recipe = sizing.default_data(attention_rates, [])[-1]
        assert recipe.samples == 800_000 and recipe.mean_length == train["length"]
        # the benchmark's rule: every candidate up to 512 anchors
        hours = sizing.size(q, recipe, attention_rates, anchors=train["anchors"], density=None).train_h
        assert hours * 3600 == pytest.approx(800_000 / train["results"]["loader"]["samples_per_s"], rel=1e-9)
    assert sizing.drafter_trainable(q) == pytest.approx(train["trainable_params"], rel=1e-3)


def test_hours_and_bytes_scale_linearly_with_tokens(rates) -> None:  # type: ignore[no-untyped-def]
    for target in sizing.KNOWN_TARGETS.values():
        one, two = (sizing.size(target, sizing.Data("x", n, 794, 0.5), rates) for n in (1e9, 2e9))
        for field in ("extract_h_bf16", "extract_h_fp8", "train_h"):
            assert getattr(two, field) == pytest.approx(2 * getattr(one, field), rel=1e-12)
        fixed = 4 * target.vocab * target.hidden  # target/embeddings.safetensors, independent of the data
        assert two.bytes_bf16 - fixed == pytest.approx(2 * (one.bytes_bf16 - fixed), rel=1e-12)


def test_extraction_scales_with_capture_flops_when_compute_bound(rates) -> None:  # type: ignore[no-untyped-def]
    q, big = sizing.KNOWN_TARGETS["Qwen3-8B"], sizing.KNOWN_TARGETS["Llama-3.3-70B"]
    ratio = (sizing.capture_flops_per_token(big, sizing.default_layer_ids(big.layers, 5))
             / sizing.capture_flops_per_token(q, sizing.default_layer_ids(q.layers, 5)))
    # 70B: compute-bound, in bf16 and fp8 alike; its rate is the measured capture rate / FLOP ratio
    for dtype in ("bf16", "fp8"):
        assert sizing.extract_tok_s(big, dtype, rates) == pytest.approx(rates.capture_tok_s / ratio, rel=1e-9)
    # a faster disk does not help a compute-bound extraction, and does help the write-bound small target
    small = sizing.KNOWN_TARGETS["Qwen3-1.7B"]
    assert sizing.extract_tok_s(big, "bf16", rates, write_bytes_s=1e12) == sizing.extract_tok_s(big, "bf16", rates)
    assert sizing.extract_tok_s(small, "bf16", rates, write_bytes_s=2 * rates.write_bytes_s) == pytest.approx(
        2 * sizing.extract_tok_s(small, "bf16", rates), rel=1e-9)


def test_training_pays_for_the_drawn_anchors_only(rates) -> None:  # type: ignore[no-untyped-def]
    """Packed blocks: a sample costs its own anchors (density x candidates, capped), so halving the answer halves the
    draft-layer and LM-head work; nothing is paid for --max-anchors itself."""
    q = sizing.KNOWN_TARGETS["Qwen3-8B"]
    layer, head = 6 * 5 * q.layer_params * 16, 4 * q.vocab * q.hidden * 15
    fc = lambda length: 4 * 5 * q.hidden * q.hidden * length  # noqa: E731
    # 800 tokens, half supervised: 399 candidates, ceil(399 / 6) = 67 anchors; 400 tokens: ceil(199 / 6) = 34
    for length, anchors in ((800, 67), (400, 34)):
        assert sizing.train_flops_per_sample(q, length, 0.5, anchors=512, density=1 / 6) == pytest.approx(
            anchors * (layer + head) + fc(length), rel=1e-12)
    # the trainer's defaults (every candidate, at most 64): 64 of 399, all 49 of a 100-token sample's candidates
    assert sizing.train_flops_per_sample(q, 800, 0.5) == pytest.approx(64 * (layer + head) + fc(800), rel=1e-12)
    assert sizing.train_flops_per_sample(q, 100, 0.5) == pytest.approx(49 * (layer + head) + fc(100), rel=1e-12)
    # the cap binds on long answers; every candidate (the reference's rule) up to it without a density
    assert sizing.anchors_per_sample(3072, 1.0, density=1.0, max_anchors=512) == 512
    assert sizing.anchors_per_sample(3072, 1.0) == 64
    assert sizing.anchors_per_sample(400, 0.5, density=None, max_anchors=512) == 199
    assert sizing.train_flops_per_sample(q, 800, 0.5, anchors=32) == pytest.approx(32 * (layer + head) + fc(800))


@settings(max_examples=200, deadline=None)
@given(candidates=st.integers(0, 5000), density=st.one_of(st.none(), st.floats(0.01, 1.0)),
       cap=st.integers(1, 1024))
def test_anchor_count_is_the_trainers_rule(candidates: int, density: float | None, cap: int) -> None:
    """sizing's anchors per sample equals `AnchorRule.count`, the rule the trainer draws with."""
    from dflash.stage2_train.epoch_plan import AnchorRule

    expected = int(AnchorRule(density=density, max_anchors=cap).count(candidates))
    assert sizing.anchors_per_sample(candidates + 1, 1.0, density, cap) == expected


def test_layer_rule_and_params_match_the_project_and_public_figures() -> None:
    # public model cards: total, and (Qwen3) non-embedding parameters
    published = {"Qwen3-8B": 8.19e9, "Llama-3.1-8B": 8.03e9, "Qwen3-32B": 32.8e9, "Llama-3.3-70B": 70.6e9}
    for name, total in published.items():
        assert sizing.KNOWN_TARGETS[name].params == pytest.approx(total, rel=0.01), name
    non_embedding = {"Qwen3-1.7B": 1.4e9, "Qwen3-8B": 6.95e9, "Qwen3-32B": 31.2e9}
    for name, count in non_embedding.items():
        t = sizing.KNOWN_TARGETS[name]
        assert t.layer_params * t.layers == pytest.approx(count, rel=0.02), name


def test_parse_count() -> None:
    assert sizing.parse_count("100M") == 100e6
    assert sizing.parse_count("1.5B") == 1.5e9
    assert sizing.parse_count("800K") == 800e3
    assert sizing.parse_count("2e9") == 2e9


def test_flop_models_agree_with_the_benchmarks_fuller_counts() -> None:
    """The capture runs layers 0..33 of Qwen3-8B; the training model (which leaves out attention scores and the
    context's k/v projections) is within 10 % of the count bench_train.py logged for the same shape."""
    q = sizing.KNOWN_TARGETS["Qwen3-8B"]
    assert sizing.capture_flops_per_token(q, [1, 9, 17, 25, 33]) == 2 * 34 * q.layer_params
    train = json.loads((RESULTS / "train_qwen3-8b_flex_cuda.json").read_text())
    loader = train["results"]["loader"]
    counted = loader["tflops"] * 1e12 * loader["step_s"] / train["batch"]  # FLOPs per sample, bench's count
    ours = sizing.train_flops_per_sample(q, train["length"], (train["length"] - 64) / train["length"],
                                         anchors=train["anchors"], density=None)
    assert 0.9 < ours / counted < 1.0, ours / counted


def test_the_docs_table_is_the_scripts_output() -> None:
    """docs/scaling.md pastes the script's table: regenerate it when the results or the model change."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sizing.py")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("\n\n")[0]
    assert table.startswith("| target |")
    assert table in (REPO / "docs" / "scaling.md").read_text()
