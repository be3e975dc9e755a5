"""Setting up a training run, in the order it happens: the accelerator, the data, the drafter, the optimizer, the
resume point. `setup_run(options)` returns a `TrainingRun` holding all of it; `trainer.py` runs the loop over it.

One process per GPU (or `--processes N` CPU processes with gloo), DDP by default (`--fsdp`: FSDP). The target is
never loaded: the frozen embedding and LM head come from the cache's `target/` folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.shared import cache_format as cf
from dflash.shared.compile_limits import raise_recompile_limit
from dflash.shared.errors import UserError
from dflash.shared.feature_codecs import FeatureCodec, manifest_codec
from dflash.shared.logs import get_logger, setup_logging
from dflash.shared.output_dirs import refuse_foreign_folder
from dflash.shared.run_files import BEST_RECORD_FILE, CONFIG_FILE, RunFiles
from dflash.stage2_train import cache_index
from dflash.stage2_train.cache_index import CacheIndex
from dflash.stage2_train.checkpoints import intact_checkpoint
from dflash.stage2_train.draft_attention import training_drafter, use_training_attention
from dflash.stage2_train.fast_path import describe, loader_workers, training_path
from dflash.stage2_train.draft_config import DFLASH2_DEFAULTS, DFlashConfig, config_from_target
from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch, rank_plan
from dflash.stage2_train.modeling_dflash import DFlashDecoderLayer, DFlashDraftModel
from dflash.stage2_train.loss import default_gamma, position_weights
from dflash.stage2_train.memory_plan import (GIB, SAFETY, DrafterShape, MemoryPlan, SmallerBudgetHold,
                                             in_use_bytes, limit_from_option, make_plan, step_bytes)
from dflash.stage2_train.objective import NEEDS_TARGET_TOPK, Objective, check_cache_for, make_objective
from dflash.stage2_train.options import TrainOptions
from dflash.stage2_train.packed_batches import CacheBatches
from dflash.stage2_train.packed_loader import make_loader
from dflash.stage2_train.shape_buckets import bucket
from dflash.stage2_train.target_parts import TargetParts, load_target_parts, resolve_mask_token

log = get_logger(__name__)


@dataclass
class TrainState:
    """What a checkpoint must hold besides model / optimizer / scheduler / RNG: the exact data position."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # micro-batches of this rank's plan already consumed in `epoch`
    plan: dict[str, Any] = field(default_factory=dict)  # what the epochs' plans are made from (`plan_inputs`)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.position = int(state["step"]), int(state["epoch"]), int(state["position"])
        self.plan = dict(state.get("plan", {}))  # (none in checkpoints written before 2026-12-06)


# Whether the loader's workers build each batch's step inputs (layout, labels, label positions, top-k rows:
# `packed_batches.packed_step_inputs`), so that the training loop's process only copies them to the device; False
# leaves them to `trainer.micro_batch_inputs` in the main process, as before, for benchmarks/bench_train.py
# --inputs-in-main to compare.
STEP_INPUTS_IN_WORKERS = True


@dataclass
class TrainingRun:
    """Everything the loop needs, made once by `setup_run`."""

    options: TrainOptions
    files: RunFiles
    accelerator: Any
    cache: Path
    manifest: dict[str, Any]
    codec: FeatureCodec  # how the cache stores its features
    index: CacheIndex  # train / validation / test split of the cache
    parts: TargetParts  # the frozen target pieces, on the CPU
    config: DFlashConfig
    mask_token_id: int
    model: Any  # the drafter, prepared by Accelerate (DDP / FSDP wrapped)
    optimizer: Any
    scheduler: Any
    objective: Objective
    compute_dtype: torch.dtype
    embed: torch.Tensor  # frozen, on the device, in the compute dtype
    lm_head: torch.Tensor
    position_weights: torch.Tensor  # [block_size] loss weight per block offset
    host_position_weights: torch.Tensor  # the same on the CPU (the step's loss normaliser from the host's labels)
    bucket_multiple: int  # packed lengths are rounded up to a multiple of at least this (`packed_batches.bucket`)
    steps_per_epoch: int
    total_steps: int
    memory: MemoryPlan | None = None  # how micro-batches are split to fit the device (`plan_memory`)
    out_of_memory_retries: int = 0  # steps that ran out of memory all the same and were retried smaller
    planned_memory: MemoryPlan | None = None  # the plan made at the start, which `memory` returns to after a retry
    memory_hold: SmallerBudgetHold | None = None  # the last retry's smaller plan: how long it holds (not checkpointed)
    planned_memory_returns: int = 0  # how often `memory` went back to `planned_memory`
    state: TrainState = field(default_factory=TrainState)
    best_tau: float = -math.inf  # the best validation walk tau after step 0 (export_best/)
    lock: Any = None  # the run directory's lock, held by the main process until the run ends

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def anchor_rule(self) -> AnchorRule:
        return AnchorRule(self.options.anchor_density or None, self.options.max_anchors, self.options.block_size)

    @property
    def step_input_settings(self) -> dict[str, Any]:
        """What `packed_batches.packed_step_inputs` takes of this run, in the loader's workers and in the trainer
        alike: the block size, the mask token, and whether the drafter has a selector (DFlash 2's positions)."""
        return {"block_size": self.options.block_size, "mask_token_id": self.mask_token_id,
                "with_selector_index": self.options.trains_selector}

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def plan(self, epoch: int) -> list[Any]:
        """The global micro-batch plan of an epoch (the same on every rank)."""
        return plan_epoch(self.index, epoch, self.options.seed, self.options.batch_tokens, self.world,
                          self.anchor_rule)

    def steps_in_epoch(self, epoch: int, plan: list[Any] | None = None) -> int:
        return len(plan if plan is not None else self.plan(epoch)) // (self.world * self.options.grad_accum)

    def loader(self, epoch: int, position: int, plan: list[Any] | None = None) -> Any:
        """This rank's micro-batches of `epoch` from plan position `position` on (CPU tensors), each with the
        trainer's inputs built from it in the loader's workers (`packed_batches.packed_step_inputs`; unless
        STEP_INPUTS_IN_WORKERS is off)."""
        plan = plan if plan is not None else self.plan(epoch)
        step_inputs = self.step_input_settings if STEP_INPUTS_IN_WORKERS else {}
        dataset = CacheBatches(self.cache, rank_plan(plan, self.rank, self.world), start=position, epoch=epoch,
                               seed=self.options.seed, rule=self.anchor_rule, bucket_multiple=self.bucket_multiple,
                               read_topk=self.options.loss in NEEDS_TARGET_TOPK, **step_inputs)
        return make_loader(dataset, self.options.num_workers)

    def whole_drafter(self) -> DFlashDraftModel | None:
        """The drafter with all of its weights on the main process (None on the others), to evaluate and export.

        Under DDP every process holds the whole drafter. Under FSDP each holds a shard and every forward needs all
        of them, so a forward on the main process alone would hang: the full weights are gathered (a collective:
        every process calls this) into a plain copy on the main process."""
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type != DistributedType.FSDP:
            return self.accelerator.unwrap_model(self.model) if self.is_main else None
        state = self.accelerator.get_state_dict(self.model)
        if not self.is_main:
            return None
        with torch.device(self.device):  # not meta: the rotary inv_freq buffer is not in the state dict
            whole = training_drafter(self.config, self.options.attention)
        whole.load_state_dict(state)
        return whole


def setup_run(options: TrainOptions) -> TrainingRun:
    """Build a run in order: the cache checked for the objective (refused at once without what it needs),
    accelerator and logs, cache and split, drafter, the training path (`choose_training_path`: attention, compile
    and the objective that follows them), optimizer and schedule, compile; then the resume point (checkpoint
    loaded) and the run's records on disk."""
    check_cache_for(options.loss, cf.read_manifest(options.cache.resolve()), options.cache)
    files = RunFiles(options.out.resolve())
    lock = claim_run_dir(options, files)
    accelerator, precision = make_accelerator(options, files)
    from accelerate.utils import set_seed

    set_seed(options.seed)
    cache = options.cache.resolve()
    manifest = cf.read_manifest(cache)
    if options.resume:
        keep_recorded_plan(options, files)
    index = CacheIndex.from_cache(cache, options.eval_fraction, options.seed, options.test_fraction,
                                  options.train_fraction)
    parts = load_target_parts(cache)
    config, mask_token_id = drafter_config(options, manifest, parts, files)
    torch.manual_seed(options.seed)
    model = training_drafter(config, options.attention)
    if options.init_from is not None:
        init_from_export(model, config, manifest, options.init_from)
    # Frozen target parts in the compute dtype (bf16 under mixed precision; fp32 otherwise, e.g. CPU tests).
    compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    device = accelerator.device
    run = TrainingRun(
        options=options, files=files, accelerator=accelerator, cache=cache, manifest=manifest,
        codec=manifest_codec(manifest), index=index, parts=parts, config=config, mask_token_id=mask_token_id,
        model=model, optimizer=None, scheduler=None, objective=make_objective(options.loss, options.kl_weight),
        compute_dtype=compute_dtype,
        embed=parts.embed_tokens.to(device, compute_dtype), lm_head=parts.lm_head.to(device, compute_dtype),
        position_weights=position_weights(options.block_size, options.gamma or default_gamma(options.block_size),
                                          device=device),
        host_position_weights=position_weights(options.block_size,
                                               options.gamma or default_gamma(options.block_size)),
        bucket_multiple=128 if device.type == "cuda" else 16, steps_per_epoch=0, total_steps=0, lock=lock)
    # Each epoch packs a new shuffle into token-budget micro-batches, so epochs differ in step count.
    run.steps_per_epoch = run.steps_in_epoch(0)
    if run.steps_per_epoch == 0:
        raise UserError(f"the cache holds too few training samples for one step of {run.world} x "
                        f"{options.grad_accum} micro-batches of {options.batch_tokens} tokens: lower --batch-tokens "
                        "or --grad-accum" + (f", or raise --train-fraction ({options.train_fraction})"
                                             if options.train_fraction < 1 else ""))
    run.total_steps = options.max_steps or sum(run.steps_in_epoch(e) for e in range(options.epochs))
    choose_training_path(run)
    options = run.options
    say_oversized_sequences(run)
    make_optimizer(run)
    run.memory = run.planned_memory = plan_memory(run)
    if options.compile:
        compile_layers(accelerator.unwrap_model(run.model))
    run.state.plan = plan_inputs(run)
    accelerator.register_for_checkpointing(run.state)
    if options.resume:
        resume(run)
    if run.is_main:
        write_run_records(run)
    return run


# How many compiled versions torch.compile keeps of one function before it runs new inputs eagerly (torch's default:
# 8). The decoder layers' forward is one function for every layer and needs more: on an H100 (2026-12-06, a
# `--attention flex --compile` run of the SmolLM2 drafter, TORCH_LOGS=recompiles) it took 8 versions by step 41
# (layer 0's input needed no gradient and the later layers' inputs did, since made equal, see compile_layers; static
# sizes first, then symbolic ones; the packed context length specialised once; inductor's guards on size
# thresholds, e.g. 576 * tokens >= 5242880), needed
# a ninth at step ~455 and from there ran new shapes uncompiled; step 651 ran out of memory (76.5 GiB against the
# planned 39.1; most likely such a shape, unfused) and the rest of the 3,000 steps ran 5x slower in the smaller
# retried micro-batches (15.8 minutes in all). Shapes are bucketed (shape_buckets.py), so the versions stay few; this
# only lifts the cap above them.
LAYER_RECOMPILE_LIMIT = 64


class RecompileLimitWatch(logging.Handler):
    """Counts torch.compile's "hit config.recompile_limit" warnings in this process (each means a compiled function
    runs new inputs eagerly from then on: slower steps, more memory), for the end-of-run compile line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("torch._dynamo hit config."):  # recompile_limit (cache_size_limit before torch 2.7)
            function = next((line.strip() for line in message.splitlines() if "function:" in line), message)
            self.functions.append(function.removeprefix("function:").strip())

    def summary(self) -> str:
        if not self.functions:
            return ""
        return (f"; torch.compile's recompile limit was reached {len(self.functions)} time(s), after which new shapes "
                f"ran uncompiled (slower, more memory): {'; '.join(sorted(set(self.functions)))}")


RECOMPILE_LIMIT_WATCH = RecompileLimitWatch()


def compile_summary() -> str:
    """The end-of-run line of a --compile run: the graphs torch.compile made in this process and whether a compiled
    function reached the recompile limit."""
    from torch._dynamo.utils import counters

    return f"compile: {counters['stats']['unique_graphs']} graphs compiled{RECOMPILE_LIMIT_WATCH.summary()}"


def compile_layers(model: DFlashDraftModel) -> None:
    """--compile: each decoder layer compiled in place in this process. The mask building stays eager (its
    data-dependent indexing is cheap and made inductor fail on CPU when the whole drafter was compiled), and weight
    names, checkpoints and the export stay those of the uncompiled drafter. Inductor's split reductions are turned
    off (unless TORCHINDUCTOR_SPLIT_REDUCTIONS says otherwise): the compiled step was measured so on an H100 (2.04x
    the plain step, docs/benchmarks.md), and a split reduction over symbolic sizes is where inductor's backward
    failed on varying packed shapes with grouped SDPA. The recompile limit is raised to `LAYER_RECOMPILE_LIMIT`
    (unless it is set higher) and hitting it is reported at the run's end (`RECOMPILE_LIMIT_WATCH`).

    The first layer's input is made to need a gradient (`layer_inputs_need_grad`): torch.compile guards on it, so
    the frozen block embedding of layer 0 and the later layers' inputs took two versions of the one layer function
    for every shape. Measured on the 2-core CPU (2026-12-07, a 16-conversation SmolLM2 cache, 40 steps of
    `--compile`): 12 versions and 13 graphs -> 6 and 7, 556 -> 417 s of step time, the same losses. The input's
    gradient costs the input-gradient matmuls of layer 0's q/k/v projections over the block tokens, ~1.1 MFLOP a
    block token on the SmolLM2 drafter: ~0.5 % of its ~219 MFLOP a block token (benchmarks/bench_train.py's count);
    not yet timed on a GPU."""
    import os

    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_SPLIT_REDUCTIONS" not in os.environ:
        inductor_config.split_reductions = False
    raise_recompile_limit(LAYER_RECOMPILE_LIMIT)
    watched = logging.getLogger("torch._dynamo.convert_frame")
    if RECOMPILE_LIMIT_WATCH not in watched.handlers:
        watched.addHandler(RECOMPILE_LIMIT_WATCH)
    model.layer_inputs_need_grad = True
    for layer in model.layers:
        layer.compile()
    log.info("compile: %d decoder layers compile on their first steps", len(model.layers))


def cpus_per_process(local_processes: int) -> int:
    """This process's share of the CPUs it may run on (its affinity: a container's or a job's CPU set; fewer where
    its cgroup's CPU quota grants fewer, as Kubernetes' CPU limits do), which the training processes on the machine
    share (no launcher dflash knows of pins each to CPUs of its own)."""
    import os

    from dflash.shared.cgroups import cgroup_cpu_limit

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        usable = min(usable, max(1, int(quota)))
    return max(1, usable // max(1, local_processes))


def local_processes(run: TrainingRun) -> int:
    """The training processes on this machine (torchrun and accelerate launch say so; else all of them)."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", run.world))


def choose_training_path(run: TrainingRun) -> None:
    """`--attention auto` and an unset `--compile` become the path fast_path.py picks for this device and run
    length, and an unset `--num-workers` its loader workers (written to the run's options.json as chosen); the
    drafter and the objective follow it."""
    given_compile, given_workers = run.options.compile, run.options.num_workers
    attention, compile_ = training_path(run.options.attention, run.options.compile, run.device.type, run.total_steps,
                                        int(run.config.hidden_size), run.options.fsdp, run.options.architecture)
    workers = loader_workers(run.options.num_workers, run.device.type, cpus_per_process(local_processes(run)))
    run.options = options = replace(run.options, attention=attention, compile=compile_, num_workers=workers)
    use_training_attention(run.model, options.attention)  # type: ignore[arg-type]
    run.objective = make_objective(options.loss, options.kl_weight, options.compile)
    if run.is_main:
        log.info(describe(options.attention, options.compile, given_compile is None, run.total_steps))
        log.info("loader: %d worker(s) a process (%s)", workers, "as given" if given_workers is not None else
                 f"chosen for {run.device.type}; --num-workers N to change")


def claim_run_dir(options: TrainOptions, files: RunFiles) -> Any:
    """The main process (RANK 0) takes the run directory: refuse a folder that is not a run, a run another `dflash
    train` is writing (its lock is held) and an existing run without --resume or --overwrite (two runs would mix
    their metrics, checkpoints and exports); --overwrite discards the old run's results (logs are kept, appended).
    Returns the held lock (None on the other processes, which only write their own logs)."""
    import os
    import shutil

    from filelock import FileLock, Timeout

    if int(os.environ.get("RANK", "0")) != 0:
        files.root.mkdir(parents=True, exist_ok=True)
        return None
    if options.resume and options.overwrite:
        raise UserError("--resume continues the run in --out and --overwrite discards it: give one of them")
    refuse_foreign_folder(files.root, files.entries(), "dflash training run")
    files.root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(files.lock), timeout=0)
    try:
        lock.acquire()
    except Timeout as error:
        raise UserError(f"another `dflash train` is writing into {files.root} (it holds {files.lock}): wait for it "
                        "to end, or train into another --out") from error
    if files.is_run() and not (options.resume or options.overwrite):
        lock.release()
        raise UserError(f"--out {files.root} already holds a training run: continue it with --resume, discard it "
                        "with --overwrite, or train into another --out")
    if options.overwrite:
        for path in files.results():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return lock


def keep_recorded_plan(options: TrainOptions, files: RunFiles) -> None:
    """--resume: the cache is split, and its sequences draw their anchors, as when the run started (its saved
    position is one of that plan); other split or anchor flags than the run's are refused (a run started before the
    anchor defaults changed, 2026-12-06, resumes with its own: --anchor-density 0.16666666666666666
    --max-anchors 512)."""
    if not files.options.is_file():
        return
    record = files.recorded_options("eval_fraction", "test_fraction", "seed")
    given = {"--eval-fraction": options.eval_fraction, "--test-fraction": options.test_fraction, "--seed": options.seed,
             "--train-fraction": options.train_fraction, "--anchor-density": options.anchor_density,
             "--max-anchors": options.max_anchors}
    made = {"--eval-fraction": record["eval_fraction"], "--test-fraction": record["test_fraction"],
            "--seed": record["seed"], "--train-fraction": record.get("train_fraction", 1.0),
            "--anchor-density": record.get("anchor_density", options.anchor_density),
            "--max-anchors": record.get("max_anchors", options.max_anchors)}

    def differ(made_value: Any, value: Any) -> bool:  # --anchor-density may be None (every candidate)
        return (made_value is None) != (value is None) or (value is not None and float(made_value) != float(value))

    differences = [f"{flag}: the run has {made[flag]}, this command gives {value}" for flag, value in given.items()
                   if differ(made[flag], value)]
    if differences:
        raise UserError(f"--resume: the run in {files.root} split its cache or drew its anchors otherwise:\n  "
                        + "\n  ".join(differences) + "\nresume with the flags it was started with")


def make_accelerator(options: TrainOptions, files: RunFiles) -> tuple[Any, str]:
    """The Accelerator (DDP, or FSDP with --fsdp) and the mixed precision it runs; logs open at once."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    precision = options.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() else "no"
    plugins: dict[str, Any] = {}
    if options.fsdp and options.trains_selector:
        # The selector loss reads the selector's weights outside the drafter's forward, where FSDP keeps them
        # sharded: DFlash 2 trains with DDP (the default) until that is built.
        raise UserError("--architecture dflash2 does not train with --fsdp yet: leave --fsdp out (DDP)")
    if options.fsdp and not torch.cuda.is_available():
        # Accelerate shards with FSDP only on GPUs; on CPU it would quietly train with DDP instead.
        raise UserError("--fsdp needs CUDA GPUs (Accelerate has no FSDP on CPU); leave it out to train with DDP")
    if options.fsdp:
        plugins["fsdp_plugin"] = fsdp_plugin(precision)
    # cpu=True on a machine without CUDA: Accelerate then forms a gloo process group from RANK/WORLD_SIZE.
    accelerator = Accelerator(mixed_precision=precision, project_dir=str(files.root), cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
                              **plugins)
    setup_logging(files.log(accelerator.process_index), verbose=options.verbose, console=accelerator.is_main_process)
    if options.fsdp and accelerator.distributed_type != DistributedType.FSDP:
        log.warning("--fsdp: Accelerate did not enable FSDP (distributed type %s; it needs a GPU process group: "
                    "accelerate launch, torchrun or --processes N), so the drafter trains unsharded",
                    accelerator.distributed_type)
    return accelerator, precision


def fsdp_plugin(precision: str) -> Any:
    """Accelerate's FSDP plugin as dflash uses it, every setting pinned (an `accelerate config` file or FSDP_*
    variables would otherwise change them): FSDP1 keeping the original parameters (so the AdamW built before
    `prepare` updates the sharded weights, and compiled layers see plain parameters), one FSDP unit per decoder
    layer (so a forward gathers one layer at a time), full-state checkpoints (what `dflash export --run` reads),
    and under bf16 float32 gradient reduction and float32 buffers (the RoPE inverse frequencies must not be
    rounded to bf16, as they are not under DDP or at inference)."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecision

    policy = None
    if precision == "bf16":
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FullyShardedDataParallelPlugin(
        fsdp_version=1, use_orig_params=True, state_dict_type="FULL_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[DFlashDecoderLayer.__name__],
        mixed_precision_policy=policy)


def drafter_config(options: TrainOptions, manifest: dict[str, Any], parts: TargetParts,
                   files: RunFiles) -> tuple[DFlashConfig, int]:
    """The drafter's config (sizes from the target, layers from the cache) and its mask token (an earlier export
    of this run keeps its choice)."""
    previous_path = files.export / CONFIG_FILE
    previous = json.loads(previous_path.read_text()) if previous_path.is_file() else {}
    mask_token_id = resolve_mask_token(parts, options.mask_token_id,
                                       previous.get("dflash_config", {}).get("mask_token_id"))
    layer_ids = list(manifest["identity"]["layer_ids"])
    num_layers = options.draft_layers or len(layer_ids)
    layer_types = None
    if options.sliding_window:
        layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    config = config_from_target(parts.config, layer_ids, num_layers, options.block_size, mask_token_id,
                                layer_types=layer_types, sliding_window=options.sliding_window,
                                embed_scale=parts.embed_scale, architecture=options.architecture)
    return config, mask_token_id


def config_differences(config: DFlashConfig, before: dict[str, Any], what: str) -> list[str]:
    """The sizes in which the drafter config `before` differs from `config`, one line each."""
    now = config.to_dict()
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "vocab_size", "block_size", "num_target_layers", "dflash_config", "layer_types")
    before = {**before, "block_size": (before.get("dflash_config") or {}).get("block_size", before.get("block_size"))}
    return [f"{key}: {what} has {before.get(key)!r}, this cache and these flags give {now.get(key)!r}"
            for key in keys if before.get(key) != now.get(key)]


def init_from_export(model: DFlashDraftModel, config: DFlashConfig, manifest: dict[str, Any],
                     export_dir: Path) -> None:
    """--init-from: start from an exported drafter's weights (a fresh optimizer and schedule), e.g. to go on
    training across sessions of a lent GPU or to fine-tune on new data. It must be the same drafter for the same
    target; a checkpoint found by --resume takes precedence (it is loaded afterwards)."""
    from dflash.shared.target_loading import same_target_hash
    from dflash.stage2_train.export import load_draft_weights, read_target_info

    config_path = export_dir / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"--init-from {export_dir}: no config.json there: give the export folder of a run "
                        "(RUN/export, or what `dflash export` wrote)")
    exported = json.loads(config_path.read_text())
    architecture = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}.get(
        next(iter(exported.get("architectures") or []), ""))
    if architecture is None:
        raise UserError(f"--init-from {export_dir}: its config.json describes {exported.get('architectures')}, not a "
                        "DFlash drafter (DFlashDraftModel or DFlash2DraftModel): give the export folder of a run")
    if architecture != config.architecture and architecture == "dflash2":
        raise UserError(f"--init-from {export_dir} is a DFlash 2 drafter: train it on with --architecture dflash2")
    # A DFlash drafter grows into a DFlash 2 one: its backbone, the new parts identity-initialised (the same
    # outputs at the first step); only the backbone's fields are compared.
    grow = architecture == "dflash" and config.architecture == "dflash2"
    if grow:
        exported["dflash_config"] = {**(exported.get("dflash_config") or {}),
                                     **{key: value for key, value in config.dflash_config.items()
                                        if key in DFLASH2_DEFAULTS}}
    differences = config_differences(config, exported, "the export")
    trained_for = read_target_info(export_dir).get("target_hash")
    target_hash = manifest["identity"].get("target_hash")
    same_target = same_target_hash(trained_for, target_hash)
    if same_target is False:
        differences.append(f"target: the export was trained for target {trained_for}, this cache holds "
                           f"features of target {target_hash}")
    elif same_target is None and trained_for and target_hash:
        log.warning("--init-from: %s and the cache recorded their target's hash by different rules (one was made "
                    "before 2026-12-05): the targets are not compared", export_dir)
    if differences:
        raise UserError(f"--init-from: the drafter in {export_dir} does not match ({'; '.join(differences)}): start "
                        "from an export made with the same target and drafter flags")
    load_draft_weights(model, export_dir, backbone_only=grow)  # the config matched: the same shapes
    log.info("--init-from: starting from the weights of %s%s", export_dir,
             " (a DFlash drafter: the DFlash 2 parts start as the identity)" if grow else "")


def say_oversized_sequences(run: TrainingRun) -> None:
    """A --batch-tokens below the cost of some training sequences (its context plus its blocks): those form a
    micro-batch alone, larger than asked; said once, with the numbers."""
    train = run.index.is_train
    costs = run.anchor_rule.cost(run.index.lengths[train], run.index.candidates[train])
    over = int((costs > run.options.batch_tokens).sum())
    if over:
        every = "every micro-batch holds one sequence" if over == len(costs) else f"those {over} go one per micro-batch"
        log.warning("--batch-tokens %d is below the cost of %d of the %d training sequences (context plus block "
                    "tokens, up to %d): %s; raise --batch-tokens to pack several", run.options.batch_tokens, over,
                    len(costs), int(costs.max()), every)


def plan_memory(run: TrainingRun) -> MemoryPlan:
    """The memory plan (memory_plan.py) for this run's micro-batches: refuses a sequence that cannot fit alone, and
    says how much of the free memory the largest micro-batch of the first epoch's plan will take (of every epoch's,
    for several FSDP processes, which cannot split one)."""
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    shape = DrafterShape.of(run.config, trainable, torch.finfo(run.compute_dtype).bits // 8, run.device.type)
    train = run.index.is_train
    lengths = run.index.lengths[train]
    if run.device.type == "cuda":
        # The stored features copied on the side stream (trainer.stored_features): two micro-batches' at most, each
        # a loader batch of --batch-tokens or a longer sequence alone, padded to its bucket.
        token_bytes = run.codec.stored_row_bytes(shape.context_dim, run.config.num_context_layers)
        tokens = bucket(max(run.options.batch_tokens, int(lengths.max())), run.bucket_multiple)
        shape = replace(shape, copied_aside_bytes=2 * tokens * token_bytes)
    blocks = run.anchor_rule.count(run.index.candidates[train])
    costliest = int(np.argmax(step_bytes(shape, lengths, blocks)))
    epochs = [run.state.epoch]
    if run.options.fsdp and run.world > 1:  # every epoch's micro-batches must fit whole: plan them all
        steps = run.steps_in_epoch(0)
        while steps < run.total_steps and len(epochs) < 10_000:
            epochs.append(len(epochs))
            steps += run.steps_in_epoch(epochs[-1])
    packs = [(sum(s.length for s in pack), int(run.anchor_rule.count([s.n_anchor_candidates for s in pack]).sum()))
             for epoch in epochs for pack in run.plan(epoch)]
    largest = max(packs, key=lambda pack: int(step_bytes(shape, *pack)))
    limit = limit_from_option(run.options.memory_limit, run.device)
    reserved = 0
    if run.options.memory_limit is None and run.device.type != "cuda":
        reserved = min(limit, loader_side_bytes(run))  # the loader's processes share this machine's memory
        limit -= reserved
    plan = make_plan(shape, largest, (int(lengths[costliest]), int(blocks[costliest])), limit, str(run.device),
                     in_use_bytes(run.device))
    split = int(step_bytes(shape, *largest)) > plan.budget_bytes
    if split and run.options.fsdp and run.world > 1:
        raise UserError(one_forward_a_step_under_fsdp(
            run.world, f"the largest micro-batch ({largest[0]} tokens, {largest[1]} blocks) needs "
            f"~{step_bytes(shape, *largest) * SAFETY / GIB:.1f} GiB, more than the "
            f"{plan.budget_bytes * SAFETY / GIB:.1f} GiB a micro-batch may use"))
    log.info("memory: %.2f GiB in use, %.2f GiB free on %s%s; planned peak %.2f GiB more (the largest micro-batch, "
             "%d tokens and %d blocks, with the optimizer state)%s", plan.in_use_bytes / GIB, limit / GIB, run.device,
             f" besides {reserved / 2**20:.0f} MiB left to the loader's side arrays" if reserved else "",
             plan.planned_peak_bytes / GIB, largest[0],
             largest[1], "; micro-batches that do not fit are split and accumulated" if split else "")
    return plan


def loader_side_bytes(run: TrainingRun) -> int:
    """What the loader's processes may hold of the cache's side arrays read whole (`cache_index.ShardStore`): each
    worker (or this process, without workers) up to its budget, two epochs' loaders at a time."""
    tokens = sum(int(entry.get("tokens", 0)) for entry in run.manifest["shards"].values())
    per_process = min(cache_index.SIDE_ARRAYS_BUDGET_BYTES,
                      cache_index.side_array_bytes(tokens, run.codec, run.config.num_context_layers))
    return 2 * max(1, int(run.options.num_workers or 0)) * per_process


def one_forward_a_step_under_fsdp(world: int, why: str) -> str:
    """The line that stops a run of several FSDP processes whose micro-batch the memory plan would split: every
    forward gathers each layer's shards from all processes, so the processes must run the same number of forwards a
    step, and each splits only its own micro-batches (under DDP only the last backward synchronises: splitting is
    safe there)."""
    return (f"--fsdp on {world} processes: {why}, and FSDP's processes cannot split their micro-batches each on "
            "its own (they would wait on each other's forwards): lower --batch-tokens or --max-anchors, or train "
            "with DDP (leave --fsdp out)")


def cosine_with_warmup(total_steps: int, warmup_fraction: float) -> Any:
    """The learning-rate factor per step: linear warm-up over `warmup_fraction` of the steps, then cosine to 0."""
    warmup = max(1, round(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# Whether AdamW takes its fused kernel on CUDA (`make_optimizer`); benchmarks/bench_train.py --foreach-adamw sets it
# False to compare with the default (foreach) implementation.
FUSED_ADAMW = True


def adamw_fused(device: torch.device) -> bool | None:
    """AdamW's `fused` for a run on `device`: its fused kernel on CUDA (one launch group for every parameter instead
    of foreach's several: the small drafter's step is host-bound, and foreach took ~2.5 ms of host time a step for
    ~0.5 ms of kernels, H200 profile of 2026-12-06); None (torch's default) elsewhere. The same update up to float
    rounding."""
    return True if FUSED_ADAMW and device.type == "cuda" else None


def keep_adamw_implementation(optimizer: Any, fused: bool | None) -> None:
    """After a checkpoint is loaded into `optimizer` (an AdamW, or Accelerate's wrapper of one): torch's
    `load_state_dict` takes the saved parameter groups whole, `fused` included, so a checkpoint saved by another
    implementation (before AdamW was fused on CUDA, or on another device type) would bring its own back. Put this
    run's back, with each step count where that implementation keeps it (fused: float32 on the parameter's device;
    otherwise float32 on the CPU, torch's default)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        group["fused"] = fused
        for parameter in group["params"]:
            state = inner.state.get(parameter)
            if state and isinstance(state.get("step"), torch.Tensor):
                device = parameter.device if fused else torch.device("cpu")
                state["step"] = state["step"].to(dtype=torch.float32, device=device)


def make_optimizer(run: TrainingRun) -> None:
    """AdamW (betas 0.9 / 0.95) and the warm-up + cosine schedule; the drafter and optimizer prepared by
    Accelerate."""
    options = run.options
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=options.lr, betas=(0.9, 0.95),
                                  weight_decay=options.weight_decay, fused=adamw_fused(run.device))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(run.total_steps, options.warmup))
    run.model, run.optimizer = run.accelerator.prepare(run.model, optimizer)
    # Not prepared: Accelerate's scheduler wrapper steps once per process, which would run the schedule world_size
    # times too fast. It is still saved and restored with every checkpoint.
    run.scheduler = scheduler
    run.accelerator.register_for_checkpointing(scheduler)


def plan_inputs(run: TrainingRun) -> dict[str, Any]:
    """What the epochs' plans, and so a saved data position, depend on besides the split and anchor flags
    (`keep_recorded_plan`): the training samples (how many, and which: the cache's finished shards), the token
    budget, the accumulation and the processes."""
    samples = np.array([(s.shard, s.row, s.length) for s in run.index.train], dtype=np.int64)
    which = hashlib.sha256(samples.tobytes()).hexdigest()[:12]
    return {"train samples": len(samples), "train sample digest": which, "--batch-tokens": run.options.batch_tokens,
            "--grad-accum": run.options.grad_accum, "processes": run.world}


def resume(run: TrainingRun) -> None:
    """--resume: refuse a run whose drafter has other sizes, then load its newest intact checkpoint (model,
    optimizer, schedule, RNG, data position) and the best validation tau it kept."""
    path = run.files.draft_config
    if path.is_file():
        differences = config_differences(run.config, json.loads(path.read_text()), "the run")
        if differences:
            raise UserError(f"--resume: the drafter in {run.files.root} does not match:\n  " + "\n  ".join(differences)
                            + "\nresume with the cache and flags the run was started with, or train into a new --out")
    if run.files.cache_manifest.is_file():
        made_from = json.loads(run.files.cache_manifest.read_text()).get("identity", {})
        differences = cf.identity_mismatch(made_from, run.manifest["identity"])
        if differences:
            raise UserError(f"--resume: the run in {run.files.root} was trained on another cache:\n  "
                            + "\n  ".join(differences).replace("cache has", "the run's cache has")
                            + "\nresume with the cache it was started with, or train into a new --out")
    best = run.files.export_best / BEST_RECORD_FILE
    run.best_tau = float(json.loads(best.read_text())["tau_walk"]) if best.is_file() else -math.inf
    latest = intact_checkpoint(run.files, "--resume")
    if latest is None:
        log.info("--resume: no checkpoint in %s, starting from scratch", run.files.checkpoints)
        return
    planned = run.state.plan
    run.accelerator.load_state(str(latest))
    recorded, run.state.plan = run.state.plan, planned
    if not recorded:
        log.warning("--resume: %s was written before checkpoints recorded what the epochs were planned from; resume "
                    "it with the flags, processes and finished shards it was started with, or its samples are "
                    "skipped or repeated", latest)

    def shown(value: Any) -> str:
        return f"{value:,}" if isinstance(value, int) else str(value)

    differences = [f"{name}: the run had {shown(recorded[name])}, now {shown(planned[name])}" for name in planned
                   if name in recorded and recorded[name] != planned[name]]
    if differences:
        raise UserError(f"--resume: the epochs of the run in {run.files.root} were planned otherwise, so its saved "
                        "data position would skip or repeat samples:\n  " + "\n  ".join(differences)
                        + "\nresume with the flags, processes and finished shards it was started with (train "
                        "samples change when extraction finished more shards since), or train into a new --out")
    keep_adamw_implementation(run.optimizer, adamw_fused(run.device))
    log.info("resumed from %s (step %d, epoch %d, micro-batch %d)", latest, run.state.step, run.state.epoch,
             run.state.position)


def write_run_records(run: TrainingRun) -> None:
    """What the run was made from, beside its results: options, drafter config and the cache's manifest."""
    options = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(run.options).items()}
    # atomic: `--resume` and `export --run` read them back, and a run killed while writing must not leave half a file
    cf.write_json_atomic(run.files.options, {**options, "total_steps": run.total_steps})
    cf.write_json_atomic(run.files.draft_config, run.config.to_dict())
    cf.write_json_atomic(run.files.cache_manifest, run.manifest)
