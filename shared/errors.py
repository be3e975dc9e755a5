"""Errors a user can fix, and how the CLI shows them: one clear line on stderr and exit code 2, no traceback (the
traceback goes to the command's log file)."""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What torch puts before the traceback of an exception it re-raises from a DataLoader worker process.
_REMOTE_TRACEBACK = "\nOriginal Traceback"


class UserError(Exception):
    """Base class of errors caused by input or options; the message names the input and what to do."""


class ExtractRefused(RuntimeError):
    """A stage-1 run cannot start (cache mismatch, shards locked by another run, bad option, a damaged output of
    `dflash generate`). Here, not in the supervisor, so that readers of stage 1's outputs need not import torch."""


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure a smaller batch can recover from: CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError (a malloc that failed, e.g. under `ulimit -v`; a cgroup's OOM killer raises nothing, which is
    why stage 2 plans its memory before the first step)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def user_message(error: BaseException) -> str:
    """The message of `error` as the user should read it. An error re-raised from a DataLoader worker carries the
    worker's whole traceback in its message ("Caught CacheError in DataLoader worker process 1. Original
    Traceback ..."): only the original message is kept, as if the error had been raised in the main process."""
    text = str(error)
    if _REMOTE_TRACEBACK not in text:
        return text
    marker = f"{type(error).__name__}: "
    position = text.rfind(marker)
    return text[position + len(marker):].strip() if position >= 0 else text.splitlines()[-1].strip()


# How the interrupted or failed command goes on (set by `interrupts.exit_on_interrupt`, which every long command
# runs under): the end of a write error's line.
HOW_TO_GO_ON = {"text": "rerun the same command"}


def os_error_message(error: OSError) -> str | None:
    """One line for the OS errors a user fixes on their machine (a full disk, a file-size limit, a read-only file
    system, a permission), naming the path and what to free or change; None for any other."""
    path = error.filename or "a file"
    go_on = HOW_TO_GO_ON["text"]
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "disk full (no space left on device)" if error.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{what} while writing {path}: free space on that disk; {go_on}"
    if error.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shell = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
        return (f"file too large: writing {path} passed the file-size limit (`ulimit -f`: {shell}) or the largest "
                f"file its file system allows: raise the limit (`ulimit -f unlimited`) or write to another file "
                f"system; {go_on}")
    if error.errno == errno.EROFS:
        return (f"{path} is on a read-only file system: write to a folder on a writable disk (--out), or remount "
                "that one read-write")
    if error.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied: {path}: give this user access to it (chmod / chown) or choose another "
                "folder")
    return None


# Write errors that torch and safetensors raise without the OSError behind them.
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # safetensors (Rust's io::Error)
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed")  # torch.save's zip writer


def hidden_os_error(error: BaseException, folder: Path) -> OSError | None:
    """The OSError behind a failed save into `folder`: safetensors names its code; torch.save's zip writer says only
    "unexpected pos", so a full disk (under 1 MiB free) or a file at the file-size limit is looked for. None when
    neither is found."""
    text = str(error)
    found = _OS_ERROR_CODE.search(text)
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), str(folder))
    if not any(marker in text for marker in _TORCH_WRITE_FAILED):
        return None
    import resource
    import shutil

    existing = next((p for p in (folder, *folder.parents) if p.exists()), folder)
    if shutil.disk_usage(existing).free < 2**20:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and folder.is_dir():
        largest = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size, default=None)
        if largest is not None and largest.stat().st_size >= limit:
            return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(largest))
    return None


def record_in_logs(line: str) -> None:
    """Write the error line a command ends with into its log files (RUN/train.log, eval.log, ...) too, not on the
    console (the caller prints it there)."""
    logger = logging.getLogger("dflash")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def exit_with_error(line: str, what: str) -> None:
    """Record the traceback of `what` failed (debug) and the line in the logs, print `dflash: error: LINE`, exit 2."""
    logging.raiseExceptions = False  # a log on the very disk that is full stays silent: the line below is the one
    logging.getLogger("dflash").debug(what, exc_info=True)  # the traceback: the log file only
    record_in_logs(f"error: {line}")
    print(f"dflash: error: {line}", file=sys.stderr)
    sys.exit(2)


@contextmanager
def user_facing_errors() -> Iterator[None]:
    try:
        yield
    except UserError as error:
        exit_with_error(user_message(error), "user error")
    except OSError as error:
        line = os_error_message(error)
        if line is None:
            raise
        exit_with_error(line, "OS error")
