"""Where does a training step's time go with flex attention vs SDPA? Phase by phase, printed as it happens.

A drafter step = build the mask, forward, backward. With flex attention the first step compiles the block-mask
builder and the fused kernels (forward and backward); a new input shape can compile again. This probe times, for
a fixed layout (B sequences of C context tokens, A anchors of block 16): the first mask build, the first step, and
the median of the next steps, for each backend, then a few steps whose anchor count changes (the real loader's
case). Every phase is printed with flush=True, so a run stopped by a time limit still shows where it stood.

    python benchmarks/flex_probe.py --shape smollm2 --out DIR      (or --shape qwen3-8b; --tiny on CPU)
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

from dflash.stage2_train.attention_masks import AnchorLayout, make_block_mask  # noqa: E402
from dflash.stage2_train.draft_attention import training_drafter  # noqa: E402
from dflash.stage2_train.draft_config import config_from_target  # noqa: E402
from dflash.stage2_train.modeling_dflash import DFlashDraftModel  # noqa: E402

SHAPES = {  # target config, context length, batch, anchors
    "smollm2": (dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     intermediate_size=1536, num_hidden_layers=30, vocab_size=49152, rope_theta=100000.0), 1024, 8, 256),
    "qwen3-8b": (dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=12288, num_hidden_layers=36, vocab_size=151936, rope_theta=1e6), 3072, 1, 512),
    "tiny": (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  num_hidden_layers=8, vocab_size=512, rope_theta=1e4), 256, 2, 8),
}


def layout_for(batch: int, context: int, anchors: int, device: torch.device, seed: int) -> AnchorLayout:
    generator = torch.Generator().manual_seed(seed)
    lists = [torch.randperm(context - 1, generator=generator)[:anchors].sort().values for _ in range(batch)]
    return AnchorLayout.from_anchor_lists(lists, [context] * batch, 16, device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--backends", default="sdpa,flex")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, context, batch, anchors = SHAPES[args.shape]
    config = config_from_target(target, None, 5, 16, 0)
    results: dict[str, dict[str, float | list[float]]] = {}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def clock(label: str, begin: float, record: dict) -> float:
        sync()
        seconds = time.perf_counter() - begin
        record[label] = seconds
        print(f"  {label}: {seconds:.3f} s", flush=True)
        return seconds

    for backend in args.backends.split(","):
        print(f"[{args.shape}] {backend}: B={batch} C={context} A={anchors}", flush=True)
        record: dict = {}
        model = training_drafter(config, backend).to(device, dtype)
        features = torch.randn(batch, context, 5 * config.hidden_size, device=device, dtype=dtype)

        def step(layout: AnchorLayout, model: DFlashDraftModel = model, features: torch.Tensor = features) -> None:
            noise = torch.randn(batch, layout.num_queries, config.hidden_size, device=device, dtype=dtype)
            mask = make_block_mask(layout) if backend == "flex" else layout
            hidden = model(noise, features, layout.query_position_ids(), layout.context_position_ids(), mask)
            hidden.float().square().mean().backward()

        layout = layout_for(batch, context, anchors, device, 0)
        if backend == "flex":
            begin = time.perf_counter()
            make_block_mask(layout)
            clock("first_block_mask_s", begin, record)
            begin = time.perf_counter()
            make_block_mask(layout_for(batch, context, anchors, device, 1))
            clock("second_block_mask_s", begin, record)
        begin = time.perf_counter()
        step(layout)
        clock("first_step_s", begin, record)
        times = []
        for i in range(args.steps):
            begin = time.perf_counter()
            step(layout_for(batch, context, anchors, device, 10 + i))
            times.append(clock(f"step_{i + 2}_s", begin, {}))
        record["median_step_s"] = statistics.median(times)
        changing = []
        for i, count in enumerate((anchors * 7 // 8, anchors * 3 // 4, anchors // 2)):
            begin = time.perf_counter()
            step(layout_for(batch, context, max(1, count), device, 100 + i))
            changing.append(clock(f"step_with_{count}_anchors_s", begin, {}))
        record["new_anchor_count_steps_s"] = changing
        record["block_tokens_per_s"] = batch * anchors * 16 / record["median_step_s"]
        if device.type == "cuda":
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        results[backend] = record
        print(json.dumps({backend: record}), flush=True)
        del model, features, step  # freed before the next backend's peak is measured
    summary = {"benchmark": "flex_probe", "shape": args.shape, "device": str(device), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "batch": batch, "context": context, "anchors": anchors,
               "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"flex_probe_{args.shape}_{device.type}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
