"""benchmarks/copy_baseline.py: the copy drafter's walk on a worked example, and its run on the committed file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np

from tests.conftest import REPO


def _copy_baseline():
    spec = importlib.util.spec_from_file_location("dflash_copy_baseline", REPO / "benchmarks" / "copy_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_walk_worked_example() -> None:
    # Prompt 1 2 3, answer 4 5 6 4 5 6 4 5 6 7. Anchors 3..6 find no earlier (previous, anchor) pair: 0 accepted.
    # At anchor 7 the pair (4, 5) was last seen at 4, so the drafts are 6 4 5 6 4 5 6 7: four of them match
    # 6 4 5 6 before 7, and the walk ends there (12 = end - 1). Pair lookups: anchors 7, 8, 9, 10 predict their
    # next token right, 11 (draft 4, answer 7) does not; 9 answer tokens after the first are predicted.
    ids = np.array([1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6, 7])
    mask = np.array([0, 0, 0] + [1] * 10, dtype=bool)
    steps, hits, tokens = _copy_baseline().copy_walk(ids, mask, block_size=16)
    assert steps == [0, 0, 0, 0, 4]
    assert (hits, tokens) == (4, 9)
    # A block of 3 drafts at most 2 tokens: anchor 7 accepts 6 4, then anchor 10 (pair (4, 5) last at 7) drafts
    # 6 4 against 6 7: one.
    steps, _, _ = _copy_baseline().copy_walk(ids, mask, block_size=3)
    assert steps == [0, 0, 0, 0, 2, 1]
    assert sum(a + 1 for a in steps) == 12 - 3  # the walk emits every answer token after the first exactly once


def test_copy_baseline_runs_on_the_committed_conversations(tmp_path) -> None:
    out = tmp_path / "copy.json"
    data = REPO / "benchmarks" / "results" / "h200_generate_static" / "generated.jsonl.gz"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "copy_baseline.py"), "--data", str(data),
                           "--heldout-sequences", "16", "--out", str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    committed = json.loads((REPO / "benchmarks" / "results" / "copy_baseline_h200_heldout16.json").read_text())
    # The 16 held-out sequences of the H200 headline run: its offline walk counted the same 7,159 tokens.
    assert result["samples"] == 16 and result["supervised_tokens"] == 7159
    assert result["tau"] == committed["tau"] and result["walk_steps"] == committed["walk_steps"]
