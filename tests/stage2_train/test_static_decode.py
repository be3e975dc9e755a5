"""The fast decode path (static caches, fixed-shape forwards; CUDA graphs on GPUs) against the dynamic one, on the
tiny targets of real families (float32, CPU): llama, gemma3_text (sliding window 8, shorter than the prompts),
qwen3_next (hybrid: linear-attention layers whose recurrent states are copied back and fed again on rollback), gpt_oss (eager attention with sinks: additive masks, sliding layers)
and deepseek_v3 (MLA: keys and values of different head sizes), with a DFlash and a DFlash 2 drafter. References: transformers'
DynamicCache path, plain greedy decoding, and a cache-free forward of the kept prefix. GPU-only parts (graph
capture) skip without CUDA; `benchmarks/bench_eval_decode.py` covers them on the GPU machine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from dflash.stage2_train.draft_config import config_from_target
from tests.end_to_end.families import DECODE_VARIANTS, build_family, decode_families, load_families
from tests.stage2_train.test_dflash2 import randomise_added_parts

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3"]
HYBRIDS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "dense_hybrid"]
BLOCK = 4
LAYER_IDS = [1, 2]


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return load_families([*FAMILIES, "dense_hybrid"], tmp_path_factory.mktemp("families"))


def drafter(target: torch.nn.Module, architecture: str) -> loop.DFlashDraftModel:
    extra = {"dflash2": {"conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4}} if architecture == "dflash2" \
        else {}
    cfg = config_from_target(target.config.to_dict(), LAYER_IDS, 1, BLOCK, 5, architecture=architecture, **extra)
    torch.manual_seed(0)
    draft = loop.drafter_for(cfg).eval()
    if architecture == "dflash2":
        randomise_added_parts(draft)
    return draft


def test_decode_modes_resolve_by_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loop.resolve_decode("auto", cpu) == (False, False)
    assert loop.resolve_decode("auto", cuda) == (True, True)
    assert loop.resolve_decode("static", cpu) == (True, False)
    assert loop.resolve_decode("dynamic", cuda) == (False, False)
    with pytest.raises(ValueError, match="decode"):
        loop.resolve_decode("fast", cpu)


def test_static_support_by_family(targets: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    for family in [*FAMILIES, "dense_hybrid"]:
        assert loop.static_unsupported(targets[family]) is None, family
    hybrid = targets["qwen3_next"]
    monkeypatch.setattr(hybrid.config, "model_type", "jamba")  # linear attention of a family not tested statically
    assert "'jamba'" in loop.static_unsupported(hybrid)
    monkeypatch.setattr(hybrid.config, "model_type", "qwen3_next")
    monkeypatch.setattr(hybrid.config, "layer_types", ["linear_attention", "mamba", "full_attention", "mamba"])
    assert "mamba" in loop.static_unsupported(hybrid)  # recurrent layers other than transformers' linear attention


@pytest.mark.parametrize("family", ["llama", "gemma3_text", *HYBRIDS])
def test_static_rollback_equals_a_fresh_forward_of_the_kept_prefix(targets: dict, family: str) -> None:
    """Verify blocks of 6 at varying kept lengths through one static cache (stale positions stay in the buffer;
    qwen3_next's recurrent states are copied back and the kept part fed again), then a forward of 3: its logits and
    captured features equal a cache-free forward of the same tokens."""
    target = targets[family]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(100, 5000, (60,), generator=generator).tolist()
    runner = loop.TargetRunner(target, LAYER_IDS, capacity=64)
    position = 20
    with torch.inference_mode(), runner.hooked():
        runner.forward(tokens[:position], 0, last_only=True)
        for keep in (0, 3, 1, 6, 2, 5, 0):
            runner.verify(torch.tensor(tokens[position:position + 6]), position)
            runner.rollback(position + keep)
            assert runner.length == position + keep
            position += keep
            tokens[position] = (tokens[position] + 7) % 5000  # the next block differs from the rejected tail
        logits, features = runner.forward(tokens[position:position + 3], position)
        with pytest.raises(RuntimeError, match="positions"):
            runner.forward(tokens[:3], position + 1)
        fresh = target(input_ids=torch.tensor([tokens[:position + 3]]), output_hidden_states=True)
    torch.testing.assert_close(logits, fresh.logits[0, position:].float(), rtol=1e-4, atol=1e-4)
    expected = torch.cat([fresh.hidden_states[i + 1][:, position:] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)


def fixed_step_widths(runner: loop.TargetRunner) -> list[int]:
    """The widths of the runner's fixed-width forwards from now on (prefill chunks, one-token steps), in order."""
    widths: list[int] = []
    fixed = runner._fixed_step

    def recorded(ids: torch.Tensor) -> object:
        widths.append(int(ids.shape[1]))
        return fixed(ids)

    runner._fixed_step = recorded  # type: ignore[method-assign]
    return widths


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "deepseek_v3", *HYBRIDS])
@pytest.mark.parametrize("length", [1, 7, 8, 21])
def test_a_chunked_prefill_equals_a_fresh_forward_and_the_steps_after_it_too(targets: dict, family: str,
                                                                            length: int) -> None:
    """A prefill in chunks of 8 (the last padded, what the padding wrote left past the cache's length) gives the
    logits of the prompt's last position and the features of its positions, and then one-token steps the logits, of
    a cache-free forward of the same tokens; hybrid targets prefill in one forward (padding would advance their
    recurrent states), and a prompt of one token is a one-token step."""
    target = targets[family]
    tokens = torch.randint(100, 5000, (length + 4,), generator=torch.Generator().manual_seed(length)).tolist()
    runner = loop.TargetRunner(target, LAYER_IDS, capacity=64, prefill_chunk=8)
    assert runner.prefill_chunk == (0 if family in HYBRIDS else 8)
    chunks = fixed_step_widths(runner)
    with torch.inference_mode(), runner.hooked():
        logits, features = runner.forward(tokens[:length], 0, last_only=True)
        steps = [runner.forward([token], position, last_only=True)[0]
                 for position, token in enumerate(tokens[length:], start=length)]
        fresh = target(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    assert runner.length == len(tokens)
    prefill_chunks = [1] if length == 1 else [] if family in HYBRIDS else [8] * -(-length // 8)
    assert chunks == prefill_chunks + [1] * 4
    torch.testing.assert_close(logits, fresh.logits[0, length - 1:length].float(), rtol=1e-4, atol=1e-4)
    expected = torch.cat([fresh.hidden_states[i + 1][:, :length] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps), fresh.logits[0, length:].float(), rtol=1e-4, atol=1e-4)


def test_a_prefill_whose_chunks_would_pass_the_cache_or_that_is_long_runs_in_one_forward(
        targets: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are for short prompts that fit: one whose padded chunks would pass the cache's end, and one longer than
    PREFILL_CHUNKED_UP_TO (where a large target would read its weights once a chunk), run in one forward; the
    default runner chunks only with CUDA graphs (without them a chunk saves nothing)."""
    assert loop.TargetRunner(targets["llama"], LAYER_IDS, capacity=64).prefill_chunk == 0  # CPU: no graphs
    monkeypatch.setattr(loop, "PREFILL_CHUNKED_UP_TO", 16)
    for capacity, length in ((20, 18), (64, 17)):  # 18 positions in chunks of 8 would write 24; 17 > 16
        runner = loop.TargetRunner(targets["llama"], LAYER_IDS, capacity=capacity, prefill_chunk=8)
        chunks = fixed_step_widths(runner)
        with torch.inference_mode(), runner.hooked():
            runner.forward(list(range(100, 100 + length)), 0, last_only=True)
        assert chunks == [] and runner.length == length


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_tokens_equal_the_dynamic_path_and_plain_decoding(targets: dict, family: str,
                                                                      architecture: str) -> None:
    target = targets[family]
    draft = drafter(target, architecture)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for prompt in (list(range(200, 230)), list(range(900, 911))):
        results = {decode: loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2],
                                                     decode=decode) for decode in ("dynamic", "static")}
        plain = {decode: spec.greedy_generate(target, prompt, 24, [2], decode=decode) for decode in ("dynamic", "static")}
        assert results["static"].tokens == results["dynamic"].tokens == plain["dynamic"].tokens
        assert plain["static"].tokens == plain["dynamic"].tokens
        assert results["static"].accepted == results["dynamic"].accepted
        expected = "static"
        assert results["static"].decode.startswith(expected) and plain["static"].decode.startswith(expected)
        assert results["dynamic"].decode == "dynamic"


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_equals_plain_decoding_on_both_paths(targets: dict, family: str) -> None:
    """The prompt-lookup baseline runs through the same runner, hybrid targets included (transformers' own refuses
    them): its tokens equal plain greedy decoding's on the dynamic and the static path."""
    target = targets[family]
    prompt = list(range(200, 216)) * 3  # repeats: the lookup finds proposals
    plain = spec.greedy_generate(target, prompt, 24, [2], decode="dynamic")
    for decode in ("dynamic", "static"):
        lookup = spec.prompt_lookup_generate(target, prompt, 24, [2], decode=decode)
        assert lookup.tokens == plain.tokens, decode
        assert len(lookup.tokens) == 1 + sum(a + 1 for a in lookup.accepted)


def test_hybrid_static_rollback_reaches_back_to_the_last_block_only(targets: dict) -> None:
    """A hybrid target's static runner keeps the recurrent states of before the last verified block only: a rollback
    further back, or one after a plain forward, says so; a new prompt (reset) starts from zero states, so the same
    prompt gives the same logits twice; a verify as a fresh runner's first forward rolls back to zero states."""
    target = targets["qwen3_5_text"]
    tokens = list(range(300, 340))
    runner = loop.TargetRunner(target, (), capacity=64)
    with torch.inference_mode():
        runner.verify(tokens[:6], 0)
        runner.rollback(3)
        logits, _ = runner.forward(tokens[3:5], 3)
        fresh = target(input_ids=torch.tensor([tokens[:5]])).logits[0, 3:].float()
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
    runner = loop.TargetRunner(target, (), capacity=64)
    with torch.inference_mode():
        first, _ = runner.forward(tokens[:20], 0, last_only=True)
        runner.verify(tokens[20:26], 20)
        with pytest.raises(ValueError, match="recurrent states"):
            runner.rollback(19)
        runner.rollback(23)
        runner.forward(tokens[23:25], 23)
        with pytest.raises(ValueError, match="recurrent states"):
            runner.rollback(24)
        runner.reset()
        again, _ = runner.forward(tokens[:20], 0, last_only=True)
    torch.testing.assert_close(again, first)


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", *HYBRIDS])
def test_partly_accepted_blocks_stay_lossless_on_the_static_path(targets: dict, family: str, pipelined: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts = the target's own greedy continuation with one wrong token at a varying offset (or none), so blocks
    are accepted in part, in full and not at all; the static drafter still runs each step, each block drafted
    ahead of the acceptance's read-back (`PIPELINED_DRAFT`) or after it. Tokens equal plain decoding and tau follows
    the planted errors."""
    target = targets[family]
    draft = drafter(target, "dflash")
    prompt = list(range(300, 320))
    reference = spec.greedy_generate(target, prompt, 40 + BLOCK, []).tokens
    monkeypatch.setattr(loop, "PIPELINED_DRAFT", pipelined)
    result, planted, ahead = decode_with_planted_drafts(target, draft, prompt, reference, "static", monkeypatch)
    assert result.decode.startswith("static") and result.tokens == reference[:40]
    assert result.accepted[:-1] == planted[:-1]
    steps = len(result.accepted)  # every step's next block drafted ahead (the last step's, unused, where it had room)
    assert steps - 1 <= ahead <= steps if pipelined else ahead == 0


PLANTED_ERRORS = [2, None, 1, 3, 2, None]  # per step: the first wrong draft (1..BLOCK - 1), or None (all right)


def decode_with_planted_drafts(target: torch.nn.Module, draft: loop.DFlashDraftModel, prompt: list[int],
                               reference: list[int], decode: str,
                               monkeypatch: pytest.MonkeyPatch) -> tuple[loop.SpecResult, list[int], int]:
    """Speculative decoding of 40 tokens whose drafts are the target's own greedy continuation (``reference``) with
    one wrong token at PLANTED_ERRORS' offsets (the drafter still runs each step); returns the result and the
    accepted count each step should have, and how many blocks were drafted ahead. A block drafted ahead
    (`PIPELINED_DRAFT`, the static path) is checked to start where the host's count of the accepted tokens says,
    with the target's next token as its anchor."""
    steps, ahead = [0], [0]
    original, original_ahead = loop.DraftRunner.draft_greedy, loop.DraftRunner.draft_block_ahead

    def planted_drafts(start: int) -> list[int]:
        offset = PLANTED_ERRORS[steps[0] % len(PLANTED_ERRORS)]
        steps[0] += 1
        drafts = [reference[start - len(prompt) + k] for k in range(1, BLOCK)]
        if offset is not None:
            drafts[offset - 1] += 1
        return drafts

    def oracle(self: loop.DraftRunner, bonus: int, start: int) -> torch.Tensor:
        proposed = original(self, bonus, start)
        return torch.tensor(planted_drafts(start), device=proposed.device)

    def oracle_ahead(self: loop.DraftRunner, features: torch.Tensor, verified_at: int,
                     record: torch.Tensor) -> torch.Tensor:
        proposed = original_ahead(self, features, verified_at, record)
        ahead[0] += 1
        accepted, emitted = loop.greedy_outcome(record.tolist())
        start = verified_at + accepted + 1
        assert int(self._start) == start and proposed[0].item() == emitted[-1] == reference[start - len(prompt)]
        return torch.tensor([emitted[-1], *planted_drafts(start)], device=proposed.device)

    monkeypatch.setattr(loop.DraftRunner, "draft_greedy", oracle)
    monkeypatch.setattr(loop.DraftRunner, "draft_block_ahead", oracle_ahead)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    result = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 40, [], decode=decode)
    monkeypatch.undo()
    planted = [(PLANTED_ERRORS[i % len(PLANTED_ERRORS)] or BLOCK) - 1 for i in range(len(result.accepted))]
    return result, planted, ahead[0]


@pytest.mark.parametrize("family", ["llama", *HYBRIDS])
def test_prompt_lookup_stays_lossless_when_its_proposals_are_accepted_in_part(targets: dict, family: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt lookup with proposals of varying lengths (blocks of 2 to 8 tokens) taken from the target's own greedy
    continuation, with a wrong token planted at varying offsets: on both paths its tokens equal plain decoding and
    each step accepts what was planted, so hybrid targets roll back to several kept lengths inside a block. The
    dynamic path verifies each block as it is; the static path pads every block to one width (one graph)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    target = targets[family]
    prompt = list(range(300, 320))
    reference = spec.greedy_generate(target, prompt, 60, [], decode="dynamic").tokens
    plans = [(5, 2), (3, None), (7, 0), (1, None), (4, 3), (6, 5)]  # (proposed tokens, index of the wrong one)

    def oracle(_self: object, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        sequence = input_ids[0].tolist()
        length, wrong = plans[calls[0] % len(plans)]
        calls[0] += 1
        proposal = reference[len(sequence) - len(prompt):][:length]
        if wrong is not None:
            proposal[wrong] = (proposal[wrong] + 1) % 5000
        return torch.tensor([sequence + proposal]), None

    monkeypatch.setattr(PromptLookupCandidateGenerator, "get_candidates", oracle)
    verify = loop.TargetRunner.verify
    widths: list[int] = []

    def recorded(self: loop.TargetRunner, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        widths.append(int(ids.numel()))
        return verify(self, ids, start)

    monkeypatch.setattr(loop.TargetRunner, "verify", recorded)
    for decode in ("dynamic", "static"):
        calls = [0]
        widths.clear()
        lookup = spec.prompt_lookup_generate(target, prompt, 40, [], decode=decode)
        assert lookup.tokens == reference[:40] and lookup.decode.startswith(decode), decode
        planned = [plans[i % len(plans)][1] for i in range(len(lookup.accepted))]
        expected = [plans[i % len(plans)][0] if wrong is None else wrong for i, wrong in enumerate(planned)]
        assert lookup.accepted[:-1] == expected[:-1], decode
        proposed = [plans[i % len(plans)][0] + 1 for i in range(len(widths))]
        assert widths == (proposed if decode == "dynamic" else [spec.PROMPT_LOOKUP_TOKENS + 1] * len(widths))


def test_static_drafter_context_equals_the_dynamic_one(targets: dict) -> None:
    """Block hidden states of the fixed-shape drafter forward (context buffer with masked rows past the context)
    equal the dynamic forward over exactly the context, after extensions that keep only part of each block."""
    target = targets["llama"]
    draft = drafter(target, "dflash")
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    features = torch.randn(1, 30, len(LAYER_IDS) * target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    dynamic = loop.DraftRunner(draft, embed, head)
    static = loop.DraftRunner(draft, embed, head, capacity=64)
    with torch.inference_mode():
        for runner in (dynamic, static):
            runner.extend(features[:, :13])
            runner.extend(features[:, 13:17], 2)  # a block of 4 of which 2 positions were kept
            runner.extend(features[:, 15:19], 4)
        assert static.context_length == dynamic.context_length == 19
        torch.testing.assert_close(static.block_hidden(77, 19), dynamic.block_hidden(77, 19), rtol=1e-5, atol=1e-5)
        assert static.draft_greedy(77, 19).tolist() == dynamic.draft_greedy(77, 19).tolist()


def drafter_with_features(target: torch.nn.Module, architecture: str, seed: int) -> tuple:
    """(drafter with scaled weights whose drafts vary, the target's embedding and head, random target features of
    40 positions) for the drafter runners' tests."""
    from tests.stage2_train.test_compiled_drafter import scaled

    draft = scaled(drafter(target, architecture), 0)
    if architecture == "dflash2":
        randomise_added_parts(draft, 0)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    features = torch.randn(1, 40, len(LAYER_IDS) * target.config.hidden_size,
                           generator=torch.Generator().manual_seed(seed))
    return draft, embed, head, features


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_fused_extension_drafts_as_the_eager_one_and_the_dynamic_runner(targets: dict, architecture: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The static drafter that projects a verified block inside the next block forward (`FUSED_EXTEND`) drafts
    the tokens of the eager extension and of the dynamic runner, with the same hidden states: three prompts on one
    runner (the second shorter than the first, so rows the first wrote lie in its masked tail; the third exactly a
    block long, so its own prefill takes the pending path), extensions keeping 1..BLOCK tokens, and two block
    extensions in a row (the first is then projected eagerly)."""
    draft, embed, head, features = drafter_with_features(targets["llama"], architecture, 5)

    def decode(runner: loop.DraftRunner) -> list[tuple[list[int], torch.Tensor]]:
        out = []
        for prompt, keeps in ((13, (2, 4, 1, 3)), (6, (4, 1)), (BLOCK, (3, 2))):
            runner.reset()
            runner.extend(features[:, :prompt])
            start = prompt
            for step, keep in enumerate(keeps):
                bonus = 7 + 100 * step
                out.append((runner.draft_greedy(bonus, start).tolist(), runner.block_hidden(bonus, start)))
                runner.extend(features[:, start:start + BLOCK], keep)
                start += keep
                if step == 1:  # a second block before the next draft
                    runner.extend(features[:, start:start + BLOCK], 1)
                    start += 1
            out.append((runner.draft_greedy(3, start).tolist(), runner.block_hidden(3, start)))
        return out

    with torch.inference_mode():
        dynamic = decode(loop.DraftRunner(draft, embed, head))
        fused = decode(loop.DraftRunner(draft, embed, head, capacity=64))
        monkeypatch.setattr(loop, "FUSED_EXTEND", False)
        eager = decode(loop.DraftRunner(draft, embed, head, capacity=64))
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in eager] == [tokens for tokens, _ in dynamic]
    for (_, a), (_, b), (_, c) in zip(fused, eager, dynamic):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same rows projected by the same modules
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert len({token for tokens, _ in dynamic for token in tokens}) > 1  # not one repeated token


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_a_block_drafted_ahead_drafts_as_the_loop_that_waits_for_the_acceptance(targets: dict,
                                                                              architecture: str) -> None:
    """`draft_block_ahead` (the next block's anchor and start taken on the device from an acceptance record, the
    verified block projected inside its forward) and `advance` give the drafts and hidden states of `extend` then
    `draft_greedy` with the anchor and start read back: three prompts on one runner, blocks kept in part and whole."""
    draft, embed, head, features = drafter_with_features(targets["llama"], architecture, 6)
    serial = loop.DraftRunner(draft, embed, head, capacity=64)
    ahead = loop.DraftRunner(draft, embed, head, capacity=64)
    compared = 0
    with torch.inference_mode():
        for prompt, keeps in ((13, (2, 4, 1, 3)), (6, (4, 1)), (BLOCK, (3, 2))):
            for runner in (serial, ahead):
                runner.reset()
                runner.extend(features[:, :prompt])
            start, bonus = prompt, 7
            assert ahead.draft_greedy(bonus, start).tolist() == serial.draft_greedy(bonus, start).tolist()
            for step, keep in enumerate(keeps):
                verified = features[:, start:start + BLOCK]
                next_bonus = 11 + 100 * step
                posterior = [20 + k for k in range(BLOCK)]
                posterior[keep - 1] = next_bonus  # the target's token after the keep - 1 accepted drafts
                assert ahead.can_draft_ahead(start)
                block = ahead.draft_block_ahead(verified, start, torch.tensor([keep - 1, *posterior]))
                ahead.advance(start, keep)
                serial.extend(verified, keep)
                start += keep
                assert block.tolist() == [next_bonus, *serial.draft_greedy(next_bonus, start).tolist()]
                assert int(ahead._start) == start and ahead.context_length == serial.context_length == start
                torch.testing.assert_close(ahead.block_hidden(next_bonus, start),
                                           serial.block_hidden(next_bonus, start), rtol=0, atol=0)
                compared += 1
    assert compared == 8


def test_a_generation_that_stops_drafting_ahead_midway_stays_lossless(targets: dict,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that cannot draft ahead (`can_draft_ahead` false: near the end of the drafter's buffer) after steps
    that did (the block verified was drafted ahead; its context rows counted by `advance`) continues with `extend`:
    the tokens and each step's acceptance equal the loop's that never drafts ahead and the dynamic path's."""
    target = targets["llama"]
    draft = drafter(target, "dflash")
    prompt = list(range(300, 320))
    reference = spec.greedy_generate(target, prompt, 40 + BLOCK, []).tokens
    allowed = loop.DraftRunner.can_draft_ahead
    calls = [0]

    def now_and_then(self: loop.DraftRunner, verified_at: int) -> bool:
        calls[0] += 1
        return calls[0] % 3 != 0 and allowed(self, verified_at)  # every third step after the read-back

    monkeypatch.setattr(loop.DraftRunner, "can_draft_ahead", now_and_then)
    mixed, planted, ahead = decode_with_planted_drafts(target, draft, prompt, reference, "static", monkeypatch)
    assert mixed.tokens == reference[:40] and mixed.accepted[:-1] == planted[:-1]
    assert 0 < ahead < len(mixed.accepted)


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail on any read of a tensor's value by the host (a device sync on CUDA, which a graph capture refuses)."""
    names = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"]
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name: str) -> Callable[..., None]:
        def method(*_args: object, **_kwargs: object) -> None:
            raise AssertionError(f"the host read a tensor value (Tensor.{name}) in a captured forward")
        return method

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "qwen3_5_text", "dense_hybrid"])
def test_captured_forwards_read_nothing_back(targets: dict, family: str, architecture: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The functions the GPU path captures (the target's fixed-width step, the drafter's block with its greedy
    tokens) run with every host read of a tensor value refused: on CUDA they contain no sync, so they can be
    captured. Checked on CPU by running the eager static path under that refusal; the hybrid target's steps include
    the forwards a rollback feeds again."""
    step, block = loop.TargetRunner._static_step, loop.DraftRunner._static_block
    calls = {"target": 0, "drafter": 0}

    def guarded_step(self: loop.TargetRunner, ids: torch.Tensor, last_only: bool) -> object:
        if last_only:  # a prefill in one forward (a hybrid target's: eager on every device); chunks come here
            return step(self, ids, last_only)
        calls["target"] += 1
        with no_host_reads():
            return step(self, ids, last_only)

    def guarded_block(self: loop.DraftRunner) -> object:
        calls["drafter"] += 1
        with no_host_reads():
            return block(self)

    monkeypatch.setattr(loop.TargetRunner, "_static_step", guarded_step)
    monkeypatch.setattr(loop.DraftRunner, "_static_block", guarded_block)
    target = targets[family]
    draft = drafter(target, architecture)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    loop.speculative_generate(target, draft, embed, head, list(range(200, 230)), LAYER_IDS, 12, [], decode="static")
    spec.greedy_generate(target, list(range(200, 230)), 6, [], decode="static")
    assert calls["target"] >= 5 + 4 and calls["drafter"] >= 4  # verify blocks, one-token steps, drafter blocks


@pytest.mark.gpu
@pytest.mark.parametrize("family", decode_families("llama", "gemma3_text"))
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_cuda_graph_path_equals_the_dynamic_path(architecture: str, family: str, tmp_path: Path) -> None:
    """On a GPU (float32): the graphed static path gives the dynamic path's tokens and acceptance, and plain decoding
    through the graphed one-token step gives the same tokens, over several prompts that reuse the captured graphs."""
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target

    folder = build_family(family, Path(resolve_target(None).load_path), tmp_path / family)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    draft = drafter(target, architecture).cuda()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    # (the last prompt's prefill runs in three chunks of loop.PREFILL_CHUNK, the last padded)
    for prompt in (list(range(200, 230)), list(range(900, 911)), list(range(50, 90)), list(range(1000, 1150))):
        graphed = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="auto")
        assert graphed.decode == "static+cuda-graphs, compiled drafter"  # COMPILE_DRAFTER's default with graphs
        eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="dynamic")
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
        plain = spec.greedy_generate(target, prompt, 24, [2], decode="auto")
        assert plain.decode == "static+cuda-graphs" and plain.tokens == graphed.tokens


@pytest.mark.gpu
def test_hybrid_targets_decode_through_cuda_graphs_as_the_dynamic_path(tmp_path: Path) -> None:
    """On a GPU (float32): a hybrid linear-attention target (dense qwen3_next) decodes on the graphed static path,
    its recurrent states copied back and the kept tokens fed again through graphs captured before the timing
    (`prewarm_rollbacks`), with the dynamic path's tokens and acceptance; plain decoding too."""
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target

    model_type, extra = DECODE_VARIANTS["dense_hybrid"]
    folder = build_family(model_type, Path(resolve_target(None).load_path), tmp_path / "dense", extra=extra)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    draft = drafter(target, "dflash").cuda()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    # (the last prompt's prefill runs in three chunks of loop.PREFILL_CHUNK, the last padded)
    for prompt in (list(range(200, 230)), list(range(900, 911)), list(range(50, 90)), list(range(1000, 1150))):
        graphed = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="auto")
        assert graphed.decode.startswith("static+cuda-graphs"), graphed.decode
        runner = target.__dict__["_dflash_static_runners"][(tuple(LAYER_IDS), True, "cuda:0", torch.float32,
                                                             loop.COMPILE_TARGET)]
        assert {(width, False) for width in range(1, BLOCK + 1)} <= set(runner._forwards)
        eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="dynamic")
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
        plain = spec.greedy_generate(target, prompt, 24, [2], decode="auto")
        assert plain.decode == "static+cuda-graphs" and plain.tokens == graphed.tokens
    # Blocks accepted in part, in full and not at all: the kept lengths 1..BLOCK - 1 replayed from their graphs.
    prompt = list(range(300, 320))
    reference = spec.greedy_generate(target, prompt, 40 + BLOCK, [], decode="dynamic").tokens
    result, planted, _ = decode_with_planted_drafts(target, draft, prompt, reference, "auto", pytest.MonkeyPatch())
    assert result.decode.startswith("static+cuda-graphs") and result.tokens == reference[:40]
    assert result.accepted[:-1] == planted[:-1]


@given(needed=st.integers(1, 1 << 20))
def test_static_capacity_fits_what_is_needed_with_bounded_slack(needed: int) -> None:
    """A planned capacity (one size for every prompt) is the next multiple of 256; a growing one the next power of
    two (few sizes, so few recaptures and recompiles), at most twice what is needed past the smallest buffer."""
    planned, grown = loop.static_capacity(needed, planned=True), loop.static_capacity(needed)
    assert planned % 256 == 0 and needed <= planned < needed + 256
    assert grown & (grown - 1) == 0 and needed <= grown and (grown == 256 or grown < 2 * needed)


@pytest.mark.gpu
def test_prompt_lookups_verify_widths_are_captured_before_its_generations(tmp_path: Path) -> None:
    """On a GPU: `prewarm_prompt_lookup` (dflash eval's warm-up) captures every forward width prompt lookup uses
    (the one-token step, its padded verify block and the prefill's chunk), so its generations capture nothing inside
    their timing, and give plain greedy decoding's tokens after it."""
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target

    folder = build_family("llama", Path(resolve_target(None).load_path), tmp_path / "llama")
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    spec.prewarm_prompt_lookup(target, 256, "auto")
    (runner,) = target.__dict__["_dflash_static_runners"].values()
    captured = {key for key, forward in runner._forwards.items() if forward.graph is not None}
    assert {(1, False), (spec.PROMPT_LOOKUP_TOKENS + 1, False), (loop.PREFILL_CHUNK, False)} <= captured
    prompt = list(range(300, 320)) * 3  # repeats: prompt lookup finds proposals of several lengths
    lookup = spec.prompt_lookup_generate(target, prompt, 40, [], capacity=256)
    assert set(runner._forwards) == captured and lookup.steps > 0
    assert lookup.tokens == spec.greedy_generate(target, prompt, 40, [], decode="auto", capacity=256).tokens
