"""Logging for every dflash command: one log file per run in the run's directory, plus stderr."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s [%(processName)s %(process)d] %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"dflash.{name.rsplit('.', 1)[-1]}")


def quiet_libraries() -> None:
    """Silence per-load progress bars of transformers / huggingface_hub (our own bar is the one that counts)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def setup_logging(log_file: Path | None, verbose: bool = False, console: bool = True) -> logging.Logger:
    """Attach a file handler (created immediately, before any model loads) and a stderr handler."""
    quiet_libraries()
    root = logging.getLogger("dflash")
    root.setLevel(logging.DEBUG)
    root.propagate = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter(FORMAT))
        file_handler.setLevel(logging.DEBUG)
        root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        stream.setLevel(logging.DEBUG if verbose else logging.INFO)
        root.addHandler(stream)
    return root
