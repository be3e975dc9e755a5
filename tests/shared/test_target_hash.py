"""The target hash that caches, generated data and exports record: the same for the same target converted or
copied anywhere (what a folder records of its own making is left out), different for other weights or another
config, and still comparable with the hashes recorded by the rule before (no prefix)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.shared.target_loading import (HASH_RULE, resolve_target, same_target_hash, sampled_file_hash,
                                          target_content_hash)


def _copy_of_the_embedded_target(folder: Path) -> Path:
    """The converted embedded SmolLM2 folder, its weights hard-linked (or symlinked), its JSON files copied."""
    source = Path(resolve_target(None).load_path)
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".json" or path.suffix == ".jinja":
            (folder / path.name).write_bytes(path.read_bytes())
        else:
            try:
                os.link(path, folder / path.name)
            except OSError:
                (folder / path.name).symlink_to(path)
    return folder


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


def test_the_same_target_converted_elsewhere_has_the_same_hash(tmp_path: Path) -> None:
    """A second conversion of the embedded GGUF in another environment differs only in what records its making:
    the GGUF's path (dflash_source.json), the transformers version, whether the hub was offline. The hash stays;
    the rule before changed with each of them."""
    original = Path(resolve_target(None).load_path)
    stable = target_content_hash(str(original))
    assert stable.startswith(HASH_RULE)
    other = _copy_of_the_embedded_target(tmp_path / "converted_elsewhere")
    (other / "dflash_source.json").write_text(json.dumps({"gguf": "/another/venv/model.gguf"}))
    _edit_json(other / "config.json", transformers_version="9.9.9")
    _edit_json(other / "tokenizer_config.json", local_files_only=True, is_local=False)
    assert target_content_hash(str(other)) == stable
    legacy = sampled_file_hash(sorted(p for p in original.iterdir() if p.suffix in {".safetensors", ".json"}))
    assert target_content_hash(str(original), like="0" * 64) == legacy  # a hash of the rule before: that rule
    assert target_content_hash(str(other), like=legacy) != legacy  # ... which the new conversion did not keep


def test_other_weights_or_another_config_change_the_hash(tmp_path: Path) -> None:
    stable = target_content_hash(resolve_target(None).load_path)
    config = _copy_of_the_embedded_target(tmp_path / "config")
    _edit_json(config / "config.json", rms_norm_eps=1e-6)
    assert target_content_hash(str(config)) != stable
    weights = _copy_of_the_embedded_target(tmp_path / "weights")
    data = bytearray((weights / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    (weights / "model.safetensors").unlink()
    (weights / "model.safetensors").write_bytes(bytes(data))
    assert target_content_hash(str(weights)) != stable


def test_recorded_hashes_compare_only_under_one_rule() -> None:
    assert same_target_hash(HASH_RULE + "ab", HASH_RULE + "ab") is True
    assert same_target_hash(HASH_RULE + "ab", HASH_RULE + "cd") is False
    assert same_target_hash("ab", "cd") is False  # both of the rule before
    assert same_target_hash(HASH_RULE + "ab", "ab") is None  # made under different rules: not comparable
    assert same_target_hash(None, HASH_RULE + "ab") is None
