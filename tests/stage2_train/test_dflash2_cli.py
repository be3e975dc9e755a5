"""DFlash 2 through the real CLI on the embedded SmolLM2 target: train (`--architecture dflash2`), warm-start from a
DFlash export (`--init-from`: the first step's block loss equals the DFlash drafter's), export in the published
format, `dflash eval` (greedy, lossless) and the refusals of bad `--init-from` folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_same_training, run_dflash, step_records
from tests.end_to_end.test_bad_input_tour import one_line_error
from tests.stage2_train.conftest import TRAIN_ARGS

ARGS = ("--eval-every", "0", "--checkpoint-every", "0", "--lr", "3e-3", "--seed", "3", *TRAIN_ARGS)


@pytest.fixture(scope="module")
def dflash_export(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("dflash") / "run"
    run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--max-steps", "4", *ARGS, check=True)
    return run / "export"


def test_dflash2_trains_exports_and_evaluates(train_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--architecture", "dflash2", "--max-steps",
               "4", *ARGS, check=True)
    records = step_records(run)
    assert sorted(records) == [1, 2, 3, 4]
    for record in records.values():
        assert record["loss"] == pytest.approx(record["loss_block"] + record["loss_selector"], rel=1e-5)
        # --selector-missing drop (the default): the selector loss counts only positions whose true token is among
        # the candidates, so it is 0 exactly when the recall is (as in the first steps) and positive otherwise
        assert 0 <= record["candidate_recall"] <= 1 and record["loss_selector"] >= 0
        assert (record["loss_selector"] > 0) == (record["candidate_recall"] > 0)
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlash2DraftModel"
    assert json.loads((run / "test_results.json").read_text())["tau_walk"] >= 1.0
    result = run_dflash("eval", "--draft", str(run / "export_best"), "--data", "heldout", "--max-samples", "2",
                        "--max-new-tokens", "16", "--threads", "1", "--out", str(tmp_path / "eval"))  # as test_train.py
    assert result.returncode == 0, result.stderr[-3000:]
    heldout = json.loads((tmp_path / "eval" / "eval.json").read_text())["datasets"]["heldout"]
    assert heldout["tau"] >= 1.0 and heldout["greedy_identical"] + heldout["tie_divergences"] == 2


@pytest.mark.slow  # ~50 s on 2 cores (inductor compiles the layers); `make test-all` runs it, `make test` not
def test_dflash2_compiled_layers_train_like_eager_ones(train_cache: Path, tmp_path: Path) -> None:
    """--compile with DFlash 2 (its convolutions inside the compiled decoder layers; the selector loss outside):
    the same losses as the eager run up to float noise, as for DFlash (test_train.py)."""
    args = ("--architecture", "dflash2", "--max-steps", "2", "--num-workers", "0", "--eval-fraction", "0", *ARGS)
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run_dflash("train", "--cache", str(train_cache), "--out", str(eager), *args, check=True)
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(compiled), *args, "--compile")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compile: 1 decoder layers compile" in result.stderr
    assert_same_training(compiled, eager, loss_rel=1e-4)
    for step, record in step_records(compiled).items():
        assert record["loss_selector"] == pytest.approx(step_records(eager)[step]["loss_selector"], rel=1e-4, abs=1e-6)


def test_dflash2_starts_from_a_dflash_export(train_cache: Path, dflash_export: Path, tmp_path: Path) -> None:
    """--init-from a DFlash export: the DFlash 2 drafter is that drafter plus identity parts, so its first step's
    block loss is the loss the DFlash drafter has on the same samples (a DFlash run from the same export)."""
    runs = {}
    for architecture in ("dflash", "dflash2"):
        runs[architecture] = tmp_path / architecture
        run_dflash("train", "--cache", str(train_cache), "--out", str(runs[architecture]), "--architecture",
                   architecture, "--init-from", str(dflash_export), "--max-steps", "1", *ARGS, check=True)
    first = {name: step_records(run)[1] for name, run in runs.items()}
    assert first["dflash2"]["loss_block"] == pytest.approx(first["dflash"]["loss"], rel=1e-5)
    assert "starting from the weights" in (runs["dflash2"] / "train.log").read_text()


def test_bad_init_from_is_refused_in_one_line(train_cache: Path, dflash_export: Path, tmp_path: Path) -> None:
    """--init-from a folder that is not a DFlash drafter, or a drafter for another target, is refused in one line."""
    not_a_drafter = tmp_path / "model"
    not_a_drafter.mkdir()
    (not_a_drafter / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    other_target = tmp_path / "other"
    other_target.mkdir()
    for path in dflash_export.iterdir():
        (other_target / path.name).write_bytes(path.read_bytes())
    info = json.loads((other_target / "dflash_target.json").read_text())
    (other_target / "dflash_target.json").write_text(json.dumps({**info, "target_hash": "v2:" + "0" * 64}))
    for folder, words in ((not_a_drafter, "not a DFlash drafter"), (other_target, "target")):
        result = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / f"run-{folder.name}"),
                            "--architecture", "dflash2", "--init-from", str(folder), "--max-steps", "1", *ARGS)
        assert result.returncode == 2, result.stderr[-2000:]
        assert words in one_line_error(result.stderr)
