"""Output folders: a command writes only into a new or empty folder, or into one it made itself."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from dflash.shared.errors import UserError


def foreign_entries(folder: Path, own: Iterable[str]) -> list[str]:
    """The names in `folder` that match none of the patterns `own` (nor an atomic-write temporary `.NAME.tmp-*` of
    one)."""
    patterns = [p for pattern in own for p in (pattern, f".{pattern}.tmp-*")]
    if not folder.is_dir():
        return []

    def ours(name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in patterns)

    return sorted(p.name for p in folder.iterdir() if not ours(p.name))


def refuse_foreign_folder(folder: Path, own: Iterable[str], what: str, option: str = "--out") -> None:
    """Refuse to write into an existing folder that holds files the command did not write (a training run, a cache
    of another kind, anything else): its files would be mixed with the new ones."""
    foreign = foreign_entries(folder, own)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise UserError(f"{option} {folder} is not empty and is not a {what} (it holds {shown}): give a new or empty "
                        "folder")
