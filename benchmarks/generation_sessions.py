"""The regenerated ShareGPT conversations that GPU sessions add up (`benchmarks/gpu_pipeline.sh` turns, generate
and pack; issue 29): the first turns to carry, the ones left to generate, and the merge of what is done.

    first-turns --out FILE [--max N|all] [--data FILE]    here (gpu_carry.sh): conversations cut after their first
                                                          answer, the first N of the dataset (default: the embedded
                                                          ShareGPT) or all of them
    pending --turns FILE --carried FILE                   on the device: the first turns that are not among the
                                                          carried conversations, rewritten in place (`turns`)
    merge --carried FILE --gen DIR --out FILE             the carried conversations, then every one `dflash generate`
                                                          has finished in DIR so far (`generate`, `pack`)

`merge` may run while `dflash generate` writes: it reads the part files through `read_finished`, which stops at a
last line without its newline (a chunk being appended, or a killed writer's), so only whole records are merged.
The carried ones come first and win over a record with the same id; skipped conversations (prompt too long,
nothing to answer) are left out, as in `dflash generate`'s own output. Files ending in .gz are read and written
compressed; the output is written to a temporary file and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any


def open_text(path: Path, mode: str, compressed: bool | None = None) -> IO[str]:
    """A text file, gzip-compressed when `compressed` (default: when its name ends in .gz)."""
    if path.suffix == ".gz" if compressed is None else compressed:
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def fail(message: str) -> None:
    """One line naming the file and what to do; exit 2."""
    print(f"generation_sessions.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file of ours (carried or first turns): a damaged line is an error, not skipped."""
    records: list[dict[str, Any]] = []
    try:
        with open_text(path, "r") as handle:
            for line in handle:
                record = json.loads(line)
                if not isinstance(record, dict) or "id" not in record:
                    raise ValueError("a record without an id")
                records.append(record)
    except (ValueError, OSError, EOFError, zlib.error) as error:  # a damaged line or record, a cut or damaged gzip
        fail(f"{path}: line {len(records) + 1} is not a whole JSON record with an id ({error}); restore the file "
             "from git or from the session that wrote it")
    return records


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write JSON lines to a temporary file beside `path`, then rename it; returns the number written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    count = 0
    with open_text(tmp, "w", compressed=path.suffix == ".gz") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def first_turns(data: str | None, max_samples: int | None) -> tuple[list[dict[str, Any]], int]:
    """The first `max_samples` conversations (None: all) cut after their first assistant turn, and how many were
    loaded; those with no assistant turn after a user turn are left out (generation would skip them)."""
    from dflash.stage1_extract.conversations import load_conversations

    loaded = load_conversations(data, max_samples=max_samples)
    turns = []
    for conversation in loaded.conversations:
        roles = [m["role"] for m in conversation.messages]
        if "user" not in roles or "assistant" not in roles[roles.index("user"):]:
            continue
        end = roles.index("assistant", roles.index("user")) + 1
        turns.append({"id": conversation.sample_id, "messages": list(conversation.messages[:end])})
    return turns, len(loaded.conversations)


def pending(turns: list[dict[str, Any]], carried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first turns whose id no carried conversation has, in their order."""
    done = {str(record["id"]) for record in carried}
    return [record for record in turns if str(record["id"]) not in done]


def merge(carried: list[dict[str, Any]], finished: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict]:
    """The carried conversations, then the finished ones not carried and not skipped; and what was added."""
    seen = {str(record["id"]) for record in carried}
    added, skipped, tokens, reasons = [], 0, 0, {}
    for record in finished:
        if "skipped" in record:
            skipped += 1
        elif str(record["id"]) not in seen:
            seen.add(str(record["id"]))
            added.append(record)
            tokens += record["dflash"]["generated_tokens"]
            reasons[record["dflash"]["finish_reason"]] = reasons.get(record["dflash"]["finish_reason"], 0) + 1
    return carried + added, {"carried": len(carried), "generated": len(added), "new_tokens": tokens,
                             "skipped": skipped, "finish_reasons": reasons}


def finished_records(gen_dir: Path) -> list[dict[str, Any]]:
    """What `dflash generate` has finished in `gen_dir` (none yet: no records)."""
    from dflash.shared.errors import ExtractRefused
    from dflash.stage1_extract.generate_parts import read_finished

    try:
        return list(read_finished(gen_dir).values()) if gen_dir.is_dir() else []
    except ExtractRefused as error:  # a damaged line before the last one of a part file
        fail(str(error))
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    first = commands.add_parser("first-turns")
    first.add_argument("--out", type=Path, required=True)
    first.add_argument("--max", default="all", help="the first N conversations of the dataset, or all")
    first.add_argument("--data", default=None, help="a chat dataset (default: the embedded ShareGPT)")
    left = commands.add_parser("pending")
    left.add_argument("--turns", type=Path, required=True)
    left.add_argument("--carried", type=Path, required=True, help="(a missing file: nothing carried)")
    joined = commands.add_parser("merge")
    joined.add_argument("--carried", type=Path, required=True, help="(a missing file: nothing carried)")
    joined.add_argument("--gen", type=Path, required=True, help="the `dflash generate --out` folder")
    joined.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "first-turns":
        if args.max != "all" and not (args.max.isdigit() and int(args.max) > 0):
            fail(f"--max {args.max!r}: give a positive number of conversations, or all")
        limit = None if args.max == "all" else int(args.max)
        turns, loaded = first_turns(args.data, limit)
        write_records(args.out, turns)
        print(f"first turns\t{len(turns)} of {loaded} conversations have an assistant turn -> {args.out}")
        return 0
    carried = read_records(args.carried) if args.carried.is_file() else []
    if args.command == "pending":
        turns = read_records(args.turns)
        left_over = pending(turns, carried)
        write_records(args.turns, left_over)
        print(f"carried\t{len(carried)} conversations generated in earlier sessions; {len(left_over)} first turns "
              f"left (of {len(turns)})")
        return 0
    records, summary = merge(carried, finished_records(args.gen))
    write_records(args.out, records)
    print(f"carried\t{summary['carried']} conversations from earlier sessions")
    print(f"generated\t{summary['generated']} conversations\t{summary['new_tokens']} new tokens"
          f"\t{summary['skipped']} skipped\t{summary['finish_reasons']}")
    print(f"merged\t{len(records)} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
