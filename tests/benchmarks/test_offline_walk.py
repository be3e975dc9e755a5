"""benchmarks/offline_walk.py on the stage-2 tests' training cache, on CPU: the offline validation walk of a fresh
DFlash and DFlash 2 drafter, timed and counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash.stage2_train.cache_index import CacheIndex
from dflash.stage2_train.options import TrainOptions
from tests.conftest import REPO
from tests.stage2_train import conftest as stage2_fixtures

train_cache = stage2_fixtures.train_cache  # the session's training cache (extracted once, shared with stage 2)


def test_both_walks_cover_the_validation_split_and_dflash2_counts_its_selector(train_cache: Path,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "walk.json"
    command = [sys.executable, "benchmarks/offline_walk.py", "--cache", str(train_cache), "--count-sequences", "2",
               "--top", "1000", "--logits-rows", "5", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, text=True, capture_output=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    results = {r["architecture"]: r for r in record["results"]}
    assert list(results) == ["dflash", "dflash2"]
    split = CacheIndex.from_cache(train_cache, TrainOptions.eval_fraction, 0, TrainOptions.test_fraction)
    validation = len(split.eval)
    for r in results.values():
        assert r["sequences"] == validation and r["steps"] >= r["sequences"] and r["seconds"] > 0
        assert 1.0 <= r["tau_walk"] < 1.5  # a fresh drafter accepts almost nothing
        assert r["operations"]["total"] >= sum(r["operations"]["by_source"].values()) > 0
    # The same backbone forwards; DFlash 2 adds its convolutions and one selector walk a forward, not one a chunk of
    # 5 logits rows (the walk's sequential positions cost the same operations for any number of blocks).
    dflash, dflash2 = (results[a]["operations"] for a in ("dflash", "dflash2"))
    assert dflash2["by_source"]["modeling_dflash.py:forward"] == dflash["by_source"]["modeling_dflash.py:forward"]
    assert dflash2["forwards"] == dflash["forwards"] >= 1
    assert dflash2["selector_walks"] == dflash2["forwards"] and dflash["selector_walks"] == 0
    assert "modeling_dflash.py:walk_candidates" in dflash2["by_source"]
    assert "modeling_dflash.py:walk_candidates" not in dflash["by_source"]
    assert dflash2["total"] > dflash["total"]
    assert record["settings"]["code"]  # which code was measured
