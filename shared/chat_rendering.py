"""How chat messages become a prompt's token ids, and the record of it: one rendering for extract, generate and eval.

`chat_token_ids` renders messages through the tokenizer's chat template (control-token text inside a message stays
plain text where transformers can do that). `template_fingerprint` is the cache identity's `tokenizer_hash`.
`rendering_record` describes how a tokenizer renders prompts: which chat template (its sha256), the template
arguments (`chat_template_kwargs`, e.g. `enable_thinking`), whether thinking is on, the special and stop tokens, the
vocabulary, and a probe prompt rendered in full. Extract writes it into the cache's manifest (`cache_format`
`RENDERING_KEY`), the export carries it, and `dflash eval` compares it with its own (`stage2_train/parity.py`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

# The conversation whose rendered prompt the record shows (how the template wraps a user turn, adds a default system
# prompt, opens the assistant turn, and what a thinking switch changes there).
PROBE_MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "Hello!"},)
# Template arguments that switch a model's thinking (reasoning) mode: Qwen3, GLM, SmolLM3 (enable_thinking),
# DeepSeek-V3.1 (thinking).
THINKING_SWITCHES = ("enable_thinking", "thinking")


@functools.cache
def _accepts_sanitize(tokenizer_type: type) -> bool:
    """Whether `apply_chat_template` can encode control tokens inside message text as plain text (5.x)."""
    try:
        return "sanitize_control_tokens" in inspect.signature(tokenizer_type.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool,
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the rendered chat; transformers 5.x returns a BatchEncoding unless return_dict=False.
    `template_kwargs`: extra variables of the chat template (e.g. {"enable_thinking": False})."""
    extra = {"sanitize_control_tokens": True} if _accepts_sanitize(type(tokenizer)) else {}
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False,
        **{**dict(template_kwargs or {}), **extra}
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(token) for token in ids]


def template_fingerprint(tokenizer: Any) -> str:
    """sha256 of the chat template, vocabulary size (with added tokens) and special tokens map."""
    payload = {
        "chat_template": tokenizer.chat_template,
        "vocab_size": len(tokenizer),
        "special_tokens_map": tokenizer.special_tokens_map,
    }
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def probe_prompt(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> str | None:
    """The text of `PROBE_MESSAGES` rendered as a prompt (with the generation prompt); None when the template cannot
    render it (no template, or it raises)."""
    try:
        text = tokenizer.apply_chat_template(list(PROBE_MESSAGES), tokenize=False, add_generation_prompt=True,
                                             **dict(template_kwargs))
    except Exception:  # noqa: BLE001 - any template failure means the same: nothing to show
        return None
    return text if isinstance(text, str) else None


def thinking_mode(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """How the template's thinking switch renders the probe with `template_kwargs`: {"switch": its name, "on": True /
    False (the rendering equals the one with the switch set to that value; None if neither), "set": whether
    template_kwargs set it (else it is the template's default)}; None when the template has no thinking switch
    (setting it True or False renders the same probe)."""
    for switch in THINKING_SWITCHES:
        on = probe_prompt(tokenizer, {**template_kwargs, switch: True})
        off = probe_prompt(tokenizer, {**template_kwargs, switch: False})
        if on is None or off is None or on == off:
            continue
        current = probe_prompt(tokenizer, template_kwargs)
        return {"switch": switch, "on": True if current == on else False if current == off else None,
                "set": switch in template_kwargs}
    return None


def rendering_record(tokenizer: Any, template_kwargs: Mapping[str, Any], stop_token_ids: Sequence[int],
                     system_turn_share: float | None = None) -> dict[str, Any]:
    """How `tokenizer` renders prompts with `template_kwargs` (see the module doc); `stop_token_ids`: the end-of-turn
    ids its answers stop at; `system_turn_share`: the share of the conversations that have a system turn (None when
    not known)."""
    template = tokenizer.chat_template  # a string, a {name: template} dict, or None
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True, ensure_ascii=False)
    vocab = sorted(tokenizer.get_vocab().items())
    return {
        "chat_template_sha256": _sha256(template) if template is not None else None,
        "chat_template_kwargs": dict(template_kwargs),
        "add_generation_prompt": True,  # a prompt ends with the opening of the assistant turn
        "sanitize_control_tokens": _accepts_sanitize(type(tokenizer)),
        "thinking": thinking_mode(tokenizer, template_kwargs),
        "probe_prompt": probe_prompt(tokenizer, template_kwargs),
        "special_token_ids": {name: getattr(tokenizer, f"{name}_token_id", None)
                              for name in ("bos", "eos", "pad", "unk")},
        "stop_token_ids": sorted(int(token) for token in stop_token_ids),
        "vocab_size": len(tokenizer),
        "vocab_sha256": _sha256(json.dumps(vocab, ensure_ascii=False)),
        "system_turn_share": system_turn_share,
    }
