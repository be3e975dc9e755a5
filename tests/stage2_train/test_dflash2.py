"""DFlash 2 (modeling_dflash.DFlash2DraftModel): identity initialisation, block-local taps, the selector's scores and
walk against direct computations, lossless sampled verification, the selector loss, and the export's format against
the published rules (z-lab's DFlash 2 fixtures: `tests/fixtures/dflash2-config.json` and its safetensors header)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train.attention_masks import AnchorLayout, PackedLayout
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFLASH2_DEFAULTS, config_from_target
from dflash.stage2_train.export import export_draft, load_draft
from dflash.stage2_train.loss import (SELECTOR_CHUNK_ROWS, dflash_loss, position_weights, selector_chunk_rows,
                                      selector_loss, selector_positions)
from dflash.stage2_train.modeling_dflash import CandidateSelector, GroupedDynamicConv, block_shift

HIDDEN, BLOCK, VOCAB = 64, 4, 50
TARGET = {"hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "num_hidden_layers": 8, "vocab_size": VOCAB, "rope_theta": 50000.0, "rms_norm_eps": 1e-5}
SMALL = {"conv_group_size": 8, "selector_rank": 16, "selector_top_k": 5}


def config(architecture: str = "dflash2", **kwargs):
    return config_from_target(TARGET, [1, 3, 5], 2, BLOCK, 7, architecture=architecture,
                              dflash2=SMALL if architecture == "dflash2" else None, **kwargs)


def randomise_added_parts(model: loop.DFlash2DraftModel, seed: int = 1) -> None:
    """Move the DFlash 2 parts off the identity, so that tests see them work."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in model.added_parameter_names():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)


def anchor_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AnchorLayout]:
    generator = torch.Generator().manual_seed(seed)
    layout = AnchorLayout.from_anchor_lists([[2, 5, 9], [3, 7]], [12, 10], BLOCK)
    noise = torch.randn(2, 3 * BLOCK, HIDDEN, generator=generator)
    context = torch.randn(2, 12, 3 * HIDDEN, generator=generator)
    return noise, context, layout


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_identity_init_equals_the_dflash_backbone(backend: str) -> None:
    """A fresh DFlash 2 drafter of a seed computes exactly (fp32, bit for bit) what the DFlash drafter of that seed
    computes, and its selector walks DFlash's greedy tokens."""
    torch.manual_seed(0)
    dflash = training_drafter(config("dflash"), backend)
    torch.manual_seed(0)
    dflash2 = training_drafter(config(), backend)
    assert isinstance(dflash2, loop.DFlash2DraftModel) and not isinstance(dflash, loop.DFlash2DraftModel)
    noise, context, layout = anchor_inputs()
    args = (noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
    hidden, hidden2 = dflash(*args), dflash2(*args)
    assert torch.equal(hidden, hidden2)
    head = torch.randn(VOCAB, HIDDEN)
    logits = hidden2[0].reshape(3, BLOCK, HIDDEN)[:, 1:] @ head.T
    path, _, _ = dflash2.candidate_selector.walk(hidden2[0].reshape(3, BLOCK, HIDDEN)[:, 1:], logits,
                                                 torch.tensor([11, 12, 13]))
    assert torch.equal(path, logits.argmax(-1))


def test_block_shift_stays_inside_blocks() -> None:
    x = torch.arange(1, 13, dtype=torch.float32).reshape(1, 12, 1)  # three blocks of 4
    assert block_shift(x, 1, BLOCK).flatten().tolist() == [0, 1, 2, 3, 0, 5, 6, 7, 0, 9, 10, 11]
    assert block_shift(x, 0, BLOCK) is x


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), kernel=st.sampled_from([1, 2, 3]))
def test_conv_equals_a_direct_computation(seed: int, kernel: int) -> None:
    """y_t = sum_o (base[0, o, c] + d[t, 0, o, group(c)]) * x_{t-o, c} (zero before the block start), written out."""
    torch.manual_seed(seed)
    conv = GroupedDynamicConv(HIDDEN, kernel, 8, BLOCK)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.1)
    x, f = torch.randn(2, 3 * BLOCK, HIDDEN), torch.randn(2, 3 * BLOCK, HIDDEN)
    y, taps = conv.prepare(x)
    z = conv.finish(f, taps)
    dynamic = conv.kernel_projection(x).view(2, 3 * BLOCK, 2, kernel, HIDDEN // 8)
    for half, (inputs, got) in enumerate([(x, y), (f, z)]):
        want = torch.zeros_like(inputs)
        for b in range(2):
            for t in range(3 * BLOCK):
                for o in range(kernel):
                    if t % BLOCK - o < 0:
                        continue
                    tap = conv.base_kernel[half, o] + dynamic[b, t, half, o].repeat_interleave(8)
                    want[b, t] += tap * inputs[b, t - o]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout_kind", ["anchors", "packed"])
def test_no_information_crosses_a_block(layout_kind: str) -> None:
    """With the DFlash 2 parts off the identity, changing one block's inputs changes no other block's outputs (the
    taps, like the attention mask, stay inside a block), on the padded and the packed layouts."""
    torch.manual_seed(0)
    model = training_drafter(config(), "eager")
    randomise_added_parts(model)
    noise, context, layout = anchor_inputs()
    if layout_kind == "packed":
        layout = PackedLayout.from_anchor_lists([[2, 5, 9], [3, 7]], [12, 10], BLOCK)
        noise = noise.reshape(1, -1, HIDDEN)[:, : layout.num_blocks * BLOCK]
        context = torch.cat([context[0, :12], context[1, :10]])[None]
    args = (layout.query_position_ids(), layout.context_position_ids(), layout)
    before = model(noise, context, *args)
    changed = noise.clone()
    changed[0, BLOCK:2 * BLOCK] += 1.0  # the second block of the first row
    after = model(changed, context, *args)
    differs = (after - before).abs().amax(-1)[0].reshape(-1, BLOCK).amax(-1) > 0
    assert differs.tolist() == [i == 1 for i in range(differs.numel())]


def test_selector_scores_and_greedy_walk_equal_a_direct_computation() -> None:
    torch.manual_seed(0)
    selector = CandidateSelector(config())
    with torch.no_grad():
        selector.successor_codebook.normal_()
    hidden, logits = torch.randn(2, BLOCK - 1, HIDDEN), torch.randn(2, BLOCK - 1, VOCAB)
    anchors = torch.tensor([3, 9])
    path, candidates, proposal = selector.walk(hidden, logits, anchors)
    assert proposal is None
    A, B, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    for n in range(2):
        previous = int(anchors[n])
        for t in range(BLOCK - 1):
            top = sorted(range(VOCAB), key=lambda v: -float(logits[n, t, v]))[: SMALL["selector_top_k"]]
            assert candidates[n, t].tolist() == top
            scores = [float(logits[n, t, b]) + float(((A[previous] * (P @ hidden[n, t])) * B[b]).sum()) for b in top]
            previous = top[max(range(len(top)), key=lambda i: scores[i])]
            assert int(path[n, t]) == previous


def test_sampled_walk_with_rejection_sampling_is_lossless() -> None:
    """The selector's sampled path, verified by rejection sampling against its proposal, emits tokens distributed as
    the target's own samples: the first token follows p1, the second (after an accepted first) p2(. | first).
    Chi-square over 12,000 draws on a 6-token vocabulary, top-3 candidates (most tokens outside them); the second
    token is tested after every first token seen at least 200 times, as one chi-square with their degrees of
    freedom summed."""
    vocab, draws = 6, 12_000
    selector = CandidateSelector(config_from_target({**TARGET, "vocab_size": vocab}, [1], 1, 3, 5,
                                                    architecture="dflash2",
                                                    dflash2={**SMALL, "selector_top_k": 3}))
    torch.manual_seed(0)
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 2.0)
        selector.predecessor_codebook.normal_(0, 2.0)
    hidden, logits = torch.randn(2, HIDDEN), torch.randn(2, vocab)
    with torch.no_grad():  # a target close to the first proposal, so that first drafts are often accepted
        first_proposal = selector.propose(hidden, logits, 4, temperature=1.0)[1][0]
    p1 = 0.7 * first_proposal + 0.3 * torch.softmax(torch.randn(vocab), -1)
    p2 = torch.softmax(torch.randn(vocab, vocab), -1)  # p2[x1] = the target's next-token distribution after x1
    p3 = torch.full((vocab,), 1 / vocab)
    generator = torch.Generator().manual_seed(1)
    firsts, seconds = torch.zeros(vocab), torch.zeros(vocab, vocab)
    with torch.no_grad():
        for _ in range(draws):
            tokens, probs = selector.propose(hidden, logits, 4, temperature=1.0, generator=generator)
            assert probs is not None and float(probs[0, tokens[0]]) > 0
            target_probs = torch.stack([p1, p2[tokens[0]], p3])
            accepted, following = loop.verify_sampling(tokens, probs, target_probs, generator)
            emitted = [*tokens[:accepted], following]
            firsts[emitted[0]] += 1
            if len(emitted) > 1:
                seconds[emitted[0], emitted[1]] += 1
    assert _chi_square_p([(firsts, p1)]) > 1e-3
    seen = [a for a in range(vocab) if seconds[a].sum() >= 200]
    assert sum(float(seconds[a].sum()) for a in seen) > 1500
    assert _chi_square_p([(seconds[a], p2[a]) for a in seen]) > 1e-3


def _chi_square_p(tests: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Pearson's chi-square test of counts against probabilities, over one or more (counts, probs) pairs with their
    statistics and degrees of freedom summed: the p-value (the regularised upper incomplete gamma function)."""
    statistic, dof = 0.0, 0
    for counts, probs in tests:
        expected = probs.double() * counts.sum().double()
        statistic += float(((counts.double() - expected) ** 2 / expected).sum())
        dof += counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_selector_loss_equals_a_direct_computation() -> None:
    """The selector loss (inject and drop) against a per-position computation: candidates = top-k of the drafter's
    logits, the true token injected in place of the last candidate (or the position dropped), predecessor = the
    true previous token (the anchor at offset 1), position weights, divided by the global weight sum."""
    torch.manual_seed(0)
    selector = CandidateSelector(config())
    with torch.no_grad():
        selector.successor_codebook.normal_()
    n_blocks = 5
    hidden, head = torch.randn(1, n_blocks * BLOCK, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (1, n_blocks, BLOCK))
    labels[..., 0] = -100
    labels[0, 1, 2] = -100  # an unsupervised position: it and the position after it (its predecessor) drop out
    block_ids = torch.randint(0, VOCAB, (1, n_blocks, BLOCK))
    for position in range(1, BLOCK):  # make some true tokens the top logit, so that both kinds of position occur
        labels[0, 0, position] = int((hidden[0, position] @ head.T).argmax())
    weights = position_weights(BLOCK)
    # The candidates as training gets them: from the block loss's logits (chunks of 7 rows: several chunks)
    _, stats = dflash_loss(hidden, head, labels, weights, 3.0, chunk_size=7, candidates=SMALL["selector_top_k"])
    for missing in ("inject", "drop"):
        loss, counts = selector_loss(selector, hidden, head, block_ids, labels, stats["candidates"], weights, 3.0,
                                     missing=missing, chunk_rows=4)
        total, hits, positions = 0.0, 0, 0
        for j in range(n_blocks):
            for k in range(1, BLOCK):
                y, a = int(labels[0, j, k]), int(block_ids[0, j, 0]) if k == 1 else int(labels[0, j, k - 1])
                if y < 0 or a < 0:
                    continue
                h = hidden[0, j * BLOCK + k]
                logits = h @ head.T
                candidates = logits.topk(SMALL["selector_top_k"]).indices.tolist()
                positions += 1
                if y in candidates:
                    hits += 1
                elif missing == "drop":
                    continue
                else:
                    candidates[-1] = y
                proj = selector.hidden_projection.weight @ h
                scores = torch.stack([logits[b] + ((selector.predecessor_codebook[a] * proj)
                                                   * selector.successor_codebook[b]).sum() for b in candidates])
                total += float(weights[k]) * float(-torch.log_softmax(scores, 0)[candidates.index(y)])
        assert float(loss) == pytest.approx(total / 3.0, rel=1e-5)
        assert int(counts["candidate_hits"]) == hits and int(counts["candidate_positions"]) == positions
        assert 0 < hits < positions


def _selector_case() -> tuple:
    """A selector with trained-looking codebooks and a micro-batch of 7 blocks: some unsupervised positions (and so
    positions without a predecessor), a padding-like block with no labels."""
    torch.manual_seed(1)
    selector = CandidateSelector(config())
    with torch.no_grad():
        selector.successor_codebook.normal_()
    n_blocks = 7
    hidden = torch.randn(1, n_blocks * BLOCK, HIDDEN, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (1, n_blocks, BLOCK))
    labels[..., 0] = -100
    labels[0, 2, 1] = labels[0, 4, 2] = -100
    labels[0, 6] = -100
    block_ids = torch.randint(0, VOCAB, (1, n_blocks, BLOCK))
    _, stats = dflash_loss(hidden.detach(), head, labels, position_weights(BLOCK), 2.0, chunk_size=5,
                           candidates=SMALL["selector_top_k"])
    return selector, hidden, head, labels, block_ids, stats["candidates"]


def test_selector_positions_are_the_supervised_positions_with_a_known_predecessor() -> None:
    _, _, _, labels, block_ids, _ = _selector_case()
    expected = [j * BLOCK + k for j in range(labels.shape[1]) for k in range(1, BLOCK)
                if labels[0, j, k] >= 0 and (k == 1 or labels[0, j, k - 1] >= 0)]
    assert selector_positions(labels, block_ids).tolist() == expected
    # 18 in the 6 labelled blocks, less offsets 1-2 of block 2 and 2-3 of block 4
    assert len(expected) == 6 * (BLOCK - 1) - 4


@pytest.mark.parametrize("missing", ["inject", "drop"])
def test_selector_loss_from_given_positions_equals_it_from_the_labels(missing: str) -> None:
    """The positions the loader builds on the CPU (`selector_positions`) give the loss, counts and gradients the
    loss finds itself, in any chunking; and with them it dispatches nothing that makes the host wait for the device
    (no nonzero, no boolean-mask indexing, no scalar read), forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    selector, hidden, head, labels, block_ids, candidates = _selector_case()
    weights = position_weights(BLOCK)

    def run(mode: TorchDispatchMode | None = None, **kwargs: object) -> tuple:
        hidden.grad = None
        selector.zero_grad()
        with mode or contextlib.nullcontext():
            loss, counts = selector_loss(selector, hidden, head, block_ids, labels, candidates, weights, 2.0,
                                         missing=missing, **kwargs)
            loss.backward()
        return (loss.detach(), int(counts["candidate_hits"]), int(counts["candidate_positions"]),
                hidden.grad.clone(), selector.successor_codebook.grad.clone())

    class Waits(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            indices = args[1] if name in ("index", "index_put", "index_put_") else ()
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if name in ("nonzero", "_local_scalar_dense", "masked_select", "item") or masks:
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    found = Waits()
    reference = run(found, chunk_rows=4)
    assert "nonzero" in found.seen  # the mode sees a wait where there is one: positions found on the device
    positions = selector_positions(labels, block_ids)
    for chunk in (3, 64):
        waits = Waits()
        got = run(waits, chunk_rows=chunk, positions=positions)
        assert waits.seen == []
        assert got[1:3] == reference[1:3] and got[2] == positions.numel()
        for a, b in zip((got[0], *got[3:]), (reference[0], *reference[3:])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_selector_chunks_keep_their_head_rows_within_the_cuda_chunk_bytes() -> None:
    """CPU: SELECTOR_CHUNK_ROWS positions. CUDA: the most multiples of it whose [rows, k, H] head rows fit in
    CUDA_CHUNK_BYTES, never fewer: one chunk for the SmolLM2 DFlash 2 step (~24,900 positions), whose 13 chunks
    of 2,048 were ~2,000 of its ~2,700 eager operations; and the memory plan counts the same chunk."""
    from dflash.stage2_train import loss as loss_module
    from dflash.stage2_train.memory_plan import DrafterShape

    assert selector_chunk_rows(32, 576, "cpu") == SELECTOR_CHUNK_ROWS
    assert selector_chunk_rows(16, 576, "cuda") == 28 * SELECTOR_CHUNK_ROWS  # the default 16 candidates, SmolLM2
    for top_k, hidden_size, element_bytes in ((32, 576, 2), (32, 4096, 2), (8, 896, 4), (64, 8192, 2)):
        rows = selector_chunk_rows(top_k, hidden_size, "cuda", element_bytes)
        row_bytes = top_k * hidden_size * element_bytes
        assert rows % SELECTOR_CHUNK_ROWS == 0
        assert rows == SELECTOR_CHUNK_ROWS or rows * row_bytes <= loss_module.CUDA_CHUNK_BYTES < (
            rows + SELECTOR_CHUNK_ROWS) * row_bytes
    drafter = config()
    for device_type in ("cpu", "cuda"):
        shape = DrafterShape.of(drafter, 10, 2, device_type)
        assert shape.selector_chunk == selector_chunk_rows(SMALL["selector_top_k"], HIDDEN, device_type, 2)


def test_selector_loss_trains_the_selector_and_the_drafter() -> None:
    torch.manual_seed(0)
    model = training_drafter(config(), "sdpa")
    noise, context, layout = anchor_inputs()
    hidden = model(noise, context, layout.query_position_ids(), layout.context_position_ids(), layout)
    labels = torch.randint(0, VOCAB, (1, 6, BLOCK))
    labels[..., 0] = -100
    head = torch.randn(VOCAB, HIDDEN)
    block, stats = dflash_loss(hidden.reshape(1, -1, HIDDEN), head, labels, position_weights(BLOCK), 1.0,
                               candidates=model.candidate_selector.top_k)
    loss, _ = selector_loss(model.candidate_selector, hidden.reshape(1, -1, HIDDEN), head,
                            torch.randint(0, VOCAB, (1, 6, BLOCK)), labels, stats["candidates"], position_weights(BLOCK),
                            1.0, missing="inject")
    loss.backward()
    for name in ("candidate_selector.successor_codebook", "layers.0.self_attn.q_proj.weight"):
        assert float(dict(model.named_parameters())[name].grad.abs().sum()) > 0, name


# The published DFlash 2 export format (z-lab/dflash tests/fixtures/dflash2-config.json and
# dflash2-safetensors-header.json, a 5-layer drafter of hidden 6656, vocabulary 202048, r 256, g 16, K 2).
PUBLISHED_DFLASH_CONFIG_KEYS = {"block_size", "conv_group_size", "conv_kernel_size", "mask_token_id", "selector_rank",
                                "selector_top_k", "target_layer_ids"}
PUBLISHED_LAYER_TENSORS = {"attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                           "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
                           "mlp.up_proj.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
                           "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
                           "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
                           "self_attn.v_proj.weight"}
PUBLISHED_TOP_TENSORS = {"candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                         "candidate_selector.successor_codebook", "fc.weight", "hidden_norm.weight", "norm.weight"}


def test_export_follows_the_published_dflash2_format(tmp_path: Path) -> None:
    from safetensors import safe_open

    cfg = config_from_target(TARGET, [1, 3, 5], 2, BLOCK, 7, architecture="dflash2")  # the published K, g, r, k
    export_draft(training_drafter(cfg), tmp_path, {"identity": {}})
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"] and written["is_causal"] is False
    assert written["model_type"] == "qwen3" and written["tie_word_embeddings"] is False
    assert written["vocab_size"] == VOCAB and written["num_target_layers"] == TARGET["num_hidden_layers"]
    assert PUBLISHED_DFLASH_CONFIG_KEYS <= set(written["dflash_config"])
    assert {key: written["dflash_config"][key] for key in DFLASH2_DEFAULTS} == DFLASH2_DEFAULTS
    assert written["dflash_config"]["block_size"] == BLOCK
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert set(shapes) == PUBLISHED_TOP_TENSORS | {f"layers.{i}.{name}" for i in range(2)
                                                   for name in PUBLISHED_LAYER_TENSORS}
    kernel, groups, rank = 2, HIDDEN // 16, 256
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == [2, kernel, HIDDEN]
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == [2 * kernel * groups, HIDDEN]
    assert shapes["candidate_selector.predecessor_codebook"] == [VOCAB, rank]
    assert shapes["candidate_selector.successor_codebook"] == [VOCAB, rank]
    assert shapes["candidate_selector.hidden_projection.weight"] == [rank, HIDDEN]
    reloaded = load_draft(tmp_path)
    assert isinstance(reloaded, loop.DFlash2DraftModel) and reloaded.candidate_selector.top_k == 16
    assert math.isclose(float(reloaded.layers[0].attention_conv.base_kernel[0, 0, 0]), 1.0)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_auto_model_spec_generate_equals_dflash_eval(family: str, tmp_path: Path) -> None:
    """A DFlash 2 export via `AutoModel` (its shipped modeling file) gives the tokens and tau of the loop `dflash
    eval` runs (fp32, CPU), greedy and sampled (same generator seed), and greedy output equals plain decoding."""
    from transformers import AutoModel, AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target
    from dflash.stage2_train import speculative as spec
    from tests.end_to_end.families import build_family

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(
        build_family(family, Path(resolve_target(None).load_path), tmp_path / family), dtype=torch.float32).eval()
    cfg = config_from_target(target.config.to_dict(), [1, 2], 1, BLOCK, 5, architecture="dflash2",
                             dflash2={"conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4})
    torch.manual_seed(0)
    draft = loop.drafter_for(cfg).eval()
    randomise_added_parts(draft)
    buffers = {name: buffer.clone() for name, buffer in draft.named_buffers()}
    export_draft(draft, tmp_path / "export", {"identity": {}})
    draft = draft.to(torch.bfloat16).float()
    loaded = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DFlash2DraftModel"
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    for name, buffer in loaded.named_buffers():  # the rotary frequencies, not in the state dict: computed
        assert torch.equal(buffer, buffers[name]), name
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = list(range(200, 220))
    for temperature in (0.0, 0.8):
        ours = loop.speculative_generate(target, draft, embed, head, prompt, [1, 2], 24, [2], temperature=temperature,
                                         generator=torch.Generator().manual_seed(5))
        output = loaded.spec_generate(input_ids=torch.tensor([prompt]), target=target, max_new_tokens=24,
                                      temperature=temperature, stop_token_ids=[2],
                                      generator=torch.Generator().manual_seed(5))
        assert output[0, len(prompt):].tolist() == ours.tokens
        assert loaded.last_acceptance_lengths == [a + 1 for a in ours.accepted]
        if temperature == 0:
            assert ours.tokens == spec.greedy_generate(target, prompt, 24, [2]).tokens
