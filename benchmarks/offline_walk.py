"""How long the offline validation walk takes and how many operations it dispatches, DFlash against DFlash 2.

    python benchmarks/offline_walk.py --cache CACHE [--architecture dflash --architecture dflash2] \\
        [--sequences N] [--count-sequences 4] [--logits-rows N] --out FILE.json

For each architecture: the run `dflash train --cache CACHE --architecture A --attention sdpa` sets up
(`run_setup.setup_run`, in a temporary folder removed afterwards; no loader workers), its freshly initialised
drafter (DFlash 2's selector made other than the identity: its successor codebook drawn at the initialiser's
scale, so that its walk picks other tokens than DFlash's argmax, as a trained one does), then `trainer.walk_split`
over the first --sequences sequences of the validation split (default: all of it), as every evaluation of
training walks it: its wall seconds (one run, after one walk of --count-sequences sequences that warms the
allocator), and for the first --count-sequences sequences the aten operations dispatched (a TorchDispatchMode), in
all and by source (innermost frame in the package's stage2_train/*.py, as file:function), the drafter's forwards
(`acceptance._draft_rows`) and DFlash 2's selector walks (`CandidateSelector.walk` / `walk_candidates` calls). A
fresh drafter's tau is ~1, so the walk takes one step a position: the most steps a walk can take. --logits-rows
sets how many rows of logits are taken at once (`acceptance.LOGITS_ROWS`, default its value). The record names the
code (`git describe`).

Why: on an H100 (2026-12-07) DFlash 2's validation over the four-times cache's 855 sequences took ~55 s against
DFlash's ~23 s. The operations are the host's part (those that are not views are kernel launches on a GPU); the
seconds on a CPU are not a GPU's (there the model runs in float32, and the CPU's matmul speed depends on the
layout of its input) and say only how the two compare here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.stage2_train import acceptance, trainer  # noqa: E402
from dflash.stage2_train.modeling_dflash import CandidateSelector  # noqa: E402
from dflash.stage2_train.options import TrainOptions  # noqa: E402
from train_step_ops import patch  # noqa: E402

PACKAGE_FOLDER = "stage2_train/"


class OperationCount(TorchDispatchMode):
    """Every aten operation dispatched, by name and by the innermost frame in stage2_train/*.py."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.by_source: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.by_name[func.__name__.split(".")[0]] += 1
        source = "other"
        for frame in reversed(traceback.extract_stack(limit=30)):
            if PACKAGE_FOLDER in frame.filename:
                source = f"{Path(frame.filename).name}:{frame.name}"
                break
        self.by_source[source] += 1
        return func(*args, **(kwargs or {}))


def counted_calls(stack: ExitStack, owner: Any, name: str) -> list[int]:
    """[calls of `owner.name`], counted until `stack` closes (`train_step_ops.patch`; the original is called)."""
    original, calls = getattr(owner, name), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    patch(stack, owner, name, counted)
    return calls


def code_version() -> str | None:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def measure(cache: Path, architecture: str, sequences: int | None, count_sequences: int, work: Path,
            top: int) -> dict[str, Any]:
    options = TrainOptions(cache=cache, out=work / architecture, architecture=architecture, attention="sdpa",
                           max_steps=1, eval_every=0, checkpoint_every=0, num_workers=0,
                           overwrite=True, seed=0)
    run = trainer.setup_run(options)
    try:
        model = run.whole_drafter()
        selector = getattr(model, "candidate_selector", None)
        if selector is not None:
            with torch.no_grad():
                torch.nn.init.normal_(selector.successor_codebook, std=selector.initializer_range)
        trainer.walk_split(run, model, "validation", count_sequences)  # warm-up
        started = time.perf_counter()
        result = trainer.walk_split(run, model, "validation", sequences)
        seconds = time.perf_counter() - started
        # walk_candidates exists since the one-walk-a-forward change; before it, `walk` was called per chunk.
        walk_methods = [name for name in ("walk", "walk_candidates") if hasattr(CandidateSelector, name)]
        with ExitStack() as stack:
            forwards = counted_calls(stack, acceptance, "_draft_rows")
            walks = [counted_calls(stack, CandidateSelector, name) for name in walk_methods]
            counted = stack.enter_context(OperationCount())
            trainer.walk_split(run, model, "validation", count_sequences)
        # `walk` delegates to `walk_candidates`: a walk is a call of either made from outside the selector.
        selector_walks = max((calls[0] for calls in walks), default=0)
    finally:
        run.accelerator.end_training()
        if run.lock is not None:
            run.lock.release()
    return {"architecture": architecture, "sequences": result["sequences"], "steps": result["steps"],
            "tau_walk": result["tau_walk"], "seconds": round(seconds, 3),
            "operations": {"sequences": count_sequences, "forwards": forwards[0],
                           "selector_walks": selector_walks if selector is not None else 0,
                           "total": sum(counted.by_name.values()),
                           "by_source": dict(counted.by_source.most_common(top)),
                           "by_name": dict(counted.by_name.most_common(top))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--architecture", action="append", choices=("dflash", "dflash2"), default=None)
    parser.add_argument("--sequences", type=int, default=None, help="validation sequences timed (default: all)")
    parser.add_argument("--count-sequences", type=int, default=4, help="validation sequences counted")
    parser.add_argument("--top", type=int, default=12, help="sources and operation names listed")
    parser.add_argument("--logits-rows", type=int, default=acceptance.LOGITS_ROWS,
                        help="rows of logits taken at once (acceptance.LOGITS_ROWS)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    architectures = args.architecture or ["dflash", "dflash2"]
    acceptance.LOGITS_ROWS = args.logits_rows
    with tempfile.TemporaryDirectory(prefix="offline_walk_") as work:
        results = [measure(args.cache, architecture, args.sequences, args.count_sequences, Path(work), args.top)
                   for architecture in architectures]
    record = {"settings": {"cache": str(args.cache), "code": code_version(), "sequences": args.sequences,
                           "logits_rows": args.logits_rows,
                           "count_sequences": args.count_sequences, "device": "cuda" if torch.cuda.is_available()
                           else f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d")},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for result in results:
        print(f"{result['architecture']}: {result['seconds']:.2f} s for {result['sequences']} sequences "
              f"({result['steps']} steps); for {result['operations']['sequences']}: "
              f"{result['operations']['total']} operations, {result['operations']['forwards']} forwards, "
              f"{result['operations']['selector_walks']} selector walks")


if __name__ == "__main__":
    main()
