"""`dflash train`: the training loop, in one place (nanoGPT style), on HF Accelerate.

One process per GPU (or `--processes N` CPU processes with gloo), DDP by default. A global step is
world_size x grad_accum consecutive micro-batches of the epoch's plan (`data.plan_epoch`); the loss of every
micro-batch is normalised by the weight sum of the whole global step, all-reduced before the forward, so the update
is the same for any split of the global batch over processes and accumulation steps. The target is never loaded:
the frozen embedding and LM head come from the cache's `target/` folder.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger, setup_logging
from dflash.stage2_train.acceptance import offline_acceptance
from dflash.stage2_train.data import CacheBatches, CacheIndex, block_labels, eval_sequences, make_loader, plan_epoch
from dflash.stage2_train.draft_model import DFlashDecoderLayer, DFlashDraftModel, config_from_target
from dflash.stage2_train.export import export_draft
from dflash.stage2_train.loss import default_gamma, dflash_loss, position_weights, weight_sum
from dflash.stage2_train.target_parts import load_target_parts, resolve_mask_token

log = get_logger(__name__)

CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
BEST_EXPORT_DIR = "export_best"  # the drafter at the evaluation with the best held-out tau so far
BEST_RECORD_FILE = "best.json"  # in BEST_EXPORT_DIR: that evaluation's step and tau
METRICS_FILE = "metrics.jsonl"
DRAFT_CONFIG_FILE = "draft_config.json"
CACHE_MANIFEST_FILE = "cache_manifest.json"


@dataclass
class TrainOptions:
    cache: Path
    out: Path
    epochs: int = 1
    max_steps: int | None = None
    draft_layers: int | None = None
    block_size: int = 16
    sliding_window: int | None = None
    mask_token_id: int | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    batch_tokens: int = 8192
    grad_accum: int = 1
    max_anchors: int = 512
    gamma: float | None = None
    eval_fraction: float = 0.05
    eval_every: int = 200
    eval_sequences: int = 16
    checkpoint_every: int = 500
    resume: bool = False
    init_from: Path | None = None
    seed: int = 0
    attention: str = "auto"
    compile: bool = False
    fsdp: bool = False
    mixed_precision: str = "auto"
    num_workers: int = 2
    log_every: int = 10
    verbose: bool = False


@dataclass
class TrainState:
    """What a checkpoint must hold besides model / optimizer / scheduler / RNG: the exact data position."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # micro-batches of this rank's plan already consumed in `epoch`

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.position = int(state["step"]), int(state["epoch"]), int(state["position"])


def cosine_with_warmup(total_steps: int, warmup_fraction: float) -> Any:
    warmup = max(1, round(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Trainer:
    def __init__(self, options: TrainOptions) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed

        self.options = options
        self.out = options.out.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        precision = options.mixed_precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() else "no"
        plugins: dict[str, Any] = {}
        if options.fsdp and not torch.cuda.is_available():
            # Accelerate shards with FSDP only on GPUs; on CPU it would quietly train with DDP instead.
            raise UserError("--fsdp needs CUDA GPUs (Accelerate has no FSDP on CPU); leave it out to train with DDP")
        if options.fsdp:
            plugins["fsdp_plugin"] = fsdp_plugin(precision)
        # cpu=True on a machine without CUDA: Accelerate then forms a gloo process group from RANK/WORLD_SIZE.
        self.accelerator = Accelerator(mixed_precision=precision, project_dir=str(self.out),
                                       cpu=not torch.cuda.is_available(),
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
                                       **plugins)
        main = self.accelerator.is_main_process
        setup_logging(self.out / f"train-rank{self.accelerator.process_index}.log" if not main else self.out / "train.log",
                      verbose=options.verbose, console=main)
        if options.fsdp and self.accelerator.distributed_type != DistributedType.FSDP:
            log.warning("--fsdp: Accelerate did not enable FSDP (distributed type %s; it needs a GPU process group: "
                        "accelerate launch, torchrun or --processes N), so the drafter trains unsharded",
                        self.accelerator.distributed_type)
        set_seed(options.seed)
        self.device = self.accelerator.device
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.cache = options.cache.resolve()
        self.manifest = cf.read_manifest(self.cache)
        self.parts = load_target_parts(self.cache)
        previous = self._previous_config()
        self.mask_token_id = resolve_mask_token(self.parts, options.mask_token_id,
                                                previous.get("dflash_config", {}).get("mask_token_id"))
        layer_ids = list(self.manifest["identity"]["layer_ids"])
        num_layers = options.draft_layers or len(layer_ids)
        layer_types = None
        if options.sliding_window:
            layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        self.config = config_from_target(self.parts.config, layer_ids, num_layers, options.block_size,
                                         self.mask_token_id, layer_types=layer_types,
                                         sliding_window=options.sliding_window)
        torch.manual_seed(options.seed)
        self.model = DFlashDraftModel(self.config, attn_implementation=options.attention)  # type: ignore[arg-type]
        if options.init_from is not None:
            self._init_from(options.init_from)
        # Frozen target parts in the compute dtype (bf16 under mixed precision; fp32 otherwise, e.g. CPU tests).
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.embed = self.parts.embed_tokens.to(self.device, self.compute_dtype)
        self.lm_head = self.parts.lm_head.to(self.device, self.compute_dtype)
        self.weights = position_weights(options.block_size, options.gamma or default_gamma(options.block_size))
        self.weights = self.weights.to(self.device)
        self.index = CacheIndex.from_cache(self.cache, options.eval_fraction, options.seed)
        self.pad_multiple = 128 if self.device.type == "cuda" else 16
        # Each epoch packs a new shuffle into token-budget micro-batches, so epochs differ in step count.
        self.steps_per_epoch = self._steps_in_epoch(0)
        if self.steps_per_epoch == 0:
            raise UserError(f"the cache holds too few training samples for one step of {self.world} x "
                            f"{options.grad_accum} micro-batches of {options.batch_tokens} tokens")
        self.total_steps = options.max_steps or sum(self._steps_in_epoch(e) for e in range(options.epochs))
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=options.lr, betas=(0.9, 0.95),
                                      weight_decay=options.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(self.total_steps, options.warmup))
        self.model, self.optimizer = self.accelerator.prepare(self.model, optimizer)
        # Not prepared: Accelerate's scheduler wrapper steps once per process, which would run the schedule
        # world_size times too fast. It is still saved and restored with every checkpoint.
        self.scheduler = scheduler
        self.accelerator.register_for_checkpointing(self.scheduler)
        if options.compile:
            # Each decoder layer, compiled in place in this process: the mask building stays eager (its
            # data-dependent indexing is cheap and made inductor fail on CPU when the whole drafter was compiled),
            # and weight names, checkpoints and the export stay those of the uncompiled drafter.
            layers = self.accelerator.unwrap_model(self.model).layers
            for layer in layers:
                layer.compile()
            log.info("--compile: %d decoder layers compile on their first steps", len(layers))
        if options.resume:
            self._check_resumable()
        self.state = TrainState()
        self._checkpointed_step: int | None = None  # steps already saved / evaluated, so the end of training
        self._evaluated_step: int | None = None  # does not repeat what --checkpoint-every / --eval-every just did
        self._last_eval: dict[str, Any] = {}
        self._best_tau = self._recorded_best_tau() if options.resume else -math.inf
        self.accelerator.register_for_checkpointing(self.state)
        self.tensorboard = None
        if main:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.out / "tensorboard"))
            (self.out / "train_options.json").write_text(json.dumps(
                {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}, indent=2))
            (self.out / DRAFT_CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2))
            cf.write_json_atomic(self.out / CACHE_MANIFEST_FILE, self.manifest)

    # ------------------------------------------------------------------------------------------ helpers

    def _check_resumable(self) -> None:
        """--resume into a run whose drafter has other sizes (another target's cache, other flags): refuse clearly
        instead of failing deep inside load_state with a tensor-shape error."""
        path = self.out / DRAFT_CONFIG_FILE
        if not path.is_file():
            return
        differences = self._config_differences(json.loads(path.read_text()), "the run")
        if differences:
            raise UserError(f"--resume: the drafter in {self.out} does not match:\n  " + "\n  ".join(differences)
                            + "\nresume with the cache and flags the run was started with, or train into a new --out")

    def _config_differences(self, before: dict[str, Any], what: str) -> list[str]:
        """The sizes in which the drafter config `before` differs from this run's, one line each."""
        now = self.config.to_dict()
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "block_size", "num_target_layers", "dflash_config", "layer_types")
        return [f"{key}: {what} has {before.get(key)!r}, this cache and these flags give {now.get(key)!r}"
                for key in keys if before.get(key) != now.get(key)]

    def _init_from(self, export_dir: Path) -> None:
        """--init-from: start from an exported drafter's weights (a fresh optimizer and schedule), e.g. to go on
        training across sessions of a lent GPU or to fine-tune on new data. It must be the same drafter for the
        same target; a checkpoint found by --resume takes precedence (it is loaded afterwards)."""
        from dflash.stage2_train.export import load_draft_weights, read_target_info

        config_path = export_dir / "config.json"
        if not config_path.is_file():
            raise UserError(f"--init-from {export_dir}: no config.json there: give the export folder of a run "
                            "(RUN/export, or what `dflash export` wrote)")
        differences = self._config_differences(json.loads(config_path.read_text()), "the export")
        trained_for = read_target_info(export_dir).get("target_hash")
        target_hash = self.manifest["identity"].get("target_hash")
        if trained_for and target_hash and trained_for != target_hash:
            differences.append(f"target: the export was trained for target {trained_for}, this cache holds "
                               f"features of target {target_hash}")
        if differences:
            raise UserError(f"--init-from: the drafter in {export_dir} does not match:\n  " + "\n  ".join(differences)
                            + "\nstart from an export made with the same target and drafter flags")
        load_draft_weights(self.model, export_dir)  # the config matched: the same shapes, no second drafter built
        log.info("--init-from: starting from the weights of %s", export_dir)

    def _previous_config(self) -> dict[str, Any]:
        path = self.out / EXPORT_DIR / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _plan(self, epoch: int) -> list[Any]:
        return plan_epoch(self.index, epoch, self.options.seed, self.options.batch_tokens, self.world,
                          self.pad_multiple)

    def _steps_in_epoch(self, epoch: int, plan: list[Any] | None = None) -> int:
        return len(plan if plan is not None else self._plan(epoch)) // (self.world * self.options.grad_accum)

    def _loader(self, epoch: int, position: int, plan: list[Any] | None = None) -> Any:
        plan = plan if plan is not None else self._plan(epoch)
        rank_plan = plan[self.rank :: self.world]
        dataset = CacheBatches(self.cache, rank_plan, start=position, epoch=epoch, seed=self.options.seed,
                               max_anchors=self.options.max_anchors, block_size=self.options.block_size,
                               pad_multiple=self.pad_multiple)
        return make_loader(dataset, self.options.num_workers)

    def _latest_checkpoint(self) -> Path | None:
        folder = self.out / CHECKPOINTS_DIR
        done = sorted(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1])) if folder.is_dir() else []
        done = [p for p in done if (p / "complete").is_file()]
        return done[-1] if done else None

    def save_checkpoint(self) -> None:
        path = self.out / CHECKPOINTS_DIR / f"step-{self.state.step:08d}"
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(path))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            (path / "complete").write_text(str(self.state.step))  # marks a checkpoint that was written fully
            log.info("checkpoint %s", path)
        self._checkpointed_step = self.state.step

    # ------------------------------------------------------------------------------------------ one step

    def _micro_batch_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        from dflash.stage2_train.attention_masks import AnchorLayout

        device = self.device
        labels, block_ids = block_labels(batch["input_ids"], batch["loss_mask"], batch["anchors"],
                                         batch["anchor_valid"], batch["lengths"], self.options.block_size,
                                         self.mask_token_id)
        layout = AnchorLayout(
            anchors=batch["anchors"].to(device, non_blocking=True),
            anchor_valid=batch["anchor_valid"].to(device, non_blocking=True),
            context_lengths=batch["lengths"].to(device, non_blocking=True),
            context_len=int(batch["features"].shape[1]),
            block_size=self.options.block_size,
        )
        features = batch["features"].to(device, non_blocking=True)
        if "feature_scales" in batch:  # an fp8 cache: dequantize on the device, after the half-size copy
            features = cf.dequantize_fp8(features, batch["feature_scales"].to(device, non_blocking=True),
                                         self.compute_dtype)
        return {
            "features": features,
            "block_ids": block_ids.to(device, non_blocking=True),
            "labels": labels.to(device, non_blocking=True),
            "layout": layout,
        }

    def _forward_loss(self, inputs: dict[str, Any], total_weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
        layout = inputs["layout"]
        batch, blocks, block_size = inputs["block_ids"].shape
        noise = torch.nn.functional.embedding(inputs["block_ids"].view(batch, blocks * block_size), self.embed)
        features = inputs["features"].to(self.compute_dtype)
        with self.accelerator.autocast():
            hidden = self.model(noise, features, layout.query_position_ids(), layout.context_position_ids(), layout)
        return dflash_loss(hidden.to(self.lm_head.dtype), self.lm_head, inputs["labels"], self.weights, total_weight)

    def train(self) -> dict[str, Any]:
        options = self.options
        self._drop_partial_metrics_line()
        if options.resume:
            latest = self._latest_checkpoint()
            if latest is None:
                log.info("--resume: no checkpoint in %s, starting from scratch", self.out / CHECKPOINTS_DIR)
            else:
                self.accelerator.load_state(str(latest))
                self._checkpointed_step = self.state.step
                log.info("resumed from %s (step %d, epoch %d, micro-batch %d)", latest, self.state.step,
                         self.state.epoch, self.state.position)
        log.info("training %d steps (~%d per epoch) on %d process(es), %s, %d train / %d eval samples; mask token %d",
                 self.total_steps, self.steps_per_epoch, self.world, self.device, len(self.index.train),
                 len(self.index.eval), self.mask_token_id)
        if self.state.step == 0 and options.eval_every:
            self.evaluate()  # the untrained drafter: the baseline every later acceptance figure is compared with
        started = time.time()
        window_tokens, window_start = 0, time.time()
        per_step = self.world * options.grad_accum
        while self.state.step < self.total_steps:
            plan = self._plan(self.state.epoch)
            loader = iter(self._loader(self.state.epoch, self.state.position, plan))
            local_steps_left = self._steps_in_epoch(self.state.epoch, plan) - self.state.position // options.grad_accum
            for _ in range(local_steps_left):
                if self.state.step >= self.total_steps:
                    break
                micro = [self._micro_batch_inputs(next(loader)) for _ in range(options.grad_accum)]
                local_weight = sum(weight_sum(m["labels"], self.weights) for m in micro)
                total_weight = self.accelerator.reduce(local_weight.detach().clone(), reduction="sum")
                step_loss = torch.zeros((), device=self.device)
                correct = torch.zeros(options.block_size, device=self.device)
                counted = torch.zeros(options.block_size, device=self.device)
                tokens = 0
                for i, inputs in enumerate(micro):
                    sync = i == len(micro) - 1
                    with nullcontext() if sync else self.accelerator.no_sync(self.model):
                        loss, stats = self._forward_loss(inputs, total_weight)
                        # DDP averages gradients over processes; the loss is already globally normalised.
                        self.accelerator.backward(loss * self.world)
                    step_loss += loss.detach()
                    correct += stats["correct_by_position"].float()
                    counted += stats["count_by_position"].float()
                    tokens += int(inputs["layout"].anchor_valid.sum()) * options.block_size
                if options.clip:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), options.clip)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.state.step += 1
                self.state.position += options.grad_accum
                global_loss = self.accelerator.reduce(step_loss, reduction="sum")
                correct = self.accelerator.reduce(correct, reduction="sum")
                counted = self.accelerator.reduce(counted, reduction="sum")
                window_tokens += tokens * self.world
                record = {"step": self.state.step, "elapsed_s": round(time.time() - started, 3),
                          "loss": float(global_loss), "lr": self.scheduler.get_last_lr()[0],
                          "accuracy": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
                          "labels": int(counted[1:].sum())}  # supervised drafted tokens in the global batch
                if self.state.step % options.log_every == 0 or self.state.step == self.total_steps:
                    elapsed = time.time() - window_start
                    record["block_tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
                    remaining = (self.total_steps - self.state.step) * elapsed / max(1, options.log_every)
                    log.info("step %d/%d loss %.4f acc %.3f lr %.2e %.0f block tok/s ETA %s", self.state.step,
                             self.total_steps, record["loss"], record["accuracy"], record["lr"],
                             record["block_tokens_per_s"], time.strftime("%H:%M:%S", time.gmtime(remaining)))
                    window_tokens, window_start = 0, time.time()
                self._log_metrics(record)
                if options.eval_every and self.state.step % options.eval_every == 0:
                    self.evaluate()
                if options.checkpoint_every and self.state.step % options.checkpoint_every == 0:
                    self.save_checkpoint()
            else:
                self.state.epoch += 1
                self.state.position = 0
                continue
            break
        if options.compile:
            from torch._dynamo.utils import counters

            log.info("--compile: %d graphs compiled", counters["stats"]["unique_graphs"])
        if self._checkpointed_step != self.state.step:  # --checkpoint-every may have just saved this step
            self.save_checkpoint()
        whole = self._whole_drafter()  # one gather under FSDP serves the final evaluation and the export
        final = self._last_eval if self._evaluated_step == self.state.step else self._evaluate(whole)
        if whole is not None:
            export_draft(whole, self.out / EXPORT_DIR, self.manifest)
            log.info("exported the drafter to %s (%.1f min)", self.out / EXPORT_DIR, (time.time() - started) / 60)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return final

    # ------------------------------------------------------------------------------------------ eval, logs

    def evaluate(self) -> dict[str, Any]:
        """Offline acceptance length on held-out sequences (main process; the others wait)."""
        return self._evaluate(self._whole_drafter() if self.index.eval else None)

    def _evaluate(self, model: DFlashDraftModel | None) -> dict[str, Any]:
        """`evaluate` of the drafter a `_whole_drafter()` call of every process just gave (None off the main one)."""
        result: dict[str, Any] = {}
        if model is not None and self.index.eval:
            was_training = model.training
            model.eval()
            with torch.no_grad(), self.accelerator.autocast():
                result = offline_acceptance(model, self.embed, self.lm_head,
                                            eval_sequences(self.index, self.options.eval_sequences),
                                            self.options.block_size, self.mask_token_id, seed=self.options.seed)
            model.train(was_training)
            result["step"] = self.state.step
            log.info("eval step %d: tau %.3f (walk), %.3f (random anchors); acceptance by position %s",
                     self.state.step, result["tau_walk"], result["tau_random_anchors"],
                     [round(x, 3) for x in result["acceptance_by_position"]])
            if self.state.step > 0 and result["tau_walk"] > self._best_tau:
                # A drafter trained for many epochs on little data overfits: its held-out tau peaks before the
                # schedule ends (H200 headline, README). Keep the peak as well as the end.
                self._best_tau = result["tau_walk"]
                record = {"step": self.state.step, "tau_walk": result["tau_walk"]}
                export_draft(model, self.out / BEST_EXPORT_DIR, self.manifest,
                             extra_files={BEST_RECORD_FILE: json.dumps(record) + "\n"})
            self._log_metrics({"step": self.state.step, **{f"eval/{k}": v for k, v in result.items()}})
            from dflash.stage2_train.plots import write_plots

            write_plots(self.out)
        self.accelerator.wait_for_everyone()
        self._evaluated_step, self._last_eval = self.state.step, result
        return result

    def _recorded_best_tau(self) -> float:
        """The held-out tau of the best export a resumed run already kept (-inf when it kept none)."""
        path = self.out / BEST_EXPORT_DIR / BEST_RECORD_FILE
        return float(json.loads(path.read_text())["tau_walk"]) if path.is_file() else -math.inf

    def _whole_drafter(self) -> DFlashDraftModel | None:
        """The drafter with all of its weights on the main process (None on the others), to evaluate and export.

        Under DDP every process holds the whole drafter. Under FSDP each holds a shard and every forward needs all
        of them, so a forward on the main process alone would hang: the full weights are gathered (a collective:
        every process calls this) into a plain copy on the main process."""
        from accelerate.utils import DistributedType

        main = self.accelerator.is_main_process
        if self.accelerator.distributed_type != DistributedType.FSDP:
            return self.accelerator.unwrap_model(self.model) if main else None
        state = self.accelerator.get_state_dict(self.model)
        if not main:
            return None
        with torch.device(self.device):  # not meta: the rotary inv_freq buffer is not in the state dict
            whole = DFlashDraftModel(self.config, attn_implementation=self.options.attention)  # type: ignore[arg-type]
        whole.load_state_dict(state)
        return whole

    def _drop_partial_metrics_line(self) -> None:
        """A run killed mid-write can leave half a line in metrics.jsonl: cut it before appending again."""
        path = self.out / METRICS_FILE
        if self.accelerator.is_main_process and path.is_file():
            text = path.read_bytes()
            if text and not text.endswith(b"\n"):
                path.write_bytes(text[: text.rfind(b"\n") + 1])

    def _log_metrics(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.out / METRICS_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, record["step"])


def export_checkpoint(run_dir: Path, checkpoint: Path | None = None, out: Path | None = None) -> Path:
    """Export the weights of a checkpoint (default: the latest complete one) of a run."""
    from dflash.stage2_train.draft_model import DFlashConfig

    run_dir = run_dir.resolve()
    if checkpoint is None:
        folder = run_dir / CHECKPOINTS_DIR
        done = sorted((p for p in folder.glob("step-*") if (p / "complete").is_file()),
                      key=lambda p: int(p.name.split("-")[1])) if folder.is_dir() else []
        if not done:
            raise UserError(f"{run_dir} has no complete checkpoint under {CHECKPOINTS_DIR}/")
        checkpoint = done[-1]
    config = DFlashConfig.from_dict(json.loads((run_dir / DRAFT_CONFIG_FILE).read_text()))
    model = DFlashDraftModel(config)
    model.load_state_dict(_checkpoint_weights(checkpoint))
    manifest = json.loads((run_dir / CACHE_MANIFEST_FILE).read_text())
    out = out or run_dir / EXPORT_DIR
    export_draft(model, out, manifest)
    return out


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


def _checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of an `accelerate save_state` folder: model.safetensors under DDP; under FSDP (full
    state dict, Accelerate's default for FSDP1) the main process's torch.save file pytorch_model_fsdp.bin."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from safetensors.torch import load_file

    if (checkpoint / "model.safetensors").is_file():
        return load_file(str(checkpoint / "model.safetensors"))
    if (checkpoint / f"{FSDP_MODEL_NAME}.bin").is_file():
        return torch.load(checkpoint / f"{FSDP_MODEL_NAME}.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{checkpoint} holds neither model.safetensors nor {FSDP_MODEL_NAME}.bin (a sharded FSDP "
                    "checkpoint? its run's own export/ folder has the weights)")


def run_training(options: TrainOptions) -> dict[str, Any]:
    return Trainer(options).train()


def spawn_processes(options: TrainOptions, processes: int) -> int:
    """Run `processes` training processes on this machine (CPU: gloo) without `accelerate launch`."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    children = []
    for rank in range(processes):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes)}
        child = context.Process(target=_child_main, args=(options, env), name=f"dflash-train-{rank}")
        child.start()
        children.append(child)
    code = 0
    try:
        for child in children:
            child.join()
            code = code or (child.exitcode or 0)
            if child.exitcode:
                for other in children:
                    if other.is_alive():
                        other.terminate()
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
            child.join()
    return 1 if code else 0


def _child_main(options: TrainOptions, env: dict[str, str]) -> None:
    os.environ.update(env)
    run_training(options)
