"""The aten operations the host dispatches eagerly in one `dflash train` step, by phase and by source, and the ones
among them that make the host wait for the device: on a GPU each eager operation is a Python call and a kernel
launch (or a host computation), so their count is the step's host time where the step is host-bound (the SmolLM2
drafter's on an H100/H200), and every wait stalls the queue.

Counted on CPU, one architecture after another, over the first loader batch of a cache:

    python benchmarks/train_step_ops.py --cache CACHE --architecture dflash --architecture dflash2 \\
        [--batch-tokens 2304] [--draft-layers N] [--attention sdpa] [--no-compile] [--ce-chunk-rows N] \\
        [--selector-chunk-rows N] [--warm-steps 2] [--top-sources 40] --out FILE.json

CACHE: any dflash cache, e.g. the tests' training cache (60 conversations of tests/conftest.py's
`make_conversations`, written as JSON lines to chats.jsonl) extracted from the embedded SmolLM2 target:

    dflash extract --data chats.jsonl --out CACHE --max-length 128 --workers 2 --batch-tokens 1024

What is counted: the run `dflash train --cache CACHE --architecture A --batch-tokens N [--draft-layers L]
--attention X [--compile] --mixed-precision bf16` sets up (`run_setup.setup_run`, in a temporary folder removed
afterwards; its other options `dflash train`'s defaults, no loader workers), the same first loader batch stepped
--warm-steps times (compilation, optimizer state, allocator growth), then one more step counted: `trainer.train_step`
(step_parts, each micro-batch's inputs, forward, objective, DFlash 2's selector loss, backward, the step's tally,
`update_weights`) and the reading of its metrics record (`PendingRecord.settle`, which the training loop does one
step later). A TorchDispatchMode sees every aten
operation dispatched; with `ignore_compile_internals()` the decoder layers compiled by --compile run as compiled, so
their fused kernels are not seen (one call each), only the operations their generated code calls outside the
kernels (e.g. `mm`, kind ".../compiled:inductor-code").

As on CUDA, where the CPU would run otherwise: AdamW fused (`run_setup.adamw_fused`), the block loss's chunks of
`loss.chunk_rows(vocab, "cuda")` rows and the selector loss's of `loss.selector_chunk_rows(k, H, "cuda", 2)`
positions unless --ce-chunk-rows / --selector-chunk-rows (a chunk costs operations: the count depends on it).
Operations on host tensors count too (e.g. the loss normaliser from the labels on the CPU): the host dispatches
them as well; copies to the device are not there on the CPU (`to_device` is a no-op).

Reported per architecture: the operations in all (`total`), by phase (inputs, forward, objective, selector loss,
backward, optimizer+record = `update_weights` and the reading of its record, tally = `StepTally.add`, other = the
rest of `train_step`: the loss normaliser, the tally's start, the loss's scaling), by kind (fw: a forward; bw: in the
backward, dispatched by an autograd node of C++; bw-python: a Python backward, e.g. a checkpointed chunk's
recomputation; "/compiled:..." inside a compiled region's runtime), by operation name, the --top-sources sources
(innermost frame in the package's stage2_train/*.py as file:function:line; a C++ autograd node's operations at the
forward line that made the node, from anomaly mode's traceback, with the node's name), and every operation that makes
the host wait for a CUDA device (`SYNC_OPS`, and indexing by a boolean mask), with its source; on_host marks those
dispatched inside `step_parts`, on the loader's batches, which are in host memory on a GPU too (no wait there).
Flex attention cannot train on the CPU (no backward): --attention sdpa (the default) or eager. A count, not a time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash.stage2_train  # noqa: E402
from dflash.stage2_train import loss as loss_module  # noqa: E402
from dflash.stage2_train import run_setup, trainer  # noqa: E402
from dflash.stage2_train.options import TrainOptions  # noqa: E402
from dflash.stage2_train.packed_batches import STEP_INPUTS  # noqa: E402

# The package's stage2_train folder as its modules were imported from (the frames' file names start with it).
STAGE2_DIR = str(Path(dflash.stage2_train.__file__).parent) + os.sep
PHASES = ("inputs", "forward", "objective", "selector loss", "backward", "optimizer+record", "tally", "other")
# Operations whose result the host reads, or whose output size depends on the data: on CUDA each waits for the
# device to finish everything queued before it.
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                      "unique_consecutive", "is_nonzero", "equal"})
# Indexing whose index may be a boolean mask (its nonzero() runs inside the kernel, unseen by the mode).
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
OpKey = tuple[str, str, str, str]  # phase, kind, source, operation
SyncKey = tuple[str, str, str, str, bool]  # the same and on_host (dispatched inside `step_parts`)


def indexes_by_mask(op: str, args: tuple[Any, ...]) -> bool:
    """An indexing operation given a boolean (or byte) mask among its indices (its second argument)."""
    if op not in MASK_INDEX_OPS or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in args[1])


def compiled_region(filename: str) -> str | None:
    """The compiled-code kind of a frame's file: inductor's generated code, or the runtime of compiled regions."""
    if "torchinductor" in filename and "site-packages" not in filename:
        return "compiled:inductor-code"
    if "/torch/_functorch/_aot_autograd/" in filename or "/torch/_inductor/" in filename:
        return "compiled:runtime"
    return None


class StepOps(TorchDispatchMode):
    """Counts the aten operations dispatched while `counting`, each under the phase it runs in and its source."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.phase = "other"
        self.on_host = False  # inside `step_parts`, which reads only the loader's batches, in host memory
        self.backward_caller: FrameType | None = None  # the frame that called the backward, while it runs
        self.ops: Counter[OpKey] = Counter()
        self.syncs: Counter[SyncKey] = Counter()
        self.traceback_line = re.compile(r'File "(' + re.escape(STAGE2_DIR) + r'[^"]+)", line (\d+), in (\S+)')

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled regions run as compiled, not traced through the mode

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting:
            self.record(str(func.overloadpacket.__name__), args)
        return func(*args, **(kwargs or {}))

    def record(self, op: str, args: tuple[Any, ...]) -> None:
        kind, source = self.attribute(sys._getframe(2))
        key = (self.phase, kind, source, op)
        self.ops[key] += 1
        if op in SYNC_OPS:
            self.syncs[(*key, self.on_host)] += 1
        elif indexes_by_mask(op, args):
            self.syncs[(self.phase, kind, source, f"{op}(bool mask)", self.on_host)] += 1

    def attribute(self, frame: FrameType | None) -> tuple[str, str]:
        """The kind and source of the operation dispatched from `frame`."""
        compiled, innermost = None, None
        while frame is not None:
            filename = frame.f_code.co_filename
            compiled = compiled or compiled_region(filename)
            if filename.startswith(STAGE2_DIR):
                innermost = frame
                break
            frame = frame.f_back
        node = torch._C._current_autograd_node()
        if node is None:
            kind, source = "fw", frame_source(innermost)
        elif "AccumulateGrad" in node.name():
            kind, source = "bw", "autograd:AccumulateGrad"
        elif innermost is None or innermost is self.backward_caller:  # an autograd node of C++
            kind, source = "bw", f"{self.node_origin(node)} [{node.name()}]"
        else:  # Python code run by the backward: a custom Function's backward, a checkpoint's recomputation
            kind, source = "bw-python", f"{frame_source(innermost)} [{node.name()}]"
        return (f"{kind}/{compiled}" if compiled else kind), source

    def node_origin(self, node: Any) -> str:
        """The package's forward line that made `node` (its anomaly-mode traceback), else "?"."""
        trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
        if not trace:
            return "?"
        lines = self.traceback_line.findall("".join(trace) if isinstance(trace, list) else str(trace))
        if not lines:
            return "?"
        filename, line, function = lines[-1]
        return f"{filename[len(STAGE2_DIR):]}:{function}:{line}"

    @contextmanager
    def in_phase(self, name: str, on_host: bool = False) -> Iterator[None]:
        outer = self.phase, self.on_host
        self.phase, self.on_host = name, on_host or self.on_host
        try:
            yield
        finally:
            self.phase, self.on_host = outer


def frame_source(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename[len(STAGE2_DIR):]}:{frame.f_code.co_name}:{frame.f_lineno}"


def patch(stack: ExitStack, owner: Any, name: str, value: Any) -> None:
    """`owner.name = value` until `stack` closes (then as it was: an attribute of its own, or none)."""
    own = vars(owner)
    had, before = name in own, own.get(name)
    setattr(owner, name, value)
    stack.callback(lambda: setattr(owner, name, before) if had else delattr(owner, name))


def in_phase(counter: StepOps, name: str, function: Callable[..., Any], on_host: bool = False) -> Callable[..., Any]:
    @functools.wraps(function)
    def phased(*args: Any, **kwargs: Any) -> Any:
        with counter.in_phase(name, on_host):
            return function(*args, **kwargs)

    return phased


def backward_in_phase(counter: StepOps, backward: Callable[..., Any]) -> Callable[..., Any]:
    """The accelerator's backward under the "backward" phase, its caller's frame kept: an operation whose innermost
    package frame is that one was dispatched by a C++ autograd node."""
    def phased(loss: torch.Tensor, **kwargs: Any) -> Any:
        outer, counter.backward_caller = counter.backward_caller, sys._getframe(1)
        try:
            with counter.in_phase("backward"):
                return backward(loss, **kwargs)
        finally:
            counter.backward_caller = outer

    return phased


def chunking_as_on_cuda(stack: ExitStack, ce_rows: int | None, selector_rows: int | None) -> None:
    """The loss's chunk sizes as CUDA's (or as given) on this CPU run. The loss looks both functions up in its
    module when it runs (`block_loss` without a chunk_size, `selector_loss` with chunk_rows=None, which is what the
    trainer passes), so replacing them there sets the chunking of the trainer's own calls; the memory plan
    imported its own references and keeps the CPU's (it only decides whether a batch is split)."""
    cuda_ce, cuda_selector = loss_module.chunk_rows, loss_module.selector_chunk_rows

    def ce_chunk(vocab: int, device_type: str) -> int:
        return ce_rows or cuda_ce(vocab, "cuda")

    def selector_chunk(top_k: int, hidden_size: int, device_type: str, element_bytes: int = 2) -> int:
        return selector_rows or cuda_selector(top_k, hidden_size, "cuda", element_bytes)

    patch(stack, loss_module, "chunk_rows", ce_chunk)
    patch(stack, loss_module, "selector_chunk_rows", selector_chunk)


def train_options(args: argparse.Namespace, architecture: str, out: Path) -> TrainOptions:
    """The run's options: those given, bf16 as on a GPU, no evaluation or checkpoint, the loader in this process."""
    return TrainOptions(cache=args.cache, out=out, architecture=architecture, batch_tokens=args.batch_tokens,
                        draft_layers=args.draft_layers, attention=args.attention, compile=args.compile,
                        mixed_precision="bf16", max_steps=100, eval_fraction=0.0, test_fraction=0.0, eval_every=0,
                        checkpoint_every=0, num_workers=0, overwrite=True, seed=0)


def first_step_batches(run: Any) -> list[dict[str, Any]]:
    steps = trainer.step_batches(run)
    try:
        return next(steps)
    finally:
        steps.close()


def micro_batch_sizes(run: Any, batches: list[dict[str, Any]], selector_chunk: int | None) -> dict[str, Any]:
    """What the counted step's micro-batches hold (the memory plan's parts of the loader batches)."""
    parts = trainer.step_parts(run, batches)
    labels = [part[STEP_INPUTS]["labels"] for part in parts]
    sizes = {"micro_batches": len(parts), "sequences": sum(len(part["lengths"]) for part in parts),
             "tokens": sum(int(part["lengths"].sum()) for part in parts),
             "blocks": sum(int(x.shape[1]) for x in labels),
             "supervised": sum(int((x != loss_module.IGNORE_INDEX).sum()) for x in labels)}
    if selector_chunk is not None:  # (DFlash 2: its parts carry the positions its selector loss scores)
        scored = [len(part[STEP_INPUTS]["selector_index"]) for part in parts]
        sizes["selector_positions"] = sum(scored)
        sizes["selector_chunks"] = sum(math.ceil(n / selector_chunk) for n in scored)
    return sizes


def count_step(args: argparse.Namespace, architecture: str, work: Path) -> dict[str, Any]:
    """One architecture's run: its first loader batch stepped --warm-steps times, then once more counted."""
    run = trainer.setup_run(train_options(args, architecture, work / architecture))
    try:
        batches = first_step_batches(run)
        shape = run_shape(run)
        counter, loss = counted_steps(run, batches, args.warm_steps)
        sizes = micro_batch_sizes(run, batches, shape["selector_chunk_rows"])
    finally:
        run.accelerator.end_training()
        if run.lock is not None:
            run.lock.release()
    return {"architecture": architecture, **shape, **sizes, "loss": loss, **summarise(counter, args.top_sources)}


def run_shape(run: Any) -> dict[str, Any]:
    """The run's path, drafter and loss chunking (the chunk sizes as the loss gets them in this run)."""
    selector = trainer.candidate_selector(run)
    top_k = None if selector is None else int(selector.top_k)
    hidden, vocab = int(run.config.hidden_size), int(run.config.vocab_size)
    return {"attention": run.options.attention, "compile": run.options.compile,
            "precision": str(run.compute_dtype).removeprefix("torch."),
            "draft_layers": int(run.config.num_hidden_layers), "hidden_size": hidden, "vocab_size": vocab,
            "ce_chunk_rows": loss_module.chunk_rows(vocab, run.device.type), "selector_top_k": top_k,
            "selector_chunk_rows": None if top_k is None else loss_module.selector_chunk_rows(
                top_k, hidden, run.device.type, run.lm_head.element_size())}


def counted_steps(run: Any, batches: list[dict[str, Any]], warm_steps: int) -> tuple[StepOps, float]:
    """`warm_steps` steps, then one counted, each `train_step` and the reading of its record, under the counter
    (on while warming too: compiled for the state it runs under) and anomaly mode (the nodes' tracebacks); returns
    the counter and the counted step's loss."""
    counter, loss = StepOps(), 0.0
    with ExitStack() as stack:
        phase_step(stack, counter, run)
        stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        for counting in [False] * warm_steps + [True]:
            with counter:
                counter.counting = counting
                record = trainer.train_step(run, batches)
                with counter.in_phase("optimizer+record"):
                    loss = trainer.PendingRecord(record).settle()["loss"]
                counter.counting = False
    return counter, loss


def phase_step(stack: ExitStack, counter: StepOps, run: Any) -> None:
    """The trainer's step functions under their phases (`train_step` looks them up in its module when it runs)."""
    patch(stack, trainer, "step_parts", in_phase(counter, "inputs", trainer.step_parts, on_host=True))
    for name, phase in (("micro_batch_inputs", "inputs"), ("drafter_hidden", "forward"),
                        ("block_objective", "objective"), ("add_selector_loss", "selector loss"),
                        ("update_weights", "optimizer+record")):
        patch(stack, trainer, name, in_phase(counter, phase, getattr(trainer, name)))
    patch(stack, trainer.StepTally, "add", in_phase(counter, "tally", trainer.StepTally.add))
    patch(stack, run.accelerator, "backward", backward_in_phase(counter, run.accelerator.backward))


def summarise(counter: StepOps, top_sources: int) -> dict[str, Any]:
    ops = counter.ops
    by_phase: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    by_source: dict[tuple[str, str, str], Counter[str]] = {}
    for (phase, kind, source, op), n in ops.items():
        by_phase[phase] += n
        by_kind[kind] += n
        by_op[op] += n
        by_source.setdefault((phase, kind, source), Counter())[op] += n
    sources = sorted(by_source.items(), key=lambda item: -item[1].total())[:top_sources]
    return {"total": ops.total(), "by_phase": {phase: by_phase[phase] for phase in PHASES if phase in by_phase},
            "by_kind": dict(by_kind.most_common()), "by_op": dict(by_op.most_common()),
            "top_sources": [{"phase": phase, "kind": kind, "source": source, "count": op_counts.total(),
                             "ops": dict(op_counts.most_common())}
                            for (phase, kind, source), op_counts in sources],
            "syncs": [{"phase": phase, "kind": kind, "source": source, "op": op, "count": n, "on_host": on_host}
                      for (phase, kind, source, op, on_host), n in counter.syncs.most_common()]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a dflash cache (`dflash extract`)")
    parser.add_argument("--architecture", action="append", choices=("dflash", "dflash2"),
                        help="repeatable; default dflash and dflash2")
    parser.add_argument("--batch-tokens", type=int, default=2304)
    parser.add_argument("--draft-layers", type=int, default=None, help="default: `dflash train`'s")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"),
                        help="(flex attention has no backward on the CPU)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="the decoder layers uncompiled (default: --compile)")
    parser.add_argument("--ce-chunk-rows", type=int, default=None,
                        help="rows of the block loss's chunks (default: loss.chunk_rows on CUDA)")
    parser.add_argument("--selector-chunk-rows", type=int, default=None,
                        help="positions of DFlash 2's selector loss's chunks (default: loss.selector_chunk_rows on "
                             "CUDA)")
    parser.add_argument("--warm-steps", type=int, default=2)
    parser.add_argument("--top-sources", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.architecture = args.architecture or ["dflash", "dflash2"]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = {"cache": str(args.cache), "batch_tokens": args.batch_tokens, "draft_layers": args.draft_layers,
                "attention": args.attention, "compile": args.compile,
                "ce_chunk_rows": args.ce_chunk_rows or "loss.chunk_rows on CUDA",
                "selector_chunk_rows": args.selector_chunk_rows or "loss.selector_chunk_rows on CUDA",
                "warm_steps": args.warm_steps, "mixed_precision": "bf16", "adamw_fused": True, "device": "cpu",
                "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    results = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="dflash-train-step-ops-") as work:
        # What a CUDA run would take where the CPU takes something else (the operation count depends on both).
        patch(stack, run_setup, "adamw_fused", lambda device: True)  # one _fused_adamw_ per parameter group
        chunking_as_on_cuda(stack, args.ce_chunk_rows, args.selector_chunk_rows)
        for architecture in args.architecture:
            results.append(count_step(args, architecture, Path(work)))
            print(f"{architecture}: {results[-1]['total']} operations, "
                  + ", ".join(f"{phase} {n}" for phase, n in results[-1]["by_phase"].items())
                  + f"; {sum(s['count'] for s in results[-1]['syncs'] if not s['on_host'])} waiting for the device",
                  flush=True)
    record = {"settings": settings, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {args.out}")
    return record


if __name__ == "__main__":
    main()
