"""The distillation objective (`--loss kl|mix`): the chunked fused loss against a dense float64 reference (values and
gradients), the full KL when K is the vocabulary, the "other" bucket's optimum, and its numerics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.stage2_train.loss import IGNORE_INDEX, block_loss, dflash_loss, position_weights, weight_sum
from dflash.stage2_train.objective import LOSSES, MicroBatch, make_objective

VOCAB, HIDDEN, BLOCK = 97, 24, 6


def problem(seed: int, k: int, batch: int = 2, blocks: int = 5, scale: float = 1.0, vocab: int = VOCAB) -> dict:
    """Random drafter states, LM head, labels (some unsupervised) and a target whose top-k log-probabilities come
    from its own full softmax, stored as float16 (as the cache holds them)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, blocks * BLOCK, HIDDEN, generator=gen, dtype=torch.float64) * scale
    head = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    labels = torch.randint(0, vocab, (batch, blocks, BLOCK), generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.25] = IGNORE_INDEX
    labels[:, :, 0] = IGNORE_INDEX
    target_logits = torch.randn(batch, blocks, BLOCK, vocab, generator=gen, dtype=torch.float64) * 2.5
    log_p = torch.log_softmax(target_logits, dim=-1)
    top = torch.topk(log_p, k, dim=-1)
    weights = position_weights(BLOCK, dtype=torch.float64)
    return {"hidden": hidden, "head": head, "labels": labels, "ids": top.indices.to(torch.int32),
            "logprobs": top.values.to(torch.float16), "full_log_p": log_p, "weights": weights}


def dense_reference(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor,
                    logprobs: torch.Tensor, weights: torch.Tensor, total: float, ce_weight: float,
                    kl_weight: float) -> torch.Tensor:
    """The objective written plainly in float64 over full logits: per supervised position, ce_weight * CE +
    kl_weight * KL over the K stored tokens plus one "other" bucket (log q_other: a logsumexp of the drafter's
    log-probabilities with the K tokens masked out), position-weighted, divided by the global weight sum."""
    vocab = head.shape[0]
    logits = hidden.reshape(*labels.shape, -1) @ head.t()
    log_q = torch.log_softmax(logits, dim=-1)
    keep = labels != IGNORE_INDEX
    w = weights.expand_as(labels)[keep]
    ce = -log_q[keep].gather(1, labels[keep][:, None])[:, 0]
    p = logprobs[keep].double().exp()
    other = torch.clamp(1 - p.sum(-1), min=0) if ids.shape[-1] < vocab else torch.zeros(len(p), dtype=p.dtype)
    total_mass = p.sum(-1) + other
    p, other = p / total_mass[:, None], other / total_mass
    kept_log_q, kept_ids = log_q[keep], ids[keep].long()
    in_top = torch.zeros_like(kept_log_q, dtype=torch.bool).scatter_(1, kept_ids, True)
    log_q_other = torch.logsumexp(kept_log_q.masked_fill(in_top, -math.inf), dim=-1)
    kl = (torch.xlogy(p, p) - p * kept_log_q.gather(1, kept_ids)).sum(-1)
    kl = kl + torch.where(other > 0, torch.xlogy(other, other) - other * log_q_other, 0.0)
    return (w * (ce_weight * ce + kl_weight * kl)).sum() / total


def ours_and_reference(case: dict, ce_weight: float, kl_weight: float, chunk: int, dtype=torch.float32):
    total = float(weight_sum(case["labels"], case["weights"]))
    h_ref = case["hidden"].clone().requires_grad_()
    w_ref = case["head"].clone().requires_grad_()
    reference = dense_reference(h_ref, w_ref, case["labels"], case["ids"], case["logprobs"], case["weights"], total,
                                ce_weight, kl_weight)
    reference.backward()
    h = case["hidden"].to(dtype).requires_grad_()
    w = case["head"].to(dtype).requires_grad_()
    loss, stats = block_loss(h, w, case["labels"], case["weights"].float(), total, topk_ids=case["ids"],
                             topk_logprobs=case["logprobs"], ce_weight=ce_weight, kl_weight=kl_weight,
                             chunk_size=chunk)
    loss.backward()
    return (loss, h.grad, w.grad, stats), (reference, h_ref.grad, w_ref.grad)


@pytest.mark.parametrize("ce_weight,kl_weight", [(0.0, 1.0), (0.3, 0.7), (1.0, 0.0)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_loss_and_gradients_equal_the_dense_reference(ce_weight: float, kl_weight: float, chunk: int) -> None:
    """K = 10 of 97 tokens (the "other" bucket holds real mass), float16 log-probabilities (their sum can exceed
    1 by rounding), gradients w.r.t. the drafter states and the LM head."""
    case = problem(0, k=10)
    (loss, grad_h, grad_w, stats), (reference, ref_h, ref_w) = ours_and_reference(case, ce_weight, kl_weight, chunk)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-4, atol=1e-7)
    total = float(weight_sum(case["labels"], case["weights"]))
    ce_only = dense_reference(case["hidden"], case["head"], case["labels"], case["ids"], case["logprobs"],
                              case["weights"], total, 1.0, 0.0)
    kl_only = dense_reference(case["hidden"], case["head"], case["labels"], case["ids"], case["logprobs"],
                              case["weights"], total, 0.0, 1.0)
    torch.testing.assert_close(stats["weighted_ce_sum"].double() / total, ce_only, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["weighted_kl_sum"].double() / total, kl_only, rtol=1e-5, atol=1e-6)


def test_ce_weight_alone_is_the_cross_entropy() -> None:
    case = problem(1, k=5)
    total = weight_sum(case["labels"], case["weights"])
    h, w = case["hidden"].float(), case["head"].float()
    ce, _ = dflash_loss(h, w, case["labels"], case["weights"].float(), total, chunk_size=9)
    same, _ = block_loss(h, w, case["labels"], case["weights"].float(), total, topk_ids=case["ids"],
                         topk_logprobs=case["logprobs"], ce_weight=1.0, kl_weight=0.0, chunk_size=9)
    torch.testing.assert_close(same, ce, rtol=1e-6, atol=0)


def test_kl_with_k_equal_to_the_vocabulary_is_the_full_kl() -> None:
    """K = V: no "other" bucket, and the loss is the full-distribution KL(target || drafter) (torch's kl_div),
    position-weighted; the gradient is autograd's through it."""
    case = problem(2, k=VOCAB)
    case["logprobs"] = torch.topk(case["full_log_p"], VOCAB, dim=-1).values.float()  # exact, not float16
    total = float(weight_sum(case["labels"], case["weights"]))
    keep = case["labels"] != IGNORE_INDEX
    h_ref = case["hidden"].clone().requires_grad_()
    log_q = torch.log_softmax((h_ref @ case["head"].t()).reshape(*case["labels"].shape, -1), dim=-1)
    full_kl = F.kl_div(log_q[keep], case["full_log_p"][keep], log_target=True, reduction="none").sum(-1)
    reference = (case["weights"].expand_as(case["labels"])[keep] * full_kl).sum() / total
    reference.backward()
    h = case["hidden"].float().requires_grad_()
    loss, _ = block_loss(h, case["head"].float(), case["labels"], case["weights"].float(), total,
                         topk_ids=case["ids"], topk_logprobs=case["logprobs"], ce_weight=0.0, kl_weight=1.0,
                         chunk_size=8)
    loss.backward()
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-7)


def test_the_target_itself_is_the_optimum_of_the_bucketed_kl_and_not_of_renormalised_top_k() -> None:
    """A drafter whose distribution is the target's scores KL = 0 with zero gradient (K = 5 of 97: much of the mass
    is in the "other" bucket), up to the float32 the loss computes in. Renormalising the top-k instead would score
    it -log(sum of its K probabilities) > 0, and push it to be more confident than the target."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, BLOCK, HIDDEN, generator=gen, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (1, 1, BLOCK), generator=gen)
    labels[..., 0] = IGNORE_INDEX
    log_p = torch.log_softmax(hidden @ head.t(), dim=-1).reshape(1, 1, BLOCK, VOCAB)  # the drafter's own
    top = torch.topk(log_p, 5, dim=-1)
    weights = position_weights(BLOCK, dtype=torch.float64)
    total = weight_sum(labels, weights.float())
    h = hidden.clone().requires_grad_()
    loss, _ = block_loss(h, head, labels, weights, total, topk_ids=top.indices, topk_logprobs=top.values,
                         ce_weight=0.0, kl_weight=1.0)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-6 and float(h.grad.abs().max()) < 1e-6  # float32 inside
    mass = top.values.exp().sum(-1)[..., 1:]
    assert float(mass.max()) < 0.7  # the bucket holds real mass, so renormalising would be far off
    renormalised = (weights[1:] * -mass.log()).sum() / total
    assert float(renormalised) > 0.3


def test_bucketed_kl_is_exact_when_the_drafters_other_mass_underflows() -> None:
    """The drafter puts all but e**-100 of its mass on the target's top-3 (logits 120 apart): 1 - the sum of its
    top-3 probabilities is rounding noise even in float64, yet the loss (the bucket's p_other * ~120) and its
    gradients stay finite and equal the float64 reference (a logsumexp over the masked logits)."""
    case = problem(4, k=3)
    gen = torch.Generator().manual_seed(7)
    direction = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    direction /= direction.norm()
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.01 - direction  # every token: -u
    head[:3] += direction * torch.tensor([2.0, 1.98, 1.96], dtype=torch.float64)[:, None]  # tokens 0-2: ~+u
    case["head"] = head
    case["hidden"] = 60 * direction + 0.01 * torch.randn(case["hidden"].shape, generator=gen, dtype=torch.float64)
    logits = (case["hidden"] @ head.t()).reshape(*case["labels"].shape, VOCAB)  # ~ +60 on 0-2, ~ -60 elsewhere
    case["ids"] = torch.topk(logits, 3, dim=-1).indices.to(torch.int32)  # the target's top-3: the drafter's
    case["logprobs"] = torch.tensor([0.5, 0.2, 0.1]).log().to(torch.float16).expand(*case["labels"].shape, 3)
    keep = case["labels"] != IGNORE_INDEX
    drafter_top = torch.softmax(logits, dim=-1).gather(-1, case["ids"].long()).sum(-1)[keep]
    log_other = torch.logsumexp(torch.log_softmax(logits, dim=-1)[..., 3:], dim=-1)[keep]
    assert float(log_other.max()) < -100  # the true mass outside the top-3: below e**-100
    assert float((1 - drafter_top).abs().max()) < 1e-15  # 1 - sum is float64 rounding noise, not that mass
    (loss, grad_h, grad_w, _), (reference, ref_h, ref_w) = ours_and_reference(case, 0.0, 1.0, chunk=5)
    assert 10 < float(loss.detach()) < 1e4
    torch.testing.assert_close(loss.double(), reference, rtol=1e-4, atol=0)
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-3, atol=1e-6)


def test_micro_batches_sum_to_the_global_kl() -> None:
    case = problem(5, k=7, batch=4)
    total = weight_sum(case["labels"], case["weights"])
    args = dict(ce_weight=0.5, kl_weight=0.5, chunk_size=11)
    h, w, weights = case["hidden"].float(), case["head"].float(), case["weights"].float()
    whole, _ = block_loss(h, w, case["labels"], weights, total, topk_ids=case["ids"], topk_logprobs=case["logprobs"],
                          **args)
    parts = sum(block_loss(h[s], w, case["labels"][s], weights, total, topk_ids=case["ids"][s],
                           topk_logprobs=case["logprobs"][s], **args)[0] for s in (slice(0, 1), slice(1, 4)))
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-7)


def test_objectives_bind_the_kl_weight_and_log_their_terms() -> None:
    """--loss mix gets --kl-weight; kl and mix report the ce and kl terms (each divided by the global weight sum)
    and their loss is the weighted sum of the two."""
    case = problem(6, k=4, batch=1)
    h, w, weights = case["hidden"].float(), case["head"].float(), case["weights"].float()
    micro = MicroBatch(features=torch.zeros(1), block_ids=torch.zeros(1), labels=case["labels"], layout=None,
                       topk_ids=case["ids"], topk_logprobs=case["logprobs"])
    total = weight_sum(case["labels"], weights)
    mix, mix_stats = make_objective("mix", kl_weight=0.25)(h, w, micro, weights, total)
    kl, kl_stats = make_objective("kl", kl_weight=0.25)(h, w, micro, weights, total)
    terms = mix_stats["terms"]
    torch.testing.assert_close(mix, 0.75 * terms["ce"] + 0.25 * terms["kl"])
    torch.testing.assert_close(kl, kl_stats["terms"]["kl"])
    torch.testing.assert_close(terms["kl"], kl_stats["terms"]["kl"])
    assert LOSSES == ("ce", "kl", "mix")
    with pytest.raises(ValueError, match="top-k"):
        make_objective("kl")(h, w, MicroBatch(torch.zeros(1), torch.zeros(1), case["labels"], None), weights, total)


@pytest.mark.parametrize("loss", LOSSES)
def test_candidates_are_the_top_k_of_the_drafter_logits_and_change_nothing_else(loss: str) -> None:
    """`candidates=k` (what DFlash 2's selector loss scores) gives the top-k of the drafter's logits at every
    supervised position, highest first, and zeros elsewhere, whatever the objective and chunking; the loss and its
    gradient are the same as without it."""
    data = problem(3, k=8)
    micro = MicroBatch(features=torch.zeros(1), block_ids=torch.zeros(1), labels=data["labels"], layout=None,
                       topk_ids=data["ids"], topk_logprobs=data["logprobs"])
    objective = make_objective(loss)
    results = []
    for candidates in (0, 5):
        hidden = data["hidden"].clone().requires_grad_(True)
        value, stats = objective(hidden, data["head"], micro, data["weights"], 7.0, candidates=candidates)
        value.backward()
        results.append((value.detach(), hidden.grad, stats))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert "candidates" not in results[0][2]
    got = results[1][2]["candidates"]
    logits = data["hidden"].reshape(*data["labels"].shape, HIDDEN) @ data["head"].T
    supervised = data["labels"] != IGNORE_INDEX
    assert got.shape == (*data["labels"].shape, 5)
    assert torch.equal(got[supervised], logits.topk(5, dim=-1).indices[supervised])
    assert not got[~supervised].any()
