"""SDPA over the whole DFlash training mask vs per group of blocks (`grouped_attention`), same drafter, same inputs.

The training layout puts A blocks of Bk queries after C context keys. With the whole mask, SDPA scores every query
against C + A * Bk keys although a block sees only the context before its anchor and its own Bk keys; grouped,
each query scores C + G * Bk keys (G from `blocks_per_group`). Both run the drafter's forward and backward (no LM
head) in the same process on random inputs; outputs and parameter gradients are compared too. Speed does not depend
on weight values.

    python benchmarks/bench_grouped_attention.py --shape smollm2 --anchors 512 --context 1024 --layers 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.stage2_train.attention_masks import AnchorLayout, batch_dense_mask, grouped_dense_mask  # noqa: E402
from dflash.stage2_train.draft_attention import training_drafter  # noqa: E402
from dflash.stage2_train.draft_config import config_from_target  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--context", type=int, default=1024, help="context tokens per sequence")
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = config_from_target(SHAPES[args.shape], None, args.layers, args.block_size, mask_token_id=0)
    model = training_drafter(config, "sdpa").to(device, dtype)
    hidden, width = config.hidden_size, config.num_context_layers * config.hidden_size
    anchors = [torch.randperm(args.context - 1)[: args.anchors].sort().values for _ in range(args.batch)]
    layout = AnchorLayout.from_anchor_lists(anchors, [args.context] * args.batch, args.block_size, device=device)
    features = torch.randn(args.batch, args.context, width, device=device, dtype=dtype)
    noise = torch.randn(args.batch, layout.num_queries, hidden, device=device, dtype=dtype)
    q_pos, k_pos = layout.query_position_ids(), layout.context_position_ids()

    variants = {"whole mask": lambda: batch_dense_mask(layout), "grouped": lambda: layout}
    results: dict[str, dict] = {}
    outputs, gradients = {}, {}
    for name, mask_of in variants.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            out = model(noise, features, q_pos, k_pos, mask_of())  # the mask is built inside the timed step
            out.float().square().mean().backward()
            synchronize(device)
            if step:
                times.append(time.perf_counter() - start)
        outputs[name] = out.detach().float()
        gradients[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
        results[name] = {"s_per_step": statistics.median(times), "steps": times, "peak_gb": peak}
        print(f"{name}: {results[name]['s_per_step']:.3f} s/step", flush=True)

    whole, grouped = outputs["whole mask"], outputs["grouped"]
    record = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": str(dtype), "torch": torch.__version__, "shape": args.shape, "layers": args.layers,
        "batch": args.batch, "context": args.context, "anchors": args.anchors, "block_size": args.block_size,
        "keys_per_query": {"whole mask": args.context + args.anchors * args.block_size,
                           "grouped": args.context + grouped_dense_mask(layout).queries_per_group},
        "results": results,
        "speedup": results["whole mask"]["s_per_step"] / results["grouped"]["s_per_step"],
        "max_abs_difference": float((whole - grouped).abs().max()),
        "max_abs_output": float(whole.abs().max()),
        "max_abs_gradient_difference": float((gradients["whole mask"] - gradients["grouped"]).abs().max()),
        "max_abs_gradient": float(gradients["whole mask"].abs().max()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"grouped_attention_{args.shape}_{device.type}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    shown = ("keys_per_query", "speedup", "max_abs_difference", "max_abs_gradient_difference")
    print(json.dumps({k: record[k] for k in shown}), f"-> {path}")


if __name__ == "__main__":
    main()
