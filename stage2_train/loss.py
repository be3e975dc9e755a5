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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 1024
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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i scale_i * CE(hidden_i @ weight.T, label_i), chunked over i; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, pos_weights: Tensor, denominator: Tensor,
                chunk_size: int, want_grad: bool):
        num = hidden.shape[0]
        need_h = want_grad and ctx.needs_input_grad[0]
        need_w = want_grad and ctx.needs_input_grad[1]
        weighted_ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(num, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = pos_weights / denominator  # [N] float32: d loss / d CE_i
        for start in range(0, num, chunk_size):
            end = min(start + chunk_size, num)
            h, lab = hidden[start:end], labels[start:end]
            logits = (h @ weight.t()).float()  # [n, V]; the only large buffer
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, lab[:, None])[:, 0]
            weighted_ce += (pos_weights[start:end] * (lse - target_logit)).sum()
            correct[start:end] = logits.argmax(dim=-1) == lab
            if need_h or need_w:
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                probs[torch.arange(end - start, device=probs.device), lab] -= 1.0
                grad_logits = probs.mul_(scale[start:end, None])  # [n, V] float32
                if need_h:
                    grad_hidden[start:end] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_weight += grad_logits.t() @ h.float()
            del logits
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.has = (need_h, need_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(weighted_ce, correct)
        return weighted_ce / denominator, weighted_ce, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce: Tensor | None, _grad_correct: Tensor | None):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        grad_hidden = grad_weight = None
        if need_h:
            grad_hidden = saved.pop(0)
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if need_w:
            grad_weight = (saved.pop(0) * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    global_weight_sum: Tensor | float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
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
      num_tokens       long scalar, number of supervised positions.
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
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = hidden.device

    flat_labels = labels.reshape(-1).to(device)
    index = (flat_labels != IGNORE_INDEX).nonzero(as_tuple=True)[0]  # one device sync (variable N)
    offsets = index % block
    selected_labels = flat_labels[index].long()
    selected_hidden = hidden.reshape(-1, hidden_size).index_select(0, index)  # autograd scatters back
    pos_weights = weights.to(device=device, dtype=torch.float32)[offsets]
    denominator = torch.as_tensor(global_weight_sum, dtype=torch.float32, device=device).detach()
    denominator = denominator.clamp_min(torch.finfo(torch.float32).tiny)
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)

    loss, weighted_ce, correct = _ChunkedLinearCrossEntropy.apply(
        selected_hidden, lm_head_weight, selected_labels, pos_weights, denominator, chunk_size, want_grad
    )
    correct_by_position = torch.zeros(block, dtype=torch.long, device=device).index_add_(0, offsets, correct.long())
    count_by_position = torch.zeros(block, dtype=torch.long, device=device).index_add_(
        0, offsets, torch.ones_like(offsets)
    )
    stats = {
        "weighted_ce_sum": weighted_ce.detach(),
        "weight_sum": weight_sum(labels.to(device), weights.to(device)),
        "correct_by_position": correct_by_position,
        "count_by_position": count_by_position,
        "num_tokens": count_by_position.sum(),
    }
    return loss, stats
