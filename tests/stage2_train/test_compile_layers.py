"""--compile's decoder layers: torch.compile's recompile limit is lifted above what a run's bucketed shapes need, and
a run that still reaches it says so (after it, new shapes run uncompiled: on an H100 that ran out of memory)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

from dflash.stage2_train.attention_masks import PackedLayout
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.run_setup import (LAYER_RECOMPILE_LIMIT, RECOMPILE_LIMIT_WATCH, compile_layers,
                                           compile_summary)


def tiny_drafter() -> torch.nn.Module:
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=256, block_size=4, num_target_layers=4,
                          dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1, 2]})
    return training_drafter(config, "sdpa")


def train_forward(model: torch.nn.Module, context_lengths: list[int], seed: int = 0) -> torch.Tensor:
    """One packed forward and backward; returns the noise embedding (a frozen input: it needs no gradient)."""
    layout = PackedLayout.from_anchor_lists([[1, length // 2] for length in context_lengths], context_lengths, 4)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, layout.num_queries, 64, generator=generator)
    features = torch.randn(1, layout.context_len, 3 * 64, generator=generator)
    model(noise, features, layout.query_position_ids(), layout.context_position_ids(), layout).sum().backward()
    return noise


@pytest.fixture
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch):
    """compile_layers' global settings are undone after the test (the recompile limit, inductor's split reductions,
    the watch on torch's logger), so that later tests in this process see torch's defaults."""
    torch._dynamo.reset()
    monkeypatch.setattr(RECOMPILE_LIMIT_WATCH, "functions", [])
    watched = logging.getLogger("torch._dynamo.convert_frame")
    had_watch = RECOMPILE_LIMIT_WATCH in watched.handlers
    # (inductor's config through its own patch: monkeypatch's undo left the setting unreadable for a second test)
    with dynamo_config.patch(recompile_limit=8), inductor_config.patch(split_reductions=inductor_config.split_reductions):
        yield
    if not had_watch:
        watched.removeHandler(RECOMPILE_LIMIT_WATCH)
    torch._dynamo.reset()


def test_compile_layers_lifts_the_recompile_limit_and_the_run_reports_reaching_it(fresh_dynamo: None) -> None:
    model = tiny_drafter()
    compile_layers(model)
    assert dynamo_config.recompile_limit == LAYER_RECOMPILE_LIMIT > 8
    assert RECOMPILE_LIMIT_WATCH.summary() == ""
    for layer in model.layers:  # the limit is dynamo's: its eager backend reaches it as inductor does, without C++ builds
        layer.compile(backend="eager")
    train_forward(model, [20, 30])
    with dynamo_config.patch(recompile_limit=1):  # one version allowed: a second shape reaches the limit
        train_forward(model, [12, 40, 9])
    summary = RECOMPILE_LIMIT_WATCH.summary()
    assert "recompile limit was reached 1 time(s)" in summary and "modeling_dflash.py" in summary, summary
    # The run's closing line (trainer.py logs it; test_train.py's --compile run checks it appears there).
    assert re.fullmatch(r"compile: \d+ graphs compiled; torch.compile's recompile limit was reached .*", compile_summary())
    with dynamo_config.patch(recompile_limit=LAYER_RECOMPILE_LIMIT + 1):
        compile_layers(model)  # a higher limit someone set is kept
        assert dynamo_config.recompile_limit == LAYER_RECOMPILE_LIMIT + 1


def test_every_layer_takes_one_compiled_version_per_shape_and_the_gradients_stay_the_same(fresh_dynamo: None) -> None:
    """compile_layers makes the first layer's input need a gradient, as the later layers' inputs do, so that the one
    layer function compiles once per shape, not twice (torch.compile guards on requires_grad); the weights'
    gradients are those of the uncompiled drafter, and the caller's tensor is left as it was."""
    from torch._dynamo.utils import counters

    plain, compiled = tiny_drafter(), tiny_drafter()
    compile_layers(compiled)
    for layer in compiled.layers:
        layer.compile(backend="eager")
    counters.clear()
    noise = train_forward(compiled, [20, 30])
    assert counters["stats"]["unique_graphs"] == 1 and not noise.requires_grad
    train_forward(plain, [20, 30])
    for (name, weight), (_, reference) in zip(compiled.named_parameters(), plain.named_parameters(), strict=True):
        assert weight.grad is not None and torch.allclose(weight.grad, reference.grad, rtol=1e-5, atol=1e-6), name
    compiled.layer_inputs_need_grad = False  # as before: the first layer's call is a version of its own
    torch._dynamo.reset()
    counters.clear()
    train_forward(compiled, [20, 30])
    assert counters["stats"]["unique_graphs"] == 2
