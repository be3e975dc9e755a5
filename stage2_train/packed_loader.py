"""The DataLoader over packed batches (`packed_batches.CacheBatches`) and the life cycle of its workers.

`make_loader` builds it (forked workers by default, a forkserver for a cache in object storage); `start_loader`
starts an epoch's workers with Ctrl-C and SIGTERM blocked, so that none can die of a signal meant for the main
process (each worker then ignores Ctrl-C and ends quietly on SIGTERM); `stop_loader` stops them from the caller, where
an interrupt propagates.
"""

from __future__ import annotations

import inspect
import os
import signal
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from dflash.shared.object_store import is_mirror
from dflash.stage2_train.packed_batches import CacheBatches


# What the main process alone handles: a terminal's Ctrl-C and a scheduler's SIGTERM reach every process of the
# group, and a loader worker that died of one first made torch raise "DataLoader worker exited unexpectedly" / "is
# killed by signal" in the main process, on top of (or instead of) the interrupt: seen for SIGINT in 1 of 6 and for
# SIGTERM in 2 of 3 signals to the group of a training run whose epochs were one step long.
_MAIN_PROCESS_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def start_loader(loader: DataLoader) -> Iterator[Any]:
    """`iter(loader)`, with SIGINT and SIGTERM blocked in this thread while it forks its workers, so that none is
    born able to die of them (`_worker_signals` then sets what they do for good). A signal that arrives meanwhile
    is delivered to this process as soon as they are forked."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_PROCESS_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_loader(batches: Iterator[Any]) -> None:
    """Stop an epoch's loader workers now, from the caller, where an interrupt propagates. Left to the iterator's
    `__del__` (when the next epoch's loader replaced it), a Ctrl-C that came while it joined its workers was
    raised inside `__del__`, where Python reports it as "Exception ignored" and goes on: the run kept training and
    left a worker unreaped (seen in 1 of 5 interrupts of a run whose epochs were one step long). `_shutdown_workers`
    is torch's own method for this (what `__del__` and the end of an epoch call); it does nothing a second time."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _worker_signals(_worker_id: int) -> None:
    """A DataLoader worker's first act: ignore Ctrl-C, and end quietly (exit code 0) on a SIGTERM from anyone
    (torch's own handler does so only when the parent sends it, as it does to stop a worker that does not finish;
    a scheduler's SIGTERM killed the worker, and the main process, which took the same signal, reports it); then
    take the signals it was born with blocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: os._exit(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _MAIN_PROCESS_SIGNALS)


def make_loader(dataset: CacheBatches, num_workers: int, *, prefetch_factor: int = 2,
                pin_memory: bool | None = None, context: str | None = None) -> DataLoader:
    """A DataLoader over `dataset` that yields its micro-batches in plan order.

    Workers are forked by default: zarr-python resets its IO thread and event loop in a forked child
    (`os.register_at_fork` in zarr.core.sync), stores are opened only inside each worker (never inherited), and
    fork starts a worker at once where spawn re-imports torch and zarr in every worker of every epoch
    (persistent_workers is off because each epoch has its own plan; the trainer starts the next epoch's loader
    a few steps ahead instead, `trainer.NEXT_EPOCH_LEAD_STEPS`), and the parent's plan is shared, not pickled.
    Fork is PyTorch's default on Linux and fine with CUDA initialised in the parent, as the workers never touch
    CUDA.

    Measured here (2 workers, per epoch): fork 0.15-0.4 s to the first batch, forkserver 2.2 s the first time
    (0.25 s later, with torch/zarr preloaded), spawn 4.5 s every epoch. `context="forkserver"` is the choice for a
    parent that runs threads which may hold locks at fork time; it needs the usual `if __name__ == "__main__"`
    guard in the launching script.

    Memory in flight: num_workers * prefetch_factor micro-batches of about batch_tokens * D * 2 bytes each, in
    shared memory (/dev/shm must hold them: containers often default to 64 MB); twice that near an epoch's end,
    while the next epoch's loader, started ahead, fills its own.

    Default context: fork, except for a cache in object storage (shared/object_store.py): obstore's I/O runtime
    lives in threads of the parent, which a forked child does not have (its first read would wait forever), so
    workers then come from a forkserver, which has never touched the bucket.
    """
    if context is None:
        context = "forkserver" if is_mirror(dataset.cache_dir) else "fork"
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    options: dict[str, Any] = {"batch_size": None, "num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        import multiprocessing

        mp_context = multiprocessing.get_context(context)
        if context == "forkserver":
            mp_context.set_forkserver_preload(["torch", "zarr", __name__])
        options.update(persistent_workers=False, prefetch_factor=prefetch_factor, multiprocessing_context=mp_context,
                       worker_init_fn=_worker_signals)
    if "in_order" in inspect.signature(DataLoader).parameters:
        options["in_order"] = True  # the default; plan order depends on it
    return DataLoader(dataset, **options)
