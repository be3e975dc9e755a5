"""SpecForge 0.2.0's own DFlash training step on the shape and work of `bench_train.py`'s random Qwen3-8B mode, to
time both side by side on one GPU (issue 30: dflash's step against SpecForge's).

    python benchmarks/bench_specforge.py [--steps 8] [--warmup 3] [--attention flex_attention] [--profile 3]
    python benchmarks/bench_specforge.py --tiny --length 96 --batch 2 --steps 2    # a check on CPU, seconds

Every piece of the step is SpecForge's, imported from PyPI `specforge==0.2.0` (installed with --no-deps: sglang,
wandb, yunchang and the rest of its pins are never imported; `make install` unzips it into .venv/reference_specforge/,
used when `specforge` is not installed). The run is assembled as `specforge train` assembles an offline DFlash run
(`training.strategy=dflash`, its defaults otherwise) on one device:
  - the run config: `specforge.config.Config` (flex attention, 512 anchors, chunks of 128 blocks in the loss,
    bf16 weights, lr 1e-4, clip 0.5, cosine schedule with warm-up, FSDP SHARD_GRAD_OP);
  - the target: a folder with the target's config.json and random bf16 `model.embed_tokens.weight` /
    `lm_head.weight` (what `TargetEmbeddingsAndHead.from_pretrained` reads);
  - the drafter's config: `model_loading.resolve_draft_config` (generated from the target's config by the DFlash
    provider's `populate_dflash_generated_config`, 5 layers and target layers [1, 9, 17, 25, 33] by
    `apply_dflash_overrides`); the drafter: the provider's `build_draft` (`DFlashDraftModel`, bf16); the training
    model: its `build_training_model` (`OnlineDFlashModel` over the frozen target embeddings and LM head);
  - one process group (`specforge.distributed.init_distributed` after `cli._bootstrap_single_process_env`, as
    `specforge train` does for one process), `FSDPTrainingBackend.prepare_model` (FSDP over the training model,
    each decoder layer a unit, bf16) with `BF16Optimizer` (AdamW over fp32 master weights) from the assembly's
    optimizer factory, the provider's step strategy (`DFlashTrainStrategy`) and `TrainerCore`.
The timed step is `TrainerCore.train_step(batch, StepContext)`, what `TrainerController.fit` calls per batch:
`DFlashTrainStrategy.forward_loss` -> `OnlineDFlashModel.forward` (`_sample_anchor_positions`, the noise
embeddings, the flex block mask `create_dflash_block_mask` built anew each step, `DFlashDraftModel.forward`, the
cross-entropy by `checkpointed_chunk_reduce` over chunks of 128 blocks with activation checkpointing), then
`FSDPTrainingBackend.backward`, the gradient normalisation by the loss denominator, and `BF16Optimizer.step` (grad
norm, clip, AdamW on the fp32 masters, schedule, copy back to bf16). Liger kernels (`model.use_liger_kernel`) are
off, SpecForge's default. On CPU (the --tiny check) flex attention has no backward and FSDP needs an accelerator:
there the defaults are SpecForge's `sdpa` backend (`create_dflash_sdpa_mask`) and its NO_SHARD wrapper (DDP).

The work is bench_train's (its constants and `random_options` shape): --batch sequences of --length random tokens
whose first PROMPT_TOKENS are prompt (loss mask 0), features of the 5 captured layers x hidden size (random bf16),
block 16, up to ANCHORS anchors per sequence among the same candidates (positions p with loss_mask[p] and
loss_mask[p + 1]; both take all of them when there are fewer). The samples go through SpecForge's offline
normaliser and collator into one `TrainBatch`, which is moved to the device once and fed to every step, as
bench_train's "memory" variant feeds its first micro-batch (SpecForge's loader is not timed). Random weights and
features: speed does not depend on their values.

FLOPs: `bench_train.step_flops` on SpecForge's work of each timed step (its anchors and kept blocks, recorded by a
wrapper that returns what `_sample_anchor_positions` returns; its supervised block tokens, the `accuracy_denom`
the step reports): the work both implementations must do, so TFLOP/s and MFU compare like for like. Not credited:
SpecForge's LM head over every block token (the anchor position and labels past the sequence end included) and
its second LM-head forward when the checkpointed loss chunks are recomputed in backward; its context axis is not
packed (--batch rows of --length), dflash's is (the same tokens when batch x length is a bucket size, as
4 x 3072 is). Warm-up: --warmup steps (3, bench_train's), compilations of the flex kernel included; then --steps
steps timed with the device synchronised before and after. Result:
train_specforge_LABEL[_ATTENTION][_SHARDING]_DEVICE.json (the parts that differ from the GPU defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train import (ANCHORS, LAYER_IDS, MASK_TOKEN_ID, PROMPT_TOKENS, QWEN3_8B, TINY,  # noqa: E402
                                    profile_steps, step_flops, throughput)

SPECFORGE_VERSION = "0.2.0"
REFERENCE_FOLDER = Path(sys.prefix) / "reference_specforge"  # where `make install` unzips the wheel


def import_specforge() -> None:
    """Make `specforge` importable: installed, or the wheel `make install` unzipped; else stop in one line."""
    try:
        import specforge  # noqa: F401
    except ModuleNotFoundError:
        if not (REFERENCE_FOLDER / "specforge").is_dir():
            sys.exit(f"specforge is not importable and {REFERENCE_FOLDER} is missing: run `make install`, or "
                     f"`pip install --no-deps specforge=={SPECFORGE_VERSION}`")
        sys.path.append(str(REFERENCE_FOLDER))
    version = metadata.version("specforge")
    if version != SPECFORGE_VERSION:
        sys.exit(f"specforge {version} is importable, this benchmark is written for {SPECFORGE_VERSION}")


def write_target(folder: Path, target: dict) -> None:
    """The target as SpecForge reads it: config.json and random bf16 embeddings and LM head."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(target))
    generator = torch.Generator().manual_seed(0)
    shape = (target["vocab_size"], target["hidden_size"])
    save_file({name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name in ("model.embed_tokens.weight", "lm_head.weight")}, str(folder / "model.safetensors"))


def random_batch(target: dict, batch: int, length: int, device: torch.device):  # noqa: ANN201 - TrainBatch
    """--batch random sequences as SpecForge's offline reader hands them over (input_ids, loss_mask, hidden_states
    of the captured layers), through its own normaliser and collator, on the device."""
    from specforge.algorithms.common.dflash_family_data import build_collator, normalize_offline_sample
    from specforge.runtime.contracts import TrainBatch

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(length, len(LAYER_IDS) * target["hidden_size"], generator=generator).to(torch.bfloat16)
    loss_mask = torch.ones(length, dtype=torch.long)
    loss_mask[:PROMPT_TOKENS] = 0
    samples = [normalize_offline_sample({"input_ids": torch.randint(target["vocab_size"], (length,),
                                                                    generator=generator),
                                         "loss_mask": loss_mask, "hidden_states": rows}, max_len=length)
               for _ in range(batch)]
    tensors = {name: tensor.to(device) for name, tensor in build_collator()(samples).items()}
    return TrainBatch(sample_ids=[str(i) for i in range(batch)], strategy="dflash", tensors=tensors)


def specforge_run(target_folder: Path, batch_size: int, attention: str, sharding: str,
                  total_steps: int) -> SimpleNamespace:
    """SpecForge's DFlash training run on one process, assembled from its own functions (see the docstring):
    `core.train_step` is its step; also the config, the drafter's config and the training model."""
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.cli import _bootstrap_single_process_env
    from specforge.config import Config
    from specforge.distributed import init_distributed
    from specforge.modeling.target.target_utils import load_target_config
    from specforge.training.assembly import _optimizer_factory
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.model_loading import resolve_draft_config
    from specforge.utils import get_local_device

    target = json.loads((target_folder / "config.json").read_text())
    cfg = Config(model={"target_model_path": str(target_folder), "draft_num_hidden_layers": len(LAYER_IDS),
                        "mask_token_id": MASK_TOKEN_ID % target["vocab_size"]},
                 data={"hidden_states_path": str(target_folder)},
                 training={"strategy": "dflash", "attention_backend": attention, "batch_size": batch_size,
                           "num_anchors": ANCHORS, "max_steps": total_steps, "fsdp_sharding": sharding})
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding  # as `specforge train` sets it
    _bootstrap_single_process_env()
    init_distributed(timeout=cfg.training.dist_timeout)
    providers = algorithm_providers()
    draft_config = resolve_draft_config(cfg, provider=providers.model.draft_config)
    draft = providers.model.build_draft(cfg, draft_config)
    parts = providers.model.build_training_model(cfg, draft, draft_config, load_target_config(str(target_folder)),
                                                 None)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)  # counted before any wrapper
    optimizer_factory = _optimizer_factory(cfg)
    optimizer_factory.configure_total_steps(total_steps)
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(), optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(parts.model, optimizer_target=parts.model.draft_model)
    core = TrainerCore(providers.step.build(wrapped), backend, accumulation_steps=cfg.training.accumulation_steps)
    return SimpleNamespace(cfg=cfg, draft_config=draft_config, model=parts.model, backend=backend, core=core,
                           trainable_params=trainable, device=get_local_device())


def record_work(model) -> list:  # noqa: ANN001
    """Record the anchors and kept blocks of every forward of SpecForge's training model (`OnlineDFlashModel`):
    a wrapper that returns what its `_sample_anchor_positions` returns."""
    seen: list = []
    sample = model._sample_anchor_positions

    def recorded(seq_len, loss_mask, device):  # noqa: ANN001, ANN202
        anchors, keep = sample(seq_len, loss_mask, device)
        seen.append((anchors, keep))
        return anchors, keep

    model._sample_anchor_positions = recorded
    return seen


def specforge_work(config, anchors: torch.Tensor, keep: torch.Tensor, length: int, feature_dim: int,
                   supervised: int) -> SimpleNamespace:  # noqa: ANN001
    """One SpecForge step's work in the form `bench_train.step_flops` reads (a packed micro-batch): the blocks
    (anchor positions within their sequence, kept or not), the context axis (batch x length), the feature width and
    the supervised block tokens (`labels`: -100 except `supervised` entries)."""
    layout = SimpleNamespace(block_valid=keep.flatten().cpu(), block_anchor=anchors.flatten().cpu(),
                             block_size=config.block_size, context_len=anchors.shape[0] * length)
    labels = torch.full((int(keep.sum()) * config.block_size,), -100)
    labels[:supervised] = 0
    return SimpleNamespace(layout=layout, labels=labels, features=torch.empty(0, feature_dim, device="meta"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="bench_train's tiny target, to check the script on CPU")
    parser.add_argument("--length", type=int, default=3072, help="tokens per sequence (bench_train's --length)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (bench_train's --batch)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (bench_train's --steps)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps before timing (bench_train's random-cache mode: 3), flex compilations included")
    parser.add_argument("--attention", choices=("flex_attention", "sdpa", "eager"), default=None,
                        help="SpecForge's training.attention_backend (default: its flex_attention; on CPU, where "
                             "flex attention has no backward, sdpa)")
    parser.add_argument("--sharding", choices=("SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"), default=None,
                        help="SpecForge's training.fsdp_sharding (default: its SHARD_GRAD_OP, FSDP; NO_SHARD wraps in "
                             "DDP instead; on CPU, where FSDP cannot run, NO_SHARD)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile this many steps (bench_train's profile: time by category, top kernels)")
    parser.add_argument("--name", default=None, help="name of the result files (default: from the shape)")
    parser.add_argument("--work-dir", type=Path, default=None, help="for the random target (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if min(args.steps, args.batch) < 1 or args.warmup < 0 or args.length <= PROMPT_TOKENS + 1:
        parser.error(f"--steps and --batch must be >= 1, --warmup >= 0, --length > {PROMPT_TOKENS + 1}")
    import_specforge()
    import transformers
    from specforge.training.strategies.base import StepContext

    target = TINY if args.tiny else QWEN3_8B
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="specforge-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    started = time.time()
    write_target(work / "target", target)
    total_steps = args.warmup + args.steps + args.profile
    cuda = torch.cuda.is_available()
    attention = args.attention or ("flex_attention" if cuda else "sdpa")
    sharding = args.sharding or ("SHARD_GRAD_OP" if cuda else "NO_SHARD")
    run = specforge_run(work / "target", args.batch, attention, sharding, total_steps)
    print(f"SpecForge run assembled in {time.time() - started:.1f} s", flush=True)
    device = run.device
    batch = random_batch(target, args.batch, args.length, device)
    seen = record_work(run.model)
    supervised: list[torch.Tensor] = []
    forward_loss = run.core.strategy.forward_loss

    def observed_forward_loss(batch, ctx=None):  # noqa: ANN001, ANN202 - what the step reports, kept
        out = forward_loss(batch, ctx)
        supervised.append(out.metrics["accuracy_denom"])
        return out

    run.core.strategy.forward_loss = observed_forward_loss
    run.core.strategy.trainable_module().train()  # as TrainerController.fit does
    global_step = [0]
    losses: list[float] = []

    def step() -> None:
        result = run.core.train_step(batch, ctx=StepContext(global_step=global_step[0], total_steps=total_steps))
        global_step[0] += result.optimizer_stepped
        losses.append(result.loss)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    warmup_began = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - warmup_began
    seen.clear()
    supervised.clear()
    begin = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - begin
    feature_dim = batch.tensors["hidden_states"].shape[-1]
    works = [specforge_work(run.draft_config, anchors, keep, args.length, feature_dim, int(count))
             for (anchors, keep), count in zip(seen, supervised)]
    flops = sum(step_flops(run.draft_config, work) for work in works)
    block_tokens = sum(float(work.layout.block_valid.sum()) for work in works) * run.draft_config.block_size
    results = {"memory": throughput(flops, seconds, args.steps, block_tokens, args.steps * args.batch)}
    print("memory", json.dumps(results["memory"]), flush=True)
    label = "tiny" if args.tiny else "qwen3-8b"
    variant = "".join(f"_{value.lower()}" for value, default in ((attention, "flex_attention"),
                                                                   (sharding, "SHARD_GRAD_OP")) if value != default)
    name = args.name or f"specforge_{label}{variant}_{device.type}"
    profile_summary = None
    if args.profile:
        profile_summary, table = profile_steps(step, args.profile, device)
        profile_summary["source"] = "memory"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"profile_{name}.txt").write_text(table + "\n")
        print("profile", json.dumps(profile_summary), flush=True)
    summary = {
        "benchmark": "train_specforge", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
        "specforge": metadata.version("specforge"),
        "trainable_params": run.trainable_params,
        "attention": attention, "wrapper": run.backend._wrapper_kind,
        "fsdp_sharding": run.backend.parallel_config.sharding_strategy, "block_size": run.draft_config.block_size,
        "target_layer_ids": list(run.model.draft_model.target_layer_ids),
        "objective_chunk_blocks": run.cfg.training.objective_chunk_blocks,
        "length": args.length, "batch": args.batch, "anchors": ANCHORS,
        "block_tokens_per_step": block_tokens / args.steps, "flops_per_step": flops / args.steps,
        "warmup_steps": args.warmup, "warmup_s": warmup_s, "results": results,
        "losses": {"first": losses[0], "last": losses[-1]}, "profile": profile_summary,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
        "timed_step": "specforge.training.controller.TrainerCore.train_step (DFlashTrainStrategy, "
                      "FSDPTrainingBackend, BF16Optimizer) on one TrainBatch kept on the device",
        "flops_counted": "bench_train.step_flops of SpecForge's anchors and supervised tokens: drafter matmuls, "
                         "attention and the LM head on supervised block tokens; not its LM head on the other block "
                         "tokens nor the recomputation of its checkpointed loss chunks"}
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"train_{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
