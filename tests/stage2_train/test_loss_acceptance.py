"""Tests for the DFlash loss (stage2_train/loss.py) and the offline acceptance estimate (stage2_train/acceptance.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.shared.feature_codecs import BF16
from dflash.stage2_train import acceptance as acceptance_module
from dflash.stage2_train.acceptance import (
    acceptance_table,
    draft_predictions,
    predictions_of,
    offline_acceptance,
    tau_standard_error,
    walk_acceptance,
)
from dflash.stage2_train.attention_masks import AnchorLayout
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from tests.stage2_train.test_dflash2 import randomise_added_parts
from dflash.stage2_train.loss import (
    IGNORE_INDEX,
    default_gamma,
    dflash_loss,
    position_weights,
    weight_sum,
)

# ---------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------


def test_default_gamma() -> None:
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    assert default_gamma(4) == pytest.approx(1.75) and default_gamma(32) == pytest.approx(14.0)


def test_position_weights() -> None:
    w = position_weights(16)
    assert w.shape == (16,) and w.dtype == torch.float32
    assert w[0] == 0.0 and w[1] == 1.0
    expected = torch.tensor([0.0] + [math.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    torch.testing.assert_close(w, expected, atol=0, rtol=1e-7)
    torch.testing.assert_close(position_weights(4, gamma=2.0), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert bool((w[2:] < w[1:-1]).all()), "decreasing after offset 1"


def random_problem(seed: int, batch=3, blocks=5, block=6, hidden=16, vocab=37, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, blocks * block, hidden, generator=gen, dtype=dtype)
    head = torch.randn(vocab, hidden, generator=gen, dtype=dtype) / hidden**0.5
    labels = torch.randint(0, vocab, (batch, blocks, block), generator=gen)
    drop = torch.rand(batch, blocks, block, generator=gen) < 0.3
    labels[drop] = IGNORE_INDEX
    labels[:, :, 0] = IGNORE_INDEX
    labels[0, -1] = IGNORE_INDEX  # a fully padded block
    return h, head, labels


def naive_loss(h, head, labels, weights, total):
    logits = h.reshape(*labels.shape, -1) @ head.t()
    ce = F.cross_entropy(logits.reshape(-1, head.shape[0]).float(), labels.reshape(-1), reduction="none",
                         ignore_index=IGNORE_INDEX).view(labels.shape)
    return (ce * weights * (labels != IGNORE_INDEX)).sum() / total


def test_weight_sum() -> None:
    _, _, labels = random_problem(0)
    w = position_weights(6)
    expected = ((labels != IGNORE_INDEX).float() * w).sum()
    torch.testing.assert_close(weight_sum(labels, w), expected)
    assert weight_sum(torch.full((2, 3, 6), IGNORE_INDEX), w) == 0


@pytest.mark.parametrize("shape4d", [False, True])
def test_loss_and_gradients_match_naive(shape4d: bool) -> None:
    h, head, labels = random_problem(1)
    w = position_weights(6)
    total = weight_sum(labels, w) * 1.7  # as if other ranks/micro-batches held the rest
    h1, head1 = h.clone().requires_grad_(), head.clone().requires_grad_()
    inp = h1.view(*labels.shape, -1) if shape4d else h1
    loss, stats = dflash_loss(inp, head1, labels, w, total, chunk_size=7)
    loss.backward()
    h2, head2 = h.clone().requires_grad_(), head.clone().requires_grad_()
    ref = naive_loss(h2, head2, labels, w, total)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(head1.grad, head2.grad, atol=1e-6, rtol=1e-5)

    supervised = labels != IGNORE_INDEX
    argmax = (h.reshape(*labels.shape, -1) @ head.t()).argmax(-1)
    assert stats["num_tokens"] == supervised.sum()
    assert torch.equal(stats["count_by_position"], supervised.reshape(-1, 6).sum(0))
    assert torch.equal(stats["correct_by_position"], ((argmax == labels) & supervised).reshape(-1, 6).sum(0))
    torch.testing.assert_close(stats["weighted_ce_sum"], ref.detach() * total, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats["weight_sum"], weight_sum(labels, w))
    assert all(not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunks_equal_the_eager_loss(dtype: torch.dtype) -> None:
    """`fused=True` (--compile): each chunk's softmax, loss and gradient through the compiled `cross_entropy_chunk`
    (inductor, also on CPU), the last chunk padded to the chunk size; the same loss, statistics, candidates and
    gradients (of the hidden states and of a trainable head) as the eager chunks, in float32 to rounding and in
    bf16 to bf16 rounding."""
    h, head, labels = random_problem(1)
    w = position_weights(6)
    total = weight_sum(labels, w) * 1.3
    from torch._dynamo.utils import counters

    from dflash.stage2_train import loss as loss_module

    loss_module._compiled_cross_entropy_chunk.cache_clear()  # compiled anew here: the count below sees its graph
    frames = counters["stats"]["unique_graphs"]
    results = []
    for fused in (False, True):
        hh, head_param = h.to(dtype).requires_grad_(), head.to(dtype).requires_grad_()
        loss, stats = dflash_loss(hh, head_param, labels, w, total, chunk_size=7, candidates=3, fused=fused)
        loss.backward()
        results.append((loss.detach(), stats, hh.grad.float(), head_param.grad.float()))
    (eager, eager_stats, eager_h, eager_head), (fused, fused_stats, fused_h, fused_head) = results
    assert counters["stats"]["unique_graphs"] == frames + 1  # one graph, whole (fullgraph), for every chunk
    assert (labels != IGNORE_INDEX).sum() % 7 != 0  # a partial last chunk, padded in the fused path
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(fused, eager, **tolerance)
    torch.testing.assert_close(fused_stats["weighted_ce_sum"], eager_stats["weighted_ce_sum"], **tolerance)
    torch.testing.assert_close(fused_h, eager_h, **tolerance)
    torch.testing.assert_close(fused_head, eager_head, **tolerance)
    assert torch.equal(fused_stats["correct_by_position"], eager_stats["correct_by_position"])
    # The candidates: the same top-k logits (the ids may differ where two logits tie exactly; in bf16 the fused path
    # takes them from the bf16 logits, the eager one from their float32 copy: the same values).
    logits = (h.to(dtype) @ head.to(dtype).t()).float().reshape(*labels.shape, -1)
    supervised = (labels != IGNORE_INDEX)[..., None]
    fused_top, eager_top = (logits.gather(-1, stats["candidates"]) * supervised
                            for stats in (fused_stats, eager_stats))
    assert torch.equal(fused_top, eager_top)


def test_chunk_size_does_not_change_result() -> None:
    h, head, labels = random_problem(2)
    w = position_weights(6)
    total = weight_sum(labels, w)
    results = []
    for chunk in (1, 5, 64, 10_000):
        hh = h.clone().requires_grad_()
        loss, stats = dflash_loss(hh, head, labels, w, total, chunk_size=chunk)
        loss.backward()
        results.append((loss.detach(), hh.grad, stats["correct_by_position"]))
    for loss, grad, correct in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, results[0][1], atol=1e-7, rtol=1e-6)
        assert torch.equal(correct, results[0][2])


@pytest.mark.parametrize("vocab", [97, 32_000, 49_152, 151_936, 262_144, 1_000_000])
def test_chunk_rows_keep_a_cuda_chunk_within_its_bytes(vocab: int) -> None:
    """CPU: DEFAULT_CHUNK_SIZE rows. CUDA: the most multiples of DEFAULT_CHUNK_SIZE whose float32 logits fit in
    CUDA_CHUNK_BYTES, never fewer than DEFAULT_CHUNK_SIZE; and the memory plan counts the same chunk."""
    from dflash.stage2_train import loss as loss_module
    from dflash.stage2_train.memory_plan import DrafterShape

    assert loss_module.chunk_rows(vocab, "cpu") == loss_module.DEFAULT_CHUNK_SIZE
    rows = loss_module.chunk_rows(vocab, "cuda")
    step = loss_module.DEFAULT_CHUNK_SIZE
    assert rows % step == 0 and rows >= step
    assert rows == step or rows * vocab * 4 <= loss_module.CUDA_CHUNK_BYTES < (rows + step) * vocab * 4
    config = config_from_target({**TARGET_CONFIG, "vocab_size": vocab}, TARGET_LAYER_IDS, LAYERS, BLOCK, MASK)
    for device_type in ("cpu", "cuda"):
        shape = DrafterShape.of(config, 10, 2, device_type)
        assert shape.loss_chunk == loss_module.chunk_rows(vocab, device_type)
    assert loss_module.chunk_rows(49_152, "cuda") == 5 * step  # SmolLM2's vocabulary: 5 chunks a step, not 26


def test_micro_batches_sum_to_the_global_loss() -> None:
    """The property DDP + gradient accumulation relies on: per-micro-batch losses with the global weight sum add up."""
    h, head, labels = random_problem(3, batch=4)
    w = position_weights(6)
    parts = [slice(0, 1), slice(1, 4)]
    total = sum(weight_sum(labels[s], w) for s in parts)  # the all-reduce, before any forward
    torch.testing.assert_close(total, weight_sum(labels, w))

    h_full, head_full = h.clone().requires_grad_(), head.clone().requires_grad_()
    full, _ = dflash_loss(h_full, head_full, labels, w, total, chunk_size=16)
    full.backward()

    h_split, head_split = h.clone().requires_grad_(), head.clone().requires_grad_()
    summed = 0.0
    for s in parts:
        part, _ = dflash_loss(h_split[s], head_split, labels[s], w, total, chunk_size=16)
        part.backward()  # gradients accumulate like accumulation steps
        summed = summed + part.detach()
    torch.testing.assert_close(summed, full.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h_split.grad, h_full.grad, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(head_split.grad, head_full.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(full.detach(), naive_loss(h, head, labels, w, total), atol=1e-5, rtol=1e-5)


def test_loss_edge_cases() -> None:
    h, head, labels = random_problem(4)
    w = position_weights(6)
    empty = torch.full_like(labels, IGNORE_INDEX)
    hh = h.clone().requires_grad_()
    loss, stats = dflash_loss(hh, head, empty, w, 0.0)
    loss.backward()
    assert loss.item() == 0.0 and stats["num_tokens"] == 0
    assert torch.equal(hh.grad, torch.zeros_like(h)), "no labels: zero (not missing) gradient"
    with torch.no_grad():
        loss_ng, _ = dflash_loss(h, head, labels, w, weight_sum(labels, w))
    torch.testing.assert_close(loss_ng, naive_loss(h, head, labels, w, weight_sum(labels, w)), atol=1e-5, rtol=1e-5)


def test_loss_bf16_close_to_fp32() -> None:
    h, head, labels = random_problem(5)
    w = position_weights(6)
    total = weight_sum(labels, w)
    hb = h.to(torch.bfloat16).requires_grad_()
    loss, _ = dflash_loss(hb, head.to(torch.bfloat16), labels, w, total, chunk_size=8)
    loss.backward()
    assert loss.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, naive_loss(h, head, labels, w, total), atol=0.05, rtol=0.02)


# ---------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, LAYERS, BLOCK, VOCAB, MASK = 64, 4, 2, 2, 4, 50, 7
TARGET_LAYER_IDS = [1, 3, 5]
TARGET_CONFIG = {
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "vocab_size": VOCAB,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
}


def make_dflash2_model() -> DFlashDraftModel:
    """Tiny DFlash 2 drafter (seed 0, its backbone's weights as initialised, not `make_model`'s), its added parts
    moved away from the identity so that its selector's walk picks other tokens than the argmax."""
    config = config_from_target(TARGET_CONFIG, TARGET_LAYER_IDS, LAYERS, BLOCK, MASK, architecture="dflash2",
                                dflash2={"conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4})
    torch.manual_seed(0)
    model = training_drafter(config, "sdpa").eval()
    randomise_added_parts(model)
    return model


def make_model(backend: str = "sdpa", seed: int = 0, large: bool = True) -> DFlashDraftModel:
    """Tiny drafter; ``large`` weights (norm weights around 1) so predictions depend on every input."""
    config = config_from_target(TARGET_CONFIG, TARGET_LAYER_IDS, LAYERS, BLOCK, MASK)
    torch.manual_seed(seed)
    model = training_drafter(config, backend)
    if large:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
                else:
                    param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model.eval()


def target_weights(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    return embed, head


def random_features(seq_len: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(seq_len, len(TARGET_LAYER_IDS) * HIDDEN, generator=gen)


def inference_drafts(model, embed, head, features, ids, p) -> torch.Tensor:
    """The inference layout, one block alone: context = features[:p], block at p..p+Bk-1, no mask."""
    block = torch.full((BLOCK,), MASK)
    block[0] = ids[p]
    with torch.no_grad():
        hidden = model(embed[block][None], features[None, :p], torch.arange(p, p + BLOCK)[None])
    return (hidden[0, 1:] @ head.t()).argmax(-1)


def slow_acceptance(model, embed, head, features, ids, p) -> int:
    drafts = inference_drafts(model, embed, head, features, ids, p)
    a = 0
    for k in range(1, BLOCK):
        if p + k >= len(ids) or int(drafts[k - 1]) != int(ids[p + k]):
            break
        a += 1
    return a


def greedy_chain_data(model, embed, head, features, prefix, start, end, seed=3):
    """input_ids where, along the anchor chain start, start + Bk, ..., the drafter's drafts ARE the data.

    Tokens at chain anchors (and before start) are random; token[p + k] := draft k at anchor p. A draft at anchor
    p depends only on token[p] and features < p, so filling left to right is consistent.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (features.shape[0],), generator=gen)
    ids[: len(prefix)] = prefix
    for p in range(start, end - 1, BLOCK):
        drafts = inference_drafts(model, embed, head, features, ids, p)
        for k in range(1, BLOCK):
            if p + k < end:
                ids[p + k] = drafts[k - 1]
    return ids


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_acceptance_table_equals_one_block_inference(backend: str) -> None:
    """The batched training-layout table equals drafting each block alone, as real decoding does."""
    model = make_model(backend)
    embed, head = target_weights()
    seq_len = 23
    features = random_features(seq_len)
    ids = greedy_chain_data(model, embed, head, features, torch.tensor([]), 2, seq_len)  # non-trivial acceptance
    anchors = torch.arange(seq_len)
    table = acceptance_table(model, embed, head, features, ids, anchors, BLOCK, MASK, chunk=5)
    preds = draft_predictions(model, embed, head, features, ids, anchors, BLOCK, MASK, chunk=5)
    for p in range(seq_len):
        assert torch.equal(preds[p], inference_drafts(model, embed, head, features, ids, p)), p
        assert int(table[p]) == slow_acceptance(model, embed, head, features, ids, p), p
        assert int(table[p]) <= seq_len - 1 - p, "positions >= S are never accepted"
    assert table.dtype == torch.long and table.shape == (seq_len,)
    assert table.max() == BLOCK - 1, "the chain makes some anchors accept fully"
    # Chunking and anchor order do not matter; bf16 features are accepted.
    shuffled = torch.randperm(seq_len, generator=torch.Generator().manual_seed(0))
    again = acceptance_table(model, embed, head, features, ids, shuffled, BLOCK, MASK, chunk=64)
    assert torch.equal(again, table[shuffled])


@pytest.mark.parametrize("logits_rows", [1, 7, 2048])
def test_dflash2_drafts_are_the_selector_walk_of_each_block_alone(logits_rows: int) -> None:
    """DFlash 2's offline drafts (its candidates taken `LOGITS_ROWS` rows at a time, one walk over every block of
    the forward) are, for every anchor, what decoding proposes for that block alone: the selector's `propose` on
    the inference layout's hidden states and float32 logits."""
    model = make_dflash2_model()
    embed, head = target_weights()
    seq_len = 19
    features = random_features(seq_len)
    ids = torch.randint(0, VOCAB, (seq_len,), generator=torch.Generator().manual_seed(1))
    anchors = torch.arange(seq_len)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceptance_module, "LOGITS_ROWS", logits_rows)
        preds = draft_predictions(model, embed, head, features, ids, anchors, BLOCK, MASK, chunk=5)
    for p in range(seq_len):
        block = torch.full((BLOCK,), MASK)
        block[0] = ids[p]
        with torch.no_grad():
            hidden = model(embed[block][None], features[None, :p], torch.arange(p, p + BLOCK)[None])[0, 1:]
            alone, _ = model.candidate_selector.propose(hidden, (hidden @ head.t()).float(), int(ids[p]))
        assert preds[p].tolist() == alone, p


def test_walk_acceptance_hand_made() -> None:
    start, end = 5, 30
    zeros = walk_acceptance(torch.zeros(40, dtype=torch.long), start, end)
    assert zeros == [0] * (end - 1 - start), "one token per step: emits start+1 .. end-1"
    full = {p: BLOCK - 1 for p in range(40)}
    end_full = start + 1 + 6 * BLOCK  # the response (start+1 .. end-1) is a whole number of blocks
    steps = walk_acceptance(full, start, end_full)
    assert steps == [BLOCK - 1] * 6 and np.mean([a + 1 for a in steps]) == BLOCK
    cut = walk_acceptance(full, start, end_full + 2)
    assert cut == [BLOCK - 1] * 6 + [1], "the last step is cut at the response's last token"
    assert sum(a + 1 for a in cut) == end_full + 2 - 1 - start
    table = {5: 2, 8: 0, 9: 3, 13: 1, 15: 9}
    assert walk_acceptance(table, 5, 18) == [2, 0, 3, 1, 1]
    assert walk_acceptance(table, 5, 6) == [] and walk_acceptance(table, 5, 5) == []
    with pytest.raises(ValueError):
        walk_acceptance(torch.full((10,), -1), 0, 10)


def make_sequence(ids, features, mask):
    return {"input_ids": ids, "features": features, "loss_mask": mask}


def test_oracle_chain_is_fully_accepted() -> None:
    """Data generated greedily from the drafter along the decoding chain: the walk accepts Bk - 1 every step."""
    model = make_model("sdpa")
    embed, head = target_weights()
    prompt, steps = 9, 5
    end = prompt + 1 + steps * BLOCK  # response = positions prompt .. end-1; the first walked anchor is `prompt`
    seq_len = end + 6  # a second user turn follows the first response
    features = random_features(seq_len)
    ids = greedy_chain_data(model, embed, head, features, torch.tensor([]), prompt, end)
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[prompt:end] = 1
    mask[end + 3 : end + 5] = 1  # a second assistant turn: not walked
    table = acceptance_table(model, embed, head, features, ids, torch.arange(prompt, end - 1), BLOCK, MASK)
    accept_at = dict(zip(range(prompt, end - 1), table.tolist()))
    assert walk_acceptance(accept_at, prompt, end) == [BLOCK - 1] * steps

    result = offline_acceptance(model, embed, head, [make_sequence(ids, features, mask)], max_random_anchors=64)
    assert result["tau_walk"] == BLOCK and result["steps"] == steps and result["sequences"] == 1
    assert result["acceptance_by_position"] == [1.0] * (BLOCK - 1)
    assert result["tokens"] == end - 1 - prompt
    assert result["random_anchors"] == (end - prompt - 1) + 1  # every training-valid anchor (< 64)
    assert 1.0 <= result["tau_random_anchors"] <= BLOCK
    assert model.training is False

    # Same data as read from a cache: numpy input_ids / mask, stored bf16 bits decoded by their codec.
    bits = features.to(torch.bfloat16).view(torch.uint16).numpy()
    decoded = BF16.decode_numpy(bits, None)
    bf16 = offline_acceptance(model, embed, head, [make_sequence(ids.numpy().astype(np.int32), decoded, mask.numpy())])
    assert bf16["steps"] >= 1 and 1.0 <= bf16["tau_walk"] <= BLOCK

    # The prompt_end convention adds one step at the last prompt token.
    pe = offline_acceptance(model, embed, head, [make_sequence(ids, features, mask)], first_anchor="prompt_end")
    assert pe["tokens"] == end - prompt and pe["steps"] >= 2


def test_random_drafter_tau_is_about_one() -> None:
    model = make_model("sdpa", large=False).train()  # default (reference) initialisation
    embed, head = target_weights()
    gen = torch.Generator().manual_seed(5)
    sequences = []
    for i in range(3):
        seq_len = 40 + 7 * i
        ids = torch.randint(0, VOCAB, (seq_len,), generator=gen)
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[10 + i :] = 1
        sequences.append(make_sequence(ids, random_features(seq_len, seed=10 + i), mask))
    sequences.append(make_sequence(torch.arange(8), random_features(8), torch.zeros(8)))  # no response: skipped
    result = offline_acceptance(model, embed, head, sequences, max_random_anchors=16, seed=1)
    assert model.training, "mode restored"
    assert result["sequences"] == 3 and result["random_anchors"] == 3 * 16
    assert 1.0 <= result["tau_walk"] < 1.25 and 1.0 <= result["tau_random_anchors"] < 1.25
    assert result["steps"] >= 0.8 * sum(len(s["input_ids"]) - 10 - i for i, s in enumerate(sequences[:3]))
    assert len(result["acceptance_by_position"]) == BLOCK - 1
    again = offline_acceptance(model, embed, head, sequences, max_random_anchors=16, seed=1)
    assert again == result, "deterministic for a seed"
    alone = [offline_acceptance(model, embed, head, [s], max_random_anchors=0) for s in sequences[:3]]
    assert all(math.isnan(a["tau_walk_stderr"]) for a in alone)  # one sequence: no spread to measure
    assert result["tau_walk_stderr"] == tau_standard_error([a["tokens"] for a in alone], [a["steps"] for a in alone])


def test_tau_standard_error_against_the_mean_of_equal_units_and_a_bootstrap() -> None:
    """With equal step counts the ratio's standard error is the standard error of the mean of the per-unit taus;
    with unequal counts it matches a bootstrap over units (resampled with replacement) within 3 %."""
    rng = np.random.default_rng(0)
    steps = [40] * 30
    tokens = [int(rng.integers(40, 120)) for _ in steps]
    taus = np.array(tokens) / 40
    assert tau_standard_error(tokens, steps) == pytest.approx(taus.std(ddof=1) / math.sqrt(len(taus)), rel=1e-12)
    steps = rng.integers(5, 200, size=150)
    tokens = np.array([int(rng.integers(s, 4 * s)) for s in steps])
    picks = rng.integers(0, len(steps), size=(20000, len(steps)))
    bootstrap = (tokens[picks].sum(1) / steps[picks].sum(1)).std()
    assert tau_standard_error(tokens.tolist(), steps.tolist()) == pytest.approx(bootstrap, rel=0.03)
    assert math.isnan(tau_standard_error([5], [3])) and math.isnan(tau_standard_error([5, 0], [3, 0]))
    assert tau_standard_error([6, 6, 6], [3, 3, 3]) == 0.0


def test_table_uses_only_context_before_the_anchor() -> None:
    """Changing features at or after an anchor (or in other blocks' range) never changes that anchor's drafts."""
    model = make_model("sdpa")
    embed, head = target_weights()
    seq_len = 20
    features = random_features(seq_len)
    ids = torch.randint(0, VOCAB, (seq_len,), generator=torch.Generator().manual_seed(9))
    anchors = torch.tensor([3, 8, 12, 17])
    base = draft_predictions(model, embed, head, features, ids, anchors, BLOCK, MASK)
    changed = features.clone()
    changed[8:] = torch.randn(changed[8:].shape)
    after = draft_predictions(model, embed, head, changed, ids, anchors, BLOCK, MASK)
    assert torch.equal(after[:2], base[:2])
    assert isinstance(AnchorLayout.from_anchor_lists([anchors], [seq_len], BLOCK), AnchorLayout)


# ---------------------------------------------------------------------------
# CUDA only (skipped on CPU): realistic vocabulary memory bound, and the flex backend in the acceptance table
# ---------------------------------------------------------------------------

cuda = pytest.mark.gpu


@cuda
def test_loss_memory_is_bounded_at_qwen_vocabulary() -> None:
    import time

    device = torch.device("cuda")
    vocab, hidden, batch, blocks, block = 151936, 4096, 2, 256, 16  # 8192 positions
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(batch, blocks * block, hidden, device=device, generator=gen).to(torch.bfloat16)
    head = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, blocks, block), device=device, generator=gen)
    labels[:, :, 0] = IGNORE_INDEX
    w = position_weights(block, device=device)
    total = weight_sum(labels, w)
    h.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loss, stats = dflash_loss(h, head, labels, w, total, chunk_size=1024)
    loss.backward()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    full_logits = batch * blocks * block * vocab * 4
    print(f"\nloss {loss.item():.4f}, fwd+bwd {elapsed * 1e3:.1f} ms, peak extra {peak / 2**30:.2f} GiB "
          f"(full fp32 logits would be {full_logits / 2**30:.2f} GiB)")
    assert peak < 2.5 * 2**30 and peak < full_logits / 2  # ~1.9 GiB seen on an H200 (chunk 1024)
    # Against the naive reference on a slice (fp32 logits of the same bf16 inputs).
    part = labels[:1, :32]
    hp = h.detach()[:1, : 32 * block].float().requires_grad_()
    ref = naive_loss(hp, head.float(), part, w, weight_sum(part, w))
    ref.backward()
    hq = h.detach()[:1, : 32 * block].float().requires_grad_()
    ours, _ = dflash_loss(hq, head.float(), part, w, weight_sum(part, w), chunk_size=100)
    ours.backward()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hq.grad, hp.grad, atol=1e-6, rtol=1e-3)


@cuda
def test_acceptance_table_on_cuda_matches_cpu() -> None:
    cpu_model = make_model("sdpa")
    embed, head = target_weights()
    seq_len = 40
    features = random_features(seq_len)
    ids = greedy_chain_data(cpu_model, embed, head, features, torch.tensor([]), 3, seq_len)
    anchors = torch.arange(seq_len)
    expected = acceptance_table(cpu_model, embed, head, features, ids, anchors, BLOCK, MASK)
    for backend in ("sdpa", "flex", "eager"):
        model = make_model(backend).cuda()
        got = acceptance_table(model, embed.cuda(), head.cuda(), features.cuda(), ids.cuda(), anchors, BLOCK, MASK,
                               chunk=16)
        mismatch = (got != expected).sum().item()
        print(f"\n{backend}: {mismatch} of {seq_len} anchors differ from CPU; max a {int(got.max())}")
        assert mismatch <= 1, backend  # fp32 TF32-free matmuls: near-exact; allow one near-tie flip
        result = offline_acceptance(model, embed.cuda(), head.cuda(),
                                    [make_sequence(ids, features, (torch.arange(seq_len) >= 3).long())])
        assert result["steps"] >= 1


def test_json_safe_turns_every_nan_and_infinity_into_null() -> None:
    import json
    import math

    from dflash.stage2_train.acceptance import json_safe

    report = {"tau": math.nan, "ci": (1.0, math.inf), "by_position": [0.5, -math.inf], "steps": 3,
              "nested": {"x": [math.nan, {"y": 2.5}]}, "name": "test"}
    assert json_safe(report) == {"tau": None, "ci": [1.0, None], "by_position": [0.5, None], "steps": 3,
                                 "nested": {"x": [None, {"y": 2.5}]}, "name": "test"}
    json.dumps(json_safe(report), allow_nan=False)  # valid JSON


def test_evaluation_inside_training_compiles_nothing_and_uses_sdpa() -> None:
    """`uncompiled_sdpa`, which the trainer's evaluations run under: a drafter with compiled layers and the flex
    backend is evaluated eagerly with SDPA (no graph compiled, so the evaluation's shapes leave the training step's
    compilations alone), to the same tau as the plain SDPA drafter; its backend is restored afterwards."""
    from torch._dynamo.utils import counters

    from dflash.stage2_train.draft_attention import uncompiled_sdpa

    embed, head = target_weights()
    sequence = make_sequence(torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)),
                             random_features(40), torch.cat([torch.zeros(12), torch.ones(28)]).to(torch.uint8))
    reference = offline_acceptance(make_model("sdpa"), embed, head, [sequence])
    model = make_model("flex")
    for layer in model.layers:
        layer.compile()
    graphs = counters["stats"]["unique_graphs"]
    with uncompiled_sdpa(model):
        assert model.attention.implementation == "sdpa"
        result = offline_acceptance(model, embed, head, [sequence])
    assert counters["stats"]["unique_graphs"] == graphs
    assert model.attention.implementation == "flex"
    assert result["tau_walk"] == reference["tau_walk"] and result["steps"] == reference["steps"] > 1


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(2, 40), min_size=1, max_size=6), chunk=st.integers(1, 12),
       mask_elements=st.sampled_from([0, 1 << 12, 1 << 16, 1 << 30]),
       context_bytes=st.sampled_from([1, 1 << 14, 1 << 40]))
def test_sequences_drafted_together_get_the_drafts_each_gets_alone(architecture: str, lengths: list[int],
                                                                   chunk: int, mask_elements: int,
                                                                   context_bytes: int) -> None:
    """`predictions_of` with the chunks of several sequences as rows of one padded forward (any budget of mask
    elements and of context bytes) gives each sequence the drafts of one chunk a forward; so does
    `offline_acceptance`, which batches its sequences. Budgets too small for two chunks give one a forward; ample
    ones, a single forward."""
    model = make_dflash2_model() if architecture == "dflash2" else make_model("sdpa")
    embed, head = target_weights()
    gen = torch.Generator().manual_seed(sum(lengths))
    sequences = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        anchors = torch.randperm(length, generator=gen)[: max(1, length // 2)].sort().values
        sequences.append((random_features(length, seed=i), ids, anchors))
    alone = [draft_predictions(model, embed, head, f, ids, a, BLOCK, MASK, chunk=chunk) for f, ids, a in sequences]
    forwards = [0]
    draft_rows = acceptance_module._draft_rows

    def counted(*args: Any) -> None:
        forwards[0] += 1
        draft_rows(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceptance_module, "FORWARD_CONTEXT_BYTES", {"cpu": context_bytes})
        patch.setattr(acceptance_module, "_draft_rows", counted)
        together = predictions_of(model, embed, head, sequences, BLOCK, MASK, chunk=chunk, mask_elements=mask_elements)
    assert all(torch.equal(x, y) for x, y in zip(alone, together))
    chunks = sum(-(-max(1, length // 2) // chunk) for length in lengths)
    if mask_elements == 0 or context_bytes == 1:
        assert forwards[0] == chunks
    elif mask_elements == 1 << 30 and context_bytes == 1 << 40:
        assert forwards[0] == 1
    cached = [make_sequence(ids, f, (torch.arange(len(ids)) >= len(ids) // 3).long()) for f, ids, _ in sequences]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceptance_module, "GROUP_TOKENS", 1)  # every sequence alone
        one_by_one = offline_acceptance(model, embed, head, cached, max_random_anchors=4, seed=1)
    assert offline_acceptance(model, embed, head, cached, max_random_anchors=4, seed=1) == one_by_one


def test_long_sequences_drafted_together_through_grouped_attention_and_a_sliding_window() -> None:
    """Chunks of 200 anchors (800 block queries: the grouped SDPA path) of sequences of a few hundred tokens, on a
    drafter with a sliding-window layer, several to a forward: each gets its drafts alone (float32)."""
    config = config_from_target(TARGET_CONFIG, TARGET_LAYER_IDS, LAYERS, BLOCK, MASK,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    torch.manual_seed(0)
    model = training_drafter(config, "sdpa").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5 if param.dim() > 1 else 1 + 0.3 * param)
    embed, head = target_weights()
    gen = torch.Generator().manual_seed(7)
    sequences = []
    for i, length in enumerate((420, 260, 333)):
        anchors = torch.arange(length // 3, length - 1)
        sequences.append((random_features(length, seed=20 + i), torch.randint(0, VOCAB, (length,), generator=gen),
                          anchors))
    alone = [draft_predictions(model, embed, head, f, ids, a, BLOCK, MASK, chunk=200) for f, ids, a in sequences]
    together = predictions_of(model, embed, head, sequences, BLOCK, MASK, chunk=200, mask_elements=1 << 30)
    assert all(torch.equal(x, y) for x, y in zip(alone, together))
    assert len({tuple(row.tolist()) for row in alone[0]}) > 10  # the drafts vary from anchor to anchor
