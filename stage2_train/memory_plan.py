"""The memory plan of a training run, made before the first step: the peak a micro-batch needs, estimated from its
shapes, against the memory the device has left. A micro-batch that would not fit is split into several that are
accumulated (the same samples, the same global step, the same result up to float rounding); a sequence that does
not fit even alone stops the run before it starts, with one line naming the estimate, the limit and the flag to
change. Nothing is left to the kernel's OOM killer, which ends a process without a word.

The estimate can still be wrong where the plan cannot see: another process on the same GPU that grows after the
plan was made, fragmentation. A step that runs out of memory all the same is retried (`trainer.train_step`) with
its micro-batches cut smaller (`MemoryPlan.after_out_of_memory`), which gives the same update; one that fails with a
single sequence per micro-batch stops with the one line above.

The estimate counts what autograd keeps per drafter layer for Q block queries over K = C + Q keys (projections,
norms in float32, RoPE copies, the grouped keys, the mask, the SwiGLU intermediates), the context projection, one
chunk of the fused loss, the transient gradients of one layer in the backward, and the optimizer state that the
first step allocates. Measured against the process's real peak on CPU (`train.log`: "memory: planned ... measured"),
it errs on the high side; the planned and measured peaks of every run are logged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dflash.shared.cgroups import cgroup_free_bytes
from dflash.shared.errors import UserError
from dflash.stage2_train.attention_masks import MAX_PACKED_COPIES_RATIO
from dflash.stage2_train.loss import chunk_rows, selector_chunk_rows

SAFETY = 1.25  # the estimate is multiplied by this before it is compared with the limit
CPU_HEADROOM_BYTES = 1 << 30  # left free on a CPU machine for the loader workers' interpreters and the page cache
GIB = 1 << 30


@dataclass(frozen=True)
class DrafterShape:
    """What the estimate needs to know of the drafter and the run."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    context_dim: int  # concatenated target features per token (fc input)
    vocab: int
    block_size: int
    element_bytes: int  # the compute dtype's (4: float32 on CPU, 2: bf16 under mixed precision)
    trainable_params: int
    loss_chunk: int = 1024  # rows of the loss's chunks (`loss.chunk_rows`)
    selector_chunk: int = 2048  # DFlash 2: positions of the selector loss's chunks (`loss.selector_chunk_rows`)
    conv_kernel: int = 0  # DFlash 2: taps of the convolution around each sublayer (0: a DFlash drafter)
    selector_top_k: int = 0  # DFlash 2: the path selector's candidates per position
    selector_rank: int = 0  # DFlash 2: the rank of its codebooks
    # CUDA: the stored features copied on the side stream (`trainer.stored_features`) that may be alive beside
    # any step, whatever its split: two micro-batches' at most (set by run_setup.plan_memory)
    copied_aside_bytes: int = 0

    @classmethod
    def of(cls, config: Any, trainable_params: int, element_bytes: int, device_type: str = "cpu") -> DrafterShape:
        added = config.dflash_config or {}  # DFlash 2's settings (none for a DFlash drafter)
        top_k = int(added.get("selector_top_k", 0))
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   layers=config.num_hidden_layers, context_dim=config.num_context_layers * config.hidden_size,
                   vocab=config.vocab_size, block_size=config.block_size, element_bytes=element_bytes,
                   trainable_params=trainable_params,  # DFlash 2's codebooks ([V, r] each) are counted here
                   conv_kernel=int(added.get("conv_kernel_size", 0)), selector_top_k=top_k,
                   selector_rank=int(added.get("selector_rank", 0)),
                   loss_chunk=chunk_rows(config.vocab_size, device_type),
                   selector_chunk=selector_chunk_rows(top_k or 1, config.hidden_size, device_type, element_bytes))


def step_bytes(shape: DrafterShape, context_tokens: Any, blocks: Any) -> Any:
    """Bytes a forward + backward over one packed micro-batch needs beyond the fixed state (ints, or numpy arrays
    elementwise)."""
    b, fp32 = shape.element_bytes, 4
    q = blocks * shape.block_size
    k = context_tokens + q
    h, i, d = shape.hidden, shape.intermediate, shape.head_dim
    qh, kvh = shape.heads * d, shape.kv_heads * d
    context = context_tokens * (shape.context_dim * (b + 1) + h * (2 * b + 2 * fp32))
    # Per layer: norms (input and float32 copy), q/k/v and their norms and RoPE copies, the keys and values as the
    # grouped attention copies and expands them to every query head (up to MAX_PACKED_COPIES_RATIO times the whole
    # mask's keys), the boolean mask (the whole one: an upper bound), the attention output, o_proj and the
    # residuals, and the SwiGLU intermediates.
    norms = 2 * q * h * (b + 2 * fp32)
    projections = q * qh * (3 * b + 2 * fp32) + k * h * b + k * kvh * (4 * b + 2 * fp32)
    grouped_keys = 2 * MAX_PACKED_COPIES_RATIO * k * qh * b
    mask = 2 * q * k
    attention_out = q * qh * b * 2 + q * h * b * 2
    mlp = q * (4 * i * b + h * b)
    # DFlash 2: per convolution (two per layer) its input, each tap's shifted copy and the output.
    convs = 2 * q * h * b * (shape.conv_kernel + 2) if shape.conv_kernel else 0
    per_layer = norms + projections + grouped_keys + mask + attention_out + mlp + convs
    # One chunk of logits: the head product in the compute dtype, its float32 copy (none when the product is float32
    # already) and one float32 temporary of that size (logsumexp's; measured on the CPU: 10 bytes a logit for the
    # uncompiled cross-entropy in bf16, 8 for KL).
    logit_bytes = b + fp32 + (fp32 if b < fp32 else 0)
    loss = shape.loss_chunk * shape.vocab * logit_bytes + 2 * q * h * fp32
    # DFlash 2's selector loss, one chunk at a time (at most the micro-batch's scored positions, blocks x (Bk - 1)):
    # its candidates' head rows [rows, k, H] twice (the rows and a temporary of their size) and their successor
    # codebook rows [rows, k, r] in float32 and those rows' gradient; its candidates come from the block loss's
    # logits, so it builds none of its own.
    selector_rows = np.minimum(shape.selector_chunk, blocks * (shape.block_size - 1))
    selector = (selector_rows * shape.selector_top_k * (2 * h * b + 2 * shape.selector_rank * fp32)
                if shape.conv_kernel else 0)
    return context + shape.layers * per_layer + per_layer + loss + selector  # + one layer's gradients in backward


def fixed_bytes(shape: DrafterShape) -> int:
    """The optimizer state and gradients the first step allocates (AdamW: two float32 moments; float32 grads), and
    on CUDA the stored features copied aside."""
    return 12 * shape.trainable_params + shape.copied_aside_bytes


def device_limit_bytes(device: Any) -> int:
    """Memory still free for this process: on CUDA the device's free memory; on CPU the available RAM, or what the
    process's memory cgroup still allows where that is less, less a headroom."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    available = int(psutil.virtual_memory().available)
    allowed = cgroup_free_bytes()
    if allowed is not None:
        available = min(available, allowed)
    return max(0, available - CPU_HEADROOM_BYTES)


@dataclass(frozen=True)
class SmallerBudgetHold:
    """After a training step ran out of memory (`trainer.retry_smaller`): the smaller plan holds until `until_step`
    (a run's completed steps), `steps` after the retry that set it; `since_step` is when the first of its retries
    ran out (steps completed then)."""

    until_step: int
    steps: int
    since_step: int


@dataclass(frozen=True)
class MemoryPlan:
    """How many parts each micro-batch of a run is split into, and the figures behind it."""

    shape: DrafterShape
    limit_bytes: int  # what was free when the run was set up (or --memory-limit)
    budget_bytes: int  # what one part of a micro-batch may use: the limit less the fixed state, / SAFETY
    planned_peak_bytes: int  # fixed state + the largest part, x SAFETY: what the steps add to `in_use_bytes`
    in_use_bytes: int = 0  # what the process held when the plan was made (weights, data, the interpreter)

    def parts(self, lengths: np.ndarray, blocks: np.ndarray) -> list[tuple[int, int]]:
        """The micro-batch of sequences with these context lengths and block counts, cut into consecutive
        sequence ranges [a, b) that each fit the budget (one range when the whole fits)."""
        ranges, first, context, count = [], 0, 0, 0
        for s, (length, n) in enumerate(zip(lengths.tolist(), blocks.tolist())):
            if s > first and step_bytes(self.shape, context + length, count + n) > self.budget_bytes:
                ranges.append((first, s))
                first, context, count = s, 0, 0
            context, count = context + length, count + n
        ranges.append((first, len(lengths)))
        return ranges

    def part_sizes(self, lengths: np.ndarray, blocks: np.ndarray) -> list[tuple[int, int]]:
        """(estimated bytes, sequences) of each part that `parts` cuts this micro-batch into."""
        return [(int(step_bytes(self.shape, int(lengths[a:b].sum()), int(blocks[a:b].sum()))), b - a)
                for a, b in self.parts(lengths, blocks)]

    def after_out_of_memory(self, failed_parts: list[tuple[int, int]]) -> MemoryPlan | None:
        """The plan for retrying a step that ran out of memory with these parts ((estimated bytes, sequences) of
        every micro-batch of the step): a budget that leaves the costliest part of several sequences half of what
        its sequences add to the fixed cost of any step (the loss chunk), so that this part is cut again, and not
        at once into single sequences. When every part is a single sequence there is nothing left to cut (None)."""
        several = [size for size, sequences in failed_parts if sequences > 1]
        if not several:
            return None
        base = int(step_bytes(self.shape, 0, 0))
        return replace(self, budget_bytes=base + (min(self.budget_bytes, max(several)) - base) // 2)


def make_plan(shape: DrafterShape, largest: tuple[int, int], longest: tuple[int, int], limit_bytes: int,
              device_name: str, in_use_bytes: int = 0) -> MemoryPlan:
    """The plan for a run whose largest micro-batch holds `largest` = (context tokens, blocks) and whose costliest
    sequence `longest` = (tokens, blocks); refuses when even that sequence alone does not fit."""
    budget = int((limit_bytes - fixed_bytes(shape)) / SAFETY)
    single = int(step_bytes(shape, *longest))
    if single > budget:
        need = (single * SAFETY + fixed_bytes(shape)) / GIB
        raise UserError(f"one training step on the longest sequence ({longest[0]:,} tokens, {longest[1]:,} blocks) "
                        f"needs ~{need:.1f} GiB but {limit_bytes / GIB:.1f} GiB are free on {device_name}: lower "
                        "--max-anchors or --anchor-density, or train fewer --draft-layers (or free memory)")
    whole = int(step_bytes(shape, *largest))
    peak = int(SAFETY * min(whole, budget) + fixed_bytes(shape))
    return MemoryPlan(shape=shape, limit_bytes=limit_bytes, budget_bytes=budget, planned_peak_bytes=peak,
                      in_use_bytes=in_use_bytes)


def measured_peak_bytes(device: Any) -> int:
    """The process's peak so far: CUDA memory allocated by torch, or on CPU the peak resident set."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def in_use_bytes(device: Any) -> int:
    """What the process holds now: CUDA memory allocated by torch, or on CPU the resident set. The free memory the
    plan is made against excludes it, so the plan's peak and the measured peak less this are comparable."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def limit_from_option(gib: float | None, device: Any) -> int:
    """--memory-limit in GiB when given (a run sharing the machine, or a test), else what the device has free."""
    return int(gib * GIB) if gib is not None else device_limit_bytes(device)

