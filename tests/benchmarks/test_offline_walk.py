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
    result = subprocess.run([sys.executable, "benchmarks/offline_walk.py", "--cache", str(train_cache),
                             "--count-sequences", "2", "--out", str(out)], cwd=REPO, text=True,
                            capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
    # The same backbone forwards; DFlash 2 adds its convolutions and its selector's walk.
    dflash, dflash2 = (results[a]["operations"]["by_source"] for a in ("dflash", "dflash2"))
    assert dflash2["modeling_dflash.py:forward"] == dflash["modeling_dflash.py:forward"]
    assert "modeling_dflash.py:walk_candidates" in dflash2 and "modeling_dflash.py:walk_candidates" not in dflash
    assert results["dflash2"]["operations"]["total"] > results["dflash"]["operations"]["total"]
