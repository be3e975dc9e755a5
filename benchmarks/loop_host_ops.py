"""The torch operations the host dispatches in each speculative step outside the forwards that CUDA graphs replay:
the part of `dflash eval`'s fast path that costs host time on a GPU whatever the graphs do (each eager operation is
a Python call and a kernel launch there).

Counted on CPU (the static path without graphs runs the same code; a graphed forward is one replay on a GPU, so the
operations inside `GraphedForward` calls count as one), with the embedded SmolLM2-135M-Instruct and a random-weight
drafter of `dflash train`'s default shape, greedy, over --prompts MT-Bench prompts x --new-tokens tokens, in three
versions of the loop: the extension eager and the draft after the read-back (before 2026-12-07;
`modeling_dflash.FUSED_EXTEND` and `PIPELINED_DRAFT` off), the extension fused, and both (the default):

    python benchmarks/loop_host_ops.py [--prompts 2] [--new-tokens 64] --out FILE.json

Reported per speculative step (after the prefill): eager operations outside graphed forwards, graphed forwards
replayed, and the operations by name. A count, not a time: what each saves on a GPU is measured by
`bench_eval_decode.py --eager-extend` and `--serial-draft` (the pipelined draft dispatches ~7 operations more a
step, while the GPU verifies; what it moves is the read-back and the bookkeeping, which then run while the GPU
drafts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_eval_decode import random_drafter  # noqa: E402

from dflash.stage2_train import modeling_dflash as loop  # noqa: E402
from dflash.stage2_train.target_parts import scaled_embedding  # noqa: E402


class HostOps(TorchDispatchMode):
    """Counts the operations dispatched outside graphed forwards (`inside` > 0 while one runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside = 0
        self.replays = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.inside:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(target: torch.nn.Module, draft: loop.DFlashDraftModel, prompts: list[list[int]], new_tokens: int,
          fused: bool, pipelined: bool) -> dict[str, Any]:
    saved = loop.FUSED_EXTEND, loop.PIPELINED_DRAFT
    loop.FUSED_EXTEND, loop.PIPELINED_DRAFT = fused, pipelined
    embed = scaled_embedding(target.get_input_embeddings().weight, draft.embed_scale)
    head = target.get_output_embeddings().weight
    capacity = max(map(len, prompts)) + new_tokens + draft.block_size
    call = loop.GraphedForward.__call__
    mode = HostOps()

    def graphed(self: loop.GraphedForward) -> Any:
        mode.inside += 1
        mode.replays += 1
        try:
            return call(self)
        finally:
            mode.inside -= 1

    def generate(ids: list[int], tokens: int) -> loop.SpecResult:
        return loop.speculative_generate(target, draft, embed, head, ids, draft.target_layer_ids, tokens, [],
                                         decode="static", capacity=capacity)

    try:
        generate(prompts[0], 2 * draft.block_size)  # warm: the static buffers and runners built
        steps, replays, prefill_replays = 0, 0, 0
        stepping: Counter[str] = Counter()
        loop.GraphedForward.__call__ = graphed  # type: ignore[method-assign]
        for ids in prompts:
            # a generation of one token is the prefill alone: its operations are taken out of the whole one's
            mode.ops, mode.replays = Counter(), 0
            with mode:
                generate(ids, 1)
            prefill, prefill_replays = mode.ops, mode.replays
            mode.ops, mode.replays = Counter(), 0
            with mode:
                steps += generate(ids, new_tokens).steps
            stepping += mode.ops - prefill
            replays += mode.replays - prefill_replays
    finally:
        loop.GraphedForward.__call__ = call  # type: ignore[method-assign]
        loop.FUSED_EXTEND, loop.PIPELINED_DRAFT = saved
    return {"fused_extend": fused, "pipelined_draft": pipelined, "steps": steps,
            "eager_ops_per_step": sum(stepping.values()) / steps,
            "graph_replays_per_step": replays / steps,
            "ops_per_step": {name: n / steps for name, n in stepping.most_common()}}


def main() -> None:
    from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target
    from dflash.stage2_train.evaluate import load_prompts, tokenize_prompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    resolved = resolve_target(None)
    target = load_target_model(resolved.load_path, "cpu", torch.float32).eval()
    tokenizer = load_tokenizer(resolved.load_path)
    draft = random_drafter(target, len(tokenizer) - 1, torch.device("cpu"))
    prompts = [tokenize_prompt(tokenizer, p.messages) for p in load_prompts("mtbench", args.prompts)]
    with torch.inference_mode():
        results = [count(target, draft, prompts, args.new_tokens, fused, pipelined)
                   for fused, pipelined in ((False, False), (True, False), (True, True))]
    record = {"target": resolved.display_name, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "torch": torch.__version__, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for r in results:
        print(f"FUSED_EXTEND={r['fused_extend']} PIPELINED_DRAFT={r['pipelined_draft']}: "
              f"{r['eager_ops_per_step']:.1f} eager operations and "
              f"{r['graph_replays_per_step']:.1f} graphed forwards a step ({r['steps']} steps)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
