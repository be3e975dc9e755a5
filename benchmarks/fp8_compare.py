"""fp8 vs bf16 features on the same data and the same training steps (README "fp8 features").

Extracts one conversation slice twice (--feature-dtype bf16 and fp8), trains the same drafter on each with the
same flags and seed, and writes bytes/token, extraction and training throughput and the held-out offline
acceptance length of both to a JSON file. Defaults fit 2 CPU cores (~25 minutes); on a GPU raise the sizes.

    python benchmarks/fp8_compare.py --out benchmarks/results/fp8_vs_bf16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dflash(*args: str) -> float:
    started = time.time()
    subprocess.run([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, check=True)
    return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="Conversations (default: ShareGPT, as dflash extract).")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=448)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--train-flags", default="--draft-layers 1 --max-anchors 16 --batch-tokens 2048 --lr 3e-3 "
                        "--eval-every 100 --eval-sequences 8 --checkpoint-every 0 --num-workers 1")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash_fp8_compare"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result: dict[str, object] = {"samples": args.samples, "max_length": args.max_length, "steps": args.steps,
                                 "train_flags": args.train_flags}
    for dtype in ("bf16", "fp8"):
        cache, run = args.work / f"cache_{dtype}", args.work / f"run_{dtype}"
        data = ["--data", args.data] if args.data else []
        seconds = dflash("extract", *data, "--out", str(cache), "--max-samples", str(args.samples), "--max-length",
                         str(args.max_length), "--workers", str(args.workers), "--feature-dtype", dtype)
        manifest = json.loads((cache / "manifest.json").read_text())
        done = [e for e in manifest["shards"].values() if e["status"] == "done"]
        tokens = sum(e["tokens"] for e in done)
        extract_seconds = sum(e["seconds"] for e in done) / max(1, len(done))  # shards run in parallel
        train_seconds = dflash("train", "--cache", str(cache), "--out", str(run), "--max-steps", str(args.steps),
                               *args.train_flags.split())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if "eval/tau_walk" in r]
        steps = [r for r in records if "loss" in r]
        result[dtype] = {
            "tokens": tokens,
            "feature_bytes_per_token": sum(e["bytes"] for e in done) / tokens,
            "extract_command_s": round(seconds, 1),
            "extract_tokens_per_s_per_worker": round(tokens / len(done) / extract_seconds, 1),
            "train_command_s": round(train_seconds, 1),
            "train_s_per_step": round((steps[-1]["elapsed_s"] - steps[9]["elapsed_s"]) / (len(steps) - 10), 4),
            "final_loss_mean_last_20": sum(r["loss"] for r in steps[-20:]) / 20,
            "tau_walk_by_step": {r["step"]: r["eval/tau_walk"] for r in evals},
            "tau_random_by_step": {r["step"]: r["eval/tau_random_anchors"] for r in evals},
        }
        print(json.dumps(result[dtype]), flush=True)
    bf16, fp8 = result["bf16"], result["fp8"]  # type: ignore[index]
    last = max(bf16["tau_walk_by_step"])
    result["tau_ratio_fp8_over_bf16"] = fp8["tau_walk_by_step"][last] / bf16["tau_walk_by_step"][last]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
