"""Speculative decoding with the DFlash drafter (stage2_train/speculative.py) and its evaluation (evaluate.py).

Uses the real embedded SmolLM2-135M target on CPU. The module fixture holds it in float32 so that plain and
speculative greedy decoding can be required to agree exactly (in bf16, logits near 25 are 0.125 apart and exact
ties between a 1-token and a 16-token forward occur; run_eval also runs the target in float32 on CPU by default,
and tolerates such ties in bf16, e.g. on GPUs). One CPU thread: on this 2-core machine, shared with other test runs, two
threads made small forwards 3-4x slower and erratic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.shared.errors import UserError
from dflash.stage2_train.acceptance import tau_standard_error
from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from dflash.stage2_train.export import export_draft

LAYER_IDS = [1, 8, 14, 20, 27]
BLOCK = 16
MASK_ID = 16
MANIFEST = {"identity": {"target_source": "embedded:SmolLM2-135M-Instruct", "hidden_size": 576,
                         "layer_ids": LAYER_IDS}}
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a list.",
    "Tell me a short story about a cat.",
]


@pytest.fixture(scope="module")
def env() -> dict:
    from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target, stop_token_ids

    torch.set_num_threads(1)
    resolved = resolve_target(None)
    target = load_target_model(resolved.load_path, "cpu").float()
    tokenizer = load_tokenizer(resolved.load_path)
    torch.manual_seed(0)
    config = config_from_target(target.config.to_dict(), LAYER_IDS, 1, BLOCK, MASK_ID)
    draft = DFlashDraftModel(config).eval()
    return {
        "target": target,
        "tokenizer": tokenizer,
        "stops": stop_token_ids(resolved.load_path, tokenizer),
        "draft": draft,
        "config": config,
        "embed": target.get_input_embeddings().weight,
        "head": target.get_output_embeddings().weight,
    }


def chat_ids(env: dict, text: str) -> list[int]:
    ids = env["tokenizer"].apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    return list(ids)


def run_spec(env: dict, ids: list[int], n: int, **kwargs) -> loop.SpecResult:
    return loop.speculative_generate(env["target"], env["draft"], env["embed"], env["head"], torch.tensor([ids]),
                                     LAYER_IDS, n, env["stops"], **kwargs)


def check_counts(result: loop.SpecResult) -> None:
    """Every step emits accepted + 1 tokens; the prefill emits the first one."""
    assert result.steps == len(result.accepted)
    assert len(result.tokens) == 1 + sum(a + 1 for a in result.accepted)


# ---------------------------------------------------------------------------
# Greedy losslessness with an untrained drafter
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_speculative_equals_plain_greedy(env: dict, index: int) -> None:
    ids = chat_ids(env, PROMPTS[index])
    plain = spec.greedy_generate(env["target"], torch.tensor([ids]), 32, env["stops"])
    result = run_spec(env, ids, 32)
    difference = spec.first_difference(plain.tokens, result.tokens)
    assert difference is None, f"prompt {index}: first difference at new token {difference}"
    check_counts(result)
    assert result.steps >= 1
    assert result.tau < 1.2  # an untrained drafter is (almost) never right
    assert len(plain.tokens) <= 32
    if len(plain.tokens) < 32:
        assert plain.tokens[-1] in env["stops"]
    if index == 0:  # our plain loop is transformers' own greedy decoding
        hf = env["target"].generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, eos_token_id=env["stops"],
                                    pad_token_id=env["stops"][0])
        assert hf[0, len(ids):].tolist() == plain.tokens


def test_projected_context_equals_full_forward(env: dict) -> None:
    """The drafter context the loop keeps (projected once, in pieces, as decoding adds them) gives what
    DFlashDraftModel.forward gives on the raw features."""
    draft = env["draft"]
    torch.manual_seed(1)
    features = torch.randn(1, 21, len(LAYER_IDS) * 576)
    runner = loop.DraftRunner(draft, env["embed"], env["head"])
    runner.extend(features[:, :13])
    runner.extend(features[:, 13:])  # added in two pieces, as decoding does
    ids = torch.full((1, BLOCK), draft.mask_token_id)
    ids[0, 0] = 42
    noise = torch.nn.functional.embedding(ids, env["embed"])
    with torch.inference_mode():
        a = runner.block_hidden(bonus=42, start=21)
        b = draft(noise, features, torch.arange(21, 21 + BLOCK)[None])
    assert a.shape == (1, BLOCK, 576)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Oracle drafter: acceptance counting, cache cropping, context bookkeeping
# ---------------------------------------------------------------------------


def make_oracle(monkeypatch: pytest.MonkeyPatch, reference: list[int], prompt_len: int, vocab: int,
                wrong_offset=None) -> list:
    """Replace the draft step by one that proposes the target's own greedy continuation.

    ``wrong_offset(step)`` gives a block offset (1..B-1) whose draft is made wrong, or None for a perfect block.
    """
    seen: list = []

    def propose(self: loop.DraftRunner, bonus: int, start: int) -> torch.Tensor:
        assert self.context_length == start  # the drafter context covers exactly positions < start
        step = len(seen)
        seen.append(self)
        logits = torch.zeros(BLOCK - 1, vocab)
        for k in range(1, BLOCK):
            index = start - prompt_len + k  # new-token index of block position k
            token = reference[index] if index < len(reference) else 0
            if wrong_offset is not None and wrong_offset(step) == k:
                token = (token + 1) % vocab
            logits[k - 1, token] = 100.0
        return logits

    monkeypatch.setattr(loop.DraftRunner, "propose", propose)
    return seen


def test_oracle_drafter_accepts_and_stays_lossless(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = chat_ids(env, PROMPTS[1])
    n = 48
    reference = spec.greedy_generate(env["target"], ids, n + BLOCK, env["stops"]).tokens
    expected = reference[:n]
    vocab = env["embed"].shape[0]

    wrong = [5, 15, 1, 9, None, 3]  # per step: partial blocks (the KV cache is cropped) and one perfect block
    runners = make_oracle(monkeypatch, reference, len(ids), vocab, wrong_offset=lambda s: wrong[s % len(wrong)])
    result = run_spec(env, ids, n)
    assert result.tokens == expected
    check_counts(result)
    steps = result.steps
    assert result.accepted[: steps - 1] == [(w - 1 if w else BLOCK - 1) for w in (wrong * 4)[: steps - 1]]
    assert result.tau > 3

    # The drafter context holds the target's features of every accepted position (compare with a fresh forward).
    context = runners[-1].context
    runner = loop.TargetRunner(env["target"], LAYER_IDS)
    with runner.hooked(), torch.inference_mode():
        _, full = runner.forward(ids + result.tokens, 0)
        projected = env["draft"].project_context(full)
    length = context.shape[1]
    torch.testing.assert_close(context, projected[:, :length], rtol=2e-3, atol=2e-3)

    # A perfect oracle: whole blocks accepted, output cut exactly at max_new_tokens.
    make_oracle(monkeypatch, reference, len(ids), vocab)
    perfect = run_spec(env, ids, n)
    assert perfect.tokens == expected
    check_counts(perfect)
    assert perfect.accepted[0] == BLOCK - 1 and perfect.tau > 10


def test_oracle_stops_at_stop_token(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = chat_ids(env, PROMPTS[0])  # a short answer that ends with <|im_end|>
    reference = spec.greedy_generate(env["target"], ids, 64, env["stops"]).tokens
    assert reference[-1] in env["stops"] and len(reference) < 20
    make_oracle(monkeypatch, reference, len(ids), env["embed"].shape[0])
    result = run_spec(env, ids, 64)
    assert result.tokens == reference  # truncated right after the stop token, which is kept
    check_counts(result)


# ---------------------------------------------------------------------------
# KV cache cropping on the pinned transformers
# ---------------------------------------------------------------------------


def filled_cache(env: dict, tokens: list[int]):
    runner = loop.TargetRunner(env["target"])
    with torch.inference_mode():
        runner.forward(tokens, 0)
    return runner.cache


def test_crop_cache(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = filled_cache(env, list(range(100, 120)))
    assert loop.cache_length(cache) == 20
    loop.crop_cache(cache, 20)  # no-op (never crop(0), which empties the cache on old transformers)
    assert loop.cache_length(cache) == 20
    loop.crop_cache(cache, 13)
    assert loop.cache_length(cache) == 13
    assert all(layer.keys.shape[-2] == 13 and layer.values.shape[-2] == 13 for layer in cache.layers)
    with pytest.raises(ValueError):
        loop.crop_cache(cache, 14)
    # The fallback (slicing the layers) when crop() is missing or refuses.
    def refuse(_n: int) -> None:
        raise ValueError("refused")

    monkeypatch.setattr(cache, "crop", refuse)
    loop.crop_cache(cache, 7)
    assert loop.cache_length(cache) == 7
    assert all(layer.keys.shape[-2] == 7 for layer in cache.layers)


def test_cropped_cache_decodes_like_a_fresh_one(env: dict) -> None:
    """Positions written after a crop see only the kept prefix: logits equal a cache-free forward."""
    tokens = list(range(200, 230))
    cache = filled_cache(env, tokens[:25])
    loop.crop_cache(cache, 18)
    runner = loop.TargetRunner(env["target"])
    runner.cache = cache
    with torch.inference_mode():
        logits, _ = runner.forward(tokens[18:22], 18)
        fresh = env["target"](input_ids=torch.tensor([tokens[:22]])).logits[0, 18:22].float()
    torch.testing.assert_close(logits, fresh, rtol=1e-3, atol=1e-3)


def test_transformers_crop_contract() -> None:
    """The fact the cropping code relies on: crop(-k) removes k tokens; a positive length is rejected (>= 5.15)."""
    import transformers
    from packaging.version import Version
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4), 0)
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    if Version(transformers.__version__) >= Version("5.15"):
        with pytest.raises(ValueError):
            cache.crop(5)


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def test_sampling_mode_returns_valid_tokens(env: dict) -> None:
    ids = chat_ids(env, PROMPTS[2])
    generator = torch.Generator().manual_seed(0)
    result = run_spec(env, ids, 16, temperature=0.8, generator=generator)
    vocab = env["embed"].shape[0]
    assert 1 <= len(result.tokens) <= 16
    assert all(0 <= t < vocab for t in result.tokens)
    check_counts(result)
    again = run_spec(env, ids, 16, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert again.tokens == result.tokens  # reproducible with a seeded generator


def test_prompt_lookup_on_the_loop_equals_transformers_prompt_lookup_and_plain_greedy(env: dict) -> None:
    """Prompt lookup through the loop's target runner (the baseline `dflash eval` times) against transformers' own
    `generate(prompt_lookup_num_tokens=10)`, the reference, and plain greedy decoding: the same tokens, on the
    dynamic and the static path; on a prompt the model copies, most proposals are accepted."""
    ids = chat_ids(env, "Repeat this sentence twice, exactly: the quick brown fox jumps over the lazy dog near "
                        "the old river bank.")
    n = 40
    plain = spec.greedy_generate(env["target"], ids, n, env["stops"])
    with torch.inference_mode():
        out = env["target"].generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=10,
                                     eos_token_id=list(env["stops"]), pad_token_id=list(env["stops"])[0],
                                     temperature=None, top_p=None, top_k=None)
    reference, _ = loop.clip_step(out[0, len(ids):].tolist(), n, set(env["stops"]))
    for decode in ("dynamic", "static"):
        lookup = spec.prompt_lookup_generate(env["target"], ids, n, env["stops"], decode=decode)
        assert lookup.tokens == plain.tokens == reference, decode
        check_counts(lookup)
        assert lookup.tau > 2.0, (decode, lookup.tau, lookup.accepted)  # the copied sentence is found in the prompt
        assert 0 in lookup.accepted  # and some proposals are refused, so rollback runs too


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """On a 4-token vocabulary the first emitted token follows p exactly, whatever the draft distribution q."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7], [0.4, 0.3, 0.2, 0.1]])
    generator = torch.Generator().manual_seed(0)
    trials = 12000
    drafts = torch.multinomial(q, trials, replacement=True, generator=generator).T.tolist()
    first = torch.zeros(4)
    second_given_accept = torch.zeros(4)
    for d in drafts:
        accepted, token = loop.verify_sampling(d, q, p, generator)
        emitted = [*d[:accepted], token]
        first[emitted[0]] += 1
        if accepted >= 1 and len(emitted) >= 2:
            second_given_accept[emitted[1]] += 1
    assert torch.allclose(first / trials, p[0], atol=0.02), first / trials
    # p[1] plays the target's distribution at the next position (here independent of the first token)
    second = second_given_accept / second_given_accept.sum()
    assert torch.allclose(second, p[1], atol=0.03), second


# ---------------------------------------------------------------------------
# run_eval
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(env: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "draft"
    export_draft(env["draft"], out, MANIFEST)
    return out


def test_run_eval_end_to_end(exported: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.evaluate import run_eval

    report = run_eval(exported, "mtbench", tmp_path / "eval", max_samples=2, max_new_tokens=16)
    for name in ("eval.json", "eval.md", "eval.png"):
        assert (tmp_path / "eval" / name).is_file()
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    stats = saved["datasets"]["mtbench"]
    assert stats["prompts"] == 2 and stats["steps"] >= 2
    assert 1.0 <= stats["tau"] < 1.5
    assert len(stats["acceptance_by_position"]) == BLOCK - 1
    assert set(stats["tokens_per_second"]) == {"dflash", "plain", "prompt_lookup"}
    assert all(v > 0 for v in stats["tokens_per_second"].values())
    assert saved["target_dtype"] == "float32"  # --dtype auto on CPU: greedy equality is exact
    assert stats["greedy_identical"] == 2 and stats["tie_divergences"] == 0
    assert report["datasets"]["mtbench"]["tau"] == pytest.approx(stats["tau"])
    # The noise of tau over prompts: its standard error from the per-prompt accepted counts, and a 95 % interval.
    samples = stats["samples"]
    expected = tau_standard_error([sum(a + 1 for a in s["accepted"]) for s in samples],
                                  [len(s["accepted"]) for s in samples])
    assert stats["tau_stderr"] == pytest.approx(expected, rel=1e-12)
    assert stats["tau_ci95"] == pytest.approx([stats["tau"] - 1.96 * expected, stats["tau"] + 1.96 * expected])
    markdown = (tmp_path / "eval" / "eval.md").read_text()
    assert f"| mtbench | 2 | {stats['steps']} | {stats['tau']:.3f} | {expected:.3f} |" in markdown

    # --no-baselines: the same speculative decoding (same tokens, so the same tau and steps), nothing else decoded.
    alone = run_eval(exported, "mtbench", tmp_path / "alone", max_samples=2, max_new_tokens=16, baselines=False)
    only = alone["datasets"]["mtbench"]
    assert (only["tau"], only["steps"]) == (stats["tau"], stats["steps"])
    assert [s["accepted"] for s in only["samples"]] == [s["accepted"] for s in samples]
    assert only["new_tokens"]["plain"] == only["new_tokens"]["prompt_lookup"] == 0
    assert only["greedy_identical"] is None and math.isnan(only["speedup"]["dflash"])
    assert math.isnan(only["first_token_seconds_per_prompt"]["plain"]) and math.isnan(only["decode_speedup"]["dflash"])
    assert 0 < only["first_token_seconds_per_prompt"]["dflash"] < only["seconds_per_prompt"]["dflash"]
    assert alone["baselines"] is False and "| mtbench | 2 |" in (tmp_path / "alone" / "eval.md").read_text()


def test_run_eval_sampling_draws_each_methods_own_samples_and_leaves_prompt_lookup_out(
        exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At temperature > 0: dflash and plain decoding draw from generators of their own on the target's device, so
    --no-baselines gives dflash the same samples (a shared generator moved with plain decoding's draws); prompt
    lookup, greedy only, is not run and not reported as identical; the warm-up runs without stop tokens."""
    import dflash.stage2_train.evaluate as evaluate

    calls: list[tuple[int, list[int], str]] = []
    drafts: list[list[int]] = []  # each generation's tokens
    original = evaluate.speculative_generate

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[6], list(args[7]), str(kwargs["generator"].device)))
        result = original(*args, **kwargs)
        drafts.append(result.tokens)
        return result

    monkeypatch.setattr(evaluate, "speculative_generate", recorded)
    both = evaluate.run_eval(exported, "mtbench", tmp_path / "both", max_samples=2, max_new_tokens=16,
                             temperature=0.7)
    assert calls[0][:2] == (4, []) and all(stops for _, stops, _ in calls[1:])  # the warm-up's, then two prompts'
    assert {device for _, _, device in calls} == {"cpu"}  # the target's device here
    alone = evaluate.run_eval(exported, "mtbench", tmp_path / "alone", max_samples=2, max_new_tokens=16,
                              temperature=0.7, baselines=False)
    assert alone["datasets"]["mtbench"]["new_tokens"]["plain"] == 0
    assert len(drafts) == 6 and drafts[4:] == drafts[1:3]  # the two prompts' samples, with and without baselines
    assert drafts[1] != drafts[2]  # (sampled: two prompts' answers differ)
    stats = both["datasets"]["mtbench"]
    assert both["prompt_lookup_unavailable"] == "not run: greedy only (--temperature > 0)"
    assert stats["new_tokens"]["prompt_lookup"] == 0 and stats["new_tokens"]["plain"] > 0
    assert stats["prompt_lookup_identical"] is None and stats["greedy_identical"] is None
    assert both["decode_path_plain"] == both["decode_path"] == "dynamic"


def test_run_eval_jsonl_prompts(tmp_path: Path) -> None:
    from dflash.stage2_train.evaluate import load_prompts

    path = tmp_path / "chats.jsonl"
    records = [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]},
        {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]},
        {"prompt": "Plain prompt"},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = load_prompts(str(path), 10)
    assert [p.messages for p in prompts] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Q?"}],
        [{"role": "user", "content": "Plain prompt"}],
    ]
    assert prompts[0].id == "a"
    assert len(load_prompts("humaneval", 3)) == 3


def test_run_eval_user_errors(exported: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.evaluate import run_eval

    with pytest.raises(UserError, match="unknown dataset"):
        run_eval(exported, "no-such-dataset", tmp_path / "e", 1, 4)
    with pytest.raises(UserError, match="no exported drafter"):
        run_eval(tmp_path / "missing", "mtbench", tmp_path / "e", 1, 4)


def _export_variant(env: dict, out: Path, **overrides) -> Path:
    target_config = {**env["target"].config.to_dict(), **overrides}
    config = config_from_target(target_config, LAYER_IDS, 1, BLOCK, MASK_ID)
    export_draft(DFlashDraftModel(config), out, MANIFEST)
    return out


def test_mismatch_errors(env: dict, tmp_path: Path) -> None:
    from dflash.stage2_train.evaluate import check_compatibility, run_eval

    small = _export_variant(env, tmp_path / "small", hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128)
    with pytest.raises(UserError, match="hidden size 64 != the target's 576"):
        run_eval(small, "mtbench", tmp_path / "e", 1, 4)

    vocab = DFlashDraftModel(config_from_target({**env["target"].config.to_dict(), "vocab_size": 32000},
                                                LAYER_IDS, 1, BLOCK, MASK_ID))
    with pytest.raises(UserError, match="vocabulary size 32000 != the target's 49152"):
        check_compatibility(vocab, env["target"], {})

    deep = DFlashDraftModel(config_from_target({**env["target"].config.to_dict(), "num_hidden_layers": 40},
                                               [1, 35], 1, BLOCK, MASK_ID))
    with pytest.raises(UserError, match=r"layers \[35\]"):
        check_compatibility(deep, env["target"], {})


def test_greedy_difference_that_is_no_tie_raises(env: dict) -> None:
    from dflash.stage2_train.evaluate import LosslessnessError, Prompt, compare_greedy

    ids = chat_ids(env, PROMPTS[0])
    reference = spec.greedy_generate(env["target"], ids, 6, env["stops"]).tokens
    assert compare_greedy(env["target"], Prompt("p0", []), ids, reference, list(reference))["identical"]
    broken = [*reference[:3], 0, *reference[4:]]  # token 0 is never a near-top choice
    with pytest.raises(LosslessnessError, match="prompt p0: .* at new token 3"):
        compare_greedy(env["target"], Prompt("p0", []), ids, reference, broken)


def test_summary_after_the_first_token_of_answers_that_stop_at_once_and_a_method_that_did_not_run() -> None:
    """Answers of one token (a stop at once) decode nothing after it: no rate (nan, not 0 tok/s), no speedup; a method
    that did not run (prompt lookup here) has no time to its first token; the figures that exist are those of the
    prompts that decoded."""
    from dflash.stage2_train.evaluate import _summarise, speedup_standard_error

    def result(tokens: int, seconds: float, first: float) -> loop.SpecResult:
        return loop.SpecResult(tokens=[5] * tokens, accepted=[0] * (tokens - 1), steps=tokens - 1, seconds=seconds,
                               first_token_seconds=first)

    samples: list[dict] = [{"id": i} for i in range(2)]
    runs = {"dflash": [result(1, 0.02, 0.02), result(1, 0.03, 0.03)],
            "plain": [result(1, 0.01, 0.01), result(1, 0.02, 0.02)],
            "prompt_lookup": [loop.SpecResult(tokens=[]), loop.SpecResult(tokens=[])]}
    summary = _summarise("d", samples, runs, block_size=16, greedy=False)
    assert summary["first_token_seconds_per_prompt"]["dflash"] == pytest.approx(0.025)
    assert summary["first_token_seconds_per_prompt"]["plain"] == pytest.approx(0.015)
    assert math.isnan(summary["first_token_seconds_per_prompt"]["prompt_lookup"])
    assert all(math.isnan(rate) for rate in summary["decode_tokens_per_second"].values())
    assert all(math.isnan(v) for v in [*summary["decode_speedup"].values(), *summary["decode_speedup_stderr"].values()])

    runs["dflash"][1], runs["plain"][1] = result(9, 0.05, 0.03), result(9, 0.10, 0.02)
    summary = _summarise("d", samples, runs, block_size=16, greedy=False)
    assert summary["decode_tokens_per_second"]["dflash"] == pytest.approx(8 / 0.02)
    assert summary["decode_tokens_per_second"]["plain"] == pytest.approx(8 / 0.08)
    assert summary["decode_speedup"]["dflash"] == pytest.approx(4.0)
    assert summary["speedup"]["dflash"] == pytest.approx((10 / 0.07) / (10 / 0.11))  # the whole time: nearer 1
    assert summary["decode_speedup_stderr"]["dflash"] == pytest.approx(
        speedup_standard_error([0, 8], [0.0, 0.02], [0, 8], [0.0, 0.08]))
