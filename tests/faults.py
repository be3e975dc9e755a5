"""Out-of-memory errors the tests inject into dflash, so that its retries are tested on any machine.

Each fault replaces one function of the product by a wrapper that raises `torch.OutOfMemoryError` where the real
device would run out, and otherwise calls the original; the product itself knows nothing of them. One more variable
is no fault but sets how long training keeps a smaller budget after a retry, so that a short run shows the return to
the planned one. In the test's own process a test installs a fault with `monkeypatch.setattr` as `set_attribute`. A
`dflash` command gets the faults named in the environment `fault_env` makes: `install_from_environment` runs in the
command's process (forked: `tests/forked_cli.py`), and in every process started with that environment (a fresh
interpreter, the workers extract spawns) through `tests/fault_site/sitecustomize.py`, which the environment's
PYTHONPATH names.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

OOM_TOKENS_ENV = "DFLASH_FAKE_OOM_TOKENS"  # extract / generate: a forward over more tokens than N runs out
OOM_SEQUENCES_ENV = "DFLASH_FAKE_OOM_SEQUENCES"  # train: a micro-batch of more than N sequences runs out
OOM_COPY_SEQUENCES_ENV = "DFLASH_FAKE_OOM_COPY_SEQUENCES"  # train: likewise, while it is copied to the device
# train: the steps a smaller micro-batch budget holds after a retry (`trainer.SMALLER_MEMORY_STEPS`), so that a
# short test run returns to the planned budget
SMALLER_MEMORY_STEPS_ENV = "DFLASH_TEST_SMALLER_MEMORY_STEPS"
FAULT_SITE = Path(__file__).resolve().parent / "fault_site"

SetAttribute = Callable[[Any, str, Any], None]


def fault_env(**variables: str) -> dict[str, str]:
    """The environment overrides that run a `dflash` command with these fault variables set (for `run_dflash`)."""
    path = os.pathsep.join(p for p in (str(FAULT_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {**variables, "PYTHONPATH": path}


def _out_of_memory(what: str) -> Exception:
    import torch

    return torch.OutOfMemoryError(f"fake out-of-memory error ({what})")


def fail_extraction_forwards_over(tokens: int, set_attribute: SetAttribute = setattr) -> None:
    """An extraction forward over a batch of more than `tokens` padded tokens runs out of memory."""
    from dflash.stage1_extract import worker

    forward = worker.ShardExtractor._forward

    def failing_forward(self: worker.ShardExtractor, batch: list[Any], writer: Any) -> None:
        padded = worker._round_up(max(len(s.input_ids) for s in batch), self.pad_multiple) * len(batch)
        if padded > tokens:
            raise _out_of_memory(f"{OOM_TOKENS_ENV}={tokens}, {padded} tokens")
        forward(self, batch, writer)

    set_attribute(worker.ShardExtractor, "_forward", failing_forward)


def fail_generation_over(tokens: int, set_attribute: SetAttribute = setattr) -> None:
    """A `generate` call whose rows x (prompt width + new tokens) exceed `tokens` runs out of memory."""
    from dflash.stage1_extract.regenerate import ConversationRegenerator

    generate = ConversationRegenerator._generate

    def failing_generate(self: ConversationRegenerator, batch: list[tuple[Any, list[int]]], *args: Any,
                         **kwargs: Any) -> Any:
        width = max(len(ids) for _, ids in batch)
        new_tokens = max(self._budget(ids) for _, ids in batch)
        rows = max(len(batch), self._static_rows()) if self.settings.static_cache else len(batch)
        if rows * (width + new_tokens) > tokens:
            raise _out_of_memory(f"{OOM_TOKENS_ENV}={tokens}, {rows * (width + new_tokens)} tokens")
        return generate(self, batch, *args, **kwargs)

    set_attribute(ConversationRegenerator, "_generate", failing_generate)


def fail_training_micro_batches_over(sequences: int, set_attribute: SetAttribute = setattr) -> None:
    """A training micro-batch of more than `sequences` sequences runs out of memory after its backward, so that
    the retry must drop half-accumulated gradients."""
    from accelerate import Accelerator

    from dflash.stage2_train import trainer

    forward_loss, backward = trainer.forward_loss, Accelerator.backward
    current = {"sequences": 0}  # those of the micro-batch whose loss the next backward runs through

    def counting_forward_loss(run: Any, micro: Any, *args: Any, **kwargs: Any) -> Any:
        current["sequences"] = micro.sequences
        return forward_loss(run, micro, *args, **kwargs)

    def failing_backward(self: Accelerator, loss: Any, **kwargs: Any) -> None:
        backward(self, loss, **kwargs)
        if current["sequences"] > sequences:
            raise _out_of_memory(f"{OOM_SEQUENCES_ENV}={sequences}, {current['sequences']} sequences")

    set_attribute(trainer, "forward_loss", counting_forward_loss)
    set_attribute(Accelerator, "backward", failing_backward)


def fail_training_copies_over(sequences: int, set_attribute: SetAttribute = setattr) -> None:
    """A training micro-batch of more than `sequences` sequences runs out of memory while it is copied to the device
    and its features decoded (`trainer.micro_batch_inputs`), before any forward of it."""
    from dflash.stage2_train import trainer

    micro_batch_inputs = trainer.micro_batch_inputs

    def failing_copy(run: Any, batch: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if len(batch["lengths"]) > sequences:
            raise _out_of_memory(f"{OOM_COPY_SEQUENCES_ENV}={sequences}, {len(batch['lengths'])} sequences")
        return micro_batch_inputs(run, batch, *args, **kwargs)

    set_attribute(trainer, "micro_batch_inputs", failing_copy)


def install_from_environment() -> None:
    """Install the faults whose variables are set in this process's environment."""
    if os.environ.get(OOM_TOKENS_ENV):
        fail_extraction_forwards_over(int(os.environ[OOM_TOKENS_ENV]))
        fail_generation_over(int(os.environ[OOM_TOKENS_ENV]))
    if os.environ.get(OOM_SEQUENCES_ENV):
        fail_training_micro_batches_over(int(os.environ[OOM_SEQUENCES_ENV]))
    if os.environ.get(OOM_COPY_SEQUENCES_ENV):
        fail_training_copies_over(int(os.environ[OOM_COPY_SEQUENCES_ENV]))
    if os.environ.get(SMALLER_MEMORY_STEPS_ENV):
        from dflash.stage2_train import trainer

        trainer.SMALLER_MEMORY_STEPS = int(os.environ[SMALLER_MEMORY_STEPS_ENV])
