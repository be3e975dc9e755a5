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


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded GGUF converted by dflash into a fresh folder (the dflash home may hold an earlier conversion)."""
    from dflash.shared.target_loading import _convert_gguf

    folder = tmp_path_factory.mktemp("converted") / "SmolLM2"
    _convert_gguf(embedded.smollm2_gguf(), folder)
    return folder


def test_a_converted_gguf_reads_as_the_same_model_in_transformers_4_and_5(converted: Path, tmp_path: Path) -> None:
    """transformers 4 (4.57.1, z-lab's pin) reads RoPE from the top-level rope_theta (10000 when missing: another
    model, no error) and knows no tokenizer class `TokenizersBackend`: the folder states both in its terms too,
    and transformers 5 still reads the GGUF's own RoPE base and the tokenizer it saved from it. (Loaded in
    transformers 4.57.1 by hand: the same token ids and bit-equal fp32 logits as in transformers 5.)"""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast, TokenizersBackend

    fields = GGUFReader(str(embedded.smollm2_gguf())).fields
    freq_base = float(fields["llama.rope.freq_base"].contents())
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == freq_base
    assert config["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in config
    assert AutoConfig.from_pretrained(converted).rope_parameters == {"rope_theta": freq_base, "rope_type": "default"}
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert PreTrainedTokenizerFast is TokenizersBackend  # transformers 5's other name for the same class
    as_saved = tmp_path / "as_saved_by_transformers_5"  # the tokenizer files with the class name transformers 5 wrote
    as_saved.mkdir()
    for path in converted.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "config")):
            (as_saved / path.name).write_bytes(path.read_bytes())
    (as_saved / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config,
                                                                "tokenizer_class": "TokenizersBackend"}))
    tokenizer, saved = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(as_saved)
    messages = [{"role": "user", "content": "Write a haiku about the sea, then explain it."}]
    assert type(tokenizer) is type(saved) is TokenizersBackend
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) \
        == saved.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_what_restates_the_model_for_transformers_4_leaves_the_target_hash(converted: Path, tmp_path: Path) -> None:
    """Caches record the hash of folders converted before the transformers 4 keys were written: the same folder
    without them hashes the same. A top-level rope_theta that says something else is another model."""
    from dflash.shared.target_loading import target_content_hash

    def copy(name: str, **config_changes: object) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for path in converted.iterdir():
            (folder / path.name).symlink_to(path) if path.suffix == ".safetensors" else \
                (folder / path.name).write_bytes(path.read_bytes())
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
        return folder

    before = copy("as_converted_before")
    config = json.loads((before / "config.json").read_text())
    del config["rope_theta"]
    (before / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((before / "tokenizer_config.json").read_text())
    (before / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "tokenizer_class": "TokenizersBackend"}))
    assert target_content_hash(str(before)) == target_content_hash(str(converted))
    assert target_content_hash(str(copy("other_theta", rope_theta=10000.0))) != target_content_hash(str(converted))


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 500000.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}])
def test_the_transformers_4_rope_keys_give_transformers_5_the_same_rope(rope: dict) -> None:
    """A config with the restated keys beside `rope_parameters` loads in transformers 5 with the same RoPE as
    without them (transformers 5 gives a top-level rope_scaling precedence, so it must say the same)."""
    from transformers import LlamaConfig

    from dflash.shared.target_loading import rope_keys_for_transformers_4

    written = LlamaConfig(max_position_embeddings=131072, rope_parameters=dict(rope)).to_dict()
    restated = rope_keys_for_transformers_4(written)
    assert restated["rope_theta"] == rope["rope_theta"]
    assert ("rope_scaling" in restated) == (rope["rope_type"] != "default")
    with_both = LlamaConfig.from_dict({**written, **restated})
    assert with_both.rope_parameters == LlamaConfig.from_dict(written).rope_parameters
