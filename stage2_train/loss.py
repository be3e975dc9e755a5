"""The DFlash training loss: position-weighted cross-entropy over the anchor blocks, normalised globally.

For an anchor block of size Bk, offset k = 1..Bk-1 predicts ``token[p + k]`` with weight
``w_k = exp(-(k - 1) / gamma)``; offset 0 (the anchor token itself, given as input) is never a label (w_0 = 0).
The loss of one micro-batch is

    sum over supervised positions of w_k * CE(logits, label)  /  global_weight_sum

where ``global_weight_sum`` is the sum of the weights of all supervised positions of the WHOLE global batch (all
ranks, all gradient-accumulation steps). `weight_sum` needs only the labels, so a trainer computes it for every
micro-batch before any forward, all-reduces the total, and then the per-micro-batch losses (and gradients) simply
add up to the normalised global loss; DDP's gradient averaging must then be undone (multiply by world size) or the
losses summed with a SUM all-reduce, whichever the trainer uses.

Memory: logits over a 151936-token vocabulary for thousands of positions are gigabytes, so `dflash_loss` gathers
the supervised positions first and runs a fused "linear + cross-entropy" over chunks of them: each chunk's logits
are built, turned into the loss and the gradient w.r.t. the hidden states (and the LM head, if it requires
grad), and freed. Only [N, H] gradients are kept for backward; peak extra memory is one chunk of float32 logits.
The cross-entropy is computed in float32 whatever the input dtype.

Distillation (`block_loss` with the target's top-k, `dflash train --loss kl|mix`): the cache holds, for every label
position, the target's K most likely next tokens and their log-probabilities under its full softmax (stage 1,
`--store-target-topk K`). The KL term of a position is KL(p || q) from the target's distribution p to the drafter's
q, both over K + 1 outcomes: the K stored tokens, and one "other" bucket holding everything else, with the target's
remaining mass p_tail = 1 - sum_j p_j against the drafter's mass outside those K tokens, q_tail = 1 - sum_j q_j:

    KL = sum_j p_j (log p_j - log q_j) + p_tail (log p_tail - log q_tail)

Why a bucket and not renormalising the top-k to sum to 1: with the bucket, the drafter that equals the target has
KL = 0, the minimum (the bucket's KL is the KL of the two distributions coarsened to K + 1 outcomes, never more than
the full KL, and equal to it when the target puts no mass outside its top-k, e.g. K = vocabulary size); renormalised,
the target itself scores -log(sum_j p_j) > 0 and the optimum is a drafter more confident than the target, by exactly
the mass the top-k leaves out. The gradient w.r.t. the drafter's logits is q - p*, where p* is p on the K tokens and
p_tail spread over the others in the drafter's own proportions (p_tail q_v / q_tail). Stored log-probabilities are
float16, so their sum may exceed 1 by rounding: then p_tail = 0 and the K probabilities are divided by their sum.
log q_tail is a logsumexp over the logits outside the K tokens (exact, also when q_tail underflows float32), and the
tail's gradient is built from exp(z_v - logsumexp_tail) <= 1, so nothing overflows.

`block_loss` computes ce_weight * CE + kl_weight * KL per position (the objective picks the weights: ce 1/0, kl 0/1,
mix 1-w/w), under the same position weights and global normalisation as the cross-entropy, in the same chunks and
float32, from one LM head product per chunk; its memory is the cross-entropy's (one chunk of float32 logits and one
temporary of that size).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from dflash.stage2_train.options import SELECTOR_MISSING

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 1024  # rows of the LM head product per chunk on the CPU, and the fewest anywhere
# On CUDA, as many rows a chunk as keep its float32 logits within this many bytes (`chunk_rows`): each chunk is ~12
# kernel launches and one compiled call, and at 1,024 rows the SmolLM2 drafter's loss (~26K supervised positions a
# step at --batch-tokens 49152, 26 chunks) took ~21 ms of host time a step against ~11 ms of GPU time (H200 profile
# of 2026-12-06, benchmarks/results/h200_anchors_and_host_waits_2026-12-06): the host, not the GPU, set its pace.
# 1 GiB: 5,120 rows for a 49K vocabulary (6 chunks for those ~26K positions, the last padded to the full chunk
# under --compile: ~4K rows of padding, some 1.5-2 ms of GPU a step, which pays for one compiled shape instead of
# several), 1,024 for Qwen3's 152K (as before).
CUDA_CHUNK_BYTES = 1 << 30
_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The reference decay constant: 7 for block 16, 5 for block 10, 4 for block 8.

    Other block sizes have no published value; they get ``7 * block_size / 16`` (the block-16 ratio, scaled).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return _GAMMAS.get(block_size, 7.0 * block_size / 16.0)


def position_weights(
    block_size: int,
    gamma: float | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """[Bk] weights: w_0 = 0 (the anchor is never a label), w_k = exp(-(k - 1) / gamma) for k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    weights = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
    return torch.tensor(weights, dtype=dtype, device=device)


def _counts_per_position(labels: Tensor) -> Tensor:
    """[Bk] long: number of supervised labels at each block offset."""
    return (labels != IGNORE_INDEX).reshape(-1, labels.shape[-1]).sum(dim=0)


def weight_sum(labels: Tensor, weights: Tensor) -> Tensor:
    """Scalar float32: the sum of ``weights[k]`` over supervised positions (labels != -100) of ``labels [.., Bk]``.

    Needs no forward: compute it per micro-batch, all-reduce (SUM) over ranks and accumulation steps, and pass the
    total to `dflash_loss` as ``global_weight_sum``. Counted exactly per offset, then weighted in float64.
    """
    if labels.shape[-1] != weights.shape[0]:
        raise ValueError(f"labels block dim {labels.shape[-1]} != weights length {weights.shape[0]}")
    counts = _counts_per_position(labels).to(torch.float64)
    return (counts * weights.to(device=counts.device, dtype=torch.float64)).sum().to(torch.float32)


def target_distribution(topk_logprobs: Tensor, vocab_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The target's distribution over K + 1 outcomes from stored top-k log-probabilities [n, K] (any float dtype):
    (p [n, K], log p [n, K], p_tail [n], log p_tail [n]) in float32, summing to 1. p_tail = 1 - sum_j p_j, or 0
    when the sum exceeds 1 by rounding (the K probabilities are then divided by their sum) and when K covers the
    whole vocabulary (no "other" token exists)."""
    logprobs = topk_logprobs.float()
    mass = logprobs.exp().sum(dim=-1)
    tail = (1.0 - mass).clamp_min(0.0) if topk_logprobs.shape[-1] < vocab_size else torch.zeros_like(mass)
    log_total = torch.log(mass + tail)
    log_p = logprobs - log_total[:, None]
    return log_p.exp(), log_p, tail / (mass + tail), torch.log(tail) - log_total


def cross_entropy_chunk(logits: Tensor, labels: Tensor, pos_weights: Tensor, scale: Tensor, ce_weight: float,
                        grad_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk of the cross-entropy path of `_ChunkedLinearLoss`: logits [n, V] (any float dtype; computed in
    float32), labels [n], pos_weights and scale [n] float32 -> (sum of pos_weights * CE, argmax == label [n], the
    gradient w.r.t. the logits in `grad_dtype`, ce_weight * (softmax - onehot(label)) * scale, or None when
    `grad_dtype` is None). Written for `torch.compile` too (`_compiled_cross_entropy_chunk`): in place on a float32
    copy, so eagerly it holds one float32 chunk besides its input and output."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, labels[:, None])[:, 0]
    weighted_ce = (pos_weights * (lse - picked)).sum()
    correct = z.argmax(dim=-1) == labels
    if grad_dtype is None:
        return weighted_ce, correct, None
    factor = (ce_weight * scale)[:, None]
    grad = z.sub_(lse[:, None]).exp_().mul_(factor)  # on z's memory: z is a copy, or logits already float32
    grad = grad.scatter_add_(1, labels[:, None], -factor)
    return weighted_ce, correct, grad.to(grad_dtype)


@functools.cache
def _compiled_cross_entropy_chunk():  # noqa: ANN202 - a torch.compile'd `cross_entropy_chunk`
    """`cross_entropy_chunk` compiled once per process for static shapes (the loss pads its last chunk to the
    chunk size, so one graph serves every chunk of every step): its softmax, gather, argmax and gradient fused into
    a few kernels instead of ~10 passes over the [chunk, V] float32 logits."""
    return torch.compile(cross_entropy_chunk, dynamic=False, fullgraph=True)


def _padded_rows(rows: Tensor, size: int) -> Tensor:
    """`rows` with zero rows appended up to `size` (itself when it has them)."""
    if rows.shape[0] == size:
        return rows
    return torch.cat([rows, rows.new_zeros((size - rows.shape[0], *rows.shape[1:]))])


class _ChunkedLinearLoss(torch.autograd.Function):
    """sum_i scale_i * (ce_weight * CE_i + kl_weight * KL_i) over rows i of hidden @ weight.T, chunked; gradients
    computed in the forward. KL_i needs the target's top-k ids / log-probs of row i (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, topk_ids: Tensor | None,
                topk_logprobs: Tensor | None, pos_weights: Tensor, denominator: Tensor, ce_weight: float,
                kl_weight: float, chunk_size: int, want_grad: bool, candidates_k: int, fused: bool):
        num = hidden.shape[0]
        vocab = weight.shape[0]
        need_h = want_grad and ctx.needs_input_grad[0]
        need_w = want_grad and ctx.needs_input_grad[1]
        distill = topk_ids is not None and topk_logprobs is not None
        weighted_ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weighted_kl = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(num, dtype=torch.bool, device=hidden.device)
        candidates = torch.zeros((num, candidates_k), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = pos_weights / denominator  # [N] float32: d loss / d (ce_weight CE_i + kl_weight KL_i)
        # The cross-entropy path's chunk: compiled with `fused` (one static shape: the last chunk padded), else as
        # written; its gradient in float32 where the head learns (summed over chunks), else in the head's dtype.
        compiled = fused and not distill
        ce_chunk = _compiled_cross_entropy_chunk() if compiled else cross_entropy_chunk
        grad_dtype = (torch.float32 if need_w else weight.dtype) if (need_h or need_w) else None
        for start in range(0, num, chunk_size):
            end = min(start + chunk_size, num)
            h, lab, row_weights, row_scale = (t[start:end] for t in (hidden, labels, pos_weights, scale))
            if compiled:  # the missing rows of the last chunk: zeros with weight 0
                h, lab, row_weights, row_scale = (_padded_rows(t, chunk_size)
                                                  for t in (h, lab, row_weights, row_scale))
            products = h @ weight.t()  # [n, V] in the compute dtype
            if candidates_k:  # DFlash 2's candidates, from these logits rather than a second head product (and
                # before any float32 copy: the same values, half the bytes to read in bf16)
                candidates[start:end] = products[: end - start].topk(candidates_k, dim=-1).indices
            if not distill:
                ce, chunk_correct, grad_logits = ce_chunk(products, lab, row_weights, row_scale, ce_weight,
                                                          grad_dtype)
                weighted_ce += ce
                correct[start:end] = chunk_correct[: end - start]
            else:
                rows = torch.arange(end - start, device=hidden.device)
                logits = products.float()  # the only large buffer
                del products
                lse = torch.logsumexp(logits, dim=-1)
                weighted_ce += (row_weights * (lse - logits[rows, lab])).sum()
                correct[start:end] = logits.argmax(dim=-1) == lab
                ids = topk_ids[start:end].long()
                p, log_p, p_tail, log_p_tail = target_distribution(topk_logprobs[start:end], vocab)
                top_logits = logits.gather(1, ids)
                logits.scatter_(1, ids, -math.inf)  # the "other" bucket: every logit but the K stored ones
                tail_lse = torch.logsumexp(logits, dim=-1)  # -inf when K covers the vocabulary
                logits.scatter_(1, ids, top_logits)
                log_q = top_logits - lse[:, None]
                tail_term = torch.where(p_tail > 0, p_tail * (log_p_tail - (tail_lse - lse)), 0.0)
                kl = (p * (log_p - log_q)).sum(dim=-1) + tail_term
                weighted_kl += (row_weights * kl).sum()
                grad_logits = None
                if need_h or need_w:
                    # d/dz = (ce_weight + kl_weight) q - ce_weight onehot(label) - kl_weight p*, where p* is p on the
                    # K tokens and p_tail q_v / q_tail on the others: the others as exp(z_v - tail_lse) (<= 1)
                    # times ((ce_weight + kl_weight) q_tail - kl_weight p_tail); the K columns are then overwritten.
                    total = ce_weight + kl_weight
                    has_tail = torch.isfinite(tail_lse)
                    q_tail = torch.where(has_tail, (tail_lse - lse).exp(), 0.0)
                    factor = total * q_tail - kl_weight * p_tail
                    grad_logits = logits.sub_(torch.where(has_tail, tail_lse, lse)[:, None]).exp_()
                    grad_logits.mul_(factor[:, None])
                    grad_logits.scatter_(1, ids, total * log_q.exp() - kl_weight * p)
                    if ce_weight:
                        grad_logits[rows, lab] -= ce_weight
                    grad_logits.mul_(row_scale[:, None])  # [n, V] float32
                del logits
            if need_h:
                grad_hidden[start:end] = (grad_logits[: end - start].to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += grad_logits.float().t() @ h.float()
            del grad_logits
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.has = (need_h, need_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(weighted_ce, weighted_kl, correct, candidates)
        loss = (ce_weight * weighted_ce + kl_weight * weighted_kl) / denominator
        return loss, weighted_ce, weighted_kl, correct, candidates

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce: Tensor | None, _grad_kl: Tensor | None,
                 _grad_correct: Tensor | None, _grad_candidates: Tensor | None):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        grad_hidden = grad_weight = None
        if need_h:
            grad_hidden = saved.pop(0)
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if need_w:
            grad_weight = (saved.pop(0) * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None, None, None


def chunk_rows(vocab: int, device_type: str) -> int:
    """Rows of the LM head product the loss takes at a time on a device of `device_type` (see CUDA_CHUNK_BYTES): a
    multiple of DEFAULT_CHUNK_SIZE, at least it."""
    if device_type != "cuda":
        return DEFAULT_CHUNK_SIZE
    rows = CUDA_CHUNK_BYTES // (4 * vocab) // DEFAULT_CHUNK_SIZE * DEFAULT_CHUNK_SIZE
    return max(DEFAULT_CHUNK_SIZE, rows)


def supervised_index(labels: Tensor) -> Tensor:
    """The flat positions of `labels` (any shape) that are supervised (not IGNORE_INDEX), ascending."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero(as_tuple=True)[0]


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    global_weight_sum: Tensor | float,
    chunk_size: int | None = None,
    candidates: int = 0,
    fused: bool = False,
    label_index: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted block cross-entropy of one micro-batch, divided by the global weight sum.

    hidden: [B, A * Bk, H] or [B, A, Bk, H] draft outputs (after the final norm); lm_head_weight: [V, H] the frozen
    target head; labels: [B, A, Bk] (-100 = not supervised; offset 0 should always be -100, its weight is 0
    anyway); weights: [Bk] from `position_weights`; global_weight_sum: the all-reduced `weight_sum` total (a 0 total
    means there is nothing to learn: the loss is 0).

    Returns (loss, stats). ``loss`` is a float32 scalar; summing it over all micro-batches of all ranks gives the
    normalised global loss, and the same holds for the gradients. ``stats`` (all detached):
      weighted_ce_sum  float32 scalar, sum of w_k * CE over this micro-batch (loss * global_weight_sum);
      weight_sum       float32 scalar, this micro-batch's own `weight_sum`;
      correct_by_position [Bk] long, argmax == label counts per block offset;
      count_by_position   [Bk] long, supervised counts per block offset (accuracy = correct / count);
      num_tokens       long scalar, number of supervised positions;
      candidates       (only when ``candidates`` = k > 0) [B, A, Bk, k] long, the ids of the k largest logits at
                       each supervised position (0 elsewhere), highest first: DFlash 2's selector candidates
                       (`selector_loss`), taken from the logits this loss builds anyway.
    ``fused``: each chunk's softmax, loss and gradient in a compiled kernel (`_compiled_cross_entropy_chunk`; the
    same results up to float rounding), for `dflash train --compile`. ``label_index``: the flat positions of
    ``labels`` that are supervised (`supervised_index`), when the caller has them (see `block_loss`).
    ``chunk_size``: rows of the LM head product at a time (default `chunk_rows` for the vocabulary and device; the
    results do not depend on it beyond float rounding).
    """
    return block_loss(hidden, lm_head_weight, labels, weights, global_weight_sum, chunk_size=chunk_size,
                      candidates=candidates, fused=fused, label_index=label_index)


def block_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    global_weight_sum: Tensor | float,
    *,
    topk_ids: Tensor | None = None,
    topk_logprobs: Tensor | None = None,
    ce_weight: float = 1.0,
    kl_weight: float = 0.0,
    chunk_size: int | None = None,
    candidates: int = 0,
    fused: bool = False,
    label_index: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ce_weight * CE + kl_weight * KL (module docstring) of one micro-batch, position-weighted, divided by the
    global weight sum; `dflash_loss` is its cross-entropy alone.

    Arguments as `dflash_loss`, and topk_ids / topk_logprobs: [B, A, Bk, K] the target's top-k of each label
    position (aligned with labels; read only where labels != -100), needed when kl_weight > 0. Stats as
    `dflash_loss`'s, and weighted_kl_sum (sum of w_k * KL; 0 without top-k). CE is computed and reported whatever
    its weight (it is one gather beside the logsumexp the KL needs anyway). ``fused`` (`dflash_loss`) applies to
    the cross-entropy alone, without top-k; with it the KL path runs as without.
    """
    if labels.dim() != 3:
        raise ValueError(f"labels must be [B, A, Bk], got shape {tuple(labels.shape)}")
    batch, num_blocks, block = labels.shape
    hidden_size = hidden.shape[-1]
    if hidden.shape[:-1] not in ((batch, num_blocks * block), (batch, num_blocks, block)):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_size:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} does not match hidden size {hidden_size}")
    if weights.shape != (block,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, want ({block},)")
    if chunk_size is None:
        chunk_size = chunk_rows(lm_head_weight.shape[0], hidden.device.type)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if ce_weight < 0 or kl_weight < 0:
        raise ValueError(f"loss weights must be >= 0, got ce {ce_weight}, kl {kl_weight}")
    distill = topk_ids is not None and topk_logprobs is not None
    if kl_weight and not distill:
        raise ValueError("a KL term needs the target's top-k (topk_ids and topk_logprobs)")
    if distill:
        for name, tensor in (("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
            if tensor.shape[:3] != labels.shape or tensor.dim() != 4:
                raise ValueError(f"{name} {tuple(tensor.shape)} does not match labels {tuple(labels.shape)} + (K,)")
    device = hidden.device

    flat_labels = labels.reshape(-1).to(device)
    # The supervised positions: given (built on the CPU with the labels, so the host need not wait for the device
    # here), else found on the device, which makes the host wait for the forward (variable N).
    index = label_index.to(device) if label_index is not None else supervised_index(flat_labels)
    offsets = index % block
    selected_labels = flat_labels[index].long()
    selected_hidden = hidden.reshape(-1, hidden_size).index_select(0, index)  # autograd scatters back
    selected_ids = selected_logprobs = None
    if distill:
        k = topk_ids.shape[-1]
        selected_ids = topk_ids.reshape(-1, k).to(device).index_select(0, index)
        selected_logprobs = topk_logprobs.reshape(-1, k).to(device).index_select(0, index)
    pos_weights = weights.to(device=device, dtype=torch.float32)[offsets]
    denominator = torch.as_tensor(global_weight_sum, dtype=torch.float32, device=device).detach()
    denominator = denominator.clamp_min(torch.finfo(torch.float32).tiny)
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)

    loss, weighted_ce, weighted_kl, correct, selected_candidates = _ChunkedLinearLoss.apply(
        selected_hidden, lm_head_weight, selected_labels, selected_ids, selected_logprobs, pos_weights, denominator,
        float(ce_weight), float(kl_weight), chunk_size, want_grad, int(candidates), bool(fused)
    )
    correct_by_position = torch.zeros(block, dtype=torch.long, device=device).index_add_(0, offsets, correct.long())
    count_by_position = torch.zeros(block, dtype=torch.long, device=device).index_add_(
        0, offsets, torch.ones_like(offsets)
    )
    stats = {
        "weighted_ce_sum": weighted_ce.detach(),
        "weighted_kl_sum": weighted_kl.detach(),
        "weight_sum": weight_sum(labels.to(device), weights.to(device)),
        "correct_by_position": correct_by_position,
        "count_by_position": count_by_position,
        "num_tokens": count_by_position.sum(),
    }
    if candidates:
        every = torch.zeros((flat_labels.shape[0], candidates), dtype=torch.long, device=device)
        stats["candidates"] = every.index_copy_(0, index, selected_candidates).reshape(*labels.shape, candidates)
    return loss, stats


# Positions per chunk of the selector loss (its candidates' head rows, [rows, k, H], are recomputed in backward) on
# the CPU, and the fewest anywhere. On CUDA as many as keep those head rows within CUDA_CHUNK_BYTES
# (`selector_chunk_rows`): a chunk is ~150 eager operations, forward, recomputation and backward (counted on the
# CPU, 2026-12-07), and at 2,048 rows the SmolLM2 DFlash 2 step (~24,900 positions, 13 chunks) dispatched ~2,000 of
# its ~2,700 eager operations there, on an H100 step that is host-bound; 57,344 rows (one chunk) for the default
# k = 16 and H = 576 in bf16.
SELECTOR_CHUNK_ROWS = 2048


def selector_chunk_rows(top_k: int, hidden_size: int, device_type: str, element_bytes: int = 2) -> int:
    """Positions the selector loss takes at a time on a device of `device_type` (see SELECTOR_CHUNK_ROWS): a
    multiple of SELECTOR_CHUNK_ROWS, at least it."""
    if device_type != "cuda":
        return SELECTOR_CHUNK_ROWS
    rows = CUDA_CHUNK_BYTES // (top_k * hidden_size * element_bytes) // SELECTOR_CHUNK_ROWS * SELECTOR_CHUNK_ROWS
    return max(SELECTOR_CHUNK_ROWS, rows)


def selector_positions(labels: Tensor, block_ids: Tensor) -> Tensor:
    """The flat positions of labels [..., N, Bk] that the selector loss scores, ascending: supervised, at a block
    offset >= 1, with a known predecessor (the block's anchor, block_ids [..., N, Bk] at offset 0, for offset 1;
    else the previous position's label). The trainer's loader builds them on the CPU with the labels
    (`packed_batches.packed_step_inputs`), so that the loss need not wait for the device to find them."""
    block = labels.shape[-1]
    labels = labels.reshape(-1, block)
    predecessors = torch.cat([block_ids.reshape(-1, block)[:, :1], labels[:, 1:-1]], dim=1)
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, 1:] = (labels[:, 1:] != IGNORE_INDEX) & (predecessors != IGNORE_INDEX)
    return scored.reshape(-1).nonzero(as_tuple=True)[0]


def selector_loss(
    selector: torch.nn.Module,
    hidden: Tensor,
    lm_head_weight: Tensor,
    block_ids: Tensor,
    labels: Tensor,
    candidates: Tensor,
    weights: Tensor,
    global_weight_sum: Tensor | float,
    *,
    missing: str,
    chunk_rows: int | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DFlash 2's path-selector loss of one micro-batch: cross-entropy over the k candidates of S_t(y_{t-1}, .),
    with the true previous token as predecessor (the anchor at offset 1), under the block loss's position weights
    and global normalisation (`modeling_dflash.CandidateSelector`).

    hidden [1, N * Bk, H] (the drafter's final hidden states), block_ids / labels [1, N, Bk], candidates
    [1, N, Bk, k]: the top-k of the drafter's logits at each supervised position, highest first, as the block loss
    returns them (`block_loss(..., candidates=k)`: from the logits it builds anyway, so that each position takes one
    LM-head product, not three). A position counts where its label and its predecessor are known (labels != -100;
    a predecessor that is an unsupervised position, e.g. the last prompt token inside a block, drops the position).
    ``missing`` (the run's `--selector-missing`; no default here, the option has the one): where the true token is
    not among the top-k candidates, ``inject``
    puts it in place of the last candidate (SpecForge, vLLM speculators and ModelOpt do so), ``drop`` leaves the
    position out (NeMo Automodel); either way `candidate_hits` / `candidate_positions` give the candidate recall.
    U_t (the candidates' logits) keeps its gradient: the selector loss also trains the drafter's logits. Memory:
    chunks of `chunk_rows` positions (default `selector_chunk_rows` for the device), each recomputed in backward
    (`checkpoint`), so only the chunk's [rows, k, H] head rows live at a time. ``positions``: the flat positions of
    ``labels`` it scores (`selector_positions`), when the caller has them; else it finds them on the device, which
    makes the host wait for it.
    """
    from torch.utils.checkpoint import checkpoint

    if missing not in SELECTOR_MISSING:
        raise ValueError(f"missing={missing!r}: choose one of {SELECTOR_MISSING}")
    device, block_size = hidden.device, labels.shape[-1]
    head = lm_head_weight.detach()
    if chunk_rows is None:
        chunk_rows = selector_chunk_rows(candidates.shape[-1], hidden.shape[-1], device.type, head.element_size())
    # Every row gathered by index, none by a boolean mask: the row count is the index's length, known on the host,
    # so nothing here waits for the device.
    positions = (selector_positions(labels, block_ids) if positions is None else positions).to(device)
    offsets = positions % block_size
    flat_labels, flat_block_ids = labels.reshape(-1).to(device), block_ids.reshape(-1).to(device)
    rows_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # autograd scatters back
    rows_truth = flat_labels.index_select(0, positions)
    before = positions - 1  # the predecessor: the anchor (block input at offset 0) at offset 1, else the label before
    rows_pred = torch.where(offsets == 1, flat_block_ids.index_select(0, before), flat_labels.index_select(0, before))
    rows_candidates = candidates.reshape(-1, candidates.shape[-1]).to(device).index_select(0, positions)
    row_weights = weights.to(device=device, dtype=torch.float32)[offsets]

    def chunk_loss(h: Tensor, y: Tensor, a: Tensor, c: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        hit = c == y[:, None]
        found = hit.any(-1)
        if missing == "inject":
            c = torch.cat([c[:, :-1], torch.where(found, c[:, -1], y)[:, None]], dim=1)
            hit[:, -1] |= ~found
            keep = torch.ones_like(found)
        else:
            keep = found
        index = hit.float().argmax(-1)
        unary = torch.einsum("nh,nkh->nk", h.to(head.dtype), head[c]).float()
        scores = selector.scores(selector.hidden_projection(h), a, unary, c).float()
        ce = torch.nn.functional.cross_entropy(scores, index, reduction="none")
        return (w * ce * keep).sum(), found.sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.long, device=device)
    for start in range(0, rows_hidden.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (rows_hidden[part], rows_truth[part], rows_pred[part], rows_candidates[part], row_weights[part])
        loss, found = (checkpoint(chunk_loss, *args, use_reentrant=False) if torch.is_grad_enabled()
                       else chunk_loss(*args))
        total = total + loss
        hits = hits + found
    denominator = torch.as_tensor(global_weight_sum, dtype=torch.float32, device=total.device)
    loss = total / denominator.clamp_min(torch.finfo(torch.float32).tiny)
    # (a fill on the device, not a copy of a host number: that would wait for the stream)
    return loss, {"candidate_hits": hits.detach(),
                  "candidate_positions": torch.full((), rows_hidden.shape[0], dtype=torch.long, device=device)}
