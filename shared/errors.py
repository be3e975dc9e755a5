"""Errors a user can fix, and how the CLI shows them: one clear line on stderr and exit code 2, no traceback (the
traceback goes to the command's log file)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# What torch puts before the traceback of an exception it re-raises from a DataLoader worker process.
_REMOTE_TRACEBACK = "\nOriginal Traceback"


class UserError(Exception):
    """Base class of errors caused by input or options; the message names the input and what to do."""


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


@contextmanager
def user_facing_errors() -> Iterator[None]:
    try:
        yield
    except UserError as error:
        logging.getLogger("dflash").debug("user error", exc_info=True)  # the traceback: the log file only
        print(f"dflash: error: {user_message(error)}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:
        if error.errno == 28:  # ENOSPC
            print(f"dflash: error: disk full while writing {error.filename or ''}: free space and rerun the same "
                  "command (finished shards are kept)", file=sys.stderr)
            sys.exit(2)
        raise
