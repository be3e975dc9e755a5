"""Size a dflash run: cache bytes (bf16 / fp8), extraction and training H200 GPU-hours, from the measured rates.

Measured inputs (read from --results, nothing else is measured here):
  extract_qwen3-8b-random_cuda.json   one H200, Qwen3-8B-shaped target, 5 captured layers [1, 9, 17, 25, 33]:
                                      capture-only tokens/s (compute rate) and dflash's sustained feature write
                                      rate (the bound of that run: the local disk)
  train_qwen3-8b_<attention>_cuda.json one H200, Qwen3-8B-shaped drafter (5 layers, hidden 4096), block 16, 512
                                      anchors, length 3072, batch 4, fed by the cache loader: samples/s
  h200_headline/inspect_bf16.json     the real SmolLM2 cache: mean sample length and loss-token fraction of
                                      regenerated ShareGPT first turns (the default data profile)

Models (everything for other targets is extrapolated from the Qwen3-8B-shaped measurements):
  cache bytes    = tokens * (feature bytes/token + 5) + samples * 16 + 4 * V * H
                   feature bytes/token: bf16 2*L*H; fp8 L*H + 4*L (e4m3 values + one float32 scale per layer);
                   +5 = input_ids int32 + loss_mask uint8; 16 = offsets + sample_index int64;
                   4*V*H = target/embeddings.safetensors (embed_tokens + lm_head, bf16)
  extraction     tokens/s = min(compute, write):
                   compute = measured capture tokens/s * F_ref / F, F = 2 * (last captured layer + 1) * P_layer
                   write   = measured dflash write bytes/s / feature bytes per token
  training       FLOPs/sample = 6 * n_draft * P_layer * a * B          (draft layers, fwd + bwd, the sample's own
                                                                        anchors: blocks are packed, no padding)
                              + 4 * V * H * a * (B - 1)                (frozen LM head on the block tokens:
                                                                        forward + input gradient)
                              + 4 * L * H * H * S                      (fc over the context: fwd + weight grad)
                   a = min(A, n, max(1, ceil(d * n))), n = max(0, r*S - 1) anchor candidates, d = --anchor-density
                   (d = None: every candidate up to the cap A, the reference's rule and the benchmark's shape)
                   seconds = samples * FLOPs/sample / E, E = FLOPs/sample of the benchmarked shape * its samples/s
                   The benchmark (3,072-token sequences, 512 anchors) has no padding under either layout, so E holds
                   for packed batches as far as the per-token work is the same; short packed samples pay more for
                   attention and per-sequence overhead than this model counts (to be measured on the H200).
  P_layer = (params - embedding params) / num_layers; the drafter's layers have the shape of the target's layers.

Usage:
  .venv/bin/python benchmarks/sizing.py                         # the default table (markdown on stdout)
  .venv/bin/python benchmarks/sizing.py --out table.md          # ... also written to a file
  .venv/bin/python benchmarks/sizing.py --name mine --hidden 5120 --layers 40 --params 14.8e9 --vocab 151936 \
      --tokens 300M 2B                                          # a custom target
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash.shared.feature_codecs import codec
from dflash.shared.target_layers import default_layer_ids
from dflash.stage2_train.options import DEFAULT_ANCHOR_DENSITY, DEFAULT_MAX_ANCHORS

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
MAX_ANCHORS = DEFAULT_MAX_ANCHORS  # the trainer's defaults (A and D); the benchmark's own rule is 512, every candidate
CAPTURED_LAYERS = 5
TOKEN_ARRAY_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8, per token
SAMPLE_ARRAY_BYTES = 8 + 8  # offsets + sample_index int64, per sample (sample_id strings not counted)
RECIPE_SAMPLES = 800_000  # the reference DFlash recipe for Qwen3-8B: 800K samples, max length 3072
RECIPE_LENGTH = 3072


@dataclass(frozen=True)
class Target:
    name: str
    hidden: int
    layers: int
    vocab: int
    params: float  # total, embeddings included (tied embeddings counted once)
    tied: bool = False

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def layer_params(self) -> float:
        return (self.params - self.embedding_params) / self.layers


def decoder_params(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                   vocab: int, tied: bool) -> float:
    """Parameter count of a Llama / Qwen3 decoder (no biases; norms ignored: < 0.01 %)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    return layers * (attention + mlp) + vocab * hidden * (1 if tied else 2)


def _public(name: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
            vocab: int, tied: bool) -> Target:
    params = decoder_params(hidden, layers, intermediate, heads, kv_heads, head_dim, vocab, tied)
    return Target(name, hidden, layers, vocab, params, tied)


# From the models' public config.json files on the Hugging Face Hub (hidden_size, num_hidden_layers,
# intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size, tie_word_embeddings).
KNOWN_TARGETS: dict[str, Target] = {t.name: t for t in (
    _public("Qwen3-1.7B", 2048, 28, 6144, 16, 8, 128, 151936, True),
    _public("Qwen3-8B", 4096, 36, 12288, 32, 8, 128, 151936, False),
    _public("Llama-3.1-8B", 4096, 32, 14336, 32, 8, 128, 128256, False),
    _public("Qwen3-32B", 5120, 64, 25600, 64, 8, 128, 151936, False),
    _public("Llama-3.3-70B", 8192, 80, 28672, 64, 8, 128, 128256, False),
)}
REFERENCE = KNOWN_TARGETS["Qwen3-8B"]  # the shape both GPU benchmarks measured
SMOLLM2 = _public("SmolLM2-135M", 576, 30, 1536, 9, 3, 64, 49152, True)  # the real target of h200_headline


@dataclass(frozen=True)
class Data:
    label: str
    tokens: float
    mean_length: float  # tokens per sample
    loss_fraction: float  # share of tokens with loss_mask = 1 (assistant tokens)

    @property
    def samples(self) -> float:
        return self.tokens / self.mean_length


@dataclass(frozen=True)
class Rates:
    """The measured inputs, read from the result files."""
    capture_tok_s: float  # Qwen3-8B-shaped capture, nothing stored (compute rate)
    dflash_tok_s: float  # full dflash extract of the same batches
    write_bytes_s: float  # features written per second by dflash in that run
    extract_layer_ids: tuple[int, ...]
    train_samples_s: float
    train_length: int
    train_prompt: int  # leading prompt tokens (loss_mask 0) of each benchmark sequence
    train_anchors: int
    train_block: int
    train_trainable: int
    train_attention: str
    profile_mean_length: float
    profile_loss_fraction: float


def load_rates(results: Path, attention: str = "flex", fed_from: str = "loader") -> Rates:
    extract = json.loads((results / "extract_qwen3-8b-random_cuda.json").read_text())
    runs = extract["runs"]
    train = json.loads((results / f"train_qwen3-8b_{attention}_cuda.json").read_text())
    # inspect.json holds `dflash inspect --json` output followed by a line the pipeline script appended
    inspect, _ = json.JSONDecoder().raw_decode((results / "h200_headline" / "inspect_bf16.json").read_text())
    mean = lambda key: sum(run[key] for run in runs) / len(runs)  # noqa: E731
    return Rates(
        capture_tok_s=mean("capture_only_tok_s"),
        dflash_tok_s=mean("dflash_tok_s"),
        write_bytes_s=mean("dflash_write_gb_s") * 1e9,
        extract_layer_ids=tuple(extract["layer_ids"]),
        train_samples_s=train["results"][fed_from]["samples_per_s"],
        train_length=train["length"],
        train_prompt=64,  # benchmarks/bench_train.py build_cache: mask[:64] = 0
        train_anchors=train["anchors"],
        train_block=train["block_size"],
        train_trainable=train["trainable_params"],
        train_attention=attention,
        profile_mean_length=inspect["tokens"] / inspect["samples"],
        profile_loss_fraction=inspect["loss_tokens"] / inspect["tokens"],
    )


# ------------------------------------------------------------------------------------------------ formulas

def feature_bytes_per_token(target: Target, dtype: str, captured: int = CAPTURED_LAYERS) -> int:
    """The cache's bytes per token for the features (the codec's own figure: bf16 2*L*H, fp8 L*H + 4*L)."""
    return codec(dtype).stored_row_bytes(captured * target.hidden, captured)


def cache_bytes(target: Target, data: Data, dtype: str, captured: int = CAPTURED_LAYERS) -> float:
    per_token = feature_bytes_per_token(target, dtype, captured) + TOKEN_ARRAY_BYTES
    return data.tokens * per_token + data.samples * SAMPLE_ARRAY_BYTES + 4 * target.vocab * target.hidden


def capture_flops_per_token(target: Target, layer_ids: list[int] | tuple[int, ...]) -> float:
    """2 * params of the layers the capture runs (0 .. deepest captured layer); no final norm, no LM head."""
    return 2 * (max(layer_ids) + 1) * target.layer_params


def extract_tok_s(target: Target, dtype: str, rates: Rates, captured: int = CAPTURED_LAYERS,
                  write_bytes_s: float | None = None) -> float:
    layer_ids = default_layer_ids(target.layers, captured)
    efficiency = rates.capture_tok_s * capture_flops_per_token(REFERENCE, rates.extract_layer_ids)  # FLOP/s
    compute = efficiency / capture_flops_per_token(target, layer_ids)
    write = (write_bytes_s or rates.write_bytes_s) / feature_bytes_per_token(target, dtype, captured)
    return min(compute, write)


def anchors_per_sample(length: float, loss_fraction: float, density: float | None = DEFAULT_ANCHOR_DENSITY,
                       max_anchors: int = MAX_ANCHORS) -> float:
    """Blocks a sample of this length trains per epoch (`epoch_plan.AnchorRule.count` on its mean candidate count)."""
    candidates = max(0.0, loss_fraction * length - 1)
    wanted = candidates if density is None else max(1.0, math.ceil(density * candidates - 1e-9))
    return min(wanted, candidates, max_anchors)


def train_flops_per_sample(target: Target, length: float, loss_fraction: float, draft_layers: int = CAPTURED_LAYERS,
                           captured: int = CAPTURED_LAYERS, anchors: int = MAX_ANCHORS, block: int = BLOCK_SIZE,
                           density: float | None = DEFAULT_ANCHOR_DENSITY) -> float:
    drawn = anchors_per_sample(length, loss_fraction, density, anchors)
    layers = 6 * draft_layers * target.layer_params * drawn * block  # packed: only the drawn blocks are computed
    head = 4 * target.vocab * target.hidden * drawn * (block - 1)
    fc = 4 * captured * target.hidden * target.hidden * length
    return layers + head + fc


def train_efficiency(rates: Rates) -> float:
    """Training FLOP/s of the benchmarked shape under this script's FLOP model (the benchmark draws every
    candidate up to its anchor count: 512 of 3,007)."""
    loss_fraction = (rates.train_length - rates.train_prompt) / rates.train_length
    per_sample = train_flops_per_sample(REFERENCE, rates.train_length, loss_fraction, anchors=rates.train_anchors,
                                        block=rates.train_block, density=None)
    return per_sample * rates.train_samples_s


def train_seconds(target: Target, data: Data, rates: Rates, draft_layers: int = CAPTURED_LAYERS,
                  captured: int = CAPTURED_LAYERS, anchors: int = MAX_ANCHORS, block: int = BLOCK_SIZE,
                  density: float | None = DEFAULT_ANCHOR_DENSITY) -> float:
    per_sample = train_flops_per_sample(target, data.mean_length, data.loss_fraction, draft_layers, captured,
                                        anchors, block, density)
    return data.samples * per_sample / train_efficiency(rates)


def drafter_trainable(target: Target, draft_layers: int = CAPTURED_LAYERS, captured: int = CAPTURED_LAYERS) -> float:
    return draft_layers * target.layer_params + captured * target.hidden * target.hidden


@dataclass(frozen=True)
class Row:
    target: Target
    data: Data
    trainable: float
    bytes_bf16: float
    bytes_fp8: float
    extract_h_bf16: float
    extract_h_fp8: float
    train_h: float
    read_bytes_s: float  # feature bytes the trainer reads per second (bf16 cache), per GPU


def size(target: Target, data: Data, rates: Rates, draft_layers: int = CAPTURED_LAYERS,
         captured: int = CAPTURED_LAYERS, anchors: int = MAX_ANCHORS, block: int = BLOCK_SIZE,
         write_bytes_s: float | None = None, density: float | None = DEFAULT_ANCHOR_DENSITY) -> Row:
    train_s = train_seconds(target, data, rates, draft_layers, captured, anchors, block, density)
    return Row(
        target=target, data=data, trainable=drafter_trainable(target, draft_layers, captured),
        bytes_bf16=cache_bytes(target, data, "bf16", captured), bytes_fp8=cache_bytes(target, data, "fp8", captured),
        extract_h_bf16=data.tokens / extract_tok_s(target, "bf16", rates, captured, write_bytes_s) / 3600,
        extract_h_fp8=data.tokens / extract_tok_s(target, "fp8", rates, captured, write_bytes_s) / 3600,
        train_h=train_s / 3600,
        read_bytes_s=data.tokens * feature_bytes_per_token(target, "bf16", captured) / train_s,
    )


# ------------------------------------------------------------------------------------------------ output

def _si(value: float, unit: str = "") -> str:
    """Decimal prefixes; counts use K / M / B, byte quantities k / M / G / T (10^3 steps)."""
    for factor, count_prefix, unit_prefix in ((1e12, "T", "T"), (1e9, "B", "G"), (1e6, "M", "M"), (1e3, "K", "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit_prefix}{unit}" if unit else f"{value / factor:.3g}{count_prefix}"
    return f"{value:.3g} {unit}".strip()


def _bytes(value: float) -> str:
    return _si(value, "B")


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[Row]) -> str:
    head = ("| target | params | drafter trainable | data | tokens | samples | cache bf16 | cache fp8 "
            "| extract H200-h bf16 | extract H200-h fp8 | train H200-h / epoch | train read / GPU |")
    lines = [head, "|" + "---|" * 12]
    for row in rows:
        t, d = row.target, row.data
        lines.append(
            f"| {t.name} | {_si(t.params)} | {_si(row.trainable)} | {d.label} | {_si(d.tokens)} | {_si(d.samples)} "
            f"| {_bytes(row.bytes_bf16)} | {_bytes(row.bytes_fp8)} | {_hours(row.extract_h_bf16)} "
            f"| {_hours(row.extract_h_fp8)} | {_hours(row.train_h)} | {_si(row.read_bytes_s, 'B/s')} |")
    return "\n".join(lines)


def headline_extract_check(rates: Rates, results: Path) -> tuple[float, float] | None:
    """(measured, predicted) extraction tokens/s of the real SmolLM2-135M run on the H200 (time inside the shard,
    from h200_headline/extract_bf16.log), or None when the log is missing: the model's error on a tiny target."""
    import re

    log = results / "h200_headline" / "extract_bf16.log"
    if not log.exists():
        return None
    match = re.search(r"shard \d+ done: \d+ samples, (\d+) tokens, .*?([\d.]+) s$", log.read_text(), re.M)
    if not match:
        return None
    measured = int(match.group(1)) / float(match.group(2))
    return measured, extract_tok_s(SMOLLM2, "bf16", rates)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(path)


def measured_summary(rates: Rates, results: Path) -> str:
    ref = REFERENCE
    ref_bytes = feature_bytes_per_token(ref, "bf16")
    ref_flops = capture_flops_per_token(ref, rates.extract_layer_ids)
    block_tok_s = rates.train_samples_s * rates.train_anchors * rates.train_block
    check = headline_extract_check(rates, results)
    return "\n".join([
        f"Measured (one H200; from {_shown(results)}):",
        f"- extraction, Qwen3-8B-shaped, layers {list(rates.extract_layer_ids)}: dflash {rates.dflash_tok_s:,.0f} tok/s"
        f" (write-bound: {rates.write_bytes_s / 1e9:.3f} GB/s of features at {ref_bytes:,} B/token); capture only"
        f" {rates.capture_tok_s:,.0f} tok/s = {rates.capture_tok_s * ref_flops / 1e12:.0f} TFLOP/s at"
        f" 2 x {ref_flops / 2e9:.2f}B params per token",
        f"- training ({rates.train_attention}, cache loader), Qwen3-8B-shaped drafter"
        f" ({rates.train_trainable / 1e9:.3f}B trainable), length {rates.train_length}, {rates.train_anchors} anchors"
        f" x block {rates.train_block}: {rates.train_samples_s:.3f} samples/s = {block_tok_s:,.0f} block tok/s"
        f" = {train_efficiency(rates) / 1e12:.0f} TFLOP/s under this script's FLOP model",
        f"- data \"profile\" (h200_headline cache: ShareGPT first turns, answers regenerated, <= 512 new tokens):"
        f" mean {rates.profile_mean_length:.0f} tokens/sample, {rates.profile_loss_fraction:.1%} loss tokens;"
        f" \"recipe\": {RECIPE_SAMPLES:,} samples all at {RECIPE_LENGTH} tokens (the benchmarked training shape;"
        " an upper bound)",
        "Everything else is extrapolated (see the module docstring for the formulas).",
    ] + ([] if check is None else [
        f"Check on the one other target measured on the H200 (SmolLM2-135M, h200_headline/extract_bf16.log, time inside"
        f" the shard): measured {check[0]:,.0f} tok/s, this model predicts {check[1]:,.0f} tok/s (tiny targets are"
        " bound by per-batch overhead, which the model does not have)."]))


def parse_count(text: str) -> float:
    """'100M', '1B', '2.5e9', '800K' -> float."""
    suffixes = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    text = text.strip().replace("_", "").replace(",", "")
    if text and text[-1].upper() in suffixes:
        return float(text[:-1]) * suffixes[text[-1].upper()]
    return float(text)


def default_data(rates: Rates, token_counts: list[float] | None = None, recipe: bool = True,
                 mean_length: float | None = None, loss_fraction: float | None = None) -> list[Data]:
    length = mean_length or rates.profile_mean_length
    fraction = loss_fraction or rates.profile_loss_fraction
    counts = token_counts if token_counts is not None else [100e6, 1e9]
    data = [Data("profile", count, length, fraction) for count in counts]
    if recipe:
        bench_fraction = (rates.train_length - rates.train_prompt) / rates.train_length
        data.append(Data(f"recipe {_si(RECIPE_SAMPLES)} x {RECIPE_LENGTH}", RECIPE_SAMPLES * RECIPE_LENGTH,
                         RECIPE_LENGTH, bench_fraction))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the measured result files")
    parser.add_argument("--out", type=Path, help="also write the markdown (table + measured inputs) here")
    parser.add_argument("--targets", nargs="+", choices=sorted(KNOWN_TARGETS), help="known targets to list")
    parser.add_argument("--name", default="custom", help="name of a custom target")
    parser.add_argument("--hidden", type=int, help="custom target: hidden size")
    parser.add_argument("--layers", type=int, help="custom target: number of decoder layers")
    parser.add_argument("--params", type=parse_count, help="custom target: total parameters (e.g. 14.8e9 or 14.8B)")
    parser.add_argument("--vocab", type=int, help="custom target: vocabulary size")
    parser.add_argument("--tied", action="store_true", help="custom target: embeddings tied with the LM head")
    parser.add_argument("--tokens", nargs="+", type=parse_count, help="data sizes in tokens (default 100M 1B)")
    parser.add_argument("--no-recipe", action="store_true", help="leave out the 800K x 3072 reference-recipe row")
    parser.add_argument("--mean-length", type=float, help="tokens per sample (default: the measured profile)")
    parser.add_argument("--loss-fraction", type=float, help="assistant-token share (default: the measured profile)")
    parser.add_argument("--captured-layers", type=int, default=CAPTURED_LAYERS, help="L (default 5)")
    parser.add_argument("--draft-layers", type=int, help="draft layers (default: L)")
    parser.add_argument("--max-anchors", type=int, default=MAX_ANCHORS, help="anchor cap per sample (A)")
    parser.add_argument("--anchor-density", type=float, default=DEFAULT_ANCHOR_DENSITY,
                        help="anchors per candidate position (d; 0 = every candidate up to the cap)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--attention", choices=("flex", "sdpa"), default="flex", help="which training run to scale")
    parser.add_argument("--write-gbps", type=float, help="feature write rate per GPU in GB/s (default: measured)")
    args = parser.parse_args(argv)

    custom = [args.hidden, args.layers, args.params, args.vocab]
    if any(value is not None for value in custom) and not all(value is not None for value in custom):
        parser.error("a custom target needs all of --hidden, --layers, --params and --vocab")
    if args.hidden is not None:
        targets = [Target(args.name, args.hidden, args.layers, args.vocab, args.params, args.tied)]
    else:
        targets = [KNOWN_TARGETS[name] for name in (args.targets or KNOWN_TARGETS)]
    if any(t.layer_params <= 0 for t in targets):
        parser.error("--params must exceed the embedding parameters (vocab x hidden, x2 unless --tied)")
    rates = load_rates(args.results, args.attention)
    data = default_data(rates, args.tokens, recipe=not args.no_recipe and args.tokens is None,
                        mean_length=args.mean_length, loss_fraction=args.loss_fraction)
    draft_layers = args.draft_layers or args.captured_layers
    write = args.write_gbps * 1e9 if args.write_gbps else None
    density = args.anchor_density or None
    rows = [size(t, d, rates, draft_layers, args.captured_layers, args.max_anchors, args.block_size, write, density)
            for t in targets for d in data]
    text = markdown(rows) + "\n\n" + measured_summary(rates, args.results) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
