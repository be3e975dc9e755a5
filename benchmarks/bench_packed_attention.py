"""The drafter's forward and backward on one packed micro-batch of many sequences, by attention variant.

A micro-batch of --batch-tokens (context plus block tokens, as `dflash train --batch-tokens` counts them) is filled
with sequences of random lengths (--min-length to --max-length) whose anchors follow --anchor-density, packed as
training packs them (`PackedLayout`). Variants, each on the same inputs in one process:

  sdpa_whole    SDPA over the whole packed mask (what the grouping rule fell back to for micro-batches of many
                sequences before it weighed each group size's cost)
  sdpa_grouped  SDPA per group of blocks, the group size from `packed_blocks_per_group`
  flex          flex_attention with the packed BlockMask (CUDA only: compiled)
  padded        the same sequences and anchors, each padded to the largest anchor count (the layout before packing),
                SDPA grouped by `blocks_per_group`

Reported per variant: seconds per step (median of --steps after a warm-up step), peak memory above the inputs
(CUDA), and the outputs' largest difference from sdpa_grouped (the packed variants compute the same function).
--draws K instead: K micro-batches of different shapes, one after another in one process as training sees them,
two steps each; the first step of a new shape includes whatever compilation it triggers (flex: the BlockMask and
the kernel).

    python benchmarks/bench_packed_attention.py --batch-tokens 49152 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash.stage2_train.attention_masks import (  # noqa: E402
    AnchorLayout,
    PackedLayout,
    packed_blocks_per_group,
    packed_dense_mask,
)
from dflash.stage2_train.draft_attention import training_drafter  # noqa: E402
from dflash.stage2_train.draft_config import DFlashConfig, config_from_target  # noqa: E402
from dflash.stage2_train.modeling_dflash import DFlashDraftModel  # noqa: E402
from dflash.stage2_train.packed_batches import bucket  # noqa: E402

from bench_grouped_attention import SHAPES, synchronize  # noqa: E402


def draw_sequences(args: argparse.Namespace, generator: torch.Generator) -> tuple[list[int], list[list[int]]]:
    """Sequences until the budget is full: each a length, an answer of --answer-fraction of it, and anchors drawn
    from the answer's positions at the density (rounded up, capped at --max-anchors)."""
    lengths: list[int] = []
    anchors: list[list[int]] = []
    used = 0
    while True:
        length = int(torch.randint(args.min_length, args.max_length + 1, (1,), generator=generator))
        start = int(length * (1 - args.answer_fraction))
        candidates = torch.arange(start, length - 1)
        count = min(math.ceil(args.anchor_density * len(candidates)), args.max_anchors)
        cost = length + count * args.block_size
        if used + cost > args.batch_tokens:
            return lengths, anchors
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values
        lengths.append(length)
        anchors.append(chosen.tolist())
        used += cost


def packed_inputs(args: argparse.Namespace, generator: torch.Generator, config: DFlashConfig, device: torch.device,
                  dtype: torch.dtype) -> tuple[list[int], list[list[int]], PackedLayout, torch.Tensor, torch.Tensor]:
    """One micro-batch as training packs it: (lengths, anchors, layout, context features, block embeddings)."""
    lengths, anchors = draw_sequences(args, generator)
    layout = PackedLayout.from_anchor_lists(anchors, lengths, args.block_size,
                                            num_blocks=bucket(sum(len(a) for a in anchors), 8),
                                            context_len=bucket(sum(lengths)), device=device)
    width = config.num_context_layers * config.hidden_size
    context = torch.randn(1, layout.context_len, width, generator=generator).to(device, dtype)
    noise = torch.randn(1, layout.num_queries, config.hidden_size, generator=generator).to(device, dtype)
    return lengths, anchors, layout, context, noise


def timed_step(model: DFlashDraftModel, inputs: tuple, device: torch.device) -> tuple[float, torch.Tensor]:
    """One forward and backward of the drafter (no LM head): (seconds, its output)."""
    synchronize(device)
    started = time.perf_counter()
    out = model(*inputs)
    out.float().square().mean().backward()
    synchronize(device)
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-tokens", type=int, default=49152)
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--answer-fraction", type=float, default=0.6)
    parser.add_argument("--anchor-density", type=float, default=1 / 6)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--padded-anchors", type=int, default=0,
                        help="padded: each sequence's first N anchors, padded to N blocks (0 = all of them: the same "
                             "anchors as the packed variants, padded to the largest count)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="sdpa_whole,sdpa_grouped,flex,padded")
    parser.add_argument("--draws", type=int, default=0, help="a shape sweep of this many micro-batches instead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.draws:
        shape_sweep(args)
        return

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    bk = args.block_size
    config = config_from_target(SHAPES["smollm2"], None, args.layers, bk, mask_token_id=0)
    width = config.num_context_layers * config.hidden_size
    lengths, anchors, layout, context, noise = packed_inputs(args, generator, config, device, dtype)
    blocks = sum(len(a) for a in anchors)
    group = packed_blocks_per_group(layout, config.head_dim)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "dtype": str(dtype), "torch": torch.__version__, "drafter": f"SmolLM2 shape, {args.layers} layers",
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "sequences": len(lengths), "context_tokens": sum(lengths), "context_len": layout.context_len,
                    "blocks": blocks, "num_blocks": layout.num_blocks, "blocks_per_group": group, "variants": {}}
    print(f"{len(lengths)} sequences, {sum(lengths)} context tokens, {blocks} blocks (axis {layout.num_blocks}); "
          f"{group} blocks per group", flush=True)

    outputs: dict[str, torch.Tensor] = {}
    for variant in args.variants.split(","):
        if variant == "flex" and device.type != "cuda":
            continue
        torch.manual_seed(0)
        model = training_drafter(config, "flex" if variant == "flex" else "sdpa").to(device, dtype)
        if variant == "padded":
            count = args.padded_anchors or max(len(a) for a in anchors)
            padded = AnchorLayout.from_anchor_lists([a[:count] for a in anchors], lengths, bk, num_blocks=count,
                                                    context_len=max(lengths), device=device)
            inputs = (torch.randn(len(lengths), padded.num_queries, config.hidden_size, generator=generator),
                      torch.randn(len(lengths), max(lengths), width, generator=generator))
            args_for = (inputs[0].to(device, dtype), inputs[1].to(device, dtype), padded.query_position_ids(),
                        padded.context_position_ids(), padded)
        else:
            spec = packed_dense_mask(layout) if variant == "sdpa_whole" else layout
            args_for = (noise, context, layout.query_position_ids(), layout.context_position_ids(), spec)
        times = []
        try:
            for step in range(args.steps + 1):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                seconds, out = timed_step(model, args_for, device)
                if step:
                    times.append(seconds)
        except torch.OutOfMemoryError as error:
            result["variants"][variant] = {"error": str(error).splitlines()[0]}
            print(f"{variant}: out of memory", flush=True)
            continue
        record = {"seconds_per_step": statistics.median(times), "times": times}
        if device.type == "cuda":
            record["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
        if variant != "padded":
            outputs[variant] = out.detach().float()
        result["variants"][variant] = record
        print(f"{variant}: {record['seconds_per_step']:.4f} s/step"
              + (f", peak {record['peak_gib']:.2f} GiB" if "peak_gib" in record else ""), flush=True)
        del model, out
    if "sdpa_grouped" in outputs:
        for name, value in outputs.items():
            result["variants"][name]["max_abs_diff_vs_grouped"] = float((value - outputs["sdpa_grouped"]).abs().max())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"packed_attention_smollm2_{device.type}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {path}")


def shape_sweep(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = config_from_target(SHAPES["smollm2"], None, args.layers, args.block_size, mask_token_id=0)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "variants": {}}
    for variant in args.variants.split(","):
        if variant not in ("sdpa_grouped", "flex") or (variant == "flex" and device.type != "cuda"):
            continue
        torch.manual_seed(0)
        model = training_drafter(config, "flex" if variant == "flex" else "sdpa").to(device, dtype)
        draws = []
        started_all = time.perf_counter()
        for draw in range(args.draws):
            _, _, layout, context, noise = packed_inputs(args, torch.Generator().manual_seed(draw), config, device,
                                                         dtype)
            inputs = (noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
            times = [timed_step(model, inputs, device)[0] for _ in range(2)]
            draws.append({"num_blocks": layout.num_blocks, "context_len": layout.context_len, "first_s": times[0],
                          "second_s": times[1]})
            print(f"{variant} draw {draw}: {layout.num_blocks} blocks, context {layout.context_len}: "
                  f"{times[0]:.3f} s first, {times[1]:.3f} s again", flush=True)
        result["variants"][variant] = {"draws": draws, "total_s": time.perf_counter() - started_all}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"packed_attention_shapes_smollm2_{device.type}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
