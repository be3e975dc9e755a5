"""Training throughput, MFU and time by phase of `dflash train`'s step, fed by the cache loader and from in-memory
tensors.

Real cache: `python benchmarks/bench_train.py --cache CACHE --train-flags "--batch-tokens 49152 --architecture
dflash2 [--compile]" [--name smollm2-real] --steps 20 --warmup 10 --profile 3`: the run `dflash train --cache CACHE
TRAIN_FLAGS` would set up (options parsed by the CLI itself, its defaults), its loader and micro-batches (the
memory plan's) and its step (`accumulate_gradients` + `update_weights`, each step's metrics record read one step
late, as the training loop reads it: `trainer.PendingRecord`). "loader" = those steps, "memory" = the
first micro-batch again and again; FLOPs as below, of the drafter of the cache's target (DFlash 2's dynamic
convolutions and path selector not counted). Results: train_NAME.json, NAME = MODEL-real_ARCHITECTURE_ATTENTION
[_compile]_DEVICE unless --name.

Both modes then time --steps more loader steps phase by phase, the device synchronised after each (so slower than
the timed step; the phases add up to it): waiting for the loader batch, the micro-batches' inputs
(`micro_batch_inputs`: host-to-device copy of the layout and labels the loader's workers built, or built there
with --inputs-in-main; feature decode), the drafter's forward (attention masks built in it), the objective,
DFlash 2's selector loss, backward, and `update_weights` (clip, AdamW, schedule, the step's metrics record, read at
once). --profile N profiles N in-memory steps (time by category, top kernels).

Random cache (the default):
A cache of random features (real cache format, written by the stage-1 writer) for a Qwen3-8B-shaped target:
5 captured layers x 4096, sequences of --length tokens whose first 64 are prompt; a 5-layer drafter of the target's
shape (1.05B trainable), block 16, up to 512 anchors per sequence. The same training run (`run_setup.setup_run`) runs both variants:
"loader" = micro-batches from `CacheBatches` through DataLoader workers (zarr reads in the workers), "memory" = the
first micro-batch kept on the GPU and reused. Speed does not depend on weight or feature values.

FLOPs are counted per micro-batch from the shapes (matmuls only, forward + backward):
  fc over every context token (forward + weight gradient, no gradient into the frozen features): 4·S·D·H
  per layer, x3 for forward + backward: q/o projections of the Q = A·Bk block tokens 2·2·H·Hq·Q; k/v projections
  of context and block tokens 2·2·H·Hkv·(S+Q); SwiGLU MLP 3·2·H·I·Q; attention scores and values
  2·2·Hq·(visible keys) per query, visible = anchor position + Bk (what the block mask lets through)
  LM head on supervised block tokens (forward + input gradient; the head is frozen): 2·2·H·V per token
MFU = counted FLOPs / step time / 989.5e12 (H200 dense bf16 peak); also reported against the measured 775e12.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.shared import cache_format as cf  # noqa: E402
from dflash.shared.feature_codecs import BF16  # noqa: E402
from dflash.stage1_extract.shard_writer import FeatureShardWriter  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="qwen3")
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
H200_PEAK = 989.5e12
H200_MEASURED = 775e12
LAYER_IDS = [1, 9, 17, 25, 33]  # the target layers the random cache holds (5 of the 36)
ANCHORS = 512  # anchors per sequence of the random cache's micro-batches
PROMPT_TOKENS = 64  # the first tokens of every random sequence are prompt (loss mask 0)
MASK_TOKEN_ID = 151669  # the mask token of Qwen3 drafters (the first id past its added tokens), modulo the vocabulary


def build_cache(root: Path, target: dict, samples: int, length: int, layer_ids: list[int], shards: int) -> None:
    from safetensors.torch import save_file

    hidden, feature_dim = target["hidden_size"], target["hidden_size"] * len(layer_ids)
    (root / cf.TARGET_DIR).mkdir(parents=True)
    (root / cf.TARGET_DIR / "config.json").write_text(json.dumps(target))
    record = {"stop_token_ids": [151645 % target["vocab_size"]], "embed_scale": 1.0, "model_type": "qwen3"}
    (root / cf.TARGET_DIR / cf.TARGET_RECORD_FILE).write_text(json.dumps(record))
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(target["vocab_size"], hidden, generator=generator) * 0.02).to(torch.bfloat16)
    save_file({"embed_tokens.weight": embed, "lm_head.weight": embed.clone()},
              str(root / cf.TARGET_DIR / cf.EMBEDDINGS_FILE))
    identity = {"target_source": "random", "target_hash": "random", "layer_ids": layer_ids, "hidden_size": hidden,
                "feature_dtype": "bf16", "tokenizer_hash": "none", "data_fingerprint": "random", "max_length": length,
                "overlength": "truncate", "num_shards": shards}
    manifest = cf.new_manifest(identity, {})
    rng = np.random.default_rng(0)
    rows = torch.randn(length, feature_dim, generator=generator).to(torch.bfloat16)
    per_shard = samples // shards
    for shard in range(shards):
        mask = np.ones(length, np.uint8)
        mask[:PROMPT_TOKENS] = 0
        token_arrays = {
            "input_ids": rng.integers(0, target["vocab_size"], per_shard * length).astype(np.int32),
            "loss_mask": np.tile(mask, per_shard), "offsets": np.arange(per_shard + 1, dtype=np.int64) * length,
            "sample_index": np.arange(per_shard) + shard * per_shard,
            "sample_ids": [str(i) for i in range(per_shard)],
        }
        writer = FeatureShardWriter(cf.shard_path(root, shard), feature_dim=feature_dim, token_arrays=token_arrays,
                                    attributes={}, codec=BF16)
        for _ in range(per_shard):
            writer.submit(rows)
        writer.close({})
        manifest["shards"][str(shard)] = {"status": "done", "samples": per_shard, "tokens": per_shard * length,
                                          "loss_tokens": int(token_arrays["loss_mask"].sum()), "skipped": {}}
    cf.write_json_atomic(root / cf.MANIFEST_FILE, manifest)


def random_options(work: Path, target: dict, samples: int, length: int, batch: int, workers: int, attention: str,
                   compile: bool):  # noqa: ANN201 - TrainOptions
    """The random-cache run: a cache of `samples` random sequences of `length` tokens written to work/cache, and
    the options that train on it with micro-batches of `batch` sequences with ANCHORS anchors each (every candidate
    up to the cap; the packed budget counts context and block tokens)."""
    from dflash.stage2_train.options import TrainOptions

    started = time.time()
    build_cache(work / "cache", target, samples, length, LAYER_IDS, shards=4)
    print(f"cache built in {time.time() - started:.1f} s", flush=True)
    return TrainOptions(cache=work / "cache", out=work / "run", max_steps=10**6, mask_token_id=MASK_TOKEN_ID % target[
        "vocab_size"], batch_tokens=batch * (length + ANCHORS * 16), anchor_density=1.0, max_anchors=ANCHORS,
        eval_fraction=0.0, eval_every=0, checkpoint_every=0, num_workers=workers, attention=attention,
        compile=compile, mixed_precision="bf16" if torch.cuda.is_available() else "no")


def throughput(flops: float, seconds: float, steps: int, block_tokens: float, sequences: int) -> dict:
    """The figures of `steps` timed steps that took `seconds` in all."""
    return {"step_s": seconds / steps, "tflops": flops / seconds / 1e12, "mfu_vs_peak": flops / seconds / H200_PEAK,
            "mfu_vs_measured": flops / seconds / H200_MEASURED, "block_tokens_per_s": block_tokens / seconds,
            "samples_per_s": sequences / seconds}


def step_flops(config, inputs: dict) -> float:  # type: ignore[no-untyped-def]
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hq, hkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layout = inputs.layout  # packed (attention_masks.PackedLayout)
    valid = layout.block_valid
    q_tokens = float(valid.sum()) * layout.block_size
    context = float(layout.context_len)  # the packed context axis (its bucket padding included: it is computed)
    visible = float(((layout.block_anchor + layout.block_size) * valid).sum()) * layout.block_size
    feature_dim = inputs.features.shape[-1]
    supervised = float((inputs.labels != -100).sum())
    vocab = config.vocab_size
    per_layer = 2 * 2 * h * hq * q_tokens + 2 * 2 * h * hkv * (context + q_tokens) + 3 * 2 * h * inter * q_tokens
    per_layer += 2 * 2 * hq * visible
    return 4 * context * feature_dim * h + 3 * layers * per_layer + 2 * 2 * h * vocab * supervised


# Where device time goes, by kernel name on CUDA or operator name on CPU (lower case, first match wins).
PROFILE_CATEGORIES = (
    ("attention", ("attention", "flex", "triton_tem", "fmha", "sdpa")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "gemm", "cutlass", "sm90_xmma", "nvjet")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("copies and casts", ("copy", "aten::to", "aten::cat", "cat_", "contiguous", "memcpy", "memset")),
    ("loss (log-softmax, gather)", ("log_softmax", "nll_loss", "logsumexp", "cross_entropy", "gather")),
    ("fused (compiled)", ("triton_",)),
    ("elementwise and reductions", ("elementwise", "reduce", "aten::")),
)


def profile_steps(step, steps: int, device: torch.device) -> tuple[dict, str]:  # noqa: ANN001
    """Profile ``steps`` calls of ``step()``: device (or, on CPU, operator) time by category, the share of the wall
    time the device was busy, and the top-30 table by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    events = prof.key_averages()
    on_device = device.type == "cuda"

    def self_time(event) -> float:  # noqa: ANN001 - microseconds
        if on_device:
            return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
        return float(event.self_cpu_time_total)

    def counted(event) -> bool:  # noqa: ANN001
        # On CUDA only the kernels themselves: operators (aten::mm) carry their kernels' time again, and host-side
        # records such as "Command Buffer Full" or annotated ranges (Optimizer.step#...) report device time too.
        if not on_device:
            return True
        kernel = event.device_type == torch.autograd.DeviceType.CUDA
        return kernel and not event.key.startswith(("aten::", "Optimizer.", "ProfilerStep")) and "#" not in event.key

    by_category: dict[str, float] = {}
    for event in filter(counted, events):
        name = event.key.lower()
        category = next((c for c, keys in PROFILE_CATEGORIES if any(k in name for k in keys)), "other")
        by_category[category] = by_category.get(category, 0.0) + self_time(event)
    total = sum(by_category.values())
    summary = {
        "profiled_steps": steps, "wall_s_per_step": wall / steps, "timed": "device kernels" if on_device else "cpu ops",
        "busy_fraction": total / 1e6 / wall if on_device else None,
        "share": {c: t / total for c, t in sorted(by_category.items(), key=lambda kv: -kv[1])},
    }
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    if on_device:  # where the GPU's time goes, then (above) where the host's goes
        table = events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70) + \
            "\n\nBy host (self CPU) time:\n" + table
    return summary, table


PHASES = ("loader wait", "inputs", "forward", "objective", "selector loss", "backward", "optimizer")


def real_options(cache: str, train_flags: str, out: Path):  # noqa: ANN201 - TrainOptions
    """TrainOptions of `dflash train --cache CACHE TRAIN_FLAGS`, parsed by the CLI's own command (its defaults)."""
    import click

    from dflash.shared.object_store import resolve_cache
    from dflash.stage2_train.cli import train_command
    from dflash.stage2_train.options import TrainOptions

    flags = [*shlex.split(train_flags), "--cache", cache, "--out", str(out), "--overwrite"]
    try:
        params = dict(train_command.make_context("train", flags).params)
    except (click.exceptions.ClickException, click.exceptions.Exit) as error:
        message = error.format_message() if isinstance(error, click.exceptions.ClickException) else "--help"
        sys.exit(f"--train-flags: {message}")
    params.pop("processes")
    params["cache"] = resolve_cache(cache, read_through=bool(params.pop("local_copy")))
    return TrainOptions(compile=params.pop("compile_"), **params)


def phased_steps(run, next_batches, to_micros, steps: int) -> dict:  # noqa: ANN001
    """`steps` training steps with the device synchronised after each phase: mean seconds per step of each phase
    (PHASES) and its share. The phases are timed back to back, so they add up to the phased step; the
    synchronisations make it slower than the unsynchronised step."""
    from dflash.stage2_train.loss import weight_sum
    from dflash.stage2_train.trainer import (PendingRecord, StepTally, add_selector_loss, block_objective,
                                             drafter_hidden, update_weights)

    accelerator, device, block_size = run.accelerator, run.device, run.options.block_size
    seconds = dict.fromkeys(PHASES, 0.0)
    clock = [0.0]
    micro_count = 0

    def lap(phase: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds[phase] += now - clock[0]
        clock[0] = now

    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        clock[0] = time.perf_counter()
        batches = next_batches()
        lap("loader wait")
        micros = to_micros(batches)
        micro_count += len(micros)
        total = accelerator.reduce(sum(weight_sum(m.labels, run.position_weights) for m in micros).detach().clone(),
                                   reduction="sum")
        lap("inputs")
        # What `accumulate_gradients` does, phase by phase (one process: no gradient synchronisation to skip).
        tally = StepTally.empty(block_size, device)
        for micro in micros:
            hidden = drafter_hidden(run, micro)
            lap("forward")
            loss, stats = block_objective(run, hidden, micro, total)
            lap("objective")
            loss, stats = add_selector_loss(run, hidden, micro, total, loss, stats)
            lap("selector loss")
            accelerator.backward(loss * run.world)
            lap("backward")
            tally.add(loss, stats, micro)
        PendingRecord(update_weights(run, tally)).settle()  # clip, AdamW, schedule, the record read
        lap("optimizer")
    step = sum(seconds.values()) / steps
    return {"steps": steps, "micro_batches_per_step": micro_count / steps, "phased_step_s": step,
            "phase_s": {phase: seconds[phase] / steps for phase in PHASES},
            "share": {phase: seconds[phase] / steps / step for phase in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=None,
                        help="train on this cache extracted by `dflash extract` instead of a random Qwen3-8B-shaped "
                             "one; the options are `dflash train`'s defaults and --train-flags")
    parser.add_argument("--train-flags", default="",
                        help="with --cache: `dflash train` flags (quoted), e.g. \"--batch-tokens 49152 "
                             "--architecture dflash2 --compile\"")
    parser.add_argument("--warmup", type=int, default=3,
                        help="with --cache: training steps on loader batches before timing (compilations for the "
                             "first shapes), after 3 steps on the first micro-batch")
    parser.add_argument("--name", default=None, help="name of the result files (default: from the model and flags)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on CPU")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--length", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--attention", default="auto", help="auto (flex on CUDA), flex, sdpa or eager")
    parser.add_argument("--compile", action="store_true", help="train with --compile (each decoder layer compiled)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile this many steps: time by category and the top kernels")
    parser.add_argument("--profile-source", choices=("memory", "loader"), default="memory",
                        help="profile steps on the first micro-batch again and again (memory), or on new loader "
                             "batches, their inputs built as in training (loader; with --cache)")
    parser.add_argument("--sdpa-backends", default=None, metavar="LIST",
                        help="restrict torch SDPA to these backends for the whole run (comma-separated: cudnn, "
                             "efficient, flash, math), e.g. to compare the grouped SDPA attention without cuDNN")
    parser.add_argument("--exact-windows", action="store_true",
                        help="grouped SDPA over the exact widest context window of each micro-batch (the code "
                             "before attention_masks.window_width rounded it up), to compare")
    parser.add_argument("--record-at-once", action="store_true",
                        help="with --cache: read each step's metrics record right after the step (the host waits "
                             "for the device every step, the loop before trainer.StepLog), to compare")
    parser.add_argument("--pageable-inputs", action="store_true",
                        help="copy the inputs built on the CPU to the GPU from pageable memory (the code before "
                             "trainer.to_device pinned them; such a copy may wait for the device), to compare")
    parser.add_argument("--inputs-in-main", action="store_true",
                        help="build each micro-batch's layout, labels, label positions and top-k rows in the main "
                             "process (the code before the loader's workers built them: "
                             "run_setup.STEP_INPUTS_IN_WORKERS), to compare")
    parser.add_argument("--features-on-compute-stream", action="store_true",
                        help="copy each micro-batch's stored features to the GPU on the compute stream, behind the "
                             "work queued there (the code before trainer.stored_features copied them on a side "
                             "stream), to compare (the memory plan is the same, so are the micro-batches)")
    parser.add_argument("--foreach-adamw", action="store_true",
                        help="AdamW's default (foreach) implementation on CUDA too (the code before "
                             "run_setup.FUSED_ADAMW), to compare")
    parser.add_argument("--small-loss-chunks", action="store_true",
                        help="the loss's chunks of 1,024 rows on CUDA too (the code before loss.chunk_rows sized "
                             "them by CUDA_CHUNK_BYTES), to compare")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    real = args.cache is not None
    if real and (args.tiny or args.attention != "auto" or args.compile):
        parser.error("with --cache, give --attention and --compile in --train-flags (and leave --tiny out)")
    if not real and args.samples < args.batch * (args.steps + 1):  # the loader variant reads a first batch, then --steps
        parser.error(f"--samples must be at least --batch x (--steps + 1) = {args.batch * (args.steps + 1)}")
    from dflash.stage2_train.loss import weight_sum
    from dflash.stage2_train.run_setup import setup_run
    from dflash.stage2_train.trainer import (PendingRecord, accumulate_gradients, forward_loss, micro_batch_inputs,
                                             micro_batches, step_batches, update_weights)

    import dflash.stage2_train.attention_masks as attention_masks
    import dflash.stage2_train.loss as loss_module
    import dflash.stage2_train.run_setup as run_setup_module
    import dflash.stage2_train.trainer as trainer_module

    # The step as it was before each change, to compare: module switches the code reads when it runs.
    if args.exact_windows:
        attention_masks.BUCKET_WINDOWS = False
    if args.pageable_inputs:
        trainer_module.PIN_INPUTS = False
    if args.features_on_compute_stream:
        trainer_module.COPY_FEATURES_ASIDE = False
    if args.small_loss_chunks:
        loss_module.CUDA_CHUNK_BYTES = 0
    if args.foreach_adamw:
        run_setup_module.FUSED_ADAMW = False
    if args.inputs_in_main:
        run_setup_module.STEP_INPUTS_IN_WORKERS = False
    if args.sdpa_backends:
        # Process-wide switches, set for the whole run (not `sdpa_kernel(...).__enter__()` on a temporary: its
        # generator is collected at once and restores every backend, which voided the first measurement).
        cuda = torch.backends.cuda
        switches = {"cudnn": cuda.enable_cudnn_sdp, "efficient": cuda.enable_mem_efficient_sdp,
                    "flash": cuda.enable_flash_sdp, "math": cuda.enable_math_sdp}
        chosen = {name.strip() for name in args.sdpa_backends.split(",")}
        if chosen - set(switches):
            parser.error(f"--sdpa-backends: unknown backend(s) {sorted(chosen - set(switches))} (choose from "
                         f"{', '.join(switches)})")
        for name, switch in switches.items():
            switch(name in chosen)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dflash-train-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    if real:
        options = real_options(args.cache, args.train_flags, work / "run")
        label = json.loads((Path(options.cache) / cf.MANIFEST_FILE).read_text())["identity"]["target_source"]
        label = f"{label.split(':')[-1].rstrip('/').split('/')[-1].lower()}-real_{options.architecture}"
    else:
        options = random_options(work, TINY if args.tiny else QWEN3_8B, args.samples, args.length, args.batch,
                                 args.workers, args.attention, args.compile)
        label = "tiny" if args.tiny else "qwen3-8b"
    run = setup_run(options)
    device = run.device
    params = sum(p.numel() for p in run.model.parameters())

    def run_step(micro) -> float:  # noqa: ANN001
        """One optimizer step on one micro-batch: with --cache the trainer's own, else the benchmark's historic
        step (no schedule, no metrics record)."""
        if real:
            return PendingRecord(update_weights(run, accumulate_gradients(run, [micro]))).settle()["loss"]
        total = run.accelerator.reduce(weight_sum(micro.labels, run.position_weights).detach().clone(), "sum")
        loss, _ = forward_loss(run, micro, total)
        run.accelerator.backward(loss)
        run.accelerator.clip_grad_norm_(run.model.parameters(), 1.0)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if real:  # the trainer's loader (prefetching, epoch after epoch) and its micro-batches (the memory plan's)
        steps = step_batches(run)
        next_batches = steps.__next__

        def to_micros(batches: list) -> list:
            return [part for batch in batches for part in micro_batches(run, batch)]
    else:
        loader = iter(run.loader(0, 0))

        def next_batches() -> list:
            return [next(loader)]

        def to_micros(batches: list) -> list:
            return [micro_batch_inputs(run, batch) for batch in batches]
    warmup_began = time.perf_counter()
    first = to_micros(next_batches())[0]
    for _ in range(3):  # warm-up: compilation of the flex kernels, allocator growth
        run_step(first)
    if real:
        for _ in range(args.warmup):
            update_weights(run, accumulate_gradients(run, to_micros(next_batches())))
    sync()
    warmup_s = time.perf_counter() - warmup_began  # with --compile: the compilations of the first shapes
    results = {}
    for name in ("memory", "loader"):
        flops, block_tokens, sequences, kept = 0.0, 0.0, 0, []
        pending = None  # with --cache: the last step's metrics record, read one step late as the training loop does
        sync()
        begin = time.perf_counter()
        for _ in range(args.steps):
            if name == "memory":
                micros = [first]
            else:
                micros = to_micros(next_batches())
            if real:  # the FLOPs are counted after the timing, without its host synchronisations
                record = update_weights(run, accumulate_gradients(run, micros))
                if pending is not None:
                    pending.settle()
                pending = PendingRecord(record)
                if args.record_at_once:
                    pending.settle()
                    pending = None
                kept += [SimpleNamespace(layout=m.layout, labels=m.labels, sequences=m.sequences,
                                         valid_blocks=m.valid_blocks,
                                         features=torch.empty(m.features.shape, device="meta")) for m in micros]
            else:
                flops += step_flops(run.config, micros[0])
                run_step(micros[0])
        if pending is not None:
            pending.settle()
        sync()
        seconds = time.perf_counter() - begin
        if real:
            flops = sum(step_flops(run.config, m) for m in kept)
            block_tokens = sum(m.valid_blocks for m in kept) * run.options.block_size
            sequences = sum(m.sequences for m in kept)
        else:
            block_tokens = args.steps * first.valid_blocks * 16
            sequences = args.steps * args.batch
        results[name] = throughput(flops, seconds, args.steps, block_tokens, sequences)
        print(name, json.dumps(results[name]), flush=True)
    if not real:  # the phased pass reads the epoch again: --samples need only cover the loader variant
        del loader
        loader = iter(run.loader(0, 0))
        next(loader)  # the workers' start, not a step's wait
    phases = phased_steps(run, next_batches, to_micros, args.steps)
    print("phases", json.dumps(phases), flush=True)
    backend = run.accelerator.unwrap_model(run.model).attention.backend(device)  # what --attention auto chose
    attention = backend if real else args.attention
    name = args.name or f"{label}_{attention}{'_compile' if run.options.compile else ''}_{device.type}"
    profile_summary = None
    if args.profile:
        if args.profile_source == "loader" and real:
            def profiled_step() -> None:
                update_weights(run, accumulate_gradients(run, to_micros(next_batches())))
        else:
            def profiled_step() -> None:
                run_step(first)
        profile_summary, table = profile_steps(profiled_step, args.profile, device)
        profile_summary["source"] = args.profile_source if real else "memory"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"profile_{name}.txt").write_text(table + "\n")
        print("profile", json.dumps(profile_summary), flush=True)
    import torch._inductor.config as inductor_config  # (TORCHINDUCTOR_SPLIT_REDUCTIONS=0 turns them off)

    summary = {"benchmark": "train", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "trainable_params": params,
               "attention": args.attention if not real else run.options.attention, "attention_backend": backend,
               "compile": run.options.compile, "block_size": run.options.block_size,
               "sdpa_backends": args.sdpa_backends,
               "sdpa_backends_enabled": {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                         "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                         "flash": torch.backends.cuda.flash_sdp_enabled(),
                                         "math": torch.backends.cuda.math_sdp_enabled()},
               "exact_windows": not attention_masks.BUCKET_WINDOWS, "record_at_once": args.record_at_once,
               "pinned_inputs": trainer_module.PIN_INPUTS,
               "features_copied_aside": trainer_module.COPY_FEATURES_ASIDE,  # (a CPU copies nothing)
               "inputs_in_workers": run_setup_module.STEP_INPUTS_IN_WORKERS,
               "loss_chunk_rows": loss_module.chunk_rows(int(run.config.vocab_size), device.type),
               "adamw_fused": bool(run.optimizer.param_groups[0].get("fused")),
               "inductor_split_reductions": inductor_config.split_reductions if run.options.compile else None,
               "warmup_s": warmup_s, "results": results,
               "loader_overhead": results["loader"]["step_s"] / results["memory"]["step_s"] - 1,
               "phases": phases, "profile": profile_summary,
               "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None}
    if real:
        summary.update({"cache": str(args.cache), "train_flags": args.train_flags,
                        "architecture": run.options.architecture, "batch_tokens": run.options.batch_tokens,
                        "loader_workers": run.options.num_workers,
                        "flops_counted": "drafter matmuls, attention and LM head as in step_flops"
                        + ("; DFlash 2's dynamic convolutions and path selector are not counted"
                           if run.options.trains_selector else "")})
    else:
        summary.update({"length": args.length, "batch": args.batch, "anchors": ANCHORS, "loader_workers": args.workers})
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"train_{name}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
