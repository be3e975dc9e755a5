"""`dflash train`: the training loop, in one place (nanoGPT style), on HF Accelerate.

Read it in order: `run_setup.setup_run` builds the run (accelerator, data, drafter, optimizer, resume point), `train`
below is the loop, `train_step` is one optimizer step, and the loss it minimises is `run.objective`
(`objective.py`, chosen with `--loss`).

A global step is world_size x grad_accum consecutive micro-batches of the epoch's plan (`epoch_plan.plan_epoch`); the
loss of every micro-batch is normalised by the weight sum of the whole global step, all-reduced before the forward, so
the update is the same for any split of the global batch over processes and accumulation steps.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dflash.shared.errors import UserError, is_out_of_memory
from dflash.shared.logs import get_logger
from dflash.shared.run_files import BEST_RECORD_FILE, WEIGHTS_FILE
from dflash.stage2_train.acceptance import json_safe, offline_acceptance
from dflash.stage2_train.checkpoints import has_checkpoint, save_checkpoint
from dflash.stage2_train.draft_attention import uncompiled_sdpa
from dflash.stage2_train.eval_set import eval_sequences
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from dflash.stage2_train.export import export_draft, load_draft
from dflash.stage2_train.loss import selector_loss, weight_sum
from dflash.stage2_train.memory_plan import GIB, SmallerBudgetHold, measured_peak_bytes
from dflash.stage2_train.objective import MicroBatch
from dflash.stage2_train.packed_batches import (STEP_INPUTS, packed_layout, packed_step_inputs, sequence_blocks,
                                                split_packed_batch)
from dflash.stage2_train.packed_loader import start_loader, stop_loader
from dflash.stage2_train.run_setup import (TrainingRun, TrainOptions, compile_summary, one_forward_a_step_under_fsdp,
                                         setup_run)

log = get_logger(__name__)

# An experiment's change to the context features the drafter sees, in training and evaluation alike
# (benchmarks/context_ablation.py zeroes them); None in normal runs.
FeatureTransform = Callable[[Tensor], Tensor]

# A training whose loss stays within STUCK_RELATIVE of the same value for STUCK_STEPS steps is stopped: the batches
# differ from step to step, so a drafter that learns moves the loss by far more: measured on the tests' 30-step run
# (tests/stage2_train/test_train.py, --lr 4e-3), every 10 steps spread over >= 0.23 of the loss and no two steps were
# closer than 5e-3; `--lr 1e6` (the drafter predicts every token alike) spread over 3e-7 in 29 steps.
STUCK_STEPS = 10
STUCK_RELATIVE = 1e-5


def train(options: TrainOptions, feature_transform: FeatureTransform | None = None) -> dict[str, Any]:
    """Train a drafter as `options` say; returns the last validation evaluation."""
    run = setup_run(options)
    options = run.options  # with the attention and compilation chosen for this device and run (fast_path.py)
    metrics = MetricsLog(run)
    unused = int(run.index.is_unused.sum())
    log.info("training %d steps (~%d per epoch) on %d process(es), %s, %d train / %d validation / %d test samples%s; "
             "mask token %d", run.total_steps, run.steps_per_epoch, run.world, run.device, len(run.index.train),
             len(run.index.eval), len(run.index.test),
             f" ({unused} left out by --train-fraction {options.train_fraction})" if unused else "", run.mask_token_id)
    last_eval: dict[str, Any] = {}
    evaluated_step = None
    if run.state.step == 0 and options.eval_every and options.eval_untrained:
        # the untrained drafter: the baseline of every later figure
        last_eval, evaluated_step = evaluate(run, metrics, run.whole_drafter(), feature_transform), 0
    steps = step_batches(run)
    step_log = StepLog(run, metrics)
    try:
        while run.state.step < run.total_steps:
            step_started = time.time()
            loader_batches = next(steps)
            # The host's wait for the loader's next batch: a step whose workers do not keep up shows it here.
            loader_wait_s = time.time() - step_started
            record = train_step(run, loader_batches, feature_transform)  # queued on the device, not waited for
            record["loader_wait_s"] = round(loader_wait_s, 4)
            run.state.position += options.grad_accum
            step_log.queue(record, step_started)  # writes the step before this one (check_loss: one step late)
            evaluate_now = options.eval_every and run.state.step % options.eval_every == 0
            checkpoint_now = options.checkpoint_every and run.state.step % options.checkpoint_every == 0
            if evaluate_now or checkpoint_now:
                step_log.flush()  # this step's record (and its loss checked) before the drafter is read or saved
            if evaluate_now:
                last_eval = evaluate(run, metrics, run.whole_drafter(), feature_transform)
                evaluated_step = run.state.step
            if checkpoint_now:
                save_checkpoint(run.accelerator, run.files, run.state.step, options.keep_checkpoints)
    except BaseException:
        # The steps done before the error recorded, as if nothing were deferred; an error of that (e.g. the device
        # itself failed) must not hide the one that stopped the loop.
        with suppress(Exception):
            step_log.flush()
        raise
    # The last epoch's loader workers stop here, not when the generator is collected after the evaluation and
    # export. (After an error or an interrupt they are left to the process's end, as the interrupt tests expect.)
    steps.close()
    step_log.flush()
    if options.compile:
        log.info("%s", compile_summary())
    peak = measured_peak_bytes(run.device)
    log.info("memory: planned peak %.2f GiB, measured %.2f GiB above the %.2f GiB in use when planned (%s peak %.2f "
             "GiB)%s", run.memory.planned_peak_bytes / GIB, (peak - run.memory.in_use_bytes) / GIB,
             run.memory.in_use_bytes / GIB, "CUDA allocated" if run.device.type == "cuda" else "resident set",
             peak / GIB, f"; out of memory {run.out_of_memory_retries} time(s), each step retried in smaller "
             f"micro-batches, back to the planned budget {run.planned_memory_returns} time(s)"
             if run.out_of_memory_retries else "")
    if not has_checkpoint(run.files, run.state.step):
        save_checkpoint(run.accelerator, run.files, run.state.step, options.keep_checkpoints)
    whole = run.whole_drafter()  # one gather under FSDP serves the final evaluation and the export
    if evaluated_step != run.state.step:
        last_eval = evaluate(run, metrics, whole, feature_transform)
    if whole is not None:
        export_draft(whole, run.files.export, run.manifest, run_dir=run.files.root)
        log.info("exported the drafter to %s (%.1f min)", run.files.export, (time.time() - step_log.started) / 60)
    run.accelerator.wait_for_everyone()
    if run.is_main and run.index.test:
        report_test_split(run, feature_transform)
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    if run.lock is not None:
        run.lock.release()
    return last_eval


def check_loss(run: TrainingRun, recent: list[float], loss: float, step: int | None = None) -> list[float]:
    """Stop a training that cannot get anywhere, in one line: a loss that is not finite (the weights diverged), or
    one that has not moved for STUCK_STEPS steps. Returns the recent losses with this step's (`step`: the step that
    had the loss, default the run's last)."""
    step, lr = run.state.step if step is None else step, run.options.lr
    if not math.isfinite(loss):
        raise UserError(f"training stopped at step {step}: the loss is {loss} (not finite), the drafter's weights "
                        f"diverged: train afresh (--overwrite) with a lower --lr (now {lr:g}); the checkpoints "
                        "written so far are kept")
    recent = [*recent[-(STUCK_STEPS - 1):], loss]
    if len(recent) == STUCK_STEPS and max(recent) - min(recent) <= STUCK_RELATIVE * abs(loss):
        uniform = math.log(run.config.vocab_size)
        alike = " (the log of the vocabulary size: it predicts every token alike)" if abs(loss - uniform) < 1e-3 \
            else ""
        raise UserError(f"training stopped at step {step}: the loss has stayed at {loss:.4f}{alike} for "
                        f"{STUCK_STEPS} steps of different batches, so the drafter is not learning: train afresh "
                        f"(--overwrite) with a lower --lr (now {lr:g}); the checkpoints written so far are kept")
    return recent


# How many steps before an epoch's last one the next epoch's loader starts, so that its workers have forked, opened
# the cache and read their first batches while those steps run. Measured on an H100 (2026-12-06, 6 workers, the
# SmolLM2 drafter on the fast path, docs/benchmarks.md "Equal GPU time"): each epoch's first step took 0.56-0.72 s
# where the others took 0.043 s, ~14 steps' worth, 10 % of an epoch of 137 steps.
NEXT_EPOCH_LEAD_STEPS = 16


def step_batches(run: TrainingRun) -> Iterator[list[dict[str, Any]]]:
    """This rank's loader batches, grad_accum at a time: one list per global step, from the run's data position
    on, epoch after epoch (each epoch a new plan; a resumed run continues inside its epoch). The next epoch's
    loader is started NEXT_EPOCH_LEAD_STEPS steps before this one's end, where the run goes on past it."""
    upcoming = None  # the next epoch's (plan, loader), started ahead
    try:
        while True:
            if upcoming is not None:
                (plan, loader), upcoming = upcoming, None
            else:
                plan = run.plan(run.state.epoch)
                loader = start_loader(run.loader(run.state.epoch, run.state.position, plan))
            steps_left = run.steps_in_epoch(run.state.epoch, plan) - run.state.position // run.options.grad_accum
            try:
                for done in range(steps_left):
                    epoch_ends_at = run.state.step + steps_left - done  # the run's step count after this epoch
                    if upcoming is None and steps_left - done <= NEXT_EPOCH_LEAD_STEPS \
                            and epoch_ends_at < run.total_steps:
                        next_plan = run.plan(run.state.epoch + 1)
                        upcoming = next_plan, start_loader(run.loader(run.state.epoch + 1, 0, next_plan))
                    yield [next(loader) for _ in range(run.options.grad_accum)]
            finally:
                stop_loader(loader)
            run.state.epoch += 1
            run.state.position = 0
    finally:
        if upcoming is not None:
            stop_loader(upcoming[1])


def step_parts(run: TrainingRun, loader_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This rank's loader batches of a global step as the micro-batches of the memory plan, still on the host: each
    batch itself, or its sequences split into parts that each fit; each with its step inputs (`STEP_INPUTS`: the
    loader's workers built a whole batch's, a part of a split batch builds its own here)."""
    assert run.memory is not None
    parts = []
    for batch in loader_batches:
        ranges = run.memory.parts(batch["lengths"].numpy(), sequence_blocks(batch))
        if len(ranges) > 1 and run.options.fsdp and run.world > 1:  # (plan_memory checked every epoch: a safety net)
            raise UserError(one_forward_a_step_under_fsdp(
                run.world, f"a micro-batch of step {run.state.step + 1} ({int(batch['lengths'].sum())} tokens) "
                "does not fit whole"))
        for part in split_packed_batch(batch, ranges, run.bucket_multiple):
            if STEP_INPUTS not in part:
                part[STEP_INPUTS] = packed_step_inputs(part, **run.step_input_settings)
            parts.append(part)
    return parts


def micro_batches(run: TrainingRun, batch: dict[str, Any],
                  feature_transform: FeatureTransform | None = None) -> list[MicroBatch]:
    """A packed loader batch as the micro-batches of the memory plan, all on the device (`step_parts`)."""
    return [micro_batch_inputs(run, part, feature_transform) for part in step_parts(run, [batch])]


# Whether the trainer's inputs built on the CPU are pinned before their copy to a CUDA device (`to_device`); False
# copies them from pageable memory as before, for benchmarks/bench_train.py --pageable-inputs to compare.
PIN_INPUTS = True


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` (CPU) copied to `device` without making the host wait for the device.

    CUDA copies from pageable host memory go through the driver's staging buffer, and for copies larger than a few
    tens of KB the driver may synchronise with the stream first (CUDA's "API synchronization behavior"): the host
    then waits for every step queued before it. The layout, labels, label positions and top-k rows of a micro-batch
    are such copies (~0.2-0.4 MB each at --batch-tokens 49152): the loader's workers build them
    (`packed_batches.packed_step_inputs`) and its pin_memory thread pins them with the rest of the batch (features,
    scales: `make_loader`; `split_packed_batch` keeps a split batch's parts pinned); what is still pageable here,
    the inputs built in this process for a part of a split batch (or for a loader not given the block size), is
    pinned first (PyTorch's caching host allocator reuses the pinned blocks; a copy from pinned memory is queued
    like a kernel)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    if PIN_INPUTS and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# Whether a micro-batch's stored features, the bulk of its bytes (~141 MB in fp8 for 49,152 tokens of the SmolLM2
# drafter's 5 target layers, ~252 MB for the Qwen3-8B-shaped benchmark's micro-batch), are copied to a CUDA device
# on a stream of their own (`stored_features`); False copies them on the compute stream as before, behind the work
# queued there (benchmarks/bench_train.py --features-on-compute-stream compares the two).
COPY_FEATURES_ASIDE = True


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the features of every micro-batch are copied on (one per device, made when first needed):
    from torch's pool of high-priority streams, which NCCL's collectives take theirs from only when
    TORCH_NCCL_HIGH_PRIORITY=1 (the pool is handed out in turn: a shared stream would make the wait for a copy wait
    for a collective too)."""
    return torch.cuda.Stream(device, priority=-1)


# `stored_features`' bookkeeping: per device, an event on the compute stream recorded at its previous copy
# (everything queued before that copy).
_PREVIOUS_COPY_MARKS: dict[torch.device, torch.cuda.Event] = {}


def stored_features(batch: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The micro-batch's stored features and their scales (None for a codec without) on `device`, for the codec to
    decode.

    On CUDA the copies run on `copy_stream`: the host runs ahead of the device (nothing in a step waits for it), so
    they are queued while the device still computes the micro-batch or step before, and overlap it instead of
    following it on the compute stream. The compute stream waits for them before their first use, and they are
    marked as used there (`record_stream`), so that the caching allocator hands their memory to a later copy only
    once the kernels queued up to their release have run. Two micro-batches' copies at most are held that way:
    before a copy the host waits until the device has passed the micro-batch before the last one (whose copy's
    memory is then free again), which is where it is anyway when it runs at most one micro-batch ahead, e.g. one
    micro-batch a step, whose metrics `PendingRecord` reads one step late (the memory plan counts the two copies,
    run_setup.plan_memory)."""
    scales = batch.get("feature_scales")
    if device.type != "cuda" or not COPY_FEATURES_ASIDE:
        return to_device(batch["features"], device), None if scales is None else to_device(scales, device)
    compute, side = torch.cuda.current_stream(device), copy_stream(device)
    previous = _PREVIOUS_COPY_MARKS.get(device)
    if previous is not None:
        previous.synchronize()
    mark = _PREVIOUS_COPY_MARKS[device] = torch.cuda.Event()
    mark.record(compute)
    with torch.cuda.stream(side):
        copied = [None if tensor is None else to_device(tensor, device) for tensor in (batch["features"], scales)]
    compute.wait_stream(side)
    for tensor in copied:
        if tensor is not None:
            tensor.record_stream(compute)
    features, scales = copied
    assert features is not None
    return features, scales


def micro_batch_inputs(run: TrainingRun, batch: dict[str, Any],
                       feature_transform: FeatureTransform | None = None) -> MicroBatch:
    """A packed loader batch (CPU) -> the micro-batch on the device: its layout, labels, label positions and top-k
    (`packed_step_inputs`) as the loader's workers built them, or built here where the batch has none (a part of a
    split batch, a loader not given the block size); features decoded on the device (after a copy of the stored
    bytes only); every copy queued without a host wait (`to_device`); the block count read on the host (`.numpy()`
    refuses a device tensor, so it never waits for the device)."""
    device = run.device
    inputs = batch.get(STEP_INPUTS)
    if inputs is None:
        inputs = packed_step_inputs(batch, **run.step_input_settings)
    layout = packed_layout(batch, run.options.block_size, inputs)
    features = run.codec.decode(*stored_features(batch, device), run.compute_dtype)
    if feature_transform is not None:
        features = feature_transform(features)
    topk_ids, topk_logprobs = (to_device(inputs[name], device) if name in inputs else None
                               for name in ("topk_ids", "topk_logprobs"))
    selector_index = to_device(inputs["selector_index"], device) if "selector_index" in inputs else None
    return MicroBatch(features=features[None], block_ids=to_device(inputs["block_ids"], device),
                      labels=to_device(inputs["labels"], device),
                      layout=layout.map_tensors(lambda tensor: to_device(tensor, device)),
                      sequences=len(batch["lengths"]), valid_blocks=int(layout.block_valid.numpy().sum()),
                      label_index=to_device(inputs["label_index"], device), selector_index=selector_index,
                      topk_ids=topk_ids, topk_logprobs=topk_logprobs)


def forward_loss(run: TrainingRun, micro: MicroBatch, global_weight_sum: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The drafter's forward over one micro-batch and the objective's loss (divided by the global weight sum)."""
    hidden = drafter_hidden(run, micro)
    loss, stats = block_objective(run, hidden, micro, global_weight_sum)
    return add_selector_loss(run, hidden, micro, global_weight_sum, loss, stats)


def drafter_hidden(run: TrainingRun, micro: MicroBatch) -> Tensor:
    """The drafter's forward over one micro-batch: its final hidden states of the block tokens."""
    batch, blocks, block_size = micro.block_ids.shape
    noise = torch.nn.functional.embedding(micro.block_ids.view(batch, blocks * block_size), run.embed)
    with run.accelerator.autocast():
        return run.model(noise, micro.features, micro.layout.query_position_ids(),
                         micro.layout.context_position_ids(), micro.layout)


def candidate_selector(run: TrainingRun) -> torch.nn.Module | None:
    """The drafter's DFlash 2 path selector (None for a DFlash drafter)."""
    return getattr(run.accelerator.unwrap_model(run.model), "candidate_selector", None)


def block_objective(run: TrainingRun, hidden: Tensor, micro: MicroBatch,
                    global_weight_sum: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """`run.objective`'s loss of the drafter's hidden states; for DFlash 2 its stats also hold the top-k candidates
    the path selector scores."""
    selector = candidate_selector(run)
    return run.objective(hidden, run.lm_head, micro, run.position_weights, global_weight_sum,
                         candidates=0 if selector is None else selector.top_k)


def add_selector_loss(run: TrainingRun, hidden: Tensor, micro: MicroBatch, global_weight_sum: Tensor, loss: Tensor,
                      stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """`block_objective`'s `loss` and `stats`, plus DFlash 2's path selector loss where the drafter has a selector."""
    selector = candidate_selector(run)
    if selector is not None:  # DFlash 2: plus the path selector's loss (--selector-weight)
        term, counts = selector_loss(selector, hidden, run.lm_head, micro.block_ids, micro.labels,
                                     stats.pop("candidates"), run.position_weights, global_weight_sum,
                                     missing=run.options.selector_missing, positions=micro.selector_index)
        stats.setdefault("terms", {})["block"] = loss.detach()
        stats["terms"]["selector"] = term.detach()
        loss = loss + run.options.selector_weight * term
        stats["counts"] = counts
    return loss, stats


def train_step(run: TrainingRun, loader_batches: list[dict[str, Any]],
               feature_transform: FeatureTransform | None = None) -> dict[str, Any]:
    """One optimizer step over this rank's loader batches of a global step, as the micro-batches of the memory
    plan, queued on the device without waiting for it; returns the step's metrics record (`update_weights`: its
    figures still on the device).

    A step that runs out of memory all the same (another process on the GPU grew after the plan was made, say) is
    not lost: its gradients are dropped and it is run again from the same loader batches cut into smaller
    micro-batches, which gives the same update; the smaller budget holds for `SMALLER_MEMORY_STEPS` steps (twice as
    many if it ran out again soon after the last return), then the planned one is tried again. Only where every
    micro-batch is already a single sequence, or where several processes train together (the others could not
    follow the retry), does it stop, in one line naming the flags."""
    return_to_planned_memory(run)
    while True:
        try:  # the copies to the device and the feature decoding can run out of memory too
            accumulated = accumulate_parts(run, step_parts(run, loader_batches), feature_transform)
            break
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            reason = str(error).strip().splitlines()[0][:200]
        # Out of the except block, so that the failed step's tensors (held by the traceback) can be freed.
        run.optimizer.zero_grad(set_to_none=True)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
        retry_smaller(run, loader_batches, reason)
    return update_weights(run, accumulated)


# After a step ran out of memory, its smaller micro-batch budget holds for this many steps, then the planned budget
# is tried again; a step that runs out again within as many steps of that return doubles the hold, one later starts
# from this again. Keeping the smaller budget for the rest of the run cost a real run dearly: on an H100 on
# 2026-12-06 one step that ran out of memory (most likely a shape run unfused past torch.compile's recompile limit)
# left the run's other 2,349 steps in micro-batches budgeted 7.3 GiB instead of 62.4, at 0.307 s a step against
# 0.061 before (h100_generate_rest_and_data1x_2026-12-06; the uncompiled shapes there cost their share too). What ran
# out once, a transient peak or another process's growth, is often gone later.
SMALLER_MEMORY_STEPS = 500


def return_to_planned_memory(run: TrainingRun) -> None:
    """The planned micro-batch budget again, once the smaller one after a retry has held its steps. (A resumed run
    starts from the planned budget: the hold is not checkpointed.)"""
    hold = run.memory_hold
    if hold is None or run.planned_memory is None or run.memory is run.planned_memory:
        return
    if run.state.step < hold.until_step:
        return
    assert run.memory is not None
    log.info("step %d: back to the planned micro-batch budget (%.2f GiB, from %.2f) after %d steps in smaller ones",
             run.state.step + 1, run.planned_memory.budget_bytes / GIB, run.memory.budget_bytes / GIB,
             run.state.step - hold.since_step)
    run.memory = run.planned_memory
    run.planned_memory_returns += 1


def smaller_budget_hold(run: TrainingRun) -> SmallerBudgetHold:
    """How long the smaller plan of a retry at this step holds (`SMALLER_MEMORY_STEPS`)."""
    step, hold = run.state.step, run.memory_hold
    if hold is not None and run.memory is not run.planned_memory:  # out of memory again while it holds: restarted
        return SmallerBudgetHold(until_step=step + hold.steps, steps=hold.steps, since_step=hold.since_step)
    steps = SMALLER_MEMORY_STEPS
    if hold is not None and step < hold.until_step + hold.steps:  # soon after the planned budget came back
        steps = 2 * hold.steps
    return SmallerBudgetHold(until_step=step + steps, steps=steps, since_step=step)


def retry_smaller(run: TrainingRun, loader_batches: list[dict[str, Any]], reason: str) -> None:
    """After a step ran out of memory: a memory plan that cuts its micro-batches smaller, or a one-line stop."""
    assert run.memory is not None
    failed = [size for b in loader_batches for size in run.memory.part_sizes(b["lengths"].numpy(), sequence_blocks(b))]
    smaller = run.memory.after_out_of_memory(failed) if run.world == 1 and not run.options.fsdp else None
    if smaller is None:
        where = (f"with one sequence per micro-batch ({max(failed)[0] / GIB:.2f} GiB estimated)" if run.world == 1
                 else f"on one of {run.world} processes, which cannot retry it alone")
        raise UserError(f"training step {run.state.step + 1} ran out of memory on {run.device} {where} ({reason}): "
                        "set --memory-limit to what this run may use, or lower --batch-tokens, --max-anchors or "
                        "--anchor-density, or train fewer --draft-layers; --resume continues from the last "
                        "checkpoint")
    run.out_of_memory_retries += 1
    hold = smaller_budget_hold(run)
    log.warning("training step %d ran out of memory on %s (%s): retrying it in smaller micro-batches (budget %.2f "
                "GiB per micro-batch, was %.2f), the same samples and the same update; the planned budget again "
                "after %d steps", run.state.step + 1, run.device, reason, smaller.budget_bytes / GIB,
                run.memory.budget_bytes / GIB, hold.steps)
    run.memory, run.memory_hold = smaller, hold


@dataclass
class StepTally:
    """What the micro-batches of one optimizer step add up to on this process, for `update_weights`: the summed
    loss, the objective's named terms (e.g. ce and kl of --loss mix), DFlash 2's candidate hits and positions, the
    correct and counted labels by block offset, and the block tokens."""

    loss: Tensor
    correct: Tensor
    counted: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)
    block_tokens: int = 0

    @classmethod
    def empty(cls, block_size: int, device: torch.device) -> StepTally:
        return cls(loss=torch.zeros((), device=device), correct=torch.zeros(block_size, device=device),
                   counted=torch.zeros(block_size, device=device))

    def add(self, loss: Tensor, stats: dict[str, Any], micro: MicroBatch) -> None:
        """One micro-batch's loss and `forward_loss` stats."""
        self.loss += loss.detach()
        for name, value in stats.get("terms", {}).items():
            self.terms[name] = self.terms.get(name, 0) + value.detach()
        for name, value in stats.get("counts", {}).items():
            self.counts[name] = self.counts.get(name, 0) + value
        self.correct += stats["correct_by_position"].float()
        self.counted += stats["count_by_position"].float()
        self.block_tokens += micro.valid_blocks * self.correct.shape[0]


def accumulate_parts(run: TrainingRun, parts: list[dict[str, Any]],
                     feature_transform: FeatureTransform | None = None) -> StepTally:
    """Forward and backward over this rank's micro-batches of a global step (`step_parts`, on the host), gradients
    accumulated; returns what they add up to, for `update_weights`. Each part is copied to the device just before
    its forward, so that one micro-batch's inputs are there at a time, as the memory plan budgets (on CUDA, with
    the next one's stored features arriving while it computes, at most two micro-batches' copies: `stored_features`);
    the loss normaliser is counted from the labels on the host."""
    local_weight = sum(weight_sum(part[STEP_INPUTS]["labels"], run.host_position_weights) for part in parts)
    return _accumulate(run, parts, to_device(local_weight, run.device),
                       lambda part: micro_batch_inputs(run, part, feature_transform))


def accumulate_gradients(run: TrainingRun, micro_batches: list[MicroBatch]) -> StepTally:
    """`accumulate_parts` over micro-batches already on the device (benchmarks/bench_train.py: one held in memory,
    or a step's from the loader, where it makes no difference with one micro-batch a step)."""
    local_weight = sum(weight_sum(m.labels, run.position_weights) for m in micro_batches)
    return _accumulate(run, micro_batches, local_weight, lambda micro: micro)


def _accumulate(run: TrainingRun, items: list[Any], local_weight: Tensor,
                to_micro_batch: Callable[[Any], MicroBatch]) -> StepTally:
    accelerator = run.accelerator
    total_weight = accelerator.reduce(local_weight.detach().clone(), reduction="sum")
    tally = StepTally.empty(run.options.block_size, run.device)
    for i, item in enumerate(items):
        micro = to_micro_batch(item)
        last = i == len(items) - 1
        with nullcontext() if last else accelerator.no_sync(run.model):
            loss, stats = forward_loss(run, micro, total_weight)
            # DDP averages gradients over processes; the loss is already globally normalised.
            accelerator.backward(loss * run.world)
        tally.add(loss, stats, micro)
        del micro, loss, stats  # before the next micro-batch is copied in
    return tally


def update_weights(run: TrainingRun, tally: StepTally) -> dict[str, Any]:
    """The optimizer step after `accumulate_gradients`; returns the step's metrics record, its figures still device
    tensors (reduced over the processes), so that nothing here waits for the device: `PendingRecord` reads them once
    later work is queued."""
    accelerator, options = run.accelerator, run.options
    if options.clip:  # the gradient norm it returns is not recorded: not read, no wait
        accelerator.clip_grad_norm_(run.model.parameters(), options.clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.step += 1
    correct = accelerator.reduce(tally.correct, reduction="sum")
    counted = accelerator.reduce(tally.counted, reduction="sum")
    record = {"step": run.state.step, "loss": accelerator.reduce(tally.loss, reduction="sum"),
              "lr": run.scheduler.get_last_lr()[0],
              "accuracy": correct[1:].sum() / counted[1:].sum().clamp(min=1),
              "labels": counted[1:].sum().long(),  # supervised drafted tokens in the global batch
              "block_tokens": tally.block_tokens}
    if run.world > 1:  # the processes' own counts summed (an integer tensor: read as int, one step late)
        record["block_tokens"] = accelerator.reduce(to_device(torch.tensor(tally.block_tokens), run.device), "sum")
    for name in sorted(tally.terms):
        record[f"loss_{name}"] = accelerator.reduce(tally.terms[name], reduction="sum")
    if tally.counts:  # DFlash 2: how often the true token is among the selector's candidates
        hits = accelerator.reduce(tally.counts["candidate_hits"].float(), reduction="sum")
        positions = accelerator.reduce(tally.counts["candidate_positions"].float(), reduction="sum")
        record["candidate_recall"] = hits.double() / positions.double().clamp(min=1.0)  # as Python's float division
    return record


class PendingRecord:
    """A step's metrics record (`update_weights`) on its way to the host: its device figures are copied into host
    memory behind the step's work as soon as it is queued, and `settle` waits for that copy alone (a CUDA event),
    not for work queued after it. Read one step late, the trainer's own bookkeeping never makes the host wait for
    the device inside a step (no other wait is known on the fast path, not yet checked on a GPU; grouped SDPA's masks and DFlash 2's selector
    loss still read the device).

    The figures travel as one float64 tensor: float32 and integer figures are exact in it, so the numbers are
    those `float()` / `int()` of each tensor gave."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = {k: v for k, v in record.items() if not isinstance(v, Tensor)}
        figures = {k: v for k, v in record.items() if isinstance(v, Tensor)}
        self.names = list(figures)
        self.integers = {k for k, v in figures.items() if not v.is_floating_point()}
        self.ready: torch.cuda.Event | None = None
        self.values: Tensor | None = None
        if figures:
            values = torch.stack([v.detach().reshape(()).double() for v in figures.values()])
            if values.device.type == "cuda":
                self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                self.values.copy_(values, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record()
            else:
                self.values = values

    def settle(self) -> dict[str, Any]:
        """The record with Python numbers (waits for this step's figures, nothing later)."""
        if self.values is None:
            return dict(self.record)
        if self.ready is not None:
            self.ready.synchronize()
        numbers = self.values.cpu().tolist()
        figures = {k: int(x) if k in self.integers else x for k, x in zip(self.names, numbers)}
        return {**self.record, **figures}


# Steps between queuing a step and reading its metrics record (`StepLog`): 1, the host prepares step N+1 while the
# device still runs step N; 0 reads each record at once, the host waiting for the device every step (the order
# before the records were deferred; the tests compare the two).
RECORD_LAG_STEPS = 1


class StepLog:
    """The training steps' metrics records into metrics.jsonl and the log, RECORD_LAG_STEPS late: `queue` takes
    step N's record (its figures still on the device) after step N's work is queued and writes the records before
    it; `flush` writes those still pending, which the loop does before anything that reads the drafter or the
    metrics (an evaluation, a checkpoint, the end of the run, an error leaving the loop).

    Writing a record first checks its loss (`check_loss`): a loss that is not finite or stuck stops the training
    at most one step after the step that had it (that step's update applied, no checkpoint written after it)."""

    def __init__(self, run: TrainingRun, metrics: MetricsLog) -> None:
        self.run, self.metrics = run, metrics
        self.pending: list[tuple[PendingRecord, float]] = []  # with the time each step began
        self.recent_losses: list[float] = []
        self.started = self.window_start = time.time()  # the loop's start; the log window's
        self.window_tokens = 0

    def queue(self, record: dict[str, Any], launched: float) -> None:
        """Step N's record, after its work is queued; writes the records older than RECORD_LAG_STEPS steps. A
        record's step_s ends where the next step began (`launched`)."""
        self.pending.append((PendingRecord(record), launched))
        while len(self.pending) > RECORD_LAG_STEPS:
            self.write_oldest()

    def flush(self) -> None:
        """Write every pending record (waiting for the device)."""
        while self.pending:
            self.write_oldest()

    def write_oldest(self) -> None:
        """The oldest pending record: its loss checked, then its line in metrics.jsonl (and in the log every
        log_every steps)."""
        run, options = self.run, self.run.options
        pending, launched = self.pending.pop(0)
        # The step ends where the next began; the last one queued when its figures are read.
        ended = self.pending[0][1] if self.pending else None
        record = pending.settle()
        step = record["step"]
        try:
            self.recent_losses = check_loss(run, self.recent_losses, record["loss"], step=step)
        except UserError:
            self.pending.clear()  # the training stops here: no later step is recorded (as when it stopped at once)
            raise
        ended = time.time() if ended is None else ended
        # step_s: this step's wall time in the loop, from its start to the next step's (waiting for the loader,
        # building its inputs, queuing its forward, backward and optimizer while the device still runs the step
        # before), so that the steps' times add up to the loop's; a step followed by an evaluation or a checkpoint,
        # and the last, ends when its figures are read (the device done with it), without the evaluation or the
        # checkpoint. What benchmarks/recipe_bench.py times. elapsed_s: since the loop began, evaluations included.
        record["step_s"] = round(ended - launched, 4)
        record["elapsed_s"] = round(ended - self.started, 3)
        self.window_tokens += record["block_tokens"]
        if step % options.log_every == 0 or step == run.total_steps:
            elapsed = ended - self.window_start
            record["block_tokens_per_s"] = self.window_tokens / max(elapsed, 1e-9)
            record["memory_peak_gib"] = round(measured_peak_bytes(run.device) / GIB, 3)
            remaining = (run.total_steps - step) * elapsed / max(1, options.log_every)
            log.info("step %d/%d loss %.4f acc %.3f lr %.2e %.0f block tok/s ETA %s", step, run.total_steps,
                     record["loss"], record["accuracy"], record["lr"], record["block_tokens_per_s"],
                     time.strftime("%H:%M:%S", time.gmtime(remaining)))
            self.window_tokens, self.window_start = 0, ended
        self.metrics.write(record)


def evaluate(run: TrainingRun, metrics: MetricsLog, model: DFlashDraftModel | None,
             feature_transform: FeatureTransform | None = None) -> dict[str, Any]:
    """Offline acceptance length of `model` (what `run.whole_drafter()` gave every process: the drafter on the main
    process, None on the others, which wait) on the validation split (`--eval-sequences` of it, default all); keeps
    the drafter of the best evaluation after step 0 in export_best/."""
    result: dict[str, Any] = {}
    if model is not None and run.index.eval:
        result = walk_split(run, model, "validation", run.options.eval_sequences, feature_transform)
        result["step"] = run.state.step
        log.info("eval step %d: tau %.3f +- %.3f (walk, %d validation sequences), %.3f (random anchors); "
                 "acceptance by position %s", run.state.step, result["tau_walk"], result["tau_walk_stderr"],
                 result["sequences"], result["tau_random_anchors"],
                 [round(x, 3) for x in result["acceptance_by_position"]])
        if run.state.step > 0 and result["tau_walk"] > run.best_tau:
            # A drafter trained for many epochs on little data overfits: its held-out tau peaks before the schedule
            # ends (docs/benchmarks.md, the H200 run). Keep the peak as well as the end.
            run.best_tau = result["tau_walk"]
            record = {"step": run.state.step, "tau_walk": result["tau_walk"]}
            export_draft(model, run.files.export_best, run.manifest, run_dir=run.files.root,
                         extra_files={BEST_RECORD_FILE: json.dumps(record) + "\n"})
        metrics.write({"step": run.state.step, **{f"eval/{k}": v for k, v in result.items()}})
        from dflash.stage2_train.plots import write_plots

        write_plots(run.files.root)
    run.accelerator.wait_for_everyone()
    return result


def walk_split(run: TrainingRun, model: DFlashDraftModel, split: str, limit: int | None,
               feature_transform: FeatureTransform | None = None) -> dict[str, Any]:
    """`offline_acceptance` of `model` over the first `limit` (None: all) sequences of a held-out split."""
    sequences = eval_sequences(run.index, limit, split)
    if feature_transform is not None:
        sequences = ({**s, "features": feature_transform(s["features"])} for s in sequences)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), run.accelerator.autocast(), uncompiled_sdpa(model):
            return offline_acceptance(model, run.embed, run.lm_head, sequences, run.options.block_size,
                                      run.mask_token_id, seed=run.options.seed)
    finally:
        model.train(was_training)


def report_test_split(run: TrainingRun, feature_transform: FeatureTransform | None = None) -> dict[str, Any]:
    """The chosen drafter (export_best/, picked on the validation split; export/ when the run has no validation
    split) walked once over the whole test split, as exported (bf16 weights): RUN/test_results.json and the last
    log line. Main process only."""
    chosen = run.files.export_best if (run.files.export_best / WEIGHTS_FILE).is_file() else run.files.export
    model = load_draft(chosen, run.options.attention).to(run.device)
    result = walk_split(run, model, "test", None, feature_transform)
    best = chosen / BEST_RECORD_FILE
    selected = json.loads(best.read_text()) if best.is_file() else {"step": run.state.step}
    half_width = 1.96 * result["tau_walk_stderr"]
    report = {"split": "test", "drafter": chosen.name, "step": selected["step"],
              "validation_tau_walk": selected.get("tau_walk"), **result,
              "tau_walk_ci95": [result["tau_walk"] - half_width, result["tau_walk"] + half_width]}
    run.files.test_results.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    log.info("test split, %d sequences never used for training or selection: tau %.3f +- %.3f (s.e.; 95%% CI "
             "%.3f-%.3f) for %s/ (step %d) -> %s", result["sequences"], result["tau_walk"], result["tau_walk_stderr"],
             *report["tau_walk_ci95"], chosen.name, selected["step"], run.files.test_results)
    return report


class MetricsLog:
    """metrics.jsonl (one JSON line per record) and TensorBoard scalars, written by the main process only."""

    def __init__(self, run: TrainingRun) -> None:
        self.path = run.files.metrics
        self.tensorboard = None
        if not run.is_main:
            self.path = None
            return
        if self.path.is_file():  # a run killed mid-write can leave half a line: cut it before appending again
            text = self.path.read_bytes()
            if text and not text.endswith(b"\n"):
                self.path.write_bytes(text[: text.rfind(b"\n") + 1])
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(str(run.files.tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, record["step"])
