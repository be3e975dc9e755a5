"""Chat records as users bring them, turned into messages: the one reading of a record for extract, generate
and eval.

A record holds its turns under `messages` (OpenAI form: [{role, content}]), `conversations` (ShareGPT form:
[{from, value}]) or `conversation`, or another column the user names. Each turn becomes
{"role": "system" | "user" | "assistant", "content": str}; roles are matched case-insensitively through
`ROLE_MAP`. Extraction and generation keep whole conversations (`normalise_turns`); evaluation takes the prompt, the
turns before the first assistant turn (`prompt_messages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Columns tried, in order, when the user names none.
KNOWN_COLUMNS = ("messages", "conversations", "conversation")
ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


def turns_column(record: Mapping[str, Any], column: str | None = None) -> str | None:
    """The key of `record` that holds its turns: `column` when given and present, else the first known one."""
    if column is not None:
        return column if column in record else None
    return next((name for name in KNOWN_COLUMNS if name in record), None)


def is_unicode(text: str) -> bool:
    """False for text holding lone surrogates (JSON allows "\\ud800"): tokenizers and zarr cannot encode it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalise_turn(turn: Any) -> dict[str, str] | str:
    """One turn as {"role", "content"}, or why it cannot be used: "malformed", "invalid_unicode", "bad_role"."""
    if not isinstance(turn, Mapping):
        return "malformed"
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if not isinstance(role, str) or not isinstance(content, str):
        return "malformed"
    if not is_unicode(content):
        return "invalid_unicode"
    mapped = ROLE_MAP.get(role.strip().lower())
    if mapped is None:
        return "bad_role"
    return {"role": mapped, "content": content}


def normalise_turns(turns: Any) -> tuple[dict[str, str], ...] | str:
    """A whole conversation's messages, or the reason to skip it (a turn's reason, "malformed", "empty",
    "no_assistant_turn")."""
    if not isinstance(turns, list):
        return "malformed"
    if not turns:
        return "empty"
    messages = []
    for turn in turns:
        message = normalise_turn(turn)
        if isinstance(message, str):
            return message
        messages.append(message)
    if not any(message["role"] == "assistant" for message in messages):
        return "no_assistant_turn"
    return tuple(messages)


def prompt_messages(record: Any) -> list[dict[str, str]] | None:
    """The prompt of a record: its turns before the first assistant turn (or a `prompt` string as one user turn);
    None when it has no user turn there or a turn cannot be read."""
    if not isinstance(record, Mapping):
        return None
    key = turns_column(record)
    if key is None or not isinstance(record[key], list):
        prompt = record.get("prompt")
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt.strip() else None
    messages: list[dict[str, str]] = []
    for turn in record[key]:
        message = normalise_turn(turn)
        if isinstance(message, str):
            return None
        if message["role"] == "assistant":
            break
        messages.append(message)
    return messages if any(m["role"] == "user" for m in messages) else None
