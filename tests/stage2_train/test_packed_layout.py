"""The packed training layout (attention_masks.PackedLayout): the blocks of every sequence of a micro-batch on one
flat axis. It trains exactly what the padded layout trains (same loss and gradients for the same anchors, every
attention backend), and nothing leaks: a block never depends on its own sequence's tokens at or after its anchor,
on another block, or on another sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.stage2_train.attention_masks import AnchorLayout, PackedLayout, batch_dense_mask, packed_dense_mask
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from dflash.stage2_train.loss import dflash_loss, position_weights, weight_sum
from tests.stage2_train.reference_labels import block_labels

BLOCK = 4
HIDDEN, LAYERS_IN = 32, 2
VOCAB = 50
MASK = 3


def tiny_drafter(backend: str, window: int | None = None) -> DFlashDraftModel:
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=BLOCK, num_target_layers=6,
                          dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3]},
                          layer_types=["sliding_attention", "full_attention"] if window else None,
                          use_sliding_window=bool(window), sliding_window=window)
    torch.manual_seed(0)
    return training_drafter(config, backend).double()


def random_batch(seed: int, lengths: list[int], anchors: list[list[int]]):  # noqa: ANN201
    generator = torch.Generator().manual_seed(seed)
    features = [torch.randn(n, LAYERS_IN * HIDDEN, generator=generator, dtype=torch.double) for n in lengths]
    ids = [torch.randint(4, VOCAB, (n,), generator=generator) for n in lengths]
    masks = [torch.rand(n, generator=generator) < 0.8 for n in lengths]
    return features, ids, masks


def padded_loss(model: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, lengths, anchors, features, ids,
                masks, weights):  # noqa: ANN001, ANN201
    batch, width, blocks = len(lengths), max(lengths) + 3, max(len(a) for a in anchors) + 1  # extra padding
    layout = AnchorLayout.from_anchor_lists(anchors, lengths, BLOCK, num_blocks=blocks, context_len=width)
    context = torch.zeros(batch, width, LAYERS_IN * HIDDEN, dtype=torch.double)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    loss_mask = torch.zeros(batch, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        context[b, :n], input_ids[b, :n], loss_mask[b, :n] = features[b], ids[b], masks[b]
    labels, block_ids = block_labels(input_ids, loss_mask, layout.anchors, layout.anchor_valid,
                                     torch.tensor(lengths), BLOCK, MASK)
    noise = embed[block_ids.view(batch, -1)]
    hidden = model(noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
    return dflash_loss(hidden, head, labels, weights, weight_sum(labels, weights))[0]


def packed_loss(model: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, lengths, anchors, features, ids,
                masks, weights):  # noqa: ANN001, ANN201
    from dflash.stage2_train.packed_batches import packed_block_labels, packed_layout

    total, real = sum(lengths), sum(len(a) for a in anchors)
    width, blocks = total + 5, real + 3  # bucket padding at the ends
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    batch = {"lengths": torch.tensor(lengths), "context_starts": starts,
             "input_ids": torch.zeros(width, dtype=torch.long), "loss_mask": torch.zeros(width, dtype=torch.bool),
             "block_anchor": torch.zeros(blocks, dtype=torch.long), "block_sequence": torch.zeros(blocks, dtype=torch.long),
             "block_valid": torch.arange(blocks) < real}
    batch["input_ids"][:total], batch["loss_mask"][:total] = torch.cat(ids), torch.cat(masks)
    batch["block_anchor"][:real] = torch.tensor([p for a in anchors for p in a])
    batch["block_sequence"][:real] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([len(a) for a in anchors]))
    layout = packed_layout(batch, BLOCK)
    reference = PackedLayout.from_anchor_lists(anchors, lengths, BLOCK, blocks, width)
    for name in ("block_anchor", "block_context_start", "block_valid", "context_positions"):
        assert torch.equal(getattr(layout, name), getattr(reference, name)), name
    context = torch.zeros(1, width, LAYERS_IN * HIDDEN, dtype=torch.double)
    context[0, :total] = torch.cat(features)
    labels, block_ids = packed_block_labels(batch, layout, MASK)
    noise = embed[block_ids.view(1, -1)]
    hidden = model(noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
    return dflash_loss(hidden, head, labels, weights, weight_sum(labels, weights))[0]


@settings(max_examples=9, deadline=None)
@given(data=st.data(), backend=st.sampled_from(["eager", "sdpa", "flex"]), window=st.sampled_from([None, 6]))
def test_packed_and_padded_layouts_train_the_same(data: st.DataObject, backend: str, window: int | None) -> None:
    """Same anchors, same features: the loss and every parameter gradient agree within float64 rounding (1e-10
    relative; eager attention takes its softmax in float32: 1e-5), for eager, grouped SDPA and flex attention (loss
    only: flex has no backward on CPU), with and without a sliding-window layer."""
    lengths = data.draw(st.lists(st.integers(3, 24), min_size=1, max_size=4))
    anchors = [sorted(data.draw(st.sets(st.integers(0, n - 2), min_size=1, max_size=min(6, n - 1)))) for n in lengths]
    features, ids, masks = random_batch(data.draw(st.integers(0, 100)), lengths, anchors)
    weights = position_weights(BLOCK, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.double)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.double)
    losses, grads = [], []
    for compute in (padded_loss, packed_loss):
        model = tiny_drafter(backend, window)
        with torch.set_grad_enabled(backend != "flex"):
            loss = compute(model, embed, head, lengths, anchors, features, ids, masks, weights)
        if backend != "flex":
            loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    rtol = 1e-5 if backend == "eager" else 1e-10
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=rtol * 1e-2)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        scale = float(grads[0][name].abs().max())
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=rtol * 100, atol=rtol * 100 * scale, msg=name)


def test_grouped_sdpa_on_the_packed_layout_equals_the_whole_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many blocks: SDPA runs per group of blocks over a window of the flat context; the drafter's output equals
    SDPA over the whole packed mask (one group) within float64 rounding, and eager attention (float32 softmax)
    within 1e-5. (Tiny blocks rarely pay for grouping, so the test lowers the rule's thresholds.)"""
    import dflash.stage2_train.attention_masks as masks_module

    lengths = [70, 45, 90]
    anchors = [list(range(1, 69, 3)), list(range(0, 44, 2)), list(range(5, 89, 4))]
    features, _, _ = random_batch(3, lengths, anchors)
    layout = PackedLayout.from_anchor_lists(anchors, lengths, BLOCK, num_blocks=72, context_len=208)
    context = torch.zeros(1, 208, LAYERS_IN * HIDDEN, dtype=torch.double)
    context[0, :205] = torch.cat(features)
    noise = torch.randn(1, layout.num_queries, HIDDEN, dtype=torch.double)

    def run(backend: str) -> torch.Tensor:
        return tiny_drafter(backend)(noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)

    assert masks_module.packed_groups(layout).mask.shape[0] == 1
    whole, eager = run("sdpa"), run("eager")
    monkeypatch.setattr(masks_module, "MIN_GROUPED_BLOCK_KEYS", 0)
    groups = masks_module.packed_groups(layout)
    assert groups.mask.shape[0] > 1 and groups.window < layout.context_len  # several groups, each a window
    grouped = run("sdpa")
    torch.testing.assert_close(grouped, whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(masks_module, "BUCKET_WINDOWS", False)  # the exact widest window: the same output
    exact = masks_module.packed_groups(layout)
    assert groups.window == masks_module.bucket(exact.window) and groups.window > exact.window
    torch.testing.assert_close(run("sdpa"), grouped, rtol=1e-10, atol=1e-12)


@given(st.integers(1, 200_000))
def test_window_widths_are_rounded_up_to_few_shapes(widest: int) -> None:
    """Grouped SDPA's context windows: at least the widest window, at most 6.25 % (or 16 keys) more, and at most
    17 distinct widths per doubling (what lets cuDNN and compiled graphs reuse their per-shape plans)."""
    from dflash.stage2_train.attention_masks import window_width

    width = window_width(widest)
    assert widest <= width <= max(widest * 1.0625, widest + 15)
    low = 1 << (widest.bit_length() - 1)
    assert len({window_width(w) for w in range(low, 2 * low, max(1, low // 256))}) <= 17


def test_nothing_leaks_across_blocks_sequences_or_the_anchor() -> None:
    """The gradient of each valid block's output with respect to the inputs is zero outside what the rule lets it
    see: its own sequence's context strictly before its anchor, and its own block."""
    lengths, anchors = [12, 9, 14], [[2, 7], [0, 5], [3, 8, 12]]
    layout = PackedLayout.from_anchor_lists(anchors, lengths, BLOCK, num_blocks=9, context_len=40)
    dense = packed_dense_mask(layout)[0]
    starts = [0, 12, 21]
    for j, (sequence, anchor) in enumerate([(s, p) for s, a in enumerate(anchors) for p in a]):
        rows = dense[j * BLOCK : (j + 1) * BLOCK]
        allowed = torch.zeros(layout.num_keys, dtype=torch.bool)
        allowed[starts[sequence] : starts[sequence] + anchor] = True
        allowed[40 + j * BLOCK : 40 + (j + 1) * BLOCK] = True
        assert torch.equal(rows, allowed.expand_as(rows)), j
    # The drafter obeys it: perturbing anything outside a block's allowed keys leaves the block unchanged.
    model = tiny_drafter("sdpa")
    context = torch.randn(1, 40, LAYERS_IN * HIDDEN, dtype=torch.double, requires_grad=True)
    noise = torch.randn(1, layout.num_queries, HIDDEN, dtype=torch.double, requires_grad=True)
    out = model(noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
    for j in range(7):
        context.grad = noise.grad = None
        out[0, j * BLOCK : (j + 1) * BLOCK].sum().backward(retain_graph=True)
        seen_context = context.grad[0].abs().sum(-1) > 0
        seen_blocks = noise.grad[0].abs().sum(-1).view(-1, BLOCK).sum(-1) > 0
        assert torch.equal(seen_context, dense[j * BLOCK, :40] & seen_context)
        assert seen_blocks.nonzero().flatten().tolist() == [j]


def test_padding_blocks_see_only_themselves_and_the_reference_layout_agrees() -> None:
    lengths, anchors = [10, 6], [[1, 4], [2]]
    packed = packed_dense_mask(PackedLayout.from_anchor_lists(anchors, lengths, BLOCK, num_blocks=5, context_len=20))[0]
    for j in (3, 4):  # padding blocks
        row = packed[j * BLOCK]
        assert row.nonzero().flatten().tolist() == list(range(20 + j * BLOCK, 20 + (j + 1) * BLOCK))
    padded = batch_dense_mask(AnchorLayout.from_anchor_lists(anchors, lengths, BLOCK))
    # Sequence 1's block, seen from the packed layout, sees its context shifted by sequence 0's length.
    assert packed[2 * BLOCK, 10:16].tolist() == padded[1, 0, :6].tolist()


def test_many_sequences_get_the_cheapest_group_size_not_the_whole_mask() -> None:
    """A micro-batch of many sequences (30 answers, density 1/6, blocks of 16): the rule picks the group size whose
    cost, (W_G + G * Bk) * (N * Bk + 2 * D * N / G), is the least over the candidates, computed here from the anchor
    lists, among those that copy at most MAX_PACKED_COPIES_RATIO times the whole mask's keys (what the memory plan
    counts on); each query then scores at least 5x fewer keys than over the whole mask (the rule used to fall back
    to the whole mask for such micro-batches, whose keys grow with the square of the micro-batch)."""
    import math

    from dflash.stage2_train.attention_masks import MAX_PACKED_COPIES_RATIO, packed_blocks_per_group, packed_groups
    from dflash.stage2_train.packed_batches import bucket

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(200, 1500, (30,), generator=generator).tolist()
    anchors = []
    for n in lengths:
        candidates = torch.arange(n // 3, n - 1)
        count = math.ceil(len(candidates) / 6)
        anchors.append(candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values.tolist())
    real = sum(len(a) for a in anchors)
    layout = PackedLayout.from_anchor_lists(anchors, lengths, 16, num_blocks=bucket(real, 8),
                                            context_len=bucket(sum(lengths)))
    n, head_dim = layout.num_blocks, 64
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    windows = [(starts[i], starts[i] + a) for i, anchor_list in enumerate(anchors) for a in anchor_list]

    def cost(group: int) -> int:
        widest = 0
        for g in range(0, real, group):
            members = windows[g:g + group]
            widest = max(widest, max(e for _, e in members) - min(b for b, _ in members))
        return (bucket(widest) + group * 16) * (n * 16 + 2 * head_dim * (n // group))

    def copies(group: int) -> int:
        return (n // group) * (cost(group) // (n * 16 + 2 * head_dim * (n // group)))

    candidates = [g for g in (2 ** i for i in range(n.bit_length())) if g < n and n % g == 0] + [n]
    affordable = [g for g in candidates if g == n or copies(g) <= MAX_PACKED_COPIES_RATIO * layout.num_keys]
    chosen = packed_blocks_per_group(layout, head_dim)
    assert cost(chosen) == min(cost(g) for g in affordable) and chosen < n
    assert len(affordable) < len(candidates)  # the cap on copied keys (the memory plan's bound) excluded some
    groups = packed_groups(layout, head_dim=head_dim)
    assert groups.mask.shape[0] == n // chosen
    assert (groups.window + chosen * 16) * 5 <= layout.num_keys
