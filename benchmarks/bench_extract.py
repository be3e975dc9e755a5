"""Extraction throughput: dflash's capture + cache write against a plain `output_hidden_states` forward.

Both run in the same process on the same batches (same token-budget plan), one after the other, after a warm-up
pass over the same shapes. Two setups:

  --target smollm2          the real SmolLM2-135M-Instruct over real ShareGPT conversations (CPU default)
  --target qwen3-8b-random  a Qwen3-8B-shaped model with random weights over random tokens (H200); speed does not
                            depend on weight values

"plain" = model(input_ids, attention_mask, output_hidden_states=True): every layer, the final norm and the LM head,
no storage. "dflash" = what `dflash extract` does per shard: forward stopped after the last captured layer, padding
dropped on the device, copy to pinned host memory on a side stream, and the writer thread writing whole zarr shards
to a store that is fsynced and published. The disk's own fsynced write rate is measured too, to tell which bound
dflash hits. Results: JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.shared.target_layers import default_layer_ids  # noqa: E402
from dflash.stage1_extract.conversations import TokenizedSample, load_conversations, tokenize_conversation  # noqa: E402
from dflash.stage1_extract.worker import ShardExtractor, WorkerConfig, plan_batches  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_qwen3_random(device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_8B, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def random_samples(total_tokens: int, low: int, high: int, vocab: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(0)
    samples, tokens = [], 0
    while tokens < total_tokens:
        length = int(rng.integers(low, high + 1))
        ids = rng.integers(0, vocab, size=length, dtype=np.int32)
        samples.append(TokenizedSample(index=len(samples), sample_id=str(len(samples)), input_ids=ids,
                                       loss_mask=np.ones(length, np.uint8), truncated=False))
        tokens += length
    return samples


def sharegpt_samples(tokenizer: object, count: int, max_length: int) -> list[TokenizedSample]:
    data = load_conversations(None, max_samples=count)
    samples = []
    for conversation in data.conversations:
        result = tokenize_conversation(tokenizer, conversation, max_length=max_length, stop_token_ids=[2])
        if not isinstance(result, str):
            samples.append(result)
    return samples


def disk_write_rate(folder: Path, size_bytes: int) -> float:
    """GB/s of a sequential write of incompressible data followed by fsync (the bound for the cache)."""
    block = np.random.default_rng(1).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    path = folder / "disk_probe.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < size_bytes:
            handle.write(block)
            written += len(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return written / seconds / 1e9


def plain_pass(model: torch.nn.Module, batches: list[list[TokenizedSample]], device: torch.device,
               pad_multiple: int) -> float:
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = -(-max(len(s.input_ids) for s in batch) // pad_multiple) * pad_multiple
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, sample in enumerate(batch):
                ids[row, : len(sample.input_ids)] = torch.from_numpy(sample.input_ids.astype(np.int64))
                mask[row, : len(sample.input_ids)] = 1
            output = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            del output
    sync(device)
    return time.perf_counter() - started


def capture_pass(extractor: ShardExtractor, batches: list[list[TokenizedSample]], device: torch.device) -> float:
    """Only the early-exit forward and the on-device padding removal: the compute floor of `dflash`."""
    sync(device)
    started = time.perf_counter()
    for batch in batches:
        width = -(-max(len(s.input_ids) for s in batch) // extractor.pad_multiple) * extractor.pad_multiple
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sample in enumerate(batch):
            ids[row, : len(sample.input_ids)] = torch.from_numpy(sample.input_ids.astype(np.int64))
            mask[row, : len(sample.input_ids)] = 1
        mask = mask.to(device)
        features = extractor.capture.decoder_features(ids.to(device), mask)
        del features
    sync(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["smollm2", "qwen3-8b-random"], default="smollm2")
    parser.add_argument("--tokens", type=int, default=None, help="total tokens per pass")
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="where the benchmark cache is written")
    parser.add_argument("--feature-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="How dflash stores the features (fp8: quantized on the device, half the bytes).")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target == "smollm2":
        from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target

        load_path = resolve_target(None).load_path
        model = load_target_model(load_path, str(device))
        tokenizer = load_tokenizer(load_path)
        samples = sharegpt_samples(tokenizer, count=10_000, max_length=1024)
        budget_tokens = args.tokens or (2_000_000 if device.type == "cuda" else 24_000)
    else:
        model = build_qwen3_random(device)
        tokenizer = "unused: samples are token ids already"
        load_path = "random"
        samples = random_samples(args.tokens or 200_000, 512, 3072, QWEN3_8B["vocab_size"])
        budget_tokens = args.tokens or 200_000
    kept, total = [], 0
    for sample in samples:
        if total >= budget_tokens:
            break
        kept.append(sample)
        total += len(sample.input_ids)
    samples = sorted(kept, key=lambda s: (-len(s.input_ids), s.index))
    num_layers = model.config.num_hidden_layers
    layer_ids = default_layer_ids(num_layers, 5)
    batch_tokens = args.batch_tokens or (32768 if device.type == "cuda" else 4096)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config = WorkerConfig(cache_dir=work, load_path=load_path, layer_ids=layer_ids, max_length=1 << 20,
                          overlength="truncate", batch_tokens=batch_tokens, stop_token_ids=[], log_file=work / "log",
                          feature_dtype=args.feature_dtype)
    extractor = ShardExtractor(config, device, report=lambda *a: None, model=model, tokenizer=tokenizer)
    lengths = [len(s.input_ids) for s in samples]
    batches = [[samples[i] for i in b] for b in plan_batches(lengths, batch_tokens, extractor.pad_multiple)]
    tokens = sum(lengths)
    print(f"{args.target} on {device}: {len(samples)} samples, {tokens} tokens, {len(batches)} batches, "
          f"layers {layer_ids}", flush=True)

    # Warm-up over every batch shape, both paths (first-time kernel selection / allocator growth).
    plain_pass(model, batches, device, extractor.pad_multiple)
    extractor.write_shard(0, samples, {}, time.time())
    shutil.rmtree(work / "shards", ignore_errors=True)

    results = []
    for repeat in range(2):
        plain_s = plain_pass(model, batches, device, extractor.pad_multiple)
        capture_s = capture_pass(extractor, batches, device)
        sync(device)
        started = time.perf_counter()
        stats = extractor.write_shard(repeat + 1, samples, {}, time.time())
        sync(device)
        dflash_s = time.perf_counter() - started
        results.append({"plain_s": plain_s, "capture_only_s": capture_s, "dflash_s": dflash_s,
                        "capture_only_tok_s": tokens / capture_s,
                        "plain_tok_s": tokens / plain_s, "dflash_tok_s": tokens / dflash_s,
                        "speedup": plain_s / dflash_s, "feature_bytes": stats["bytes"],
                        "dflash_write_gb_s": stats["bytes"] / dflash_s / 1e9})
        print(json.dumps(results[-1]), flush=True)
        shutil.rmtree(work / "shards", ignore_errors=True)
    disk_gb_s = disk_write_rate(work, 4 << 30 if device.type == "cuda" else 1 << 30)
    best = max(results, key=lambda r: r["dflash_tok_s"])
    summary = {
        "benchmark": "extract",
        "target": args.target,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "samples": len(samples),
        "tokens": tokens,
        "layer_ids": layer_ids,
        "feature_dim": extractor.feature_dim,
        "feature_dtype": args.feature_dtype,
        "batch_tokens": batch_tokens,
        "runs": results,
        "best_speedup_vs_plain": round(best["speedup"], 3),
        "disk_fsync_write_gb_s": round(disk_gb_s, 3),
        "dflash_write_fraction_of_disk": round(best["dflash_write_gb_s"] / disk_gb_s, 3),
    }
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.feature_dtype == "bf16" else f"_{args.feature_dtype}"
    name = f"extract_{args.target}_{device.type}{suffix}.json"
    (args.out / name).write_text(json.dumps(summary, indent=2) + "\n")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
