"""`dflash generate`: regenerated answers equal plain greedy decoding; the CLI resumes without duplicates."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.shared import cache_format as cf
from dflash.shared import logs
from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target, stop_token_ids
from dflash.stage1_extract.conversations import Conversation, chat_token_ids
from dflash.stage1_extract import regenerate as regenerate_module
from dflash.stage1_extract.generate_parts import read_finished, repair_part_file
from dflash.stage1_extract.generate_run import sample_keys
from dflash.stage1_extract.regenerate import (
    FINISH_CONTEXT,
    FINISH_STOP,
    MIN_ANSWER_TOKENS,
    ConversationRegenerator,
    GenerateSettings,
    answer_budget,
    end_of_turn_tokens,
    first_prompt_tokens,
)
from dflash.stage1_extract.supervisor import Progress
from dflash.stage1_extract.worker import SampleOutOfMemory
from tests.conftest import REPO, make_conversations, run_dflash
from tests.faults import fail_generation_over

GENERATE_ARGS = ("--max-samples", "10", "--max-new-tokens", "12", "--max-length", "160", "--chunk-size", "2",
                 "--batch-tokens", "600")


@pytest.fixture(scope="module")
def smollm2_fp32() -> tuple[Any, Any, list[int]]:
    target = resolve_target(None)
    tokenizer = load_tokenizer(target.load_path)
    model = load_target_model(target.load_path, "cpu").float()
    return model, tokenizer, stop_token_ids(target.load_path, tokenizer)


def _conversations(count: int) -> list[Conversation]:
    return [Conversation(i, r["id"], tuple(r["messages"])) for i, r in enumerate(make_conversations(count))]


def _plain_greedy(model: Any, prompt: list[int], max_new: int, stops: list[int]) -> list[int]:
    """The reference: one full forward per token, no batching, padding or cache."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        if token in stops:
            break
        ids.append(token)
    return out


def asking_for_a_repetition_penalty(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give `model` a generation_config.json that asks for more than plain decoding (as Qwen2.5-Instruct's asks for
    a repetition penalty of 1.05): transformers' `generate` applies what it finds there unless told otherwise."""
    from transformers import GenerationConfig

    monkeypatch.setattr(model, "generation_config", GenerationConfig(
        repetition_penalty=1.5, no_repeat_ngram_size=2, eos_token_id=model.generation_config.eos_token_id))


def test_batched_answers_equal_plain_greedy_decoding_turn_by_turn(smollm2_fp32: tuple[Any, Any, list[int]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each answer is plain greedy decoding of its prompt, even though the target's generation config asks for a
    repetition penalty and banned n-grams (the drafter learns the target's own next-token choice)."""
    model, tokenizer, stops = smollm2_fp32
    asking_for_a_repetition_penalty(model, monkeypatch)
    conversations = _conversations(7)
    settings = GenerateSettings(max_new_tokens=10, max_length=512, batch_tokens=10_000)
    records = ConversationRegenerator(model, tokenizer, stops, settings).regenerate(
        [(c.sample_id, c) for c in conversations])
    assert [r["id"] for r in records] == [c.sample_id for c in conversations]
    for conversation, record in zip(conversations, records):
        messages = record["messages"]
        kept = [m for m in messages if m["role"] != "assistant"]
        assert kept == [m for m in conversation.messages if m["role"] != "assistant"][: len(kept)]
        generated = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = chat_token_ids(tokenizer, messages[:i], add_generation_prompt=True)
            expected = _plain_greedy(model, prompt, 10, stops)
            content = expected[:-1] if expected[-1] in stops else expected
            assert message["content"] == tokenizer.decode(content, skip_special_tokens=True), (record["id"], i)
            generated += len(expected)
        info = record["dflash"]
        assert info["generated_tokens"] == generated
        if info["finish_reason"] == FINISH_STOP:  # every assistant turn was regenerated
            assert len(messages) == len(conversation.messages)


def test_fake_oom_halves_the_batches_and_gives_the_same_answers(smollm2_fp32: tuple[Any, Any, list[int]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer, stops = smollm2_fp32
    pairs = [(c.sample_id, c) for c in _conversations(4)]
    settings = GenerateSettings(max_new_tokens=6, max_length=512, batch_tokens=10_000)
    plain = ConversationRegenerator(model, tokenizer, stops, settings).regenerate(pairs)
    fail_generation_over(150, monkeypatch.setattr)
    squeezed = ConversationRegenerator(model, tokenizer, stops, settings)
    assert squeezed.regenerate(pairs) == plain
    assert squeezed.oom_retries > 0


def test_a_conversation_that_does_not_fit_alone_names_the_flags(smollm2_fp32: tuple[Any, Any, list[int]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer, stops = smollm2_fp32
    pairs = [(c.sample_id, c) for c in _conversations(2)]
    fail_generation_over(8, monkeypatch.setattr)
    regenerator = ConversationRegenerator(model, tokenizer, stops,
                                          GenerateSettings(max_new_tokens=6, max_length=512, batch_tokens=10_000))
    with pytest.raises(SampleOutOfMemory, match=r"does not fit in the memory of cpu even alone: lower --max-length "
                                                r"\(now 512\) or --max-new-tokens \(now 6\)"):
        regenerator.regenerate(pairs)
    assert regenerator.oom_retries == 1  # the pair of conversations was halved once, then the first one alone failed


def _summarize_results() -> Any:
    spec = importlib.util.spec_from_file_location("dflash_summarize_results",
                                                  REPO / "benchmarks" / "summarize_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_static_cache_batches_give_the_default_answers(smollm2_fp32: tuple[Any, Any, list[int]],
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, tokenizer, stops = smollm2_fp32
    pairs = [(c.sample_id, c) for c in _conversations(7)]
    default = ConversationRegenerator(model, tokenizer, stops,
                                      GenerateSettings(max_new_tokens=10, max_length=512, batch_tokens=10_000))
    expected = default.regenerate(pairs)
    # 3 rows of 522 cache positions: batches of 3, 3 and 1 (+ 2 dummy rows) for the first answers
    settings = GenerateSettings(max_new_tokens=10, max_length=512, batch_tokens=3 * 522, static_cache=True)
    static = ConversationRegenerator(model, tokenizer, stops, settings)
    # A small step, so that these short prompts' batches take KV caches of several lengths.
    monkeypatch.setattr(regenerate_module, "STATIC_CACHE_STEP", 32)
    shapes: list[tuple[int, ...]] = []
    cache_lengths: list[int] = []
    caches_passed: list[Any] = []
    caches_used: set[int] = set()
    generate, forward = model.generate, model.forward

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        rows, width = kwargs["input_ids"].shape
        shapes.append((rows,))
        cache = kwargs[static._cache_kwarg]  # `cache` (transformers >= 5.2x) or `past_key_values`
        # The batch's longest prompt and most new tokens, rounded up to the step (at most max-length + new tokens).
        assert cache.layers[0].max_cache_len == min(522, -(-(width + kwargs["generation_config"].max_new_tokens)
                                                           // 32) * 32)
        cache_lengths.append(cache.layers[0].max_cache_len)
        caches_passed.append(cache)
        return generate(*args, **kwargs)

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        caches_used.add(id(kwargs.get(static._cache_kwarg)))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording_generate)
    monkeypatch.setattr(model, "forward", recording_forward)
    log_file = tmp_path / "generate.log"
    handler, logger = logging.FileHandler(log_file), logging.getLogger("dflash.regenerate")
    handler.setFormatter(logging.Formatter(logs.FORMAT))  # generate.log's lines, as the workers write them
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        records = static.regenerate(pairs)
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
        handler.close()
    assert records == expected
    assert set(shapes) == {(3,)} and len(shapes) >= 3  # every batch has the same number of rows
    assert len(set(cache_lengths)) > 1 and all(length % 32 == 0 for length in cache_lengths)
    assert {id(cache) for cache in caches_passed} == caches_used  # the decoding ran on the caches of those lengths
    # The log's batch lines give benchmarks/summarize_results.py each KV length's batches and new tokens.
    # (a process's first batch of each length apart: it compiles on CUDA).
    by_length = _summarize_results().summarize(tmp_path)["generate_batches"]["generate.log"]
    assert {int(k): v["batches"] + 1 for k, v in by_length.items()} == Counter(cache_lengths)
    assert all(v["first_batches_s"] > 0 for v in by_length.values())


def test_static_batches_may_compile_every_cache_length(smollm2_fp32: tuple[Any, Any, list[int]]) -> None:
    """With --static-cache every cache length the settings allow, at every row count out-of-memory retries may halve
    the batches to, stays under torch's recompile limit, past which transformers' compiled decoding step would
    silently run uncompiled."""
    model, tokenizer, stops = smollm2_fp32
    # (torch's own patch: pytest's monkeypatch deletes the setting when undone, which hides it from torch itself)
    with torch._dynamo.config.patch(recompile_limit=8):
        check_recompile_limit(model, tokenizer, stops)


def check_recompile_limit(model: Any, tokenizer: Any, stops: list[int]) -> None:
    settings = GenerateSettings(max_new_tokens=1024, max_length=4096, batch_tokens=1 << 20, static_cache=True)
    lengths = {settings.batch_cache_len(needed) for needed in range(1, settings.cache_len + 1)}
    rows, row_counts = settings.batch_tokens // settings.cache_len, set()
    while rows:
        row_counts.add(rows)
        rows //= 2
    assert len(lengths) == 10 and len(row_counts) == 8  # 204, 102, ..., 1 rows
    ConversationRegenerator(model, tokenizer, stops, settings)
    assert torch._dynamo.config.recompile_limit >= len(lengths) * len(row_counts)
    ConversationRegenerator(model, tokenizer, stops, replace(settings, max_length=512, max_new_tokens=64))
    assert torch._dynamo.config.recompile_limit >= len(lengths) * len(row_counts)  # never lowered


def test_continuous_batching_gives_the_default_answers(smollm2_fp32: tuple[Any, Any, list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' continuous batching over every prompt of a turn at once gives the default path's answers, those
    cut by --max-length below --max-new-tokens (prompts near the limit) included, and so does a target whose
    generation config asks for a repetition penalty (which only the default path would otherwise apply)."""
    model, tokenizer, stops = smollm2_fp32
    asking_for_a_repetition_penalty(model, monkeypatch)
    pairs = [(c.sample_id, c) for c in _conversations(7)]
    settings = GenerateSettings(max_new_tokens=10, max_length=90, batch_tokens=4096)
    budgets = [answer_budget(settings, first_prompt_tokens(tokenizer, c), end_of_turn_tokens(tokenizer))
               for _, c in pairs]
    assert min(budgets) < settings.max_new_tokens <= max(budgets)
    expected = ConversationRegenerator(model, tokenizer, stops, settings).regenerate(pairs)
    continuous = ConversationRegenerator(model, tokenizer, stops, replace(settings, continuous_batching=True))
    assert continuous.regenerate(pairs) == expected
    assert {r["dflash"]["finish_reason"] for r in expected} >= {"length"}


def test_max_turns_ends_a_conversation_after_that_many_answers(smollm2_fp32: tuple[Any, Any, list[int]]) -> None:
    model, tokenizer, _ = smollm2_fp32
    everything_stops = list(range(model.config.vocab_size))  # every answer ends at once, with an end-of-turn token
    multi_turn = [c for c in _conversations(4) if sum(m["role"] == "assistant" for m in c.messages) == 2][0]
    pairs = [(multi_turn.sample_id, multi_turn)]
    for max_turns, roles in ((1, ["user", "assistant"]), (None, ["user", "assistant", "user", "assistant"])):
        settings = GenerateSettings(max_new_tokens=4, max_length=512, max_turns=max_turns)
        [record] = ConversationRegenerator(model, tokenizer, everything_stops, settings).regenerate(pairs)
        assert [m["role"] for m in record["messages"]] == roles
        assert record["dflash"]["generated_turns"] == len(roles) // 2


def test_a_conversation_whose_next_prompt_does_not_fit_ends_at_its_last_answer(
        smollm2_fp32: tuple[Any, Any, list[int]]) -> None:
    model, tokenizer, _ = smollm2_fp32
    everything_stops = list(range(model.config.vocab_size))  # every answer is one end-of-turn token
    multi_turn = [c for c in _conversations(4) if sum(m["role"] == "assistant" for m in c.messages) == 2][0]
    user, _, second_user, _ = (dict(m) for m in multi_turn.messages)
    second_prompt = len(chat_token_ids(tokenizer, [user, {"role": "assistant", "content": ""}, second_user],
                                       add_generation_prompt=True))
    end_tokens = end_of_turn_tokens(tokenizer)
    assert end_tokens == 2  # SmolLM2's ChatML: <|im_end|> and a newline
    settings = GenerateSettings(max_new_tokens=4, max_length=second_prompt + end_tokens + MIN_ANSWER_TOKENS - 1)
    [record] = ConversationRegenerator(model, tokenizer, everything_stops, settings).regenerate(
        [(multi_turn.sample_id, multi_turn)])
    assert record["dflash"]["finish_reason"] == FINISH_CONTEXT
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"]  # not the user turn left unanswered
    # One token more and the second turn fits: the rule is exactly the one stated.
    roomier = GenerateSettings(max_new_tokens=4, max_length=settings.max_length + 1)
    [record] = ConversationRegenerator(model, tokenizer, everything_stops, roomier).regenerate(
        [(multi_turn.sample_id, multi_turn)])
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]


def test_tokens_are_reported_while_a_batch_is_generated_and_add_up_to_the_answers(
        smollm2_fp32: tuple[Any, Any, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.stage1_extract import regenerate

    model, tokenizer, stops = smollm2_fp32
    monkeypatch.setattr(regenerate, "REPORT_EVERY_S", 0.0)  # report at every decoding step
    reports: list[tuple[int, int, int]] = []
    conversations = _conversations(6)
    settings = GenerateSettings(max_new_tokens=8, max_length=512, batch_tokens=10_000)
    records = ConversationRegenerator(model, tokenizer, stops, settings,
                                      lambda *counts: reports.append(counts)).regenerate(
        [(c.sample_id, c) for c in conversations])
    first_finished = next(i for i, (done, _, _) in enumerate(reports) if done)
    assert first_finished > 0 and all(done == 0 and tokens > 0 for done, tokens, _ in reports[:first_finished])
    assert sum(tokens for _, tokens, _ in reports) == sum(r["dflash"]["generated_tokens"] for r in records)
    assert sum(done for done, _, _ in reports) == len(records)


def test_progress_eta_counts_down_between_finished_samples() -> None:
    progress = Progress(20, desc="generate")
    assert progress.status() == "loading the target, first batch (prefill)" and progress.eta_s() is None
    progress.add(0, 50)  # tokens of a batch in flight: no sample finished, no ETA to guess from yet
    assert progress.eta_s() is None and progress.status().endswith("ETA ?")
    progress.started -= 100  # 10 samples finished after 100 s: 10 more take about 100 s
    progress.add(10, 50)
    assert progress.eta_s() == pytest.approx(100, abs=1)
    eta, when = progress.estimate
    progress.estimate = (eta, when - 30)  # 30 s later, tokens still arriving, no sample finished
    progress.add(0, 200)
    assert progress.eta_s() == pytest.approx(70, abs=1)
    progress.estimate = (eta, when - 150)  # overdue: the pace so far (10 samples in 150 s: 10 more take 150 s)
    progress.started -= 50
    assert progress.eta_s() == pytest.approx(150, abs=1)
    progress.close()


def test_sample_keys_are_unique_where_ids_repeat() -> None:
    conversations = [Conversation(i, name, ()) for i, name in enumerate(["a", "b", "a", "a"])]
    assert sample_keys(conversations) == ["a", "b", "a#1", "a#2"]


def test_a_partial_last_line_is_cut_and_not_counted(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    part = parts / "worker-0.jsonl.part"
    part.write_text('{"id": "x", "messages": []}\n{"id": "y", "mess')
    assert list(read_finished(tmp_path)) == ["x"]
    assert repair_part_file(part) == len('{"id": "y", "mess')
    assert part.read_text() == '{"id": "x", "messages": []}\n'
    assert repair_part_file(part) == 0


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory, chat_jsonl: Path) -> Path:
    """An uninterrupted run over the small chat file: the reference interrupted runs must equal."""
    out = tmp_path_factory.mktemp("generated") / "gen"
    run_dflash("generate", "--data", str(chat_jsonl), "--out", str(out), *GENERATE_ARGS, check=True)
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_output_feeds_extract(generated: Path, chat_jsonl: Path, tmp_path: Path) -> None:
    records = _lines(generated / "conversations.jsonl")
    assert [r["id"] for r in records] == [f"conv-{i}" for i in range(10)]
    assert all(r["dflash"]["generated_tokens"] > 0 for r in records)
    summary = json.loads((generated / "generate.json").read_text())["summary"]
    assert summary["conversations"] == 10 and summary["skipped"] == 0
    assert (generated / "generate.log").read_text().count("dflash generate starting") == 1
    cache = tmp_path / "cache"
    run_dflash("extract", "--data", str(generated / "conversations.jsonl"), "--out", str(cache), "--max-length", "160",
               check=True)
    assert cf.read_manifest(cache)["data"]["conversations"] == 10
    # A rerun of a finished output does nothing and changes nothing.
    before = (generated / "conversations.jsonl").read_bytes()
    again = run_dflash("generate", "--data", str(chat_jsonl), "--out", str(generated), *GENERATE_ARGS)
    assert again.returncode == 0 and "0 to go" in again.stderr, again.stderr[-2000:]
    assert (generated / "conversations.jsonl").read_bytes() == before


def test_chunks_are_generated_longest_first_prompts_first(generated: Path) -> None:
    """Each worker takes the chunks in queue order and writes them in that order: the first prompts' lengths never
    grow along a part file (so batches hold prompts of similar length)."""
    tokenizer = load_tokenizer(resolve_target(None).load_path)
    lengths = {c.sample_id: first_prompt_tokens(tokenizer, c) for c in _conversations(14)}  # chat_jsonl's
    parts = sorted((generated / "parts").glob("*.part"))
    assert parts
    for part in parts:
        written = [lengths[json.loads(line)["id"]] for line in part.read_text().splitlines()]
        assert written == sorted(written, reverse=True), part.name
    assert len(set(lengths.values())) > 3  # the order is not trivially met


def test_killed_generate_resumes_without_duplicates_or_losses(generated: Path, chat_jsonl: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "gen"
    args = ("generate", "--data", str(chat_jsonl), "--out", str(out), *GENERATE_ARGS)
    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    part = out / "parts" / "worker-0.jsonl.part"
    deadline = time.time() + 300
    while not (part.is_file() and part.read_text().count("\n") >= 2) and process.poll() is None:
        assert time.time() < deadline, "no chunk was finished in time"
        time.sleep(0.1)
    if process.poll() is not None:
        pytest.skip("the run finished before the kill")  # pragma: no cover - timing
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    with open(part, "a") as handle:  # what a writer killed mid-line leaves behind
        handle.write('{"id": "conv-9", "messages": [{"ro')
    rerun = run_dflash(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "cut off a partial last line" in (out / "generate.log").read_text()
    finished_lines = sum(len(p.read_text().splitlines()) for p in (out / "parts").glob("*.part"))
    assert finished_lines == 10, "a conversation was generated twice"
    assert _lines(out / "conversations.jsonl") == _lines(generated / "conversations.jsonl")


def test_rerun_with_other_settings_is_refused(generated: Path, chat_jsonl: Path) -> None:
    changed = [a if a != "12" else "13" for a in GENERATE_ARGS]
    result = run_dflash("generate", "--data", str(chat_jsonl), "--out", str(generated), *changed)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "max_new_tokens" in result.stderr and "--overwrite" in result.stderr


def test_generate_bad_inputs_give_clear_errors(tmp_path: Path) -> None:
    missing = run_dflash("generate", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "g"))
    assert missing.returncode == 2 and "data file not found" in missing.stderr and "Traceback" not in missing.stderr
    model = run_dflash("generate", "--model", str(tmp_path), "--out", str(tmp_path / "g2"))
    assert model.returncode == 2 and "Traceback" not in model.stderr, model.stderr[-2000:]
    assert os.path.exists(tmp_path / "g2" / "generate.log")  # the log exists before anything is loaded
    for flags, message in ((("--continuous-batching", "--static-cache"), "choose one"),
                           (("--continuous-batching", "--workers-per-gpu", "2"), "--workers-per-gpu 1"),
                           (("--continuous-batching", "--temperature", "0.7"), "greedily only")):
        both = run_dflash("generate", "--out", str(tmp_path / "g3"), *flags)
        assert both.returncode == 2 and message in both.stderr and "Traceback" not in both.stderr, both.stderr[-2000:]
        assert not (tmp_path / "g3").exists()
