"""`dflash train --processes N`: N training processes on this machine (gloo on CPU, NCCL on GPUs) without
`accelerate launch`, behaving like one process to the user.

- Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the launcher: the launcher stops
  every training process (SIGTERM: each ends at once with its DataLoader workers, `end_with_workers`) and reaps
  it, then `dflash train` prints the `--resume` command once and exits 130 / 143, as one process does. The
  training processes ignore SIGINT themselves: the launcher decides.
- A training process that fails reports its one-line message to the launcher (the traceback goes to its log,
  RUN/train.log or RUN/train-rankK.log); the launcher stops the others and shows it as the main process would: a
  user error as `dflash: error: ...` with exit code 2, anything else as one line naming the log, exit code 1.
- Every training process dies with the launcher (PR_SET_PDEATHSIG), so none outlives a killed launcher.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import wait
from typing import Any

from dflash.shared.errors import UserError, os_error_message, user_message
from dflash.shared.logs import get_logger
from dflash.shared.processes import die_with_parent, stop_processes
from dflash.shared.run_files import RunFiles
from dflash.stage2_train.options import TrainOptions

log = get_logger(__name__)

USER_ERROR, CRASH = "user", "crash"


def spawn_processes(options: TrainOptions, processes: int) -> int:
    """Run `processes` training processes; returns 0 when all finished (raises UserError for a user error in any of
    them, KeyboardInterrupt when interrupted, both after every process is stopped)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    reports = context.SimpleQueue()  # (rank, USER_ERROR or CRASH, one-line message) from a failing process
    children: list[Any] = []
    failed = None
    try:
        for rank in range(processes):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes)}
            child = context.Process(target=_child_main, args=(options, env, reports), name=f"dflash-train-{rank}")
            child.start()
            children.append(child)
        failed = first_failure(children)
    finally:
        # A second Ctrl-C must not cut the stop short (it would leave processes behind): held until all are reaped.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            stop_processes(children)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if failed is None:
        return 0
    found = []
    while not reports.empty():
        found.append(reports.get())
    # A failing process makes its peers fail too (their collectives lose it): the user error is the cause.
    found.sort(key=lambda report: report[1] != USER_ERROR)
    if found and found[0][1] == USER_ERROR:
        raise UserError(found[0][2])
    files = RunFiles(options.out.resolve())
    rank, message = (found[0][0], found[0][2]) if found else (failed[0], f"exit code {failed[1]}")
    print(f"dflash train: training process {rank} failed: {message} (traceback in {files.log(rank)})",
          file=sys.stderr)
    return 1


def first_failure(children: list[Any]) -> tuple[int, int] | None:
    """Wait until every process has ended (None) or one has failed: (its rank, its exit code)."""
    running = list(children)
    while running:
        ended = wait([child.sentinel for child in running])
        for child in [c for c in running if c.sentinel in ended]:
            child.join()
            running.remove(child)
            if child.exitcode:
                return children.index(child), int(child.exitcode)
    return None


def _child_main(options: TrainOptions, env: dict[str, str], reports: Any) -> None:
    """One training process: rank `env["RANK"]` of the run."""
    from dflash.stage2_train.trainer import train

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher stops us
    signal.signal(signal.SIGTERM, end_with_workers)
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        train(options)
    except UserError as error:
        log.debug("user error", exc_info=True)  # the traceback: this process's log only
        reports.put((rank, USER_ERROR, user_message(error)))
        sys.exit(2)
    except OSError as error:
        line = os_error_message(error)  # a full disk, a read-only --out, ...: the user's to fix, in one line
        log.debug("training process %d failed", rank, exc_info=True)
        crash = f"{type(error).__name__}: {error}".splitlines()[0]
        reports.put((rank, USER_ERROR if line else CRASH, line or crash))
        sys.exit(2 if line else 1)
    except Exception as error:  # noqa: BLE001 - reported to the launcher as one line, the traceback in the log
        log.debug("training process %d failed", rank, exc_info=True)  # the log only (the console with -v)
        reports.put((rank, CRASH, f"{type(error).__name__}: {error}".splitlines()[0]))
        sys.exit(1)


def end_with_workers(signum: int, _frame: Any) -> None:
    """A training process's SIGTERM (the launcher's stop, or the launcher's death): end at once, with the DataLoader
    workers it forked. Not an exception unwinding the stack: one raised from a signal handler can land in a `finally`
    block or a `__del__` (a loader iterator shutting its workers down at the end of each epoch) and be swallowed
    there, and the process would train on. What it leaves is what a kill leaves, which --resume handles: the last
    complete checkpoint."""
    import psutil

    for worker in psutil.Process().children(recursive=True):
        try:
            worker.kill()
        except psutil.Error:
            pass
    os._exit(128 + signum)
