"""benchmarks/bench_eval_decode.py's large-target part (`bench_large`: forward times, the loops, the speedup table) on
a tiny hybrid target on CPU: the part runs on the GPU machine only at real sizes (Qwen3-8B, Qwen3.5-9B shapes), where
a mistake costs a device session."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_eval_decode  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hybrid() -> torch.nn.Module:
    """A Qwen3.5 text model of 12 layers (every fourth full attention, the rest gated delta-net), hidden 64: deep
    enough for the drafter's default 5 captured layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                  linear_value_head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


def test_the_large_target_part_times_a_hybrids_feed_again_and_counts_it_in_the_speedup(
        tiny_hybrid: torch.nn.Module) -> None:
    torch.set_num_threads(1)
    args = argparse.Namespace(context=24, qwen_new_tokens=10, repeats=1, compile_drafter=False)
    result = bench_eval_decode.bench_large(args, torch.device("cpu"), tiny_hybrid, "tiny hybrid")
    forwards, block = result["forward_seconds"], bench_eval_decode.DEFAULT_BLOCK_SIZE
    assert sorted(forwards["refeed_forward"]) == list(range(1, block))  # every kept length of a block
    assert result["forward_paths"]["verify_block"] == result["forward_paths"]["decode_step"] == "static"
    for row in result["speedup_at_tau"]:  # a step keeping tau tokens pays the verify, the drafter and that feed
        step = forwards["verify_block"] + forwards["draft_block"] + forwards["refeed_forward"][int(row["tau"])]
        assert row["from_forwards"] == pytest.approx(row["tau"] * forwards["decode_step"] / step)
    for path in ("dynamic", "static"):  # speculative decoding stays lossless on both paths
        assert result["loops"][path]["speculative_equals_plain"] == 1


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A Qwen3 target of 8 layers, hidden 64, and a random drafter of `dflash train`'s default shape for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    return target, bench_eval_decode.random_drafter(target, 499, torch.device("cpu"))


@pytest.mark.parametrize("suffix", list(bench_eval_decode.LOOP_OPTIONS))
def test_a_loop_option_path_runs_the_loop_without_the_option_and_is_compared_to_the_path_with_it(
        tiny_pair: tuple, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--eager-extend`'s and `--serial-draft`'s paths: `decode_all` decodes them with their option's flag off (and
    only them), their tokens and each step's acceptance are compared with the path's with the option, and the
    ratios are those of the two paths' own figures."""
    target, draft = tiny_pair
    on, off, flag = bench_eval_decode.LOOP_OPTIONS[suffix]
    flag_during: dict[str, set[bool]] = {}
    speculative = bench_eval_decode.loop.speculative_generate

    def spy(*args: object, **kwargs: object) -> object:
        flag_during.setdefault(str(kwargs["decode"]), set()).add(getattr(bench_eval_decode.loop, flag))
        return speculative(*args, **kwargs)

    monkeypatch.setattr(bench_eval_decode.loop, "speculative_generate", spy)
    without = "static" + suffix
    prompts = [list(range(10, 30)), list(range(40, 52))]
    out = bench_eval_decode.decode_all(target, draft, prompts, 24, 80, ("dynamic", "static", without))
    assert getattr(bench_eval_decode.loop, flag)  # restored
    assert flag_during == {"dynamic": {True}, "static": {True, False}}  # the static decode of both paths
    assert out[f"{on}_agrees_with_{off}"] == out[f"{on}_accepts_as_{off}"] == len(prompts)
    assert out[without]["dflash"]["tokens"] == out["static"]["dflash"]["tokens"] == 2 * 24
    ratio = out[f"{on}_over_{off}"]
    assert ratio["dflash_tokens_per_second"] == pytest.approx(
        out["static"]["dflash"]["tokens_per_second"] / out[without]["dflash"]["tokens_per_second"])
    assert ratio["dflash_seconds_per_step"] == pytest.approx(
        out["static"]["dflash"]["seconds_per_step"] / out[without]["dflash"]["seconds_per_step"])


def test_the_fused_extension_leaves_the_projection_out_of_the_hosts_operations_a_step(tiny_pair: tuple) -> None:
    """benchmarks/loop_host_ops.py's count on a tiny target: with FUSED_EXTEND the drafter's context projection (a
    linear layer and an RMS norm) runs inside the graphed block forward, so none of its operations is dispatched
    eagerly a step; without it each step but a generation's last (which ends before extending) dispatches one of
    each; both take two graphed forwards a step (the draft after the read-back), and the pipelined draft at most one
    more a generation (a block drafted ahead of its last step, unused)."""
    import loop_host_ops

    target, draft = tiny_pair
    prompts = [list(range(10, 30)), list(range(40, 52))]
    with torch.inference_mode():
        fused, eager, pipelined = (loop_host_ops.count(target, draft, prompts, 12, f, p)
                                   for f, p in ((True, False), (False, False), (True, True)))
    loop = bench_eval_decode.loop
    assert fused["steps"] == eager["steps"] == pipelined["steps"] > 0
    assert loop.FUSED_EXTEND and loop.PIPELINED_DRAFT  # restored
    assert fused["graph_replays_per_step"] == eager["graph_replays_per_step"] == 2.0  # draft block, verify block
    # (one block forward more where a generation's last step could still have left room for another)
    assert 2.0 <= pipelined["graph_replays_per_step"] <= 2.0 + len(prompts) / pipelined["steps"]
    for name in ("linear", "rsqrt", "pow"):
        assert name not in fused["ops_per_step"]
        assert eager["ops_per_step"][name] * eager["steps"] == pytest.approx(eager["steps"] - len(prompts))
    assert fused["eager_ops_per_step"] < eager["eager_ops_per_step"] - 5
