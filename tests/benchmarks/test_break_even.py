"""benchmarks/break_even.py: the step from which a run with a costly start stays ahead of a plain one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from benchmarks.break_even import break_even, step_seconds


def brute_force(fast: list[float], plain: list[float]) -> int | None:
    """The smallest n such that for every m >= n (within the runs) the fast total is <= the plain total."""
    steps = min(len(fast), len(plain))
    for n in range(1, steps + 1):
        if all(sum(fast[:m]) <= sum(plain[:m]) for m in range(n, steps + 1)):
            return n
    return None


@given(warmup=st.floats(0, 50), fast=st.floats(0.01, 0.5), plain=st.floats(0.01, 0.5), steps=st.integers(3, 120))
def test_break_even_matches_brute_force_or_extrapolates(warmup: float, fast: float, plain: float, steps: int) -> None:
    assume(abs(plain - fast) > 1e-3 and warmup > 1e-3)  # no float ties between the running sums
    fast_steps, plain_steps = [warmup + fast] + [fast] * (steps - 1), [plain] * steps
    result = break_even(fast_steps, plain_steps, steady_from=1)
    reached = brute_force(fast_steps, plain_steps)
    if reached is not None:
        assert not result["extrapolated"]
        assert result["break_even_step"] == reached
    elif plain > fast:  # still behind at the end: where the steady steps make up the warm-up
        assert result["extrapolated"]
        assert result["break_even_step"] == pytest.approx(1 + warmup / (plain - fast), rel=1e-6, abs=2)
    else:
        assert result["break_even_step"] is None


def test_step_seconds_reads_metrics_in_step_order(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [{"step": 2, "step_s": 0.5}, {"step": 1, "step_s": 3.0},
                                                            {"eval_step": 2, "tau": 1.1}]) + "\n")
    assert step_seconds(metrics) == [3.0, 0.5]
