"""Tests for the DFlash draft model and its training mask (tiny configs, CPU, fp32)."""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.shared.target_layers import default_layer_ids
from dflash.stage2_train import attention_masks
from dflash.stage2_train.attention_masks import (
    MAX_GROUPED_KEYS_RATIO,
    MIN_GROUPED_BLOCK_KEYS,
    AnchorLayout,
    batch_dense_mask,
    blocks_per_group,
    grouped_dense_mask,
)
from dflash.stage2_train.draft_attention import eager_attention, grouped_attention, sdpa_attention, training_drafter
from dflash.stage2_train.draft_config import DFlashConfig, config_from_target
from dflash.stage2_train.modeling_dflash import DFlashDraftModel

HIDDEN, HEADS, KV_HEADS, LAYERS, BLOCK = 64, 4, 2, 2, 4
TARGET_LAYER_IDS = [1, 3, 5]
TARGET_CONFIG = {
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "vocab_size": 100,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
}


@functools.cache
def flex_runs_on_cpu() -> bool:
    """Whether (uncompiled) flex_attention with a BlockMask runs on this CPU build of torch."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q = torch.randn(1, 2, 8, 16)
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, None, 8, 8, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention(q, q, q, block_mask=mask)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return False


BACKENDS = [
    "eager",
    "sdpa",
    pytest.param(
        "flex",
        marks=pytest.mark.skipif(not flex_runs_on_cpu(), reason="flex_attention does not run on this CPU torch build"),
    ),
]


def make_config(**overrides) -> DFlashConfig:
    kwargs = dict(target_layer_ids=TARGET_LAYER_IDS, num_draft_layers=LAYERS, block_size=BLOCK, mask_token_id=7)
    kwargs.update(overrides)
    return config_from_target(TARGET_CONFIG, **kwargs)


def make_model(config: DFlashConfig | None = None, backend: str = "eager", seed: int = 0) -> DFlashDraftModel:
    """A model with large random weights (norm weights around 1) so every path matters numerically."""
    torch.manual_seed(seed)
    model = training_drafter(config or make_config(), backend)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model.eval()


def make_batch(seed: int, lengths: list[int], num_anchors: list[int], pad_blocks: int = 1):
    """Random features/embeddings for sequences of the given lengths with sorted random anchors.

    Returns (features [B, C, n*H], embeddings [B, A*Bk, H], layout); padded context rows and padded blocks hold
    random values too, so any leak from them would show.
    """
    gen = torch.Generator().manual_seed(seed)
    anchors = [torch.randperm(s, generator=gen)[:a].sort().values for s, a in zip(lengths, num_anchors)]
    layout = AnchorLayout.from_anchor_lists(anchors, lengths, BLOCK, num_blocks=max(num_anchors) + pad_blocks)
    features = torch.randn(len(lengths), max(lengths), len(TARGET_LAYER_IDS) * HIDDEN, generator=gen)
    embeddings = torch.randn(len(lengths), layout.num_queries, HIDDEN, generator=gen)
    return features, embeddings, layout


def run(model: DFlashDraftModel, features, embeddings, layout: AnchorLayout) -> torch.Tensor:
    with torch.no_grad():
        return model(embeddings, features, layout.query_position_ids(), layout.context_position_ids(), layout)


def block_rows(j: int) -> slice:
    return slice(j * BLOCK, (j + 1) * BLOCK)


# ---------------------------------------------------------------------------
# Backends agree
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", BACKENDS[2]])
@pytest.mark.parametrize("sliding", [False, True])
def test_backends_agree_with_eager(backend: str, sliding: bool) -> None:
    config = make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6) if sliding else None
    features, embeddings, layout = make_batch(0, lengths=[23, 14], num_anchors=[4, 2])
    reference = run(make_model(config, "eager"), features, embeddings, layout)
    other = run(make_model(config, backend), features, embeddings, layout)
    assert torch.isfinite(reference).all(), "padded blocks must not produce NaN"
    torch.testing.assert_close(other, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_dense_mask_equals_layout(backend: str) -> None:
    model = make_model(None, backend)
    features, embeddings, layout = make_batch(9, lengths=[19, 12], num_anchors=[3, 2])
    with torch.no_grad():
        explicit = model(embeddings, features, layout.query_position_ids(), None, batch_dense_mask(layout))
    # 1e-5: for SDPA the layout runs per group of blocks, the explicit mask over all keys (float32 rounding)
    torch.testing.assert_close(explicit, run(model, features, embeddings, layout), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", BACKENDS[2]])
def test_backends_agree_without_mask(backend: str) -> None:
    features, embeddings, _ = make_batch(1, lengths=[11, 11], num_anchors=[1, 1], pad_blocks=0)
    q_pos = torch.arange(11, 11 + BLOCK).expand(2, -1)
    with torch.no_grad():
        reference = make_model(None, "eager")(embeddings, features, q_pos)
        other = make_model(None, backend)(embeddings, features, q_pos)
    torch.testing.assert_close(other, reference, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# No leaks: a block's output depends only on context before its anchor and on its own block
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_leak_between_blocks_or_from_future_context(backend: str) -> None:
    model = make_model(None, backend)
    features, embeddings, layout = make_batch(2, lengths=[24, 17], num_anchors=[4, 3])
    base = run(model, features, embeddings, layout)
    gen = torch.Generator().manual_seed(3)
    for b in range(layout.batch_size):
        for j in range(layout.num_blocks):
            if not layout.anchor_valid[b, j]:
                continue
            p = int(layout.anchors[b, j])
            rows = block_rows(j)

            future = features.clone()
            future[b, p:] = torch.randn(future[b, p:].shape, generator=gen)
            assert torch.equal(run(model, future, embeddings, layout)[b, rows], base[b, rows]), (b, j, "future ctx")

            others = embeddings.clone()
            keep = others[b, rows].clone()
            others[b] = torch.randn(others[b].shape, generator=gen)
            others[b, rows] = keep
            assert torch.equal(run(model, features, others, layout)[b, rows], base[b, rows]), (b, j, "other blocks")

            other_seq = features.clone()
            other_seq[1 - b] = torch.randn(other_seq[1 - b].shape, generator=gen)
            assert torch.equal(run(model, other_seq, embeddings, layout)[b, rows], base[b, rows]), (b, j, "batch")

            if p > 0:
                past = features.clone()
                past[b, p - 1] += 1.0
                changed = run(model, past, embeddings, layout)[b, rows]
                assert not torch.allclose(changed, base[b, rows]), (b, j, "context before the anchor is ignored")


def test_padded_blocks_are_isolated() -> None:
    _, _, layout = make_batch(4, lengths=[20, 9], num_anchors=[3, 1], pad_blocks=2)
    mask = batch_dense_mask(layout)
    ctx = layout.context_len
    for b in range(layout.batch_size):
        for j in range(layout.num_blocks):
            rows = mask[b, block_rows(j)]
            if layout.anchor_valid[b, j]:
                assert not rows[:, int(layout.context_lengths[b]) : ctx].any(), "padded context visible"
            else:
                expected = torch.zeros(layout.num_keys, dtype=torch.bool)
                expected[ctx + j * BLOCK : ctx + (j + 1) * BLOCK] = True
                assert torch.equal(rows, expected.expand_as(rows)), "padded block must see only itself"


# ---------------------------------------------------------------------------
# Mask properties
# ---------------------------------------------------------------------------


@st.composite
def anchors_and_sizes(draw):
    seq_len = draw(st.integers(1, 40))
    block = draw(st.integers(1, 6))
    anchors = sorted(draw(st.sets(st.integers(0, seq_len - 1), min_size=1, max_size=min(seq_len, 8))))
    return anchors, seq_len, block


def dense_mask(anchors: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    """The boolean mask [A * Bk, S + A * Bk] of one sequence of length S with these anchors."""
    return batch_dense_mask(AnchorLayout.from_anchor_lists([anchors], [seq_len], block_size))[0]


@settings(max_examples=60, deadline=None)
@given(anchors_and_sizes())
def test_dense_mask_properties(case) -> None:
    anchors, seq_len, block = case
    mask = dense_mask(anchors, seq_len, block)
    assert mask.shape == (len(anchors) * block, seq_len + len(anchors) * block)
    assert mask.dtype == torch.bool
    expected_sums = torch.tensor(anchors).repeat_interleave(block) + block
    assert torch.equal(mask.sum(dim=1), expected_sums)
    for j, p in enumerate(anchors):
        rows = mask[j * block : (j + 1) * block]
        assert rows[:, :p].all() and not rows[:, p:seq_len].any()
        block_part = rows[:, seq_len:].reshape(block, len(anchors), block)
        assert block_part[:, j].all(), "own block is bidirectional"
        others = torch.ones(len(anchors), dtype=torch.bool)
        others[j] = False
        assert not block_part[:, others].any(), "cross-block entry"


@st.composite
def grouped_layouts(draw):
    """A padded batch layout (random anchors, lengths, padding, block size) and a group size that tiles it."""
    block = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    num_blocks = draw(st.integers(1, 12))
    anchor_lists = [sorted(draw(st.sets(st.integers(0, n - 1), max_size=min(n, num_blocks)))) for n in lengths]
    context_len = max(lengths) + draw(st.integers(0, 3))
    layout = AnchorLayout.from_anchor_lists(anchor_lists, lengths, block, num_blocks, context_len)
    group = draw(st.sampled_from([g for g in range(1, num_blocks + 1) if num_blocks % g == 0]))
    window = draw(st.sampled_from([None, block, block + 3]))
    return layout, group, window


@settings(max_examples=80, deadline=None)
@given(grouped_layouts())
def test_grouped_mask_is_the_dense_mask_without_other_groups(case) -> None:
    """Each group's mask is the dense mask's rows for its queries over [context; its own blocks], and those rows
    see no block of another group: dropping the other groups' keys loses nothing."""
    layout, group, window = case
    dense = batch_dense_mask(layout, window)  # [B, Q, C + Q]
    grouped = grouped_dense_mask(layout, window, group)
    ctx, per_group = layout.context_len, group * layout.block_size
    num_groups = layout.num_queries // per_group
    assert grouped.queries_per_group == per_group and grouped.context_len == ctx
    masks = grouped.mask.view(layout.batch_size, num_groups, per_group, ctx + per_group)
    for g in range(num_groups):
        rows = dense[:, g * per_group : (g + 1) * per_group]
        own = slice(ctx + g * per_group, ctx + (g + 1) * per_group)
        assert torch.equal(masks[:, g], torch.cat([rows[:, :, :ctx], rows[:, :, own]], dim=2))
        assert int(rows[:, :, ctx:].sum()) == int(rows[:, :, own].sum()), "a query sees another group's block"


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(0, 5000), st.integers(1, 32))
def test_blocks_per_group_is_the_smallest_tiling_group_within_the_key_budget(num_blocks, context, block):
    def copies(g: int) -> int:  # keys of all groups: the context once per group plus every block key
        return (num_blocks // g) * (context + g * block)

    group = blocks_per_group(num_blocks, context, block)
    assert num_blocks % group == 0 and 1 <= group <= num_blocks
    if num_blocks * block < MIN_GROUPED_BLOCK_KEYS:
        assert group == num_blocks  # too few block keys to be worth the copies: the whole mask
        return
    assert copies(group) <= MAX_GROUPED_KEYS_RATIO * (context + num_blocks * block)
    assert not any(num_blocks % g == 0 and copies(g) <= MAX_GROUPED_KEYS_RATIO * (context + num_blocks * block)
                   for g in range(1, group))


def test_blocks_per_group_examples() -> None:
    assert blocks_per_group(512, 1000, 16) == 64  # 2,024 keys per query instead of 9,192
    assert blocks_per_group(509, 1024, 16) == 509  # a prime count: one group, the whole mask
    assert blocks_per_group(16, 448, 16) == 16  # the `make all` drafter: one group, the whole mask
    assert blocks_per_group(32, 448, 16) == 16


@pytest.mark.parametrize(("block", "heads", "kv_heads"), [(4, 4, 2), (1, 3, 1), (3, 2, 2)])
@pytest.mark.parametrize("window", [None, 6])
def test_grouped_sdpa_equals_eager_attention_over_the_whole_mask(block: int, heads: int, kv_heads: int,
                                                                 window: int | None) -> None:
    """grouped_attention(SDPA) against the eager reference with the dense mask, outputs and q/k/v gradients, for
    every group size that tiles the blocks; GQA shapes, padded blocks, sequences of different lengths."""
    gen = torch.Generator().manual_seed(block)
    anchors = [torch.randperm(n, generator=gen)[:a].sort().values for n, a in ((30, 5), (17, 3))]
    layout = AnchorLayout.from_anchor_lists(anchors, [30, 17], block, num_blocks=6, context_len=32)
    window = None if window is None else max(window, block)
    q = torch.randn(2, heads, layout.num_queries, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, layout.num_keys, 16, generator=gen) for _ in range(2))
    upstream = torch.randn(2, heads, layout.num_queries, 16, generator=gen)

    def run_attention(attention) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves)
        out.backward(upstream)
        return (out.detach(), *(t.grad for t in leaves))

    reference = run_attention(lambda *t: eager_attention(*t, batch_dense_mask(layout, window)[:, None], 0.25))
    for group in (1, 2, 3, 6):
        mask = grouped_dense_mask(layout, window, group)
        grouped = run_attention(lambda *t: grouped_attention(sdpa_attention, *t, mask, 0.25))
        for name, got, want in zip(("output", "dq", "dk", "dv"), grouped, reference):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{name}, group {group}: {m}")


def test_sdpa_drafter_with_several_groups_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole drafter (two layers, one with a sliding window) where the default grouping makes 4 groups: the
    same output and parameter gradients as eager attention over the whole mask."""
    config = make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    features, embeddings, layout = make_batch(5, lengths=[9, 8], num_anchors=[7, 6], pad_blocks=1)  # C 9, 8 blocks
    monkeypatch.setattr(attention_masks, "MIN_GROUPED_BLOCK_KEYS", 1)  # group even this tiny batch
    assert blocks_per_group(layout.num_blocks, layout.context_len, BLOCK) == 2
    upstream = torch.randn(2, layout.num_queries, HIDDEN, generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in ("eager", "sdpa"):
        model = make_model(config, backend).train()
        out = model(embeddings, features, layout.query_position_ids(), layout.context_position_ids(), layout)
        out.backward(upstream)
        results[backend] = (out.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], atol=1e-5, rtol=0)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["sdpa"][1][name], grad, atol=1e-4, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------
# Export names and config
# ---------------------------------------------------------------------------


def test_state_dict_keys_and_shapes() -> None:
    config = make_config()
    model = training_drafter(config)
    expected = {"norm.weight": (HIDDEN,), "fc.weight": (HIDDEN, 3 * HIDDEN), "hidden_norm.weight": (HIDDEN,)}
    head_dim, inter = config.head_dim, config.intermediate_size
    for i in range(LAYERS):
        expected |= {
            f"layers.{i}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"layers.{i}.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"layers.{i}.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"layers.{i}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"layers.{i}.self_attn.q_norm.weight": (head_dim,),
            f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, HIDDEN),
            f"layers.{i}.mlp.up_proj.weight": (inter, HIDDEN),
            f"layers.{i}.mlp.down_proj.weight": (HIDDEN, inter),
            f"layers.{i}.input_layernorm.weight": (HIDDEN,),
            f"layers.{i}.post_attention_layernorm.weight": (HIDDEN,),
        }
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    assert len(state) == 3 + 11 * LAYERS
    assert {k: tuple(v.shape) for k, v in state.items()} == expected


def test_config_from_target_and_export(tmp_path) -> None:
    config = make_config()
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (HIDDEN, HEADS, KV_HEADS)
    assert config.head_dim == HIDDEN // HEADS and config.intermediate_size == 128
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 50000.0
    assert config.num_target_layers == 8 and config.target_layer_ids == TARGET_LAYER_IDS
    assert config.layer_types == ["full_attention"] * LAYERS
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["model_type"] == "qwen3"
    assert saved["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": TARGET_LAYER_IDS, "embed_scale": 1.0,
                                      "block_size": BLOCK}  # where DFlash 2 readers look for it
    assert saved["is_causal"] is False  # the reference loader treats sliding layers as causal unless told
    assert saved["block_size"] == BLOCK and saved["num_target_layers"] == 8 and saved["rope_theta"] == 50000.0
    assert saved["num_hidden_layers"] == LAYERS == len(saved["layer_types"]) and saved["head_dim"] == 16
    reloaded = DFlashConfig.from_pretrained(tmp_path)
    assert reloaded.target_layer_ids == TARGET_LAYER_IDS and reloaded.mask_token_id == 7
    assert reloaded.rope_parameters == config.rope_parameters


def test_default_layer_ids() -> None:
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30, 1) == [15]
    assert make_config(target_layer_ids=None, num_draft_layers=3).target_layer_ids == [1, 3, 5]


def test_config_keeps_target_rope_scaling() -> None:
    scaled = dict(TARGET_CONFIG, rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = config_from_target(scaled, TARGET_LAYER_IDS, LAYERS, BLOCK, 7)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}
    assert config.to_dict()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


# ---------------------------------------------------------------------------
# Train / inference consistency
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding", [False, True])
def test_inference_layout_matches_training_layout(backend: str, sliding: bool) -> None:
    config = make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6) if sliding else None
    model = make_model(config, backend)
    features, embeddings, layout = make_batch(6, lengths=[26, 15], num_anchors=[5, 3])
    train = run(model, features, embeddings, layout)
    for b in range(layout.batch_size):
        for j in range(layout.num_blocks):
            if not layout.anchor_valid[b, j]:
                continue
            start = int(layout.anchors[b, j])
            q_pos = torch.arange(start, start + BLOCK)[None]
            with torch.no_grad():  # context = all positions < start, one block, no mask
                infer = model(embeddings[b : b + 1, block_rows(j)], features[b : b + 1, :start], q_pos)
            torch.testing.assert_close(infer[0], train[b, block_rows(j)], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])  # flex has no CPU backward (torch 2.13): CUDA only
def test_backward_is_finite(backend: str) -> None:
    model = make_model(None, backend).train()
    model.gradient_checkpointing = True
    features, embeddings, layout = make_batch(7, lengths=[18, 10], num_anchors=[3, 1], pad_blocks=2)
    out = model(embeddings, features, layout.query_position_ids(), layout.context_position_ids(), layout)
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------
# Parity with transformers' Qwen3 primitives (the building blocks of the reference drafter)
# ---------------------------------------------------------------------------


def qwen3_primitive_forward(model: DFlashDraftModel, embeddings, features, q_pos) -> torch.Tensor:
    """The reference semantics, step by step, on transformers' Qwen3 modules (inference layout, no mask)."""
    from types import SimpleNamespace

    from transformers.models.qwen3 import modeling_qwen3 as q3

    config = model.config

    def rms(weight, eps=config.rms_norm_eps):
        norm = q3.Qwen3RMSNorm(weight.shape[0], eps)
        norm.weight.data.copy_(weight)
        return norm

    context = rms(model.hidden_norm.weight)(torch.nn.functional.linear(features, model.fc.weight))
    positions = torch.cat([torch.arange(features.shape[1]).expand(q_pos.shape[0], -1), q_pos], dim=1)
    cos, sin = q3.Qwen3RotaryEmbedding(config)(embeddings, positions)
    hidden = embeddings
    for layer in model.layers:
        attn, bsz, q_len, ctx_len = layer.self_attn, *embeddings.shape[:2], features.shape[1]
        x = rms(layer.input_layernorm.weight)(hidden)
        q = rms(attn.q_norm.weight)(attn.q_proj(x).view(bsz, q_len, -1, config.head_dim)).transpose(1, 2)
        k = torch.cat([attn.k_proj(context), attn.k_proj(x)], dim=1).view(bsz, ctx_len + q_len, -1, config.head_dim)
        v = torch.cat([attn.v_proj(context), attn.v_proj(x)], dim=1).view(bsz, ctx_len + q_len, -1, config.head_dim)
        k = rms(attn.k_norm.weight)(k).transpose(1, 2)
        q, _ = q3.apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])
        _, k = q3.apply_rotary_pos_emb(k, k, cos, sin)
        module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=False)
        out, _ = q3.eager_attention_forward(module, q, k, v.transpose(1, 2), None, scaling=config.head_dim**-0.5)
        hidden = hidden + attn.o_proj(out.reshape(bsz, q_len, -1))
        mlp = q3.Qwen3MLP(config)
        mlp.load_state_dict(layer.mlp.state_dict())
        hidden = hidden + mlp(rms(layer.post_attention_layernorm.weight)(hidden))
    return rms(model.norm.weight)(hidden)


def test_matches_qwen3_primitives() -> None:
    model = make_model(None, "eager")
    features, embeddings, _ = make_batch(8, lengths=[13, 13], num_anchors=[1, 1], pad_blocks=0)
    q_pos = torch.arange(13, 13 + BLOCK).expand(2, -1)
    with torch.no_grad():
        ours = model(embeddings, features, q_pos)
        reference = qwen3_primitive_forward(model, embeddings, features, q_pos)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("hidden", "device", "expected"), [(576, "cuda", "sdpa"), (2048, "cuda", "flex"),
                                                              (4096, "cuda", "flex"), (4096, "cpu", "sdpa")])
def test_auto_attention_picks_the_measured_faster_backend(hidden: int, device: str, expected: str) -> None:
    config = config_from_target({**TARGET_CONFIG, "hidden_size": hidden, "num_attention_heads": hidden // 64, "num_key_value_heads": 1,
                                 "head_dim": 64}, TARGET_LAYER_IDS, 1, BLOCK, 0)
    model = training_drafter(config, "auto")
    assert model.attention.backend(torch.device(device)) == expected
    assert training_drafter(config, "flex").attention.backend(torch.device("cpu")) == "flex"  # explicit choices stand


def test_a_drafter_config_matches_itself_and_not_another_embedding_scale() -> None:
    """What --resume and --init-from compare: the same drafter configured again matches its recorded config; a
    recorded embedding scale that differs does not."""
    from dflash.stage2_train.run_setup import config_differences

    config = config_from_target({**TARGET_CONFIG, "model_type": "qwen3"}, TARGET_LAYER_IDS, LAYERS, BLOCK, 7)
    before = json.loads(json.dumps(config.to_dict()))
    assert config_differences(config, before, "the export") == []
    before["dflash_config"]["embed_scale"] = 8.0
    assert [line.split(":")[0] for line in config_differences(config, before, "the export")] == ["dflash_config"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_keeps_the_rotary_frequencies_in_float32(dtype: torch.dtype) -> None:
    """`dflash eval` casts the drafter to the target's dtype; the rotary frequencies stay transformers' float32 ones
    (a bf16 inv_freq puts far positions' angles off), while every weight takes the new dtype."""
    model = make_model()
    exact = model.rotary_emb.inv_freq.clone()
    assert exact.dtype == torch.float32
    cast = model.to(dtype)
    assert cast is model and model.fc.weight.dtype == dtype
    for name in ("inv_freq", "original_inv_freq"):
        assert torch.equal(getattr(model.rotary_emb, name), exact), name
    assert not torch.equal(exact.to(dtype).float(), exact)  # the cast alone would have changed them
    positions = torch.arange(4096)[None]
    cos, _ = model.rotary_emb(torch.zeros(1, 1, dtype=torch.float32), positions)
    reference, _ = make_model().rotary_emb(torch.zeros(1, 1), positions)
    assert torch.equal(cos, reference)
