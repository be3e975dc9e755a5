"""Ctrl-C and SIGTERM, the same for every command: exit code 128 + the signal (130 / 143) and one line saying how
to go on, instead of click's bare "Aborted!" and exit code 1."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from dflash.shared.errors import HOW_TO_GO_ON


_OWNER = {"pid": os.getpid()}


def raise_interrupt(signum: int, _frame: Any) -> None:
    """A signal handler that turns SIGTERM into KeyboardInterrupt(SIGTERM), so one `except` handles both. A forked
    child (a DataLoader worker) inherits it but must simply end as its parent stops it: there it restores the
    default action and takes the signal again."""
    if os.getpid() != _OWNER["pid"]:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(signum)


def interrupt_signal(interrupt: KeyboardInterrupt) -> signal.Signals:
    """The signal behind a KeyboardInterrupt (SIGINT for a plain Ctrl-C)."""
    return signal.Signals(interrupt.args[0] if interrupt.args else signal.SIGINT)


def rerun_command(add_flag: str | None = None, drop_flags: tuple[str, ...] = ()) -> str:
    """The command line this process was started with, as `dflash ...`, with `add_flag` added (once) and the
    flags in `drop_flags` left out."""
    args = [a for a in sys.argv[1:] if a not in drop_flags]
    if add_flag and add_flag not in args:
        args.append(add_flag)
    return shlex.join(["dflash", *args])


def exit_interrupted(command: str, signum: int, how_to_go_on: str) -> NoReturn:
    """Print `dflash COMMAND: interrupted (SIGINT); HOW_TO_GO_ON` and exit 128 + the signal number."""
    print(f"dflash {command}: interrupted ({signal.Signals(signum).name}); {how_to_go_on}", file=sys.stderr)
    sys.exit(128 + int(signum))


@contextmanager
def exit_on_interrupt(command: str, how_to_go_on: str) -> Iterator[None]:
    """Run a command's body with SIGTERM raising KeyboardInterrupt; on either, `exit_interrupted` (a full disk or
    another write error ends with the same `how_to_go_on`: `errors.os_error_message`). A body that
    handles the interrupt itself (a supervisor stopping its workers) returns 128 + the signal number as its exit
    code: the caller passes that to `exit_interrupted` too, so every command says it the same way."""
    main_thread = threading.current_thread() is threading.main_thread()
    _OWNER["pid"] = os.getpid()
    HOW_TO_GO_ON["text"] = how_to_go_on  # a disk that fills up ends the command the same way
    previous = signal.signal(signal.SIGTERM, raise_interrupt) if main_thread else None
    try:
        yield
    except KeyboardInterrupt as interrupt:
        if os.getpid() != _OWNER["pid"]:  # a forked child unwinding the stack it copied: not ours to report
            raise
        exit_interrupted(command, interrupt_signal(interrupt), how_to_go_on)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def interrupted_by(code: int) -> int | None:
    """The signal behind the exit code 128 + N of an interrupted run (None for any other code)."""
    return code - 128 if code - 128 in (signal.SIGINT, signal.SIGTERM) else None
