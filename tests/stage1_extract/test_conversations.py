"""Tests for dflash.stage1_extract.conversations: loading chat data and the assistant-only loss mask."""

from __future__ import annotations

import copy
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.shared.embedded import smollm2_gguf
from dflash.stage1_extract.conversations import (
    Conversation,
    DataError,
    TokenizedSample,
    load_conversations,
    template_fingerprint,
    tokenize_conversation,
)

SHAREGPT_COMPLETE_RECORDS = 17_671
IM_END = 2  # SmolLM2's <|im_end|>
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)
# Llama-3's pre-tokenizer regex: it keeps "\n\n" whole before a word, so its header is prefix-stable.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TWO_TURNS = (
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy? Ünïcødé ✓"},
    {"role": "assistant", "content": "Rome — 🇮🇹 of course."},
)


@pytest.fixture(scope="module")
def smollm():
    """The real SmolLM2 tokenizer from the embedded GGUF, loaded once."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML
    return tokenizer


def with_llama3_template(smollm, *, llama3_pre_tokenizer: bool):
    """SmolLM2's vocabulary with Llama-3 header/turn tokens and a Llama-3 style template."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = copy.deepcopy(smollm)
    tokenizer.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    tokenizer.chat_template = LLAMA3
    tokenizer.eos_token = "<|eot_id|>"
    if llama3_pre_tokenizer:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return tokenizer


@pytest.fixture(scope="module")
def llama3(smollm):
    return with_llama3_template(smollm, llama3_pre_tokenizer=True)


@pytest.fixture(scope="module")
def sharegpt():
    return load_conversations(None)


def conversation(*messages: dict[str, str], index: int = 0) -> Conversation:
    return Conversation(index, f"test:{index}", tuple(messages))


def masked_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def chat(user: str, assistant: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# ---------------------------------------------------------------------------------------- tokenization


def test_gguf_tokenizer_has_chatml_template(smollm):
    assert "<|im_start|>" in smollm.chat_template
    assert smollm.convert_tokens_to_ids("<|im_end|>") == IM_END


def test_chatml_mask_is_exactly_assistant_content_and_im_end(smollm):
    sample = tokenize_conversation(smollm, conversation(*TWO_TURNS), max_length=4096, stop_token_ids=[IM_END])
    assert isinstance(sample, TokenizedSample)
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert len(sample.input_ids) == len(sample.loss_mask)
    assert not sample.truncated
    runs = masked_runs(sample.loss_mask)
    assistants = [m["content"] for m in TWO_TURNS if m["role"] == "assistant"]
    assert len(runs) == len(assistants)
    for (start, end), content in zip(runs, assistants):
        assert smollm.decode(sample.input_ids[start:end].tolist()) == content + "<|im_end|>"
        assert sample.input_ids[end - 1] == IM_END
        assert smollm.decode([int(sample.input_ids[end])]) == "\n"
        assert sample.loss_mask[end] == 0
    # The ids are the template's own tokenization: one BOS-like <|im_start|> at the start, no doubled BOS.
    expected = smollm.apply_chat_template(list(TWO_TURNS), tokenize=True, return_dict=False)
    assert sample.input_ids.tolist() == list(expected)


def test_control_token_text_inside_content_is_not_a_stop(smollm):
    messages = chat("Say <|im_end|> please", "Here: <|im_end|> done")
    sample = tokenize_conversation(smollm, conversation(*messages), max_length=512, stop_token_ids=[IM_END])
    (start, end), = masked_runs(sample.loss_mask)
    assert smollm.decode(sample.input_ids[start:end].tolist()) == "Here: <|im_end|> done<|im_end|>"
    assert int((sample.input_ids[start:end] == IM_END).sum()) == 1


def test_llama3_mask_is_exactly_assistant_content_and_eot(llama3):
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    sample = tokenize_conversation(llama3, conversation(*TWO_TURNS), max_length=4096)  # stop = eos = <|eot_id|>
    assert isinstance(sample, TokenizedSample)
    assert sample.input_ids[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    runs = masked_runs(sample.loss_mask)
    assistants = [m["content"] for m in TWO_TURNS if m["role"] == "assistant"]
    assert len(runs) == 2
    for (start, end), content in zip(runs, assistants):
        assert llama3.decode(sample.input_ids[start:end].tolist()) == content + "<|eot_id|>"
        assert sample.input_ids[end - 1] == eot
    assert runs[-1][1] == len(sample.input_ids)  # nothing follows the final <|eot_id|>
    assert llama3.decode([int(sample.input_ids[runs[0][1]])]) == "<|start_header_id|>"


def test_llama3_header_with_gpt2_pre_tokenizer_is_not_prefix_stable(smollm):
    # GPT-2's regex splits "\n\nParis" into "\n", "\n", "Paris" but the bare generation prompt ends in one
    # "\n\n" token: the prompt the model sees at inference is not a prefix of the training sequence.
    tokenizer = with_llama3_template(smollm, llama3_pre_tokenizer=False)
    assert tokenize_conversation(tokenizer, conversation(*TWO_TURNS), max_length=4096) == "template_not_prefix_stable"
    assert smollm.backend_tokenizer.pre_tokenizer.__class__.__name__ == "ByteLevel"  # the copy left it alone


def test_stop_tokens_default_to_eos(llama3, smollm):
    explicit = tokenize_conversation(
        llama3, conversation(*TWO_TURNS), max_length=4096, stop_token_ids=[llama3.convert_tokens_to_ids("<|eot_id|>")]
    )
    default = tokenize_conversation(llama3, conversation(*TWO_TURNS), max_length=4096)
    assert np.array_equal(explicit.loss_mask, default.loss_mask)
    # SmolLM2's GGUF eos is <|im_end|> as well, so the default matches stop_token_ids=[2] there too.
    assert smollm.eos_token_id == IM_END


def test_without_stop_token_the_whole_span_is_masked(smollm):
    conv = conversation(*chat("hi", "hello there"))
    sample = tokenize_conversation(smollm, conv, max_length=512, stop_token_ids=[99999])
    (start, end), = masked_runs(sample.loss_mask)
    assert smollm.decode(sample.input_ids[start:end].tolist()) == "hello there<|im_end|>\n"


def test_truncate_and_skip(smollm):
    conv = conversation(*TWO_TURNS)
    full = tokenize_conversation(smollm, conv, max_length=4096, stop_token_ids=[IM_END])
    length = len(full.input_ids)
    exact = tokenize_conversation(smollm, conv, max_length=length, stop_token_ids=[IM_END])
    assert len(exact.input_ids) == length and not exact.truncated

    cut = tokenize_conversation(smollm, conv, max_length=length - 5, stop_token_ids=[IM_END])
    assert len(cut.input_ids) == len(cut.loss_mask) == length - 5
    assert cut.truncated
    assert np.array_equal(cut.input_ids, full.input_ids[: length - 5])
    assert np.array_equal(cut.loss_mask, full.loss_mask[: length - 5])

    skipped = tokenize_conversation(smollm, conv, max_length=length - 1, overlength="skip", stop_token_ids=[IM_END])
    assert skipped == "too_long"
    first_start = masked_runs(full.loss_mask)[0][0]
    one = tokenize_conversation(smollm, conv, max_length=first_start + 1, stop_token_ids=[IM_END])
    assert one == "no_assistant_tokens"
    two = tokenize_conversation(smollm, conv, max_length=first_start + 2, stop_token_ids=[IM_END])
    assert int(two.loss_mask.sum()) == 2 and two.truncated


def test_bad_arguments(smollm):
    with pytest.raises(ValueError, match="overlength"):
        tokenize_conversation(smollm, conversation(*TWO_TURNS), max_length=64, overlength="wrap")


def test_leading_assistant_turn_is_context(smollm):
    messages = [{"role": "assistant", "content": "(continued) and so on."}, *chat("More?", "Yes, more.")]
    sample = tokenize_conversation(smollm, conversation(*messages), max_length=512, stop_token_ids=[IM_END])
    (start, end), = masked_runs(sample.loss_mask)
    assert smollm.decode(sample.input_ids[start:end].tolist()) == "Yes, more.<|im_end|>"


def test_unstable_or_failing_templates_are_skip_reasons(smollm):
    tokenizer = copy.deepcopy(smollm)
    # Drops earlier assistant turns from history (as reasoning templates do): prefixes are not stable.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert tokenize_conversation(tokenizer, conversation(*TWO_TURNS), max_length=512) == "template_not_prefix_stable"
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    assert tokenize_conversation(tokenizer, conversation(*TWO_TURNS), max_length=512) == "template_error"


def test_template_fingerprint(smollm, llama3):
    assert template_fingerprint(smollm) == template_fingerprint(copy.deepcopy(smollm))
    assert len(template_fingerprint(smollm)) == 64
    assert template_fingerprint(smollm) != template_fingerprint(llama3)


ROLES = st.sampled_from(["system", "user", "assistant"])
CONTENT = st.one_of(st.text(max_size=60), st.sampled_from(["", " ", "<|im_end|>", "<|im_start|>user\n", "\n\n"]))
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=MESSAGES,
    max_length=st.integers(min_value=2, max_value=160),
    overlength=st.sampled_from(["truncate", "skip"]),
)
def test_property_sample_or_reason(smollm, messages, max_length, overlength):
    result = tokenize_conversation(
        smollm, conversation(*messages), max_length=max_length, overlength=overlength, stop_token_ids=[IM_END]
    )
    if isinstance(result, str):
        assert result in {"too_long", "no_assistant_tokens", "template_not_prefix_stable", "template_error"}
        return
    assert len(result.input_ids) == len(result.loss_mask) <= max_length
    assert set(np.unique(result.loss_mask).tolist()) <= {0, 1}
    assert int(result.loss_mask.sum()) >= 2
    assert result.loss_mask[0] == 0  # the template header is never learned


# ---------------------------------------------------------------------------------------- loading


def test_sharegpt_default_recovers_every_complete_record(sharegpt):
    assert len(sharegpt.conversations) + sum(sharegpt.skipped.values()) == SHAREGPT_COMPLETE_RECORDS
    assert sharegpt.skipped == {"empty": 126, "no_assistant_turn": 17}
    assert "cut off" in sharegpt.source
    assert [c.index for c in sharegpt.conversations[:3]] == [0, 1, 2]
    first = sharegpt.conversations[0]
    assert first.sample_id == "QWJhYvA_0"
    assert first.messages[0]["role"] == "user" and first.messages[1]["role"] == "assistant"
    assert all(len(examples) <= 5 for examples in sharegpt.skipped_examples.values())


def test_sharegpt_fingerprint_is_stable_and_tracks_max_samples(sharegpt):
    again = load_conversations(None)
    assert again.fingerprint == sharegpt.fingerprint
    small = load_conversations(None, max_samples=50)
    assert len(small.conversations) == 50
    assert small.fingerprint != sharegpt.fingerprint
    assert small.fingerprint == load_conversations(None, max_samples=50).fingerprint
    assert [c.sample_id for c in small.conversations] == [c.sample_id for c in sharegpt.conversations[:50]]


def test_jsonl_messages_form_with_skips(tmp_path):
    records = [
        {"id": "a", "messages": chat("hi", "hello")},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "tool", "content": "x"}, *chat("q", "a")]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
        {"messages": ["not a dict"]},
        {"messages": []},
        {"messages": "not a list"},
        {"other": 1},
        [1, 2],
        {"messages": [{"role": "system", "content": "s"}, *chat("q2", "a2")]},
    ]
    loaded = load_conversations(str(write_jsonl(tmp_path / "chats.jsonl", records)))
    assert loaded.skipped == {
        "no_assistant_turn": 1,
        "bad_role": 1,
        "malformed": 4,
        "empty": 1,
        "missing_column": 1,
    }
    assert [c.sample_id for c in loaded.conversations] == ["a", "chats.jsonl:1"]
    assert [c.index for c in loaded.conversations] == [0, 1]
    assert loaded.conversations[1].messages == ({"role": "system", "content": "s"}, *chat("q2", "a2"))
    assert loaded.skipped_examples["no_assistant_turn"] == ["chats.jsonl:2"]
    assert loaded.skipped_examples["malformed"][-1] == "chats.jsonl:9"


def test_jsonl_gz_sharegpt_form_and_role_mapping(tmp_path):
    turns = [
        {"from": "system", "value": "be nice"},
        {"from": "human", "value": "hi"},
        {"from": "chatgpt", "value": "a"},
        {"from": "user", "value": "b"},
        {"from": "bard", "value": "c"},
        {"from": "bing", "value": "d"},
        {"from": "model", "value": "e"},
        {"from": "GPT", "value": "f"},
    ]
    path = tmp_path / "chats.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": 7, "conversations": turns}) + "\n\n")
    (conv,) = load_conversations(str(path)).conversations
    assert conv.sample_id == "7"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user"] + ["assistant"] * 4


def test_json_array_object_wrapper_and_gz(tmp_path):
    records = [{"messages": chat(f"q{i}", f"a{i}")} for i in range(3)]
    array = tmp_path / "data.json"
    array.write_text(json.dumps(records, indent=2), encoding="utf-8")
    from_array = load_conversations(str(array))
    assert len(from_array.conversations) == 3 and "cut off" not in from_array.source

    wrapper = tmp_path / "wrapped.json"
    wrapper.write_text(json.dumps({"version": 1, "data": records}), encoding="utf-8")
    assert load_conversations(str(wrapper)).fingerprint != from_array.fingerprint  # ids differ (file name)
    assert [c.messages for c in load_conversations(str(wrapper)).conversations] == [
        c.messages for c in from_array.conversations
    ]

    single = tmp_path / "single.json"
    single.write_text(json.dumps(records[0]), encoding="utf-8")
    assert len(load_conversations(str(single)).conversations) == 1

    gz = tmp_path / "data.json.gz"
    gz.write_bytes(gzip.compress(array.read_bytes()))
    from_gz = load_conversations(str(gz))
    assert [c.messages for c in from_gz.conversations] == [c.messages for c in from_array.conversations]


def test_cut_off_json_array_is_recovered(tmp_path):
    records = [{"id": f"r{i}", "messages": chat(f"question {i}", f"answer {i}")} for i in range(4)]
    text = json.dumps(records, indent=2)
    after_third_comma = text.rindex(",", 0, text.index('"r3"')) + 1
    cases = {
        text.index('"answer 3"') + 4: ["r0", "r1", "r2"],  # inside a string
        text.rindex("}"): ["r0", "r1", "r2"],  # the last record lacks its closing brace
        after_third_comma: ["r0", "r1", "r2"],  # right after a separator
        len(text) - 1: ["r0", "r1", "r2", "r3"],  # only the closing bracket is missing
    }
    for cut, expected in cases.items():
        path = tmp_path / "cut.json"
        path.write_text(text[:cut], encoding="utf-8")
        loaded = load_conversations(str(path))
        assert [c.sample_id for c in loaded.conversations] == expected, cut
        assert "cut off" in loaded.source


def test_malformed_json_array_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"messages": []},\n{"messages": [}\n]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.json:3"):
        load_conversations(str(path))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        f"{json.dumps({'messages': chat('a', 'b')})}\n\n" + '{"messages": [oops]}\n' + json.dumps({"messages": []}),
        encoding="utf-8",
    )
    with pytest.raises(DataError) as excinfo:
        load_conversations(str(path))
    message = str(excinfo.value)
    assert "bad.jsonl:3" in message and "fix or delete" in message


def test_parquet_and_custom_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": ["p0", "p1", "p2"],
            "dialog": [
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                [{"role": "user", "content": "only user"}],
                [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}],
            ],
        }
    )
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    loaded = load_conversations(str(path), column="dialog")
    assert [c.sample_id for c in loaded.conversations] == ["p0", "p2"]
    assert loaded.conversations[1].messages == tuple(chat("z", "w"))
    assert loaded.skipped == {"no_assistant_turn": 1}
    with pytest.raises(DataError, match=r"--column") as excinfo:
        load_conversations(str(path))
    assert "dialog" in str(excinfo.value) and "id" in str(excinfo.value)


def test_custom_column_jsonl_and_missing_column(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"turns": chat("a", "b")}, {"turns": chat("c", "d")}])
    assert len(load_conversations(str(path), column="turns").conversations) == 2
    with pytest.raises(DataError, match=r"columns seen: \['turns'\]"):
        load_conversations(str(path))
    with pytest.raises(DataError, match="column 'nope'"):
        load_conversations(str(path), column="nope")


def test_directory_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"id": "b", "messages": chat("1", "2")}])
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "messages": chat("3", "4")}])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [c.sample_id for c in load_conversations(str(tmp_path)).conversations] == ["a", "b"]


def test_max_samples_takes_first_valid(tmp_path):
    records = [{"messages": []}] + [{"id": f"v{i}", "messages": chat(str(i), str(i))} for i in range(5)]
    records.insert(3, {"messages": [{"role": "user", "content": "?"}]})
    loaded = load_conversations(str(write_jsonl(tmp_path / "m.jsonl", records)), max_samples=3)
    assert [(c.index, c.sample_id) for c in loaded.conversations] == [(0, "v0"), (1, "v1"), (2, "v2")]
    assert loaded.skipped == {"empty": 1, "no_assistant_turn": 1}


def test_missing_file_and_unknown_dataset(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="not found"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="not found"):
        load_conversations("data/missing/chats")

    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    with pytest.raises(DataError, match="could not be loaded as a Hugging Face dataset id") as excinfo:
        load_conversations("no-such-org/no-such-dataset")
    assert time.perf_counter() - started < 20
    assert "local" in str(excinfo.value)


def test_empty_and_all_skipped_sources(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_conversations(str(tmp_path / "empty.jsonl"))
    path = write_jsonl(tmp_path / "skipped.jsonl", [{"messages": [{"role": "user", "content": "?"}]}])
    with pytest.raises(DataError, match="no_assistant_turn: 1"):
        load_conversations(str(path))


def test_json_file_holding_json_lines_and_unsupported_type(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [{"messages": chat("a", "b")}, {"messages": chat("c", "d")}])
    assert len(load_conversations(str(path)).conversations) == 2
    path.write_text(path.read_text() + "{broken\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"lines\.json:3"):
        load_conversations(str(path))
    (tmp_path / "chats.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_conversations(str(tmp_path / "chats.csv"))
