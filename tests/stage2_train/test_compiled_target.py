"""The target's fixed-width forwards compiled with torch.compile on the static decode path (`COMPILE_TARGET`, opt-in)
against the eager ones, on CPU (float32, Inductor's C++ kernels): the verify block and the one-token step run
compiled (fullgraph, the hooks that capture the drafter's layer features traced inside), prefills do not. On a
GPU the compiled step is what the target's CUDA graph captures: `benchmarks/bench_eval_decode.py --compile-target`
covers that. A compile takes ~5-10 s a width on 2 CPU cores, so the decoding tests are marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from tests.stage2_train.test_compiled_drafter import scaled
from tests.end_to_end.families import decode_families
from tests.stage2_train.test_static_decode import BLOCK, LAYER_IDS, drafter

PROMPTS = (list(range(200, 230)), list(range(900, 911)))


@pytest.fixture(scope="module")
def family_targets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.end_to_end.families import load_families

    return load_families(["llama", "gemma3_text"], tmp_path_factory.mktemp("families"))


@pytest.fixture
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def static_runner(target: torch.nn.Module, layer_ids: list[int], compiled: bool) -> loop.TargetRunner:
    """The static runner `speculative_generate` / `greedy_generate` kept on the target (with or without
    `COMPILE_TARGET`)."""
    runners = target.__dict__["_dflash_static_runners"]
    (runner,) = [r for r in runners.values() if r.layer_ids == layer_ids and r.compiled == compiled]
    return runner


@pytest.mark.slow  # 15-26 s a family on 2 CPU cores with a cold Inductor cache (two widths compiled), 13-18 s warm
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_compiled_target_decodes_as_the_eager_static_path(family_targets: dict, family: str, fresh_dynamo: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Over two prompts that reuse the runners: plain greedy and speculative decoding with the compiled target give
    the eager static path's tokens and per-step acceptance (and speculative equals plain), the decode path says so,
    and the compiled forwards hold no graph break (the layer hooks are traced)."""
    target = family_targets[family]
    target.__dict__.pop("_dflash_static_runners", None)  # runners of earlier tests (the targets are shared)
    draft = scaled(drafter(target, "dflash"), 0)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    results: dict[bool, list[tuple[loop.SpecResult, loop.SpecResult]]] = {}
    for setting in (False, True):
        monkeypatch.setattr(loop, "COMPILE_TARGET", setting)
        results[setting] = [(spec.greedy_generate(target, prompt, 20, [2], decode="static"),
                             loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2],
                                                       decode="static"))
                            for prompt in PROMPTS]
    for (plain, fast), (plain_compiled, fast_compiled) in zip(results[False], results[True]):
        assert plain_compiled.tokens == plain.tokens == fast.tokens == fast_compiled.tokens
        assert fast_compiled.accepted == fast.accepted
        assert plain.decode == fast.decode == "static"
        assert plain_compiled.decode == fast_compiled.decode == "static, compiled target"
    assert len({t for plain, _ in results[False] for t in plain.tokens}) > 2  # not one repeated token
    # Prompt lookup's verify blocks (2..11 tokens) are padded to one width, compiled like DFlash's block: the
    # one-token step, DFlash's block and prompt lookup's padded block, so the widths stay under torch.compile's
    # recompile limit.
    lookup = spec.prompt_lookup_generate(target, PROMPTS[0], 20, [2], decode="static")
    assert lookup.tokens == results[True][0][0].tokens and lookup.decode == "static, compiled target"
    assert any(a > 0 for a in lookup.accepted)  # it verified blocks wider than one token
    for layer_ids, widths in (([], [1, spec.PROMPT_LOOKUP_TOKENS + 1]), (LAYER_IDS, [BLOCK])):
        runner = static_runner(target, layer_ids, compiled=True)
        assert runner.compiled and runner.compile_failure is None and sorted(runner._compiled_steps) == widths
    assert counters["stats"]["unique_graphs"] >= 2
    assert not counters["graph_break"]


# ~6 s a family with a cold Inductor cache (one width compiled), ~1.3 s warm
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_compiled_verify_block_gives_the_drafter_the_eager_features(family_targets: dict, family: str,
                                                                        fresh_dynamo: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify blocks between rollbacks that keep part of each (the loop's order): the compiled runner's logits and
    the captured layer features (what `DraftRunner.extend` receives) equal the eager runner's to float32 rounding,
    and the features follow the input (the hooks ran inside the compiled forward, not once at tracing)."""
    target = family_targets[family]
    pair = {}
    for setting in (False, True):
        monkeypatch.setattr(loop, "COMPILE_TARGET", setting)
        pair[setting] = loop.TargetRunner(target, LAYER_IDS, capacity=64)
    assert pair[True].compiled and not pair[False].compiled
    pair[True].compile_widths.add(BLOCK)  # as speculative_generate names its verify block
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (20,), generator=generator).tolist()
    features: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    with torch.inference_mode(), pair[True].hooked(), pair[False].hooked():
        for setting, runner in pair.items():
            runner.forward(prompt, 0, last_only=True)
        start = len(prompt)
        for keep in (2, 4, 1, 3):
            block = torch.randint(0, target.config.vocab_size, (BLOCK,), generator=generator)
            outputs = {setting: runner.verify(block, start) for setting, runner in pair.items()}
            torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=1e-5, atol=1e-5)
            for setting, (_, captured) in outputs.items():
                assert captured is not None and captured.shape == (1, BLOCK, len(LAYER_IDS) * target.config.hidden_size)
                features[setting].append(captured.clone())
            torch.testing.assert_close(features[True][-1], features[False][-1], rtol=1e-5, atol=1e-5)
            start += keep
            for runner in pair.values():
                runner.rollback(start)
    assert not torch.allclose(features[True][0], features[True][1])
    assert list(pair[True]._compiled_steps) == [BLOCK] and pair[True].compile_failure is None
    assert not counters["graph_break"]


def test_a_target_that_does_not_compile_falls_back_to_the_eager_forwards(family_targets: dict,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler failure on the first fixed-width forward leaves the runner eager with the reason in the decode
    path's name, and plain and speculative decoding give the eager static path's tokens and acceptance; the reused
    runner stays eager. COMPILE_TARGET is off by default."""
    def failing_compile(function, **_options):  # noqa: ANN001, ANN202 - torch.compile's stand-in
        def compiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("Inductor could not lower this target\nmore lines")
        return compiled

    assert loop.COMPILE_TARGET is False
    target = family_targets["gemma3_text"]
    target.__dict__.pop("_dflash_static_runners", None)  # runners of earlier tests (the targets are shared)
    draft = scaled(drafter(target, "dflash"), 0)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = PROMPTS[0]

    def decode() -> tuple[loop.SpecResult, loop.SpecResult]:
        return (spec.greedy_generate(target, prompt, 20, [2], decode="static"),
                loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static"))

    eager_plain, eager_fast = decode()
    assert eager_plain.decode == eager_fast.decode == "static"
    monkeypatch.setattr(loop, "COMPILE_TARGET", True)
    monkeypatch.setattr(torch, "compile", failing_compile)
    reason = "static, target not compiled (RuntimeError: Inductor could not lower this target)"
    for _ in range(2):  # the second time on the reused runners
        plain, fast = decode()
        assert plain.tokens == eager_plain.tokens and fast.tokens == eager_fast.tokens
        assert fast.accepted == eager_fast.accepted
        assert plain.decode == fast.decode == reason
    for layer_ids in ([], LAYER_IDS):
        runner = next(r for r in target.__dict__["_dflash_static_runners"].values()
                      if r.layer_ids == layer_ids and r.compile_failure)
        assert runner.compiled is False and not runner._compiled_steps


@pytest.mark.gpu
@pytest.mark.parametrize("family", decode_families("llama", "gemma3_text"))
def test_cuda_graphs_of_the_compiled_target_equal_the_dynamic_path(family: str, fresh_dynamo: None, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (float32), with COMPILE_TARGET: the compiled target's fixed-width forwards captured as CUDA graphs
    give the dynamic path's tokens and acceptance, and plain decoding and prompt lookup through them the same tokens,
    over prompts that reuse the captured graphs."""
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target
    from tests.end_to_end.families import build_family

    folder = build_family(family, Path(resolve_target(None).load_path), tmp_path / family)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    draft = scaled(drafter(target, "dflash"), 0).cuda()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    monkeypatch.setattr(loop, "COMPILE_TARGET", True)
    for prompt in (*PROMPTS, list(range(50, 90))):
        graphed = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="auto")
        assert graphed.decode == "static+cuda-graphs, compiled target, compiled drafter"
        eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="dynamic")
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
        plain = spec.greedy_generate(target, prompt, 24, [2], decode="auto")
        assert plain.decode == "static+cuda-graphs, compiled target" and plain.tokens == graphed.tokens
        lookup = spec.prompt_lookup_generate(target, prompt, 24, [2], decode="auto")
        assert lookup.tokens == plain.tokens
    assert not counters["graph_break"]
