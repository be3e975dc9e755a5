"""Train/serve parity in `dflash eval` (stage2_train/parity.py, shared/chat_rendering.py) and eval's report fields.

The rendering checks run on the embedded SmolLM2 tokenizer and variants of it (another template, a thinking switch,
another vocabulary, other special tokens); one `run_eval` on the real target checks the report fields and the tau
flag; one CLI run checks the one-line warning for a user's own prompt file.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.shared.cache_format import RENDERING_KEY, read_manifest
from dflash.shared.chat_rendering import rendering_record, template_fingerprint
from dflash.shared.run_files import TARGET_INFO_FILE
from dflash.stage2_train.acceptance import tau_standard_error
from dflash.stage2_train.parity import (
    DIFFERS,
    MATCH,
    NOTE,
    TAU_RATIO_FLOOR,
    UNKNOWN,
    compare_rendering,
    summary,
    system_turn_finding,
    tau_gap,
)
from tests.conftest import make_conversations, run_dflash

LAYER_IDS = [1, 8, 14, 20, 27]
SMOLLM_GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
# The same prompt opening, with Qwen3's switch: thinking is on unless enable_thinking is false.
THINKING_GENERATION_PROMPT = ("{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is "
                              "defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
                              "{% endif %}")


def target_folder() -> Path:
    from dflash.shared.target_loading import local_model_files, resolve_target

    return local_model_files(resolve_target(None).load_path)


@functools.cache
def _loaded(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def tokenizer(folder: Path | None = None, template: str | None = None) -> Any:
    """A fresh copy of the embedded target's tokenizer (or of `folder`'s), with `template` as its chat template if
    given."""
    loaded = copy.deepcopy(_loaded(folder or target_folder()))
    if template is not None:
        loaded.chat_template = template
    return loaded


def thinking_template() -> str:
    template = tokenizer().chat_template
    assert SMOLLM_GENERATION_PROMPT in template
    return template.replace(SMOLLM_GENERATION_PROMPT, THINKING_GENERATION_PROMPT)


def statuses(findings) -> dict[str, str]:
    return {finding.check: finding.status for finding in findings}


# ---------------------------------------------------------------------------
# The rendering checks, one per kind of mismatch
# ---------------------------------------------------------------------------


def test_parity_is_silent_when_rendering_matches() -> None:
    cache = rendering_record(tokenizer(), {}, [2], 0.25)
    findings = compare_rendering(cache, rendering_record(tokenizer(), {}, [2]))
    assert statuses(findings) == {"chat template": MATCH, "thinking": MATCH, "tokenizer": MATCH,
                                  "special tokens": MATCH, "stop tokens": MATCH}
    line = summary(findings)
    assert line.startswith("prompts are rendered as the training cache's") and "NOT" not in line
    # Thinking set explicitly to what the template does by default renders the same prompts: no alarm.
    think = thinking_template()
    by_default = rendering_record(tokenizer(template=think), {}, [2])
    explicit = rendering_record(tokenizer(template=think), {"enable_thinking": True}, [2])
    assert by_default["thinking"] == {"switch": "enable_thinking", "on": True, "set": False}
    assert all(f.status == MATCH for f in compare_rendering(by_default, explicit))


def test_parity_fires_on_a_template_mismatch() -> None:
    original = tokenizer()
    other = tokenizer(template=original.chat_template.replace("named SmolLM", "named Helper"))
    findings = compare_rendering(rendering_record(original, {}, [2]), rendering_record(other, {}, [2]))
    assert statuses(findings) == {"chat template": DIFFERS, "thinking": MATCH, "tokenizer": MATCH,
                                  "special tokens": MATCH, "stop tokens": MATCH}
    detail = next(f.detail for f in findings if f.check == "chat template")
    assert "named SmolLM" in detail and "named Helper" in detail  # the probe prompt shows where they part
    assert summary(findings).startswith("prompts are NOT rendered as the training cache's: chat template: sha256")


def test_parity_fires_on_a_thinking_flag_mismatch() -> None:
    think = thinking_template()
    cache = rendering_record(tokenizer(template=think), {}, [2])  # extract renders with the template's defaults
    serving = rendering_record(tokenizer(template=think), {"enable_thinking": False}, [2])
    assert serving["probe_prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    findings = compare_rendering(cache, serving)
    assert statuses(findings) == {"chat template": MATCH, "thinking": DIFFERS, "tokenizer": MATCH,
                                  "special tokens": MATCH, "stop tokens": MATCH}
    detail = next(f.detail for f in findings if f.check == "thinking")
    assert detail == ("cache on (enable_thinking unset: the template's default), eval off (enable_thinking set)")
    # A template without the switch against one with it: the template and the thinking mode both differ.
    plain = rendering_record(tokenizer(), {}, [2])
    assert plain["thinking"] is None
    assert statuses(compare_rendering(plain, serving))["thinking"] == DIFFERS


def test_parity_fires_on_a_tokenizer_mismatch(tmp_path: Path) -> None:
    """Two tokens' ids swapped: same size, template and special tokens (so the same tokenizer_hash), another
    vocabulary; and a tokenizer with one more token."""
    folder = tmp_path / "swapped"
    shutil.copytree(target_folder(), folder, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    original, swapped = tokenizer(), tokenizer(folder)
    assert original("hello world").input_ids != swapped("hello world").input_ids
    assert template_fingerprint(original) == template_fingerprint(swapped)  # what the identity's hash cannot see
    findings = compare_rendering(rendering_record(original, {}, [2]), rendering_record(swapped, {}, [2]))
    assert statuses(findings) == {"chat template": MATCH, "thinking": MATCH, "tokenizer": DIFFERS,
                                  "special tokens": MATCH, "stop tokens": MATCH}

    grown = tokenizer()
    grown.add_tokens(["<extra_token>"])
    findings = compare_rendering(rendering_record(original, {}, [2]), rendering_record(grown, {}, [2]))
    detail = next(f.detail for f in findings if f.check == "tokenizer")
    assert statuses(findings)["tokenizer"] == DIFFERS and "49153 tokens" in detail and "the cache's 49152" in detail


def test_parity_fires_on_special_and_stop_token_mismatches() -> None:
    original, other = tokenizer(), tokenizer()
    other.eos_token = "<|endoftext|>"
    assert other.eos_token_id != original.eos_token_id
    findings = compare_rendering(rendering_record(original, {}, [2]), rendering_record(other, {}, [0, 2]))
    assert statuses(findings) == {"chat template": MATCH, "thinking": MATCH, "tokenizer": MATCH,
                                  "special tokens": DIFFERS, "stop tokens": DIFFERS}
    assert f"eos {other.eos_token_id} (cache 2)" in next(f.detail for f in findings if f.check == "special tokens")


def test_a_cache_without_the_record_is_unknown_not_wrong() -> None:
    serving = rendering_record(tokenizer(), {}, [2])
    same = compare_rendering(None, serving, "a" * 64, "a" * 64)
    assert statuses(same) == {"tokenizer and chat template": MATCH, "thinking": UNKNOWN, "stop tokens": UNKNOWN}
    assert "; unknown: stop tokens, thinking" in summary(same)
    other = compare_rendering(None, serving, "a" * 64, "b" * 64)
    assert statuses(other)["tokenizer and chat template"] == DIFFERS
    assert statuses(compare_rendering(None, serving)) == {"tokenizer and chat template": UNKNOWN,
                                                         "thinking": UNKNOWN, "stop tokens": UNKNOWN}


def test_trained_rendering_from_the_export_else_from_its_runs_cache_manifest(tmp_path: Path) -> None:
    from dflash.stage2_train.parity import trained_rendering

    record = {"chat_template_sha256": "f" * 64}
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "train_options.json").write_text("{}")
    assert trained_rendering({RENDERING_KEY: record}, run / "export") == record
    assert trained_rendering({}, run / "export") is None  # an older run: no cache_manifest.json
    (run / "cache_manifest.json").write_text(json.dumps({"identity": {}}))
    assert trained_rendering({}, run / "export") is None  # an older cache: no record
    (run / "cache_manifest.json").write_text(json.dumps({"identity": {}, RENDERING_KEY: record}))
    assert trained_rendering({RENDERING_KEY: None}, run / "export") == record  # an export made before it was carried


def test_system_turn_note() -> None:
    with_system = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    without = [[{"role": "user", "content": "Hi"}]]
    note = system_turn_finding("mine.jsonl", 0.0, with_system + without)
    assert note is not None and note.status == NOTE and note.detail.startswith("50% of the prompts have a system turn")
    assert system_turn_finding("mine.jsonl", 0.25, with_system) is None
    assert system_turn_finding("mine.jsonl", None, with_system) is None


# ---------------------------------------------------------------------------
# Live tau beside offline tau
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("live", "live_se", "offline", "offline_se", "flagged"), [
    (1.2, 0.05, 3.0, 0.05, True),  # 0.4 x, 25 s.e. below
    (2.5, 0.05, 3.0, 0.05, False),  # 0.83 x: within what healthy drafters show
    (1.8, 0.50, 3.0, 0.20, False),  # 0.6 x but only 2.2 s.e. below: too few prompts to tell
    (2.0, 0.05, 3.0, None, True),  # no offline s.e. recorded (validation split): the live one alone
])
def test_tau_gap_rule(live: float, live_se: float, offline: float, offline_se: float | None, flagged: bool) -> None:
    gap = tau_gap(live, live_se, {"split": "test", "tau_walk": offline, "tau_walk_stderr": offline_se}, 512, [],
                  thinking_on=True)
    assert gap["flagged"] is flagged and gap["ratio"] == pytest.approx(live / offline)
    assert (live / offline < TAU_RATIO_FLOOR) or not flagged
    assert bool(gap["likely_causes"]) is flagged
    if flagged:
        causes = gap["likely_causes"]
        assert any("thinking is on" in cause for cause in causes) and any("another domain" in c for c in causes)
        assert not any("short answers" in cause for cause in causes)  # 512 new tokens: eval's default
        held_out = tau_gap(live, live_se, {"split": "test", "tau_walk": offline, "tau_walk_stderr": offline_se}, 128,
                           [], from_cache=True)["likely_causes"]
        assert any("not the target's own" in c for c in held_out) and not any("another domain" in c for c in held_out)
        assert any("short answers (128 new tokens)" in c for c in held_out)
    assert tau_gap(live, live_se, None, 512, []) is None


# ---------------------------------------------------------------------------
# Speedup and its standard error
# ---------------------------------------------------------------------------


def test_speedup_standard_error_against_direct_computations() -> None:
    from dflash.stage2_train.evaluate import speedup_standard_error

    rng = random.Random(0)
    n = 400
    fast_tokens = [rng.randint(50, 512) for _ in range(n)]
    base_tokens = [t if rng.random() < 0.8 else rng.randint(50, 512) for t in fast_tokens]
    base_seconds = [t / rng.uniform(18, 26) for t in base_tokens]
    fast_seconds = [t / rng.uniform(25, 60) for t in fast_tokens]

    def speedup(rows: list[int]) -> float:
        return ((sum(fast_tokens[i] for i in rows) / sum(fast_seconds[i] for i in rows))
                / (sum(base_tokens[i] for i in rows) / sum(base_seconds[i] for i in rows)))

    # The jackknife standard error (leave one prompt out), computed directly: the same quantity by another route.
    leave_one_out = [speedup([j for j in range(n) if j != i]) for i in range(n)]
    mean = sum(leave_one_out) / n
    jackknife = math.sqrt((n - 1) / n * sum((s - mean) ** 2 for s in leave_one_out))
    assert speedup_standard_error(fast_tokens, fast_seconds, base_tokens, base_seconds) == pytest.approx(
        jackknife, rel=0.02)
    # Equal token counts: speedup = sum(base_seconds) / sum(fast_seconds), a ratio estimator like tau's.
    assert speedup_standard_error(fast_tokens, fast_seconds, fast_tokens, base_seconds) == pytest.approx(
        tau_standard_error(base_seconds, fast_seconds), rel=1e-9)
    assert math.isnan(speedup_standard_error([5], [1.0], [5], [2.0]))


# ---------------------------------------------------------------------------
# What extract records, what the export carries, and eval's report
# ---------------------------------------------------------------------------


def test_extract_records_rendering_and_export_carries_it(baseline_cache: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.draft_config import config_from_target
    from dflash.stage2_train.modeling_dflash import DFlashDraftModel
    from dflash.stage2_train.export import export_draft

    manifest = read_manifest(baseline_cache)
    conversations = make_conversations(14)  # the chat_jsonl fixture's
    share = sum(any(m["role"] == "system" for m in c["messages"]) for c in conversations) / len(conversations)
    assert manifest[RENDERING_KEY] == rendering_record(tokenizer(), {}, [2], share)
    config = json.loads((target_folder() / "config.json").read_text())
    draft = DFlashDraftModel(config_from_target(config, LAYER_IDS, 1, 16, 16))
    export_draft(draft, tmp_path / "draft", manifest)
    assert json.loads((tmp_path / "draft" / TARGET_INFO_FILE).read_text())[RENDERING_KEY] == manifest[RENDERING_KEY]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained drafter exported from a (stand-in) run whose test split recorded tau 4.0 +- 0.05 offline, with the
    embedded target's rendering as its cache's."""
    from dflash.stage2_train.draft_config import config_from_target
    from dflash.stage2_train.modeling_dflash import DFlashDraftModel
    from dflash.stage2_train.export import export_draft

    run = tmp_path_factory.mktemp("run")
    (run / "train_options.json").write_text("{}")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/tau_walk": 1.0}) + "\n"
                                       + json.dumps({"step": 90, "eval/tau_walk": 3.9}) + "\n")
    (run / "test_results.json").write_text(json.dumps({"drafter": "export_best", "step": 90, "sequences": 40,
                                                       "tau_walk": 4.0, "tau_walk_stderr": 0.05}))
    tokens = tokenizer()
    manifest = {"identity": {"target_source": "embedded:SmolLM2-135M-Instruct", "hidden_size": 576,
                             "layer_ids": LAYER_IDS, "tokenizer_hash": template_fingerprint(tokens)},
                RENDERING_KEY: rendering_record(tokens, {}, [2], 0.0)}
    config = json.loads((target_folder() / "config.json").read_text())
    torch.manual_seed(0)
    export_draft(DFlashDraftModel(config_from_target(config, LAYER_IDS, 1, 16, 16)), run / "export", manifest,
                 run_dir=run)
    return run / "export"


def test_eval_report_fields_and_parity(exported: Path, tmp_path: Path) -> None:
    from dflash.stage2_train.evaluate import run_eval, speedup_standard_error

    torch.set_num_threads(1)
    report = run_eval(exported, "mtbench", tmp_path / "eval", max_samples=2, max_new_tokens=8)
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert saved["parity"]["mismatches"] == 0 and saved["parity"]["summary"] == report["parity"]["summary"]
    assert saved["parity"]["summary"].startswith("prompts are rendered as the training cache's")
    d = saved["datasets"]["mtbench"]
    samples = d["samples"]
    assert d["greedy_identical"] == 2  # so plain and speculative decoding made the same tokens
    for sample in samples:
        assert set(sample["tokens_per_second"]) == {"dflash", "plain", "prompt_lookup"}
        for method in ("dflash", "plain"):
            assert sample["seconds"][method] > 0
            assert sample["tokens_per_second"][method] == pytest.approx(sample["new_tokens"] / sample["seconds"][method])
        assert sample["speedup"]["dflash"] == pytest.approx(sample["seconds"]["plain"] / sample["seconds"]["dflash"])
    seconds = {m: [s["seconds"][m] for s in samples] for m in ("dflash", "plain")}
    tokens = [s["new_tokens"] for s in samples]
    assert d["seconds_per_prompt"]["plain"] == pytest.approx(sum(seconds["plain"]) / 2)
    assert d["speedup"]["dflash"] == pytest.approx(sum(seconds["plain"]) / sum(seconds["dflash"]))
    assert d["speedup_stderr"]["dflash"] == pytest.approx(
        speedup_standard_error(tokens, seconds["dflash"], tokens, seconds["plain"]))
    assert d["speedup_stderr"]["dflash"] == pytest.approx(tau_standard_error(seconds["plain"], seconds["dflash"]))
    assert d["speedup_stderr"]["dflash"] > 0
    # After the first token: the whole time less each prompt's forward (timed inside it), for every method.
    for method in ("dflash", "plain", "prompt_lookup"):
        firsts = [s["first_token_seconds"][method] for s in samples]
        assert all(0 < first < s["seconds"][method] for first, s in zip(firsts, samples))
        assert d["first_token_seconds_per_prompt"][method] == pytest.approx(sum(firsts) / 2)
    after = [[t - 1 for t in tokens], [s["seconds"]["dflash"] - s["first_token_seconds"]["dflash"] for s in samples],
             [t - 1 for t in tokens], [s["seconds"]["plain"] - s["first_token_seconds"]["plain"] for s in samples]]
    assert d["decode_tokens_per_second"]["plain"] == pytest.approx(sum(after[2]) / sum(after[3]))
    assert d["decode_speedup"]["dflash"] == pytest.approx(sum(after[3]) / sum(after[1]))
    assert d["decode_speedup_stderr"]["dflash"] == pytest.approx(speedup_standard_error(*after))
    # The untrained drafter's live tau (~1) against the recorded offline test tau 4.0 +- 0.05: flagged.
    gap = d["tau_gap"]
    assert (gap["offline_split"], gap["offline_tau"], gap["live_tau"]) == ("test", 4.0, d["tau"])
    assert gap["flagged"] and any("another domain" in cause for cause in gap["likely_causes"])
    assert any("short answers (8 new tokens)" in cause for cause in gap["likely_causes"])
    markdown = (tmp_path / "eval" / "eval.md").read_text()
    assert "- train/serve parity: prompts are rendered as the training cache's" in markdown
    assert "## Train/serve parity" in markdown and "**far below it**" in markdown
    assert "## Per prompt" in markdown and f"| mtbench | {samples[0]['id']} |" in markdown
    first = d["first_token_seconds_per_prompt"]
    assert (f"| mtbench | {first['dflash'] * 1000:.1f} / {first['plain'] * 1000:.1f} / "
            f"{first['prompt_lookup'] * 1000:.1f} | {d['decode_tokens_per_second']['dflash']:.2f} |") in markdown


def test_eval_cli_says_what_differs_for_a_users_prompts(exported: Path, tmp_path: Path) -> None:
    template = tmp_path / "serving.jinja"
    template.write_text(thinking_template())
    data = tmp_path / "traffic.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "What is 2 + 2?"}]}) + "\n")
    out = tmp_path / "eval"
    result = run_dflash("eval", "--draft", str(exported), "--data", str(data), "--out", str(out), "--max-samples", "1",
                        "--max-new-tokens", "4", "--no-baselines", "--threads", "1", "--chat-template", str(template),
                        "--chat-template-kwargs", '{"enable_thinking": false}')
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stderr.splitlines() if "train/serve parity" in line)
    assert "prompts are NOT rendered as the training cache's: chat template: sha256" in line
    assert "thinking: cache n/a (the template has no thinking switch), eval off (enable_thinking set)" in line
    assert "note: system turns (traffic.jsonl)" in line.replace(str(data), "traffic.jsonl")
    parity = json.loads((out / "eval.json").read_text())["parity"]
    assert parity["mismatches"] == 2 and parity["eval"]["chat_template_kwargs"] == {"enable_thinking": False}

    bad = run_dflash("eval", "--draft", str(exported), "--data", str(data), "--out", str(out),
                     "--chat-template-kwargs", "{enable_thinking: false}")
    assert bad.returncode == 2 and "--chat-template-kwargs" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the drafter's block compiles by default too (the "
                    "stand-in would fail it); the GPU covers --compile-target in test_compiled_target.py")
def test_eval_cli_compile_target_compiles_the_targets_steps(exported: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`dflash eval --compile-target` hands the target's fixed-width forwards to torch.compile (here a stand-in that
    fails, so nothing compiles for real: the runners fall back to the eager forwards and the decode path names the
    reason, for plain and speculative decoding alike); without the flag torch.compile is not asked. (The compiled
    forwards' tokens: tests/stage2_train/test_compiled_target.py.)"""
    from click.testing import CliRunner

    import dflash.stage2_train.modeling_dflash as loop
    from dflash.shared.cli import dflash

    asked = []

    def failing_compile(function, **_options):  # noqa: ANN001, ANN202 - torch.compile's stand-in
        def compiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            asked.append(function)
            raise RuntimeError("no compiler here")
        return compiled

    monkeypatch.setattr(loop, "COMPILE_TARGET", False)  # (the flag sets it for the process: undone after the test)
    monkeypatch.setattr(torch, "compile", failing_compile)
    # The command sets up the `dflash` logger (handlers on CliRunner's streams, no propagation): undone after too.
    logger = logging.getLogger("dflash")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    args = ["eval", "--draft", str(exported), "--data", "mtbench", "--max-samples", "1", "--max-new-tokens", "6",
            "--decode", "static"]
    for flags, expected in (([], "static"), (["--compile-target"],
                                             "static, target not compiled (RuntimeError: no compiler here)")):
        out = tmp_path / f"eval{len(flags)}"
        result = CliRunner().invoke(dflash, [*args, "--out", str(out), *flags], catch_exceptions=False)
        assert result.exit_code == 0, result.output[-3000:]
        report = json.loads((out / "eval.json").read_text())
        assert report["decode_path"] == report["decode_path_plain"] == expected
        assert report["datasets"]["mtbench"]["greedy_identical"] == 1
        assert bool(asked) == bool(flags)
    for handler in logger.handlers:
        handler.close()


def test_the_static_capacity_covers_prompts_rendered_with_the_template_kwargs(
        exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The static buffers eval sizes once (so that no prompt rebuilds them inside its timing) hold every prompt as
    the timed loop renders it, with --chat-template-kwargs (here: enable_thinking false adds an empty thinking
    block to every prompt), its new tokens and the widest verify block."""
    import dflash.stage2_train.evaluate as evaluate

    template = tmp_path / "serving.jinja"
    template.write_text(thinking_template())
    calls: list[tuple[int, int, int]] = []
    original = evaluate.speculative_generate

    def recorded(target: Any, draft: Any, embed: Any, head: Any, ids: list[int], layer_ids: list[int], n: int,
                 *args: Any, **kwargs: Any) -> Any:
        calls.append((len(ids), n, kwargs["capacity"]))
        return original(target, draft, embed, head, ids, layer_ids, n, *args, **kwargs)

    monkeypatch.setattr(evaluate, "speculative_generate", recorded)
    evaluate.run_eval(exported, "mtbench", tmp_path / "eval", max_samples=2, max_new_tokens=4, baselines=False,
                      chat_template=template, chat_template_kwargs={"enable_thinking": False}, decode="static")
    block = 16
    assert len(calls) == 3  # the warm-up and two prompts
    assert all(capacity >= length + n + block for length, n, capacity in calls), calls
