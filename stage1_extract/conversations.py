"""Load chat data and turn conversations into token ids plus an assistant-only loss mask.

Loading (`load_conversations`) accepts the embedded ShareGPT default, local JSON / JSONL / (gzipped) /
Parquet files or a directory of them, or a Hugging Face dataset id. Records in OpenAI form (`messages`:
[{role, content}]) or ShareGPT form (`conversations`: [{from, value}]) are normalised to
{"role": "system"|"user"|"assistant", "content": str}; unusable records are counted by skip reason.

Tokenization (`tokenize_conversation`) always goes through `tokenizer.apply_chat_template`, and finds each
assistant span by rendering the conversation up to that turn, so the mask is exact for any template that
renders prefixes stably.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash.shared.chat_records import KNOWN_COLUMNS, is_unicode, normalise_turns, turns_column
from dflash.shared.chat_rendering import chat_token_ids, template_fingerprint
from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger

__all__ = [
    "Conversation",
    "DataError",
    "LoadedConversations",
    "TokenizedSample",
    "chat_token_ids",
    "load_conversations",
    "template_fingerprint",
    "tokenize_conversation",
]

JSON_SUFFIXES = (".json", ".json.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = JSON_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
OVERLENGTH_MODES = ("truncate", "skip")
MAX_SKIP_EXAMPLES = 5
log = get_logger(__name__)
FINGERPRINT_VERSION = b"dflash-conversations-v1"

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_PARTIAL_TAIL = re.compile(r"[\w.+-]*[ \t\n\r]*")


class DataError(UserError, ValueError):
    """The chat data cannot be used; the message names the file / line / sample and what to do."""


@dataclass(frozen=True)
class Conversation:
    """One normalised conversation."""

    index: int
    sample_id: str
    messages: tuple[dict[str, str], ...]


@dataclass
class LoadedConversations:
    """The conversations kept from a source, plus what was skipped and why."""

    conversations: list[Conversation]
    skipped: dict[str, int]
    skipped_examples: dict[str, list[str]]
    fingerprint: str
    source: str


@dataclass(frozen=True)
class TokenizedSample:
    """Token ids of one conversation and the mask of tokens the drafter learns to predict."""

    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [S]
    truncated: bool


# --------------------------------------------------------------------------------------------------
# Sources: each yields (location, record) pairs; location ("file.jsonl:12") names a record in messages.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Source:
    name: str  # short name used in default sample ids
    description: str
    records: Iterator[tuple[str, Any]]
    notes: list[str] = field(default_factory=list)  # filled while reading (e.g. a recovered truncated array)


def _has_data_suffix(path: Path) -> bool:
    return path.name.lower().endswith(DATA_SUFFIXES)


def _looks_like_path(data: str) -> bool:
    """True for strings meant as a file path rather than a dataset id ("org/name" is an id)."""
    if data.lower().endswith(DATA_SUFFIXES) or "\\" in data:
        return True
    return data.startswith(("/", "./", "../", "~", ".")) or data.count("/") > 1


def _open_source(data: str | None, split: str) -> _Source:
    if data is None:
        from dflash.shared.embedded import sharegpt_json

        path = sharegpt_json()
        notes: list[str] = []
        return _Source("sharegpt", f"embedded ShareGPT ({path})", _iter_file(path, path.name, notes), notes)
    path = Path(data).expanduser()
    if path.is_dir():
        return _directory_source(path)
    if path.is_file():
        notes = []
        return _Source(path.name, f"file {path}", _iter_file(path, path.name, notes), notes)
    if _looks_like_path(data):
        raise DataError(f"data file not found: {data} (check the path; supported: {', '.join(DATA_SUFFIXES)})")
    return _hf_source(data, split)


def _directory_source(path: Path) -> _Source:
    visible = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = [p for p in visible if _has_data_suffix(p)]
    if not files:
        raise DataError(
            f"directory {path} holds no data files ({', '.join(DATA_SUFFIXES)}); pass a file or another directory"
        )
    notes: list[str] = []
    if others := [p for p in visible if not _has_data_suffix(p)]:
        named = ", ".join(_printable(str(p.relative_to(path))) for p in others[:MAX_SKIP_EXAMPLES])
        more = f" and {len(others) - MAX_SKIP_EXAMPLES} more" if len(others) > MAX_SKIP_EXAMPLES else ""
        notes.append(f"skipped {len(others)} file(s) that are not data files ({', '.join(DATA_SUFFIXES)}): "
                     f"{named}{more}")
        log.warning("data directory %s: %s", _printable(str(path)), notes[-1])

    def records() -> Iterator[tuple[str, Any]]:
        for file in files:
            yield from _iter_file(file, str(file.relative_to(path)), notes)

    return _Source(path.name, f"directory {path} ({len(files)} files)", records(), notes)


def _hf_source(dataset_id: str, split: str) -> _Source:
    try:
        import datasets

        dataset = datasets.load_dataset(dataset_id, split=split)
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise DataError(
            f"'{dataset_id}' is not a local file or directory, and could not be loaded as a Hugging Face dataset id "
            f"(split '{split}'): not found in the local cache or no network ({reason}). "
            "Pass a local .json/.jsonl/.parquet file or a directory of them instead."
        ) from exc

    def records() -> Iterator[tuple[str, Any]]:
        for row_number, row in enumerate(dataset):
            yield f"{dataset_id}[{split}] row {row_number}", row

    return _Source(dataset_id, f"Hugging Face dataset {dataset_id} (split {split})", records())


def _iter_file(path: Path, display: str, notes: list[str]) -> Iterator[tuple[str, Any]]:
    lower = path.name.lower()
    if lower.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(path, display)
    elif lower.endswith(JSON_SUFFIXES):
        yield from _iter_json(path, display, notes)
    elif lower.endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(path, display)
    else:
        raise DataError(f"{display}: unsupported file type; use one of {', '.join(DATA_SUFFIXES)}")


# The JSON readers are hand-written rather than `json.load` / `datasets`: errors must name the file and
# line, and a JSON array that was cut off mid-way (the embedded ShareGPT file is) must still yield all its
# complete records.


def _read_text(path: Path, display: str) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.lower().endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a corrupt gzip stream
        raise DataError(f"{display}: cannot read ({exc}); check the file is complete and not corrupt") from exc
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{display}:{line}: not valid UTF-8 ({exc.reason}); re-save the file as UTF-8") from exc


def _iter_jsonl(path: Path, display: str) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    line_number = 0
    try:
        with opener(path, "rt", encoding="utf-8-sig") as handle:
            for line_number, line in enumerate(handle, start=1):
                if line.strip():
                    yield f"{display}:{line_number}", _parse_json_line(line, display, line_number)
    except UnicodeDecodeError as exc:
        line = _first_non_utf8_line(path, opener) or line_number + 1
        raise DataError(f"{display}:{line}: not valid UTF-8 ({exc.reason}); re-save the file as UTF-8") from exc
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a corrupt gzip stream
        raise DataError(
            f"{display}:{line_number + 1}: cannot read ({exc}); check the file is complete, not corrupt and UTF-8"
        ) from exc


def _first_non_utf8_line(path: Path, opener: Any) -> int | None:
    """Number of the first line that is not UTF-8 (lines counted as the text reader counts them).

    The text reader decodes whole blocks ahead of the lines it returns, so its position cannot say.
    """
    number = 0
    try:
        with opener(path, "rb") as handle:
            for raw in handle:
                for part in raw.splitlines() or [b""]:  # bytes.splitlines: \n, \r\n and \r, as the text reader
                    number += 1
                    try:
                        part.decode("utf-8")
                    except UnicodeDecodeError:
                        return number
    except (OSError, EOFError, zlib.error):
        return None
    return None


def _parse_json_line(line: str, display: str, line_number: int) -> Any:
    try:
        # Without its line end: a line cut inside a string is "Unterminated string", not "Invalid control character".
        return json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        hint = " (the file may be cut off)" if not line.endswith("\n") else ""
        raise DataError(
            f"{display}:{line_number}: malformed JSON line{hint} ({json_error_text(exc)}); "
            "fix or delete that line (JSON Lines needs one complete JSON object per line)"
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise DataError(
            f"{display}:{line_number}: unreadable JSON line ({_json_limit(exc)}); fix or delete that line"
        ) from exc


def _unreadable_json(text: str, pos: int, display: str, exc: Exception) -> DataError:
    """The error for a JSON value at `pos` that the json module refuses without a position (see _json_limit)."""
    return DataError(f"{display}:{text.count(chr(10), 0, pos) + 1}: unreadable JSON ({_json_limit(exc)}); "
                     "fix the file there")


def _json_limit(exc: Exception) -> str:
    """The json module's errors without a position: a number over Python's digit limit, or too deep nesting."""
    if isinstance(exc, RecursionError):
        return "values nested too deeply"
    return str(exc).split(";")[0]  # "Exceeds the limit (4300 digits) for integer string conversion: ..."


def _iter_json(path: Path, display: str, notes: list[str]) -> Iterator[tuple[str, Any]]:
    text = _read_text(path, display)
    start = _WHITESPACE.match(text, 0).end()
    if start == len(text):
        raise DataError(f"{display}: the file is empty; it must hold a JSON array of records")
    if text[start] == "[":
        yield from _iter_json_array(text, start + 1, display, notes)
        return
    value, end = _decode_value(text, start, display)
    if _WHITESPACE.match(text, end).end() < len(text):
        # Several top-level values: the file is really JSON Lines.
        for line_number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                yield f"{display}:{line_number}", _parse_json_line(line + "\n", display, line_number)
        return
    yield from _records_in_object(value, display)


def _iter_json_array(text: str, pos: int, display: str, notes: list[str]) -> Iterator[tuple[str, Any]]:
    """Yield the elements of the array opened before `pos`; a cut-off array yields its complete elements."""
    decode = json.JSONDecoder().raw_decode
    size = len(text)
    line, counted = 1, 0
    while True:
        pos = _WHITESPACE.match(text, pos).end()
        if pos < size and text[pos] == "]":
            _require_end(text, pos + 1, display)
            return
        try:
            element, end = decode(text, pos)
        except json.JSONDecodeError as exc:
            if _cut_off(text, exc):
                notes.append(f"{display} is cut off at line {exc.lineno}: kept the complete records before it")
                return
            raise DataError(
                f"{display}:{exc.lineno}: invalid JSON ({json_error_text(exc)}); fix the file there"
            ) from exc
        except (ValueError, RecursionError) as exc:
            raise _unreadable_json(text, pos, display, exc) from exc
        line += text.count("\n", counted, pos)
        counted = pos
        yield f"{display}:{line}", element
        pos = _WHITESPACE.match(text, end).end()
        if pos == size:
            notes.append(f"{display} is cut off after its last complete record")
            return
        if text[pos] == ",":
            pos += 1
        elif text[pos] != "]":
            lineno = text.count("\n", 0, pos) + 1
            raise DataError(f"{display}:{lineno}: expected ',' or ']' between array elements; fix the file there")


def _cut_off(text: str, exc: json.JSONDecodeError) -> bool:
    """True when a decode error is the end of a truncated file rather than bad JSON in the middle."""
    if exc.msg.startswith("Unterminated string"):  # no closing quote before the end of the file
        return True
    return _PARTIAL_TAIL.fullmatch(text, exc.pos, len(text)) is not None  # at the end, or inside `tru`, `12.`


def _decode_value(text: str, pos: int, display: str) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{display}:{exc.lineno}: invalid JSON ({json_error_text(exc)}); fix the file there"
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise _unreadable_json(text, pos, display, exc) from exc


def _require_end(text: str, pos: int, display: str) -> None:
    pos = _WHITESPACE.match(text, pos).end()
    if pos < len(text):
        lineno = text.count("\n", 0, pos) + 1
        raise DataError(f"{display}:{lineno}: unexpected content after the JSON array; remove it")


def _records_in_object(value: Any, display: str) -> Iterator[tuple[str, Any]]:
    """A top-level object is either one record or a wrapper holding the record list under one key."""
    if not isinstance(value, dict):
        raise DataError(
            f"{display}: top-level JSON must be an array of records or an object, not {type(value).__name__}"
        )
    if any(key in value for key in KNOWN_COLUMNS):
        yield f"{display}:1", value
        return
    lists = [key for key, item in value.items() if isinstance(item, list) and item and isinstance(item[0], dict)]
    if len(lists) != 1:
        raise DataError(
            f"{display}: the top-level object has keys {sorted(value)[:20]}; expected a single key holding the list "
            "of records (or use a JSON array / JSON Lines file)"
        )
    for number, record in enumerate(value[lists[0]]):
        yield f"{display}:{lists[0]}[{number}]", record


def _iter_parquet(path: Path, display: str) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{display} row {row}", record
                row += 1
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{display}: cannot read Parquet near row {row} ({exc}); check the file is complete") from exc


# --------------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------------


def _printable(text: str) -> str:
    """`text` with lone surrogates (e.g. from a file name that is not UTF-8) written as \\udcff escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _record_id(record: Mapping[str, Any]) -> str | None:
    value = record.get("id")
    if value is None or isinstance(value, (dict, list)):
        return None
    return str(value)


def _fingerprint(conversations: Iterable[Conversation]) -> str:
    """sha256 over ids and messages, with length-prefixed fields so the framing is unambiguous."""
    digest = hashlib.sha256(FINGERPRINT_VERSION)
    count = 0

    def put(text: str) -> None:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    for conversation in conversations:
        count += 1
        put(conversation.sample_id)
        digest.update(len(conversation.messages).to_bytes(8, "little"))
        for message in conversation.messages:
            put(message["role"])
            put(message["content"])
    digest.update(count.to_bytes(8, "little"))
    return digest.hexdigest()


def load_conversations(
    data: str | None, *, column: str | None = None, split: str = "train", max_samples: int | None = None
) -> LoadedConversations:
    """Load and normalise conversations; `max_samples` keeps the first N valid ones."""
    if max_samples is not None and max_samples < 1:
        raise DataError(f"--max-samples must be at least 1 (got {max_samples})")
    source = _open_source(data, split)
    conversations: list[Conversation] = []
    skipped: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    columns_seen: set[str] = set()
    records = matched = 0

    def skip(reason: str, name: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1
        if len(examples.setdefault(reason, [])) < MAX_SKIP_EXAMPLES:
            examples[reason].append(name)

    for location, record in source.records:
        records += 1
        if not isinstance(record, dict):
            skip("malformed", location)
            continue
        record_id = _record_id(record)
        name = _printable(record_id or location)
        key = turns_column(record, column)
        if key is None:
            if len(columns_seen) < 100:
                columns_seen.update(str(k) for k in record)
            skip("missing_column", name)
            continue
        matched += 1
        if record_id is not None and not is_unicode(record_id):
            skip("invalid_unicode", name)
            continue
        messages = normalise_turns(record[key])
        if isinstance(messages, str):
            skip(messages, name)
            continue
        index = len(conversations)
        conversations.append(Conversation(index, record_id or f"{_printable(source.name)}:{index}", messages))
        if max_samples is not None and len(conversations) == max_samples:
            break

    description = _printable("; ".join([source.description, *source.notes]))
    _check_usable(description, records, matched, column, columns_seen, conversations, skipped)
    return LoadedConversations(conversations, skipped, examples, _fingerprint(conversations), description)


def _check_usable(
    description: str,
    records: int,
    matched: int,
    column: str | None,
    columns_seen: set[str],
    conversations: list[Conversation],
    skipped: dict[str, int],
) -> None:
    if records == 0:
        raise DataError(f"{description}: no records found; check the file holds chat records")
    if matched == 0:
        wanted = f"column '{column}'" if column else f"a conversation column ({', '.join(KNOWN_COLUMNS)})"
        raise DataError(
            f"{description}: no record has {wanted}; columns seen: {sorted(columns_seen)}. "
            "Pass --column NAME to name the column holding the chat turns."
        )
    if not conversations:
        counts = ", ".join(f"{reason}: {count}" for reason, count in sorted(skipped.items()))
        raise DataError(f"{description}: every record was skipped ({counts}); no usable conversation")


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def _starts_with(sequence: list[int], prefix: list[int]) -> bool:
    return len(sequence) >= len(prefix) and sequence[: len(prefix)] == prefix


def _span_end(ids: list[int], start: int, end: int, stops: frozenset[int]) -> int:
    """End (exclusive) of the learned part of ids[start:end]: through the first stop token, else all of it."""
    for position in range(start, end):
        if ids[position] in stops:
            return position + 1
    return end


def _stop_ids(tokenizer: Any, stop_token_ids: Sequence[int]) -> frozenset[int]:
    if stop_token_ids:
        return frozenset(int(token) for token in stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([int(eos)])


def _assistant_mask(
    tokenizer: Any, messages: list[dict[str, str]], full: list[int], stops: frozenset[int], limit: int
) -> np.ndarray | str:
    """Mask of assistant spans in `full`, or "template_not_prefix_stable".

    An assistant turn that opens the conversation has no prompt to render before it (templates reject an
    empty chat), so it stays unmasked context. Spans starting at or after `limit` are not computed.
    """
    mask = np.zeros(len(full), dtype=np.uint8)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prefix = chat_token_ids(tokenizer, messages[:i], add_generation_prompt=True)
        if len(prefix) >= limit:
            break
        upto = chat_token_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (_starts_with(upto, prefix) and _starts_with(full, upto)):
            return "template_not_prefix_stable"
        mask[len(prefix) : _span_end(full, len(prefix), len(upto), stops)] = 1
    return mask


def tokenize_conversation(
    tokenizer: Any,
    conversation: Conversation,
    *,
    max_length: int,
    overlength: str = "truncate",
    stop_token_ids: Sequence[int] = (),
) -> TokenizedSample | str:
    """Token ids + assistant-only loss mask, or a skip reason.

    Skip reasons: "too_long" (overlength="skip"), "no_assistant_tokens", "template_not_prefix_stable",
    "template_error" (the chat template raised for this conversation, e.g. roles must alternate).
    """
    if overlength not in OVERLENGTH_MODES:
        raise ValueError(f"overlength must be one of {OVERLENGTH_MODES}, got {overlength!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    import jinja2

    messages = [dict(message) for message in conversation.messages]
    try:
        full = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
        if len(full) > max_length and overlength == "skip":
            return "too_long"
        mask = _assistant_mask(tokenizer, messages, full, _stop_ids(tokenizer, stop_token_ids), max_length)
    except jinja2.TemplateError:
        return "template_error"
    if isinstance(mask, str):
        return mask
    truncated = len(full) > max_length
    ids = np.asarray(full[:max_length], dtype=np.int32)
    mask = mask[:max_length]
    if int(mask.sum()) < 2:
        return "no_assistant_tokens"
    return TokenizedSample(conversation.index, conversation.sample_id, ids, mask, truncated)


def json_error_text(exc: json.JSONDecodeError) -> str:
    """'<what> at column N' (json's own messages may end in 'at' already: 'Unterminated string starting at')."""
    return f"{exc.msg} column {exc.colno}" if exc.msg.endswith(" at") else f"{exc.msg} at column {exc.colno}"
