"""Errors a user can fix, and how the CLI shows them: one clear line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """Base class of errors caused by input or options; the message names the input and what to do."""


@contextmanager
def user_facing_errors() -> Iterator[None]:
    try:
        yield
    except UserError as error:
        print(f"dflash: error: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:
        if error.errno == 28:  # ENOSPC
            print(f"dflash: error: disk full while writing {error.filename or ''}: free space and rerun the same "
                  "command (finished shards are kept)", file=sys.stderr)
            sys.exit(2)
        raise
