"""Damaged model files are named with their cause before transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.shared import embedded
from dflash.shared.target_loading import ModelLoadError, gguf_problem, resolve_target
from dflash.stage1_extract.conversations import json_error_text


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return embedded.smollm2_gguf().read_bytes()


def test_sound_gguf_has_no_problem() -> None:
    assert gguf_problem(embedded.smollm2_gguf()) is None


@pytest.mark.parametrize(("cut", "cause"), [(50_000_000, "truncated"), (3000, "truncated or damaged")])
def test_truncated_gguf_is_named_truncated(gguf_bytes: bytes, tmp_path: Path, cut: int, cause: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes[:cut])
    with pytest.raises(ModelLoadError, match=rf"model.gguf is {cause}.*download or copy it again"):
        resolve_target(str(path))


def test_a_file_that_is_no_gguf_is_named_so(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text('{"a": 1}\n')
    with pytest.raises(ModelLoadError, match=r"is not a GGUF file \(it starts with b'\{\"a\"'"):
        resolve_target(str(path))


@pytest.mark.parametrize(("text", "message"), [('{"a": "unterminated', "Unterminated string starting at column 7"),
                                               ('{"a": }', "Expecting value at column 7")])
def test_json_errors_say_at_column_once(text: str, message: str) -> None:
    with pytest.raises(json.JSONDecodeError) as error:
        json.loads(text)
    assert json_error_text(error.value) == message
