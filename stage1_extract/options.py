"""The options of `dflash extract` and `dflash generate` and their defaults, in one place (the CLI shows these
defaults; nothing here imports torch, so `dflash extract --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.shared.feature_codecs import FEATURE_DTYPES


@dataclass
class ExtractOptions:
    out: Path = Path("dflash_cache")  # or, on the command line, s3://BUCKET/PREFIX
    model: str | None = None
    data: str | None = None
    column: str | None = None
    split: str = "train"
    max_samples: int | None = None
    max_length: int = 2048
    overlength: str = "truncate"
    draft_layers: int = 5
    target_layers: list[int] | None = None
    shards: int | None = None
    only_shards: str | None = None
    workers: int | None = None
    batch_tokens: int | None = None
    feature_dtype: str = FEATURE_DTYPES[0]  # the CLI default (docs/benchmarks.md "fp8 features")
    store_target_topk: int | None = None  # K: store the target's top-k next-token distribution (None: do not)
    overwrite: bool = False
    redo: bool = False  # --repair: redo the selected shards even if complete; never discard the cache
    verbose: bool = False

    def recorded(self, layer_ids: list[int]) -> dict[str, Any]:
        """What the manifest keeps of these options: everything `--repair` needs to redo a shard as it was made
        (local paths made absolute, so the repair works from any directory)."""
        def local(value: str | None) -> str | None:
            return str(Path(value).resolve()) if value and Path(value).exists() else value

        return {"model": local(self.model), "data": local(self.data), "column": self.column, "split": self.split,
                "max_samples": self.max_samples, "max_length": self.max_length, "overlength": self.overlength,
                "target_layers": layer_ids, "feature_dtype": self.feature_dtype, "batch_tokens": self.batch_tokens,
                "store_target_topk": self.store_target_topk}


@dataclass
class GenerateOptions:
    out: Path = Path("dflash_generated")
    model: str | None = None
    data: str | None = None
    column: str | None = None
    split: str = "train"
    max_samples: int | None = None
    max_new_tokens: int = 512
    max_length: int = 2048
    max_turns: int | None = None
    temperature: float = 0.0
    seed: int = 0
    workers: int | None = None
    workers_per_gpu: int = 1
    batch_tokens: int | None = None
    chunk_size: int | None = None
    static_cache: bool = False
    continuous_batching: bool = False
    overwrite: bool = False
    verbose: bool = False
