"""A small PNG of the learning curves and the acceptance per block position, from the run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.shared.run_files import RunFiles


def write_plots(run_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = RunFiles(run_dir).metrics
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    figure = training_figure(records)
    out = RunFiles(run_dir).plot
    figure.savefig(out, dpi=90)
    plt.close(figure)
    return out


def training_figure(records: list[dict[str, Any]]) -> Any:
    """The figure of training.png: training loss, held-out tau, acceptance by block position."""
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/tau_walk" in r]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    # Log scale: the untrained drafter's first losses (~75 with the default drafter) would flatten the rest.
    axes[0].set(title="training loss", xlabel="step", ylabel="loss (log scale)", yscale="log")
    axes[1].plot([r["step"] for r in evals], [r["eval/tau_walk"] for r in evals], "o-", label="walk (decoding)")
    axes[1].plot([r["step"] for r in evals], [r["eval/tau_random_anchors"] for r in evals], "s--",
                 label="random anchors")
    axes[1].set(title="offline acceptance length tau (held out)", xlabel="step")
    axes[1].legend()
    if evals:
        by_position = evals[-1]["eval/acceptance_by_position"]
        axes[2].bar(range(1, len(by_position) + 1), by_position)
        axes[2].set(title=f"P(accepted >= k), step {evals[-1]['step']}", xlabel="block position k", ylim=(0, 1))
    figure.tight_layout()
    return figure
