"""The drafter's block forward compiled with torch.compile on the static decode path (`COMPILE_DRAFTER`: by default
where the block is captured as a CUDA graph) against the eager one, on CPU (float32, Inductor's C++ kernels). On a GPU the same compiled function is what
the drafter's CUDA graph captures: a GPU-only test (skipped without CUDA) and `benchmarks/bench_eval_decode.py
--compile-drafter` cover that. Compiling takes ~10 s a
drafter shape on 2 CPU cores (~40 s for the first compile with a cold Inductor cache), so the tests are few, small
and marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from tests.end_to_end.families import decode_families
from tests.stage2_train.test_static_decode import BLOCK, LAYER_IDS, drafter


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.end_to_end.families import load_families

    return load_families(["llama", "gemma3_text"], tmp_path_factory.mktemp("families"))


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "COMPILE_DRAFTER", True)
    torch._dynamo.reset()
    counters.clear()


def scaled(draft: loop.DFlashDraftModel, seed: int) -> loop.DFlashDraftModel:
    """The drafter with weights redrawn at scale 1 / sqrt(fan_in) (seeded): logits far from ties and draft tokens
    that differ from position to position, so equal tokens say more than those of near-zero initial weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if parameter.dim() == 2 and "codebook" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[1] ** 0.5)
    return draft


def runners(target: torch.nn.Module, draft: loop.DFlashDraftModel) -> dict[str, loop.DraftRunner]:
    """An eager and a compiled static drafter runner, built the way `speculative_generate` builds them."""
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    built = {}
    for name, on in (("eager", False), ("compiled", True)):
        loop.COMPILE_DRAFTER = on
        built[name] = loop.draft_runner(draft, embed, head, 1.0, 64, decode="static")
    loop.COMPILE_DRAFTER = True
    return built


@pytest.mark.slow  # ~40 s with a cold Inductor cache (the first compile of a process), ~5 s warm
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_compiled_block_drafts_the_eager_tokens(targets: dict, family: str, compiled: None) -> None:
    """Per seed a drafter (its own random weights) and random target features: drafting blocks between extensions
    that keep part of each block (the loop's order: the compiled forward must read the buffers' current context,
    start and anchor), the compiled runner's greedy draft tokens equal the eager runner's, its hidden states agree
    to float32 rounding, and it compiled without a graph break."""
    target = targets[family]
    width = len(LAYER_IDS) * target.config.hidden_size
    for seed in range(3):
        draft = scaled(drafter(target, "dflash"), seed)
        pair = runners(target, draft)
        assert pair["compiled"] is not pair["eager"] and pair["compiled"].compiled and not pair["eager"].compiled
        features = torch.randn(1, 30, width, generator=torch.Generator().manual_seed(100 + seed))
        drafts: dict[str, list[list[int]]] = {name: [] for name in pair}
        with torch.inference_mode():
            for runner in pair.values():
                runner.extend(features[:, :13])
            start = 13
            for keep, bonus in ((2, 7), (3, 900), (1, 31000), (4, 7)):  # drafts between extensions: the loop's order
                for name, runner in pair.items():
                    drafts[name].append(runner.draft_greedy(bonus, start).tolist())
                torch.testing.assert_close(pair["compiled"].block_hidden(bonus, start),
                                           pair["eager"].block_hidden(bonus, start), rtol=1e-4, atol=1e-4)
                for runner in pair.values():
                    runner.extend(features[:, start:start + BLOCK], keep)
                start += keep
        assert drafts["compiled"] == drafts["eager"]
        assert len({token for block in drafts["eager"] for token in block}) > 1  # not one repeated token
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_speculative_decoding_with_the_compiled_drafter_equals_plain_decoding(targets: dict, architecture: str,
                                                                             compiled: None) -> None:
    """The whole greedy loop with the compiled block forward (a DFlash drafter and a DFlash 2 one, whose compiled
    forward includes the selector's walk): its tokens equal plain greedy decoding's, and its per-step acceptance
    equals the eager static path's, over two prompts that reuse the compiled runner."""
    target = targets["gemma3_text"]
    draft = scaled(drafter(target, architecture), 0)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for prompt in (list(range(200, 230)), list(range(900, 911))):
        plain = spec.greedy_generate(target, prompt, 20, [2], decode="static")
        fast = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static")
        loop.COMPILE_DRAFTER = False
        eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static")
        loop.COMPILE_DRAFTER = True
        assert fast.tokens == plain.tokens == eager.tokens
        assert fast.accepted == eager.accepted
    compiled_runners = [r for r in draft.__dict__["_dflash_static_runners"].values() if r.compiled]
    assert len(compiled_runners) == 1
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", decode_families("llama", "gemma3_text"))
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_cuda_graph_of_the_compiled_block_equals_the_dynamic_path(architecture: str, family: str, compiled: None,
                                                                  tmp_path: Path) -> None:
    """On a GPU (float32): the compiled block forward is captured as the drafter's CUDA graph (no capture failure)
    and the graphed loop gives the dynamic path's tokens and acceptance over prompts that reuse the graph."""
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target
    from tests.end_to_end.families import build_family

    folder = build_family(family, Path(resolve_target(None).load_path), tmp_path / family)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    draft = scaled(drafter(target, architecture), 0).cuda()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for prompt in (list(range(200, 230)), list(range(900, 911)), list(range(50, 90))):
        graphed = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="auto")
        assert graphed.decode == "static+cuda-graphs, compiled drafter"
        eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 24, [2], decode="dynamic")
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
    (runner,) = draft.__dict__["_dflash_static_runners"].values()
    assert runner.compiled and runner.graph_failure is None and runner._block.graph is not None
    assert not counters["graph_break"]


def test_the_drafter_compiles_by_default_only_where_its_block_is_a_cuda_graph(targets: dict,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """COMPILE_DRAFTER None (the default): compiled with CUDA graphs, eager on the CPU's static path; True / False
    force it. Only the choice is built here (torch.compile is lazy: nothing compiles before a first draft)."""
    target = targets["llama"]
    draft = drafter(target, "dflash")
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert loop.COMPILE_DRAFTER is None
    for setting, graphs, compiled in ((None, False, False), (None, True, True), (True, False, True),
                                      (False, True, False)):
        monkeypatch.setattr(loop, "COMPILE_DRAFTER", setting)
        # graphs=True without CUDA: only the runner's choice is looked at, nothing is captured or run
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
        runner = loop.DraftRunner(draft, embed, head, 1.0, 64, graphs)
        assert runner.compiled is compiled, (setting, graphs)
    assert loop.DraftRunner(draft, embed, head, 1.0).compiled is False  # the dynamic path never compiles


def test_a_drafter_that_does_not_compile_falls_back_to_the_eager_block(targets: dict,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler failure on the first (warm-up) call leaves the runner eager with the reason in the decode path's
    name, and the loop's tokens and acceptance are the eager static path's."""
    def failing_compile(function, **_options):  # noqa: ANN001, ANN202 - torch.compile's stand-in
        def compiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("Inductor could not lower this drafter")
        return compiled

    target = targets["gemma3_text"]
    draft = scaled(drafter(target, "dflash"), 0)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = list(range(200, 230))
    monkeypatch.setattr(loop, "COMPILE_DRAFTER", False)
    eager = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static")
    monkeypatch.setattr(loop, "COMPILE_DRAFTER", True)
    monkeypatch.setattr(torch, "compile", failing_compile)
    fallen = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static")
    assert fallen.tokens == eager.tokens and fallen.accepted == eager.accepted
    assert fallen.decode == "static, drafter not compiled (RuntimeError: Inductor could not lower this drafter)"
    runner = next(r for r in draft.__dict__["_dflash_static_runners"].values() if r.compile_failure)
    assert runner.compiled is False
    again = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 20, [2], decode="static")
    assert again.tokens == eager.tokens and again.decode == fallen.decode  # the reused runner stays eager
