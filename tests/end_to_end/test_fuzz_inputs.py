"""Fuzzing what users hand to `dflash extract`: chat data files and option values.

Every input must end in success or a clear error that names the input (exit code 2 from the CLI, no Python
traceback from inside a library), and a failing run must leave a complete cache in the same directory intact.

Most examples run in-process against the loader (`load_conversations`), the tokenization a worker applies to
what the loader kept (`tokenize_conversation`), and the click command with the extraction itself stubbed out.
A handful of representative files go through the real `dflash extract` CLI: the supervisor validates the data
before any worker loads the model, so a refused file costs only process start and tokenizer load (~3.5 s).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from dflash.shared.cli import dflash
from dflash.stage1_extract.conversations import DataError, LoadedConversations, load_conversations, tokenize_conversation
from tests.cache_compare import assert_same_cache
from tests.conftest import make_conversations, run_dflash

FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
ROLES = ("system", "user", "assistant")
TOKENIZE_SKIPS = {"too_long", "no_assistant_tokens", "template_not_prefix_stable", "template_error"}

# ------------------------------------------------------------------------------------------------ strategies

ODD_TEXT = [
    "\x00", "\ud800", "\udfff", "\ud83d", "\u202e", "\u200f", "\u061c", "\u2066", "\ufeff", "\u2028", "\u2029",
    "\r", "\r\n", "\x1e", "\x7f", "<|im_end|>", "<|im_start|>assistant\n", "\U0001f600", "é", "中文", "עברית",
    "مرحبا", "\\u0000", "\"", "}\n{",
]
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=24),  # any code point, lone surrogates included
    st.lists(st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=6)), max_size=6).map("".join),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=6
)
roles = st.one_of(
    st.sampled_from(["user", "assistant", "system", "human", "gpt", " USER ", "Assistant", "tool", "function", "",
                     "bot", "assistant\x00"]),
    texts, json_values,
)
turn = st.one_of(
    st.fixed_dictionaries({}, optional={"role": roles, "content": st.one_of(texts, json_values), "from": roles,
                                        "value": st.one_of(texts, json_values)}),
    json_values,
)
good_turns = st.builds(  # [system], then user / assistant pairs
    lambda system, pairs: [{"role": "system", "content": system}] * (system is not None)
    + [m for q, a in pairs for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})],
    st.none() | texts, st.lists(st.tuples(texts, texts), min_size=1, max_size=2),
)
any_role_turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts}), max_size=4)
turn_lists = st.one_of(good_turns, any_role_turns, st.lists(turn, max_size=4), json_values)
good_record = st.fixed_dictionaries({"messages": good_turns}, optional={"id": st.one_of(st.text(max_size=8), scalars)})
record = st.one_of(
    good_record,
    good_record,  # drawn more often, so that many examples load and reach the tokenizer
    st.fixed_dictionaries({}, optional={"id": json_values, "messages": turn_lists, "conversations": turn_lists,
                                        "conversation": turn_lists, "other": json_values}),
    json_values,
)


def valid_records(count: int) -> list[dict]:
    return make_conversations(count)


# --------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the files of hypothesis examples (a function-scoped tmp_path would be shared by them anyway)."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer and stop tokens an extraction worker uses for the embedded target."""
    from dflash.shared.target_loading import load_tokenizer, resolve_target, stop_token_ids

    target = resolve_target(None)
    tok = load_tokenizer(target.load_path)
    return tok, stop_token_ids(target.load_path, tok)


def write(path: Path, data: bytes) -> Path:
    for old in path.parent.glob("input*"):
        old.unlink()
    path.write_bytes(data)
    return path


def jsonl_bytes(records: list, ensure_ascii: bool = True) -> bytes:
    # ensure_ascii=False with a lone surrogate gives bytes that are not UTF-8: a file a buggy tool could write
    return b"".join(json.dumps(r, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass") + b"\n" for r in records)


def load_or_error(path: Path, **kwargs) -> LoadedConversations | DataError:
    """The loader's result, or its DataError; any other exception fails the test (with its traceback)."""
    try:
        return load_conversations(str(path), **kwargs)
    except DataError as error:
        return error


def check_error(error: DataError, path: Path) -> str:
    message = str(error)
    assert path.name in message, f"the error does not name the input file: {message}"
    assert "Traceback" not in message and len(message) < 2000, message
    return message


def check_loaded(loaded: LoadedConversations, tok=None, max_length: int = 64) -> list:
    """What the loader keeps is usable: valid roles, UTF-8 text, an assistant turn; tokenizing it never raises."""
    assert loaded.conversations
    assert [c.index for c in loaded.conversations] == list(range(len(loaded.conversations)))
    loaded.source.encode("utf-8")  # logged and written to the manifest
    for conversation in loaded.conversations:
        conversation.sample_id.encode("utf-8")  # stored in the zarr store
        assert any(m["role"] == "assistant" for m in conversation.messages)
        for message in conversation.messages:
            assert message["role"] in ROLES and isinstance(message["content"], str)
            message["content"].encode("utf-8")
    results = []
    if tok is not None:
        tokenizer, stops = tok
        for conversation in loaded.conversations[:2]:
            result = tokenize_conversation(tokenizer, conversation, max_length=max_length, stop_token_ids=stops)
            if isinstance(result, str):
                assert result in TOKENIZE_SKIPS, result
            else:
                assert len(result.input_ids) <= max_length and int(result.loss_mask.sum()) >= 2
            results.append(result)
    return results


# ------------------------------------------------------------------------------------ the loader, in-process


@settings(FUZZ, max_examples=300)
@given(records=st.lists(record, max_size=6), form=st.sampled_from(["jsonl", "jsonl.gz", "json", "json-wrapper"]),
       ensure_ascii=st.booleans(), column=st.sampled_from([None, None, None, "conversation", "other"]),
       max_samples=st.sampled_from([None, None, 1, 2]))
def test_any_records_load_or_fail_clearly(scratch: Path, tokenizer, records: list, form: str, ensure_ascii: bool,
                                          column: str | None, max_samples: int | None) -> None:
    if form.startswith("jsonl"):
        data = jsonl_bytes(records, ensure_ascii)
        data = gzip.compress(data) if form.endswith(".gz") else data
        path = write(scratch / f"input.{form}", data)
    else:
        value = records if form == "json" else {"data": records}
        text = json.dumps(value, ensure_ascii=ensure_ascii)
        path = write(scratch / "input.json", text.encode("utf-8", "surrogatepass"))
    result = load_or_error(path, column=column, max_samples=max_samples)
    event(f"error: {str(result).split('(')[0][-40:]}" if isinstance(result, DataError) else "loaded")
    if isinstance(result, DataError):
        check_error(result, path)
        return
    for tokenized in check_loaded(result, tokenizer):
        event(f"tokenized: {tokenized if isinstance(tokenized, str) else 'sample'}")
    kept, skipped = len(result.conversations), sum(result.skipped.values())
    if max_samples is None:
        assert kept + skipped == len(records), (result.skipped, len(records))
    else:
        assert kept <= max_samples


@FUZZ
@given(data=st.binary(max_size=3000), suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet"]),
       packing=st.sampled_from(["raw", "gzip", "gzip-damaged"]), position=st.integers(0, 10**6))
@example(data=b"\xff\xfe{\x00", suffix=".jsonl", packing="raw", position=0)
@example(data=b"PAR1\x00\x00PAR1", suffix=".parquet", packing="raw", position=0)
@example(data=b'{"messages": []}\n' * 40, suffix=".jsonl.gz", packing="gzip-damaged", position=25)
def test_binary_garbage_fails_clearly(scratch: Path, data: bytes, suffix: str, packing: str, position: int) -> None:
    if packing != "raw":
        data = gzip.compress(data)
        if packing == "gzip-damaged":
            i = position % len(data)
            data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
    path = write(scratch / f"input{suffix}", data)
    result = load_or_error(path)
    if isinstance(result, DataError):
        check_error(result, path)
    else:
        check_loaded(result)


@FUZZ
@given(form=st.sampled_from(["jsonl", "json"]), cut=st.floats(0, 1), indent=st.sampled_from([None, 2]))
def test_truncated_file_keeps_a_prefix_or_names_the_line(scratch: Path, form: str, cut: float,
                                                         indent: int | None) -> None:
    records = valid_records(6)
    if form == "jsonl":
        data = jsonl_bytes(records)
    else:
        data = json.dumps(records, indent=indent, ensure_ascii=False).encode()
    data = data[: int(len(data) * cut)]
    path = write(scratch / f"input.{form}", data)
    result = load_or_error(path)
    if isinstance(result, DataError):
        message = check_error(result, path)
        if form == "jsonl" and "malformed JSON line" in message:  # the last line, cut in the middle
            last_line = data.count(b"\n") + 1
            assert f"{path.name}:{last_line}:" in message and "cut off" in message, message
        else:  # nothing complete is left
            assert "no records found" in message or "the file is empty" in message, message
        return
    ids = [c.sample_id for c in result.conversations]
    assert ids == [r["id"] for r in records[: len(ids)]], "a truncated file must yield a prefix of its records"
    if form == "json" and len(ids) < len(records):
        assert "cut off" in result.source


@FUZZ
@given(form=st.sampled_from(["jsonl", "json"]), position=st.floats(0, 1), junk=st.binary(min_size=1, max_size=40),
       replace=st.integers(0, 30))
@example(form="jsonl", position=0.5, junk=b"\x00", replace=0)
@example(form="json", position=0.5, junk=b"]", replace=0)
def test_damaged_middle_fails_clearly_or_loads(scratch: Path, form: str, position: float, junk: bytes,
                                               replace: int) -> None:
    records = valid_records(5)
    data = jsonl_bytes(records) if form == "jsonl" else json.dumps(records, indent=1).encode()
    i = int(len(data) * position)
    data = data[:i] + junk + data[i + replace:]
    path = write(scratch / f"input.{form}", data)
    result = load_or_error(path)
    if isinstance(result, DataError):
        message = check_error(result, path)
        named_line = re.search(re.escape(path.name) + r":(\d+):", message)
        if named_line:
            assert 1 <= int(named_line.group(1)) <= data.count(b"\n") + 1, message
    else:
        check_loaded(result)


@FUZZ
@given(line=st.integers(1, 5), where=st.floats(0, 1),
       bad=st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]),  # \xed\xa0\x80: an encoded surrogate
       form=st.sampled_from(["jsonl", "jsonl.gz", "json"]))
def test_invalid_utf8_names_its_line(scratch: Path, line: int, where: float, bad: bytes, form: str) -> None:
    lines = (jsonl_bytes(valid_records(5)) if form.startswith("jsonl") else
             json.dumps(valid_records(5), indent=None, separators=(",\n", ": ")).encode()).split(b"\n")
    assume(line <= len(lines))
    i = int(len(lines[line - 1]) * where)
    lines[line - 1] = lines[line - 1][:i] + bad + lines[line - 1][i:]
    data = b"\n".join(lines)
    path = write(scratch / f"input.{form}", gzip.compress(data) if form.endswith(".gz") else data)
    with pytest.raises(DataError) as error:
        load_conversations(str(path))
    assert f"{path.name}:{line}: not valid UTF-8" in check_error(error.value, path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet"])
@pytest.mark.parametrize("content", [b"", b"\n\n", b" \t\r\n", b"\xef\xbb\xbf"])
def test_empty_files_are_named(tmp_path: Path, suffix: str, content: bytes) -> None:
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(gzip.compress(content) if suffix.endswith(".gz") and content else content)
    with pytest.raises(DataError) as error:
        load_conversations(str(path))
    check_error(error.value, path)


def damaged_gzip(records: list) -> bytes:
    """A gzip file damaged inside its deflate stream (gzip raises zlib.error, not OSError, reading it)."""
    data = gzip.compress(json.dumps(records).encode() * 20)
    return data[:20] + bytes([data[20] ^ 0xFF]) + data[21:]


BAD_FILES = {
    # name: (bytes, text expected in the error)
    "array.jsonl": (json.dumps(valid_records(2), indent=2).encode(), "array.jsonl:1:"),
    "oneline-array.jsonl": (json.dumps(valid_records(2)).encode() + b"\n", "oneline-array.jsonl"),
    "numbers.json": (b"[1, 2, 3]", "numbers.json"),
    "null.json": (b"null", "not NoneType"),
    "string.json": (b'"messages"', "not str"),
    "nul.jsonl": (jsonl_bytes(valid_records(1)) + b"\x00\x00\n", "nul.jsonl:2:"),
    "crlf-garbage.jsonl": (jsonl_bytes(valid_records(1))[:-1] + b"\r\n{oops\r\n", "crlf-garbage.jsonl:2:"),
    "utf16.jsonl": (jsonl_bytes(valid_records(1)).decode().encode("utf-16"), "utf16.jsonl:1:"),
    "latin1.json": (json.dumps([{"messages": [{"role": "user", "content": "caf\u00e9"}]}], ensure_ascii=False)
                    .encode("latin-1"), "latin1.json:1:"),
    # the json module's own limits: raised as ValueError / RecursionError, not JSONDecodeError
    "bigint.jsonl": (b'{"id": ' + b"9" * 5000 + b', "messages": []}\n', "bigint.jsonl:1:"),
    "bigint.json": (b'[{"id": 1}, {"id": ' + b"9" * 5000 + b"}]", "bigint.json:1:"),
    "deep.jsonl": (jsonl_bytes(valid_records(1)) + b"[" * 100_000 + b"]" * 100_000 + b"\n", "deep.jsonl:2:"),
    "deep.json": (b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deep.json:1:"),
    "deep-element.json": (b"[\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n]", "deep-element.json:2:"),
    "damaged.jsonl.gz": (damaged_gzip(valid_records(3)), "damaged.jsonl.gz:1:"),
    "damaged.json.gz": (damaged_gzip(valid_records(3)), "damaged.json.gz: cannot read"),
    "surrogates-only.jsonl": (jsonl_bytes([{"id": "\ud800", "messages": [{"role": "user", "content": "a"},
                                                                         {"role": "assistant", "content": "b"}]},
                                           {"messages": [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": "\udfff"}]}]),
                              "invalid_unicode: 2"),
    "wrong-types.jsonl": (jsonl_bytes([{"messages": 5}, {"messages": None}, {"messages": "hi"},
                                       {"messages": [{"role": 1, "content": "x"},
                                                     {"role": "assistant", "content": []}]},
                                       {"messages": [["user", "hi"], ["assistant", "yo"]]}]), "malformed: 5"),
    "wrong-roles.jsonl": (jsonl_bytes([{"messages": [{"role": "tool", "content": "x"}]},
                                       {"conversations": [{"from": "narrator", "value": "x"}]}]), "bad_role: 2"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_name_file_and_line(tmp_path: Path, name: str) -> None:
    data, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataError) as error:
        load_conversations(str(path))
    message = check_error(error.value, path)
    assert expected in message, message


def test_huge_lines(tmp_path: Path) -> None:
    big = "word " * 1_000_000  # a 5 MB message
    good = {"id": "big", "messages": [{"role": "user", "content": big}, {"role": "assistant", "content": big}]}
    path = tmp_path / "huge.jsonl"
    path.write_bytes(jsonl_bytes([good]) + b"{" + b"x" * 5_000_000 + b"\n")
    with pytest.raises(DataError) as error:
        load_conversations(str(path))
    assert "huge.jsonl:2:" in check_error(error.value, path)  # the message does not quote the 5 MB line
    path.write_bytes(jsonl_bytes([good]))
    (conversation,) = load_conversations(str(path)).conversations
    assert conversation.messages[1]["content"] == big


def test_odd_but_valid_text_is_kept_and_bad_unicode_skipped(tmp_path: Path, tokenizer) -> None:
    odd = "".join(c for c in ODD_TEXT if not 0xD800 <= ord(c[0]) <= 0xDFFF or len(c) > 1)
    records = [
        {"id": "odd", "messages": [{"role": "user", "content": odd}, {"role": "assistant", "content": odd + " ok"}]},
        {"id": "rtl", "conversations": [{"from": "human", "value": "\u202eabc"}, {"from": "gpt", "value": "שלום"}]},
        {"id": "surrogate", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\ud800"}]},
        {"id": "\udc80", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "odd.jsonl"
    path.write_bytes(jsonl_bytes(records))
    loaded = load_conversations(str(path))
    assert [c.sample_id for c in loaded.conversations] == ["odd", "rtl"]
    assert loaded.skipped == {"invalid_unicode": 2}
    samples = check_loaded(loaded, tokenizer, max_length=512)
    assert [s.sample_id for s in samples] == ["odd", "rtl"]


def test_file_name_that_is_not_utf8_gives_printable_ids(tmp_path: Path) -> None:
    records = [{"messages": r["messages"]} for r in valid_records(2)]  # no ids: defaults come from the file name
    path = Path(os.fsdecode(bytes(tmp_path) + b"/\xffdata.jsonl"))
    path.write_bytes(jsonl_bytes(records))
    loaded = load_conversations(str(path))
    assert [c.sample_id for c in loaded.conversations] == ["\\udcffdata.jsonl:0", "\\udcffdata.jsonl:1"]
    check_loaded(loaded)


def test_directory_names_the_bad_file(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(valid_records(2)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(DataError, match=r"sub/b\.jsonl:1:"):
        load_conversations(str(tmp_path))


# ----------------------------------------------------------------------------------------- options, in-process

NUMERIC_OPTIONS = {  # option: (ExtractOptions field, smallest allowed value, largest allowed value)
    "--max-length": ("max_length", 8, None),
    "--max-samples": ("max_samples", 1, None),
    "--workers": ("workers", 1, 1024),
    "--batch-tokens": ("batch_tokens", 16, None),
    "--shards": ("shards", 1, None),
    "--draft-layers": ("draft_layers", 1, None),
}
ODD_VALUES = ["", " ", "-1", "0", "7", "8", "1.5", "1e3", "0x10", "nan", "inf", "-inf", "\uff11\uff12", "\u0663",
              "1_000", "+8", " 9 ", "--", "-", "\u221e", "\x00", "\ud800", "9" * 40, "-" + "9" * 40, "9" * 5000,
              "12abc", "None", "true"]
option_values = st.one_of(st.integers(-(10**40), 10**40).map(str), st.sampled_from(ODD_VALUES), st.text(max_size=10))


@pytest.fixture(scope="module")
def stub_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("stub") / "cache")


def invoke_extract(*args: str):
    """`dflash extract ARGS` through click, with the extraction replaced by a stub that records its options."""
    with mock.patch("dflash.stage1_extract.supervisor.run_extract", return_value=0) as stub:
        result = CliRunner().invoke(dflash, ["extract", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    options = stub.call_args.args[0] if stub.called else None
    return result, options


def python_int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


@FUZZ
@given(option=st.sampled_from(sorted(NUMERIC_OPTIONS)), value=option_values)
def test_numeric_options_accept_only_integers_in_range(stub_out: str, option: str, value: str) -> None:
    field, smallest, largest = NUMERIC_OPTIONS[option]
    result, options = invoke_extract("--out", stub_out, f"{option}={value}")
    number = python_int(value)
    if number is not None and number >= smallest and (largest is None or number <= largest):
        assert result.exit_code == 0 and getattr(options, field) == number, result.output
    else:
        assert result.exit_code == 2 and options is None, result.output
        assert f"Invalid value for '{option}'" in result.output, result.output


@FUZZ
@given(value=st.one_of(st.text(alphabet="0123456789,- x.", max_size=12), st.text(max_size=8)))
@example(value="1,,2")
@example(value="1.5")
@example(value="-1")
def test_target_layers_option(stub_out: str, value: str) -> None:
    result, options = invoke_extract("--out", stub_out, f"--target-layers={value}")
    try:
        expected = [int(x) for x in value.split(",") if x.strip()] if value else None
    except ValueError:
        assert result.exit_code == 2 and "Invalid value for '--target-layers'" in result.output, result.output
        return
    assert result.exit_code == 0 and options.target_layers == expected, result.output


@FUZZ
@given(text=st.text(alphabet="0123456789-, ab", max_size=10), num_shards=st.integers(1, 12))
@example(text="5-2", num_shards=8)
@example(text="-1", num_shards=3)
def test_only_shards_ranges_parse_or_are_refused(text: str, num_shards: int) -> None:
    from dflash.stage1_extract.supervisor import ExtractRefused, parse_shard_ranges

    try:
        chosen = parse_shard_ranges(text, num_shards)
    except ExtractRefused as error:
        assert "--only-shards" in str(error)
        return
    assert chosen == sorted(set(chosen)) and all(0 <= i < num_shards for i in chosen)


@pytest.mark.parametrize("value", ["5-2", "a-b", "-1", ",", "3-", "1--2"])
def test_bad_only_shards_is_a_usage_error(stub_out: str, value: str) -> None:
    result, options = invoke_extract("--out", stub_out, f"--only-shards={value}")
    assert result.exit_code == 2 and options is None, result.output
    assert "Invalid value for '--only-shards'" in result.output


@pytest.mark.parametrize("value", ["5-2", ","])
def test_only_shards_selecting_nothing_is_refused(value: str) -> None:
    from dflash.stage1_extract.supervisor import ExtractRefused, parse_shard_ranges

    with pytest.raises(ExtractRefused, match="--only-shards"):
        parse_shard_ranges(value, 8)


def test_too_many_draft_layers_names_the_option() -> None:
    from dflash.shared.errors import UserError
    from dflash.shared.target_layers import default_layer_ids, validate_layer_ids

    with pytest.raises(UserError, match="--draft-layers"):
        validate_layer_ids(default_layer_ids(30, 100), 30)


# ---------------------------------------------------------------------------------------- the real CLI, a few

CLI_ARGS = ("--max-length", "96", "--shards", "2", "--workers", "1", "--batch-tokens", "256")


@pytest.fixture(scope="module")
def odd_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A complete cache extracted by the real CLI from a file with a non-UTF-8 name and odd but valid text.

    Records with lone surrogates and wrong roles are skipped, the rest extracted: the run must succeed.
    """
    folder = tmp_path_factory.mktemp("odd")
    odd = "NUL\x00 RTL\u202eabc\u202c \u2066isolate\u2069 BOM\ufeff LS\u2028 <|im_end|> <|im_start|>user \U0001f600"
    records = [
        {"messages": [{"role": "user", "content": "Hi! " + odd}, {"role": "assistant", "content": "Hello. " + odd}]},
        {"conversations": [{"from": "human", "value": "مرحبا"},
                           {"from": "gpt", "value": "שלום, " + "word " * 60}]},
        {"messages": [{"role": "user", "content": "lone \ud800"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"id": 7, "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]},
    ]
    data = Path(os.fsdecode(bytes(folder) + b"/odd-\xff.jsonl"))
    data.write_bytes(jsonl_bytes(records))
    out = folder / "cache"
    result = run_dflash("extract", "--data", str(data), "--out", str(out), *CLI_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    for text in ("Traceback", "Logging error"):
        assert text not in result.stderr, result.stderr[-3000:]
    assert "invalid_unicode" in result.stderr and "bad_role" in result.stderr
    return data, out


def inspect_verify(cache: Path) -> None:
    result = CliRunner().invoke(dflash, ["inspect", "--cache", str(cache), "--verify"])
    assert result.exit_code == 0 and "verify: OK" in result.output, result.output


def test_cli_extracts_odd_valid_data(odd_cache: tuple[Path, Path]) -> None:
    _, cache = odd_cache
    inspect_verify(cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert sum(s["samples"] for s in manifest["shards"].values()) == 3
    assert manifest["data"]["skipped_on_load"] == {"invalid_unicode": 1, "bad_role": 1}
    assert "\\udcff" in manifest["data"]["source"]


CLI_BAD_FILES = {
    "cut.jsonl": (jsonl_bytes(valid_records(3))[:-30], "cut.jsonl:3:"),
    "garbage.jsonl": (jsonl_bytes(valid_records(2)) + b"\xff\xfe\x00\x89PNG\r\n" + bytes(range(256)),
                      "garbage.jsonl:3:"),
    "deep.json": (b"[" * 100_000, "deep.json:1:"),
    "damaged.jsonl.gz": (damaged_gzip(valid_records(3)), "damaged.jsonl.gz:1:"),
    "array.jsonl": (json.dumps(valid_records(2), indent=2).encode(), "array.jsonl:1:"),
    "empty.jsonl": (b"\n", "no records"),
}


@pytest.mark.parametrize("name", list(CLI_BAD_FILES))
def test_cli_bad_data_exits_2_and_leaves_the_cache_intact(odd_cache: tuple[Path, Path], tmp_path: Path,
                                                         name: str) -> None:
    data, expected = CLI_BAD_FILES[name]
    bad = tmp_path / name
    bad.write_bytes(data)
    cache = tmp_path / "cache"
    shutil.copytree(odd_cache[1], cache)
    manifest = (cache / "manifest.json").read_bytes()
    result = run_dflash("extract", "--data", str(bad), "--out", str(cache), *CLI_ARGS)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("dflash: error:")]
    assert len(error_lines) == 1 and expected in error_lines[0] and name in error_lines[0], result.stderr
    assert (cache / "manifest.json").read_bytes() == manifest
    assert_same_cache(odd_cache[1], cache)
    inspect_verify(cache)
