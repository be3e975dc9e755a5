"""Child processes of a command (extraction and generation workers, training processes): they die with their
parent, and a stop leaves none of them, nor any process they started, running or unreaped."""

from __future__ import annotations

import ctypes
import signal
import time
from typing import Any


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no child outlives a killed run."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_processes(processes: list[Any], grace_s: float = 15.0) -> None:
    """Terminate (SIGTERM) and reap every process of `processes` (multiprocessing processes). One still alive
    after `grace_s` (e.g. blocked in a collective whose peer is gone, where its SIGTERM handler cannot run) is
    killed together with the processes it started (its DataLoader workers), so none is left orphaned."""
    import psutil

    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.time() + grace_s
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.time()))
        if process.is_alive():
            try:
                family = psutil.Process(process.pid).children(recursive=True)
            except psutil.Error:
                family = []
            process.kill()
            process.join()
            for child in family:
                try:
                    child.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(family, timeout=5)
