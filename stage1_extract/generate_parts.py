"""The output folder of `dflash generate`: the entries it may hold, and its part files, one per worker, to which
finished conversations are appended as whole JSON lines (a killed writer leaves at most a partial last line).

Its own module, without torch: `benchmarks/generation_sessions.py` reads the part files of a running generation
(importing `generate_run` for them took ~3 s a call, with torch and the model code).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash.shared import cache_format as cf
from dflash.shared.errors import ExtractRefused

OUTPUT_FILE = "conversations.jsonl"
SETTINGS_FILE = "generate.json"
PARTS_DIR = "parts"
LOG_FILE = "generate.log"
LOCK_FILE = ".generate.lock"
# Everything an output directory may hold (anything else: the folder is not ours; generate will not write there).
OUTPUT_ENTRIES = (OUTPUT_FILE, SETTINGS_FILE, PARTS_DIR, LOG_FILE, LOCK_FILE, cf.STATUS_DIR)


def repair_part_file(path: Path) -> int:
    """Cut off a partial last line left by a kill; returns the bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return 0
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
        return size - keep


def read_finished(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Every finished record in the part files, by key (the first one wins if a key ever appears twice)."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted((out_dir / PARTS_DIR).glob("*.jsonl.part")):
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.endswith("\n"):
                    break  # a partial line of a killed writer: not finished
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ExtractRefused(f"{path}:{number} is not valid JSON ({error}); the part file was edited or "
                                         "damaged: delete it to regenerate its conversations") from error
                records.setdefault(str(record["id"]), record)
    return records


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append whole lines and fsync, so a finished chunk survives a kill or power loss."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
