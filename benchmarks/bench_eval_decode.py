"""Decode speed of `dflash eval`'s loop: the dynamic path (DynamicCache, eager forwards) against the fast path
(static KV caches, fixed-shape forwards replayed from CUDA graphs), plain and speculative decoding alike.

Recipe (the GPU machine, one H100; about 4 minutes, most of it the dynamic path of part a):

    python benchmarks/bench_eval_decode.py --out benchmarks/results/eval_decode_h100 [--draft RUN/export]

(a) ``smollm2``: SmolLM2-135M-Instruct (the embedded default target, bf16) with the drafter export --draft, or
    without one a random-weight drafter of the shape `dflash train` builds by default (speed only: its tau is about
    1). --prompts MT-Bench first turns x --new-tokens tokens (no stop token, so every run emits them all), each
    prompt decoded plainly and speculatively on both paths: tokens/s, tau, the fast path's speedup over the dynamic
    one, the speculative speedup over plain decoding of the same path, and whether the tokens of the two paths and
    of plain vs speculative decoding agree (bf16: the paths' kernels differ, so a near-tie may flip a token).
(b) ``qwen3-8b``: a Qwen3-8B-shaped random-weight target (bf16; speed does not depend on weight values) with a
    5-layer drafter of its shape (block 16), a random prompt of --context tokens. Measured on the fast path: one
    verify forward of a block, one plain decode step (each with the one read-back its loop does), one drafter block
    forward, median over --repeats; then the loops themselves over --qwen-new-tokens tokens (time per step). The
    speedup the loop would give at tau 3, 4, 6 is computed from these measured step times:
    forwards: tau * t_decode / (t_verify + t_draft); loop: tau * t_plain_step / t_speculative_step (its measured
    step at tau about 1 includes the loop's own overhead).

Warm-up first: every path decodes the first prompt (graphs captured, kernels chosen) before the timed runs, and the
static buffers are sized for the longest prompt, so compile/capture time stays out of the timed window. Results:
OUT/bench_eval_decode.json (and the table on stdout).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_extract import QWEN3_8B, build_qwen3_random  # noqa: E402

from dflash.shared.target_layers import default_layer_ids  # noqa: E402
from dflash.stage1_extract.supervisor import ExtractOptions  # noqa: E402
from dflash.stage2_train import modeling_dflash as loop  # noqa: E402
from dflash.stage2_train.draft_config import config_from_target  # noqa: E402
from dflash.stage2_train.options import DEFAULT_BLOCK_SIZE  # noqa: E402
from dflash.stage2_train.speculative import first_difference, greedy_generate  # noqa: E402
from dflash.stage2_train.target_parts import scaled_embedding  # noqa: E402

PATHS = ("dynamic", "static")  # "static" = the fast path (CUDA graphs on a GPU)
TAUS = (3.0, 4.0, 6.0)
DRAFT_LAYERS = ExtractOptions.draft_layers  # `dflash extract`'s default: 5 captured layers, 5 drafter layers


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_drafter(target: torch.nn.Module, mask_token_id: int, device: torch.device) -> loop.DFlashDraftModel:
    """A random-weight DFlash drafter of `dflash train`'s default shape for this target: DRAFT_LAYERS layers over
    the default captured layers, block DEFAULT_BLOCK_SIZE."""
    config = target.config.get_text_config()
    layer_ids = default_layer_ids(int(config.num_hidden_layers), DRAFT_LAYERS)
    draft_config = config_from_target(config.to_dict(), layer_ids, DRAFT_LAYERS, DEFAULT_BLOCK_SIZE, mask_token_id)
    torch.manual_seed(0)
    with device:
        draft = loop.drafter_for(draft_config)
    return draft.to(next(target.parameters()).dtype).eval()


def summary(results: list[loop.SpecResult]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    steps = sum(r.steps for r in results)
    accepted = [a for r in results for a in r.accepted]
    return {"tokens": tokens, "seconds": seconds, "steps": steps,
            "tokens_per_second": tokens / seconds if seconds else float("nan"),
            "seconds_per_step": seconds / steps if steps else float("nan"),
            "tau": sum(a + 1 for a in accepted) / len(accepted) if accepted else float("nan"),
            "decode": sorted({r.decode for r in results})}


def decode_all(target: torch.nn.Module, draft: loop.DFlashDraftModel, prompts: list[list[int]], new_tokens: int,
               capacity: int) -> dict[str, Any]:
    """Plain and speculative decoding of every prompt on both paths (after a warm-up of each on the first prompt)."""
    embed = scaled_embedding(target.get_input_embeddings().weight, draft.embed_scale)
    head = target.get_output_embeddings().weight
    layer_ids = draft.target_layer_ids

    def speculative(ids: list[int], n: int, path: str) -> loop.SpecResult:
        return loop.speculative_generate(target, draft, embed, head, ids, layer_ids, n, [], decode=path,
                                         capacity=capacity)

    def plain(ids: list[int], n: int, path: str) -> loop.SpecResult:
        return greedy_generate(target, ids, n, [], decode=path, capacity=capacity)

    runs: dict[str, dict[str, list[loop.SpecResult]]] = {p: {"plain": [], "dflash": []} for p in PATHS}
    warmup: dict[str, float] = {}
    for path in PATHS:
        started = time.perf_counter()
        speculative(prompts[0], 2 * DEFAULT_BLOCK_SIZE, path)
        plain(prompts[0], 8, path)
        sync()
        warmup[path] = time.perf_counter() - started
    for ids in prompts:
        for path in PATHS:
            runs[path]["plain"].append(plain(ids, new_tokens, path))
            runs[path]["dflash"].append(speculative(ids, new_tokens, path))
    out: dict[str, Any] = {"warmup_seconds": warmup}
    for path in PATHS:
        plain_s, spec_s = summary(runs[path]["plain"]), summary(runs[path]["dflash"])
        lossless = [first_difference(p.tokens, s.tokens) for p, s in zip(runs[path]["plain"], runs[path]["dflash"])]
        out[path] = {"plain": plain_s, "dflash": spec_s,
                     "speedup": spec_s["tokens_per_second"] / plain_s["tokens_per_second"],
                     "speculative_equals_plain": sum(d is None for d in lossless),
                     "first_differences": lossless,
                     "projected_speedup": {str(tau): tau * plain_s["seconds_per_step"] / spec_s["seconds_per_step"]
                                           for tau in TAUS}}
    out["fast_over_dynamic"] = {method: out["static"][method]["tokens_per_second"]
                                / out["dynamic"][method]["tokens_per_second"] for method in ("plain", "dflash")}
    out["paths_agree"] = {method: sum(a.tokens == b.tokens for a, b in zip(runs["dynamic"][method],
                                                                           runs["static"][method]))
                          for method in ("plain", "dflash")}
    out["prompts"] = len(prompts)
    out["new_tokens"] = new_tokens
    return out


def bench_smollm2(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target
    from dflash.stage2_train.evaluate import load_prompts, tokenize_prompt
    from dflash.stage2_train.export import load_draft

    resolved = resolve_target(None)
    target = load_target_model(resolved.load_path, str(device), torch.bfloat16).eval()
    tokenizer = load_tokenizer(resolved.load_path)
    if args.draft:
        draft = load_draft(Path(args.draft)).to(device=device, dtype=torch.bfloat16).eval()
        drafter_name = str(args.draft)
    else:
        draft = random_drafter(target, len(tokenizer) - 1, device)
        drafter_name = f"random weights, {DRAFT_LAYERS} layers, block {DEFAULT_BLOCK_SIZE} (speed only)"
    prompts = [tokenize_prompt(tokenizer, p.messages) for p in load_prompts("mtbench", args.prompts)]
    capacity = max(map(len, prompts)) + args.new_tokens + draft.block_size
    result = decode_all(target, draft, prompts, args.new_tokens, capacity)
    return {"target": resolved.display_name, "drafter": drafter_name, "block_size": draft.block_size,
            "draft_layers": int(draft.config.num_hidden_layers), **result}


def median_seconds(step: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_qwen3(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    target = build_qwen3_random(device)
    draft = random_drafter(target, QWEN3_8B["vocab_size"] - 1, device)
    block, layer_ids = draft.block_size, draft.target_layer_ids
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, QWEN3_8B["vocab_size"], (args.context,), generator=generator).tolist()
    capacity = args.context + args.qwen_new_tokens + block
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    forwards: dict[str, float] = {}
    with torch.inference_mode():
        verifier = loop.target_runner(target, layer_ids, capacity, "static")
        drafter = loop.draft_runner(draft, embed, head, 1.0, capacity, "static")
        with verifier.hooked():
            _, features = verifier.forward(prompt, 0, last_only=True)
            drafter.extend(features)
            block_ids = torch.tensor(prompt[:block], device=device)

            def verify() -> None:
                logits, _ = verifier.verify(block_ids, args.context)
                loop.verify_greedy(block_ids[1:], logits)  # the loop's one read-back
                verifier.rollback(args.context)

            def propose() -> None:
                drafter.draft_greedy(prompt[0], args.context)

            for step in (verify, propose):  # warm-up: capture
                step()
            forwards["verify_block"] = median_seconds(verify, args.repeats)
            forwards["draft_block"] = median_seconds(propose, args.repeats)
        decoder = loop.target_runner(target, (), capacity, "static")
        decoder.forward(prompt, 0, last_only=True)

        def decode_step() -> None:
            logits, _ = decoder.forward([prompt[1]], args.context, last_only=True)
            int(logits[-1].argmax())  # the plain loop's one read-back
            decoder.rollback(args.context)

        decode_step()
        forwards["decode_step"] = median_seconds(decode_step, args.repeats)
        paths = {"verify_block": verifier.path, "draft_block": "static+cuda-graphs" if drafter.graph_failure is None
                 else drafter.graph_failure, "decode_step": decoder.path}
    loops = decode_all(target, draft, [prompt], args.qwen_new_tokens, capacity)
    spec_step = forwards["verify_block"] + forwards["draft_block"]
    fast = loops["static"]
    return {
        "target": "Qwen3-8B-shaped, random weights (bf16)",
        "drafter": f"random weights, {DRAFT_LAYERS} layers, block {block}",
        "context": args.context,
        "forward_seconds": forwards,
        "forward_paths": paths,
        "verify_over_decode": forwards["verify_block"] / forwards["decode_step"],
        "loops": loops,
        "speedup_at_tau": [
            {"tau": tau,
             "from_forwards": tau * forwards["decode_step"] / spec_step,
             "from_loop_steps": tau * fast["plain"]["seconds_per_step"] / fast["dflash"]["seconds_per_step"]}
            for tau in TAUS],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_eval_decode.json")
    parser.add_argument("--part", choices=["all", "smollm2", "qwen3-8b"], default="all")
    parser.add_argument("--draft", type=Path, default=None, help="a drafter export for SmolLM2 (default: random)")
    parser.add_argument("--prompts", type=int, default=5, help="MT-Bench prompts (part a)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per prompt (part a)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of the Qwen3-8B-shaped target")
    parser.add_argument("--qwen-new-tokens", type=int, default=64, help="tokens of the Qwen3-8B-shaped loops")
    parser.add_argument("--repeats", type=int, default=50, help="timed repeats of each single forward")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }
    if args.part in ("all", "smollm2"):
        report["smollm2"] = bench_smollm2(args, device)
        print(json.dumps(report["smollm2"], indent=1, default=str)[:4000])
    if args.part in ("all", "qwen3-8b"):
        if "smollm2" in report:
            torch.cuda.empty_cache() if device.type == "cuda" else None
        report["qwen3_8b"] = bench_qwen3(args, device)
        for row in report["qwen3_8b"]["speedup_at_tau"]:
            print(f"tau {row['tau']}: speedup {row['from_forwards']:.2f}x (forwards), {row['from_loop_steps']:.2f}x "
                  "(loop steps)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_eval_decode.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
