"""What the stage-2 CLI tests share: the training flags of a small, fast run and one cache extracted from the
embedded SmolLM2 target, built once per test run (`built_once`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import built_once, make_conversations, run_dflash, step_records

# Small and fast on 2 CPU cores, but the real model, data path, loss and loop. The anchor rule is the one these
# tests' times and thresholds were set with (1/6 of the positions; the default was 1/6 until 2026-12-06, now every
# position up to --max-anchors: with it, the learning test's 3 live prompts of 24 tokens accepted nothing once).
TEST_ANCHOR_DENSITY = 1 / 6
TRAIN_ARGS = ("--draft-layers", "1", "--max-anchors", "24", "--anchor-density", str(TEST_ANCHOR_DENSITY),
              "--batch-tokens", "2304",
              "--num-workers", "1",
              "--eval-fraction", "0.05", "--eval-sequences", "6", "--test-fraction", "0.1", "--mixed-precision", "no")
# The validation (hash < 0.05) and test (0.05 <= hash < 0.15) splits: the training split is the one of a run that
# held out 0.15 for validation alone.
SPLIT = (0.05, 0.1)


@pytest.fixture(scope="session")
def train_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def extract(folder: Path) -> None:
        data = folder / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
        run_dflash("extract", "--data", str(data), "--out", str(folder / "cache"), "--max-length", "128",
                   "--workers", "2", "--batch-tokens", "1024", check=True)

    return built_once(tmp_path_factory, "train_cache", extract) / "cache"


def final_losses(run: Path) -> dict[int, float]:
    return {step: record["loss"] for step, record in step_records(run).items()}
