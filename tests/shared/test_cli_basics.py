"""The behaviour every command shares: --version, interrupts (exit 130 / 143 and the way on), and one-line errors
also for errors raised in DataLoader worker processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from click.testing import CliRunner

from dflash.shared.cli import dflash
from dflash.shared.errors import UserError, user_facing_errors, user_message
from dflash.shared.interrupts import exit_on_interrupt, rerun_command


def test_version_names_the_installed_package() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(dflash, ["--version"])
    assert result.exit_code == 0 and result.output == f"dflash {version('dflash')}\n"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_interrupt_exits_128_plus_the_signal_with_the_way_on(signum: signal.Signals, code: int,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    # Python's own Ctrl-C behaviour, also when the tests run as a background job (which ignores SIGINT).
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as stopped, exit_on_interrupt("train", "continue with: dflash train --resume"):
            os.kill(os.getpid(), signum)
            time.sleep(1)  # the handler runs between bytecodes: let it, inside the block
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
    assert stopped.value.code == code
    assert capsys.readouterr().err == f"dflash train: interrupted ({signum.name}); continue with: dflash train --resume\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored


def test_rerun_command_adds_resume_once_and_drops_overwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["cli.py", "train", "--out", "my run", "--overwrite"])
    assert rerun_command("--resume", drop_flags=("--overwrite",)) == "dflash train --out 'my run' --resume"
    monkeypatch.setattr("sys.argv", ["cli.py", "train", "--resume"])
    assert rerun_command("--resume") == "dflash train --resume"


class ShardProblem(UserError):
    pass


def test_an_error_from_a_dataloader_worker_is_shown_as_its_own_message(capsys: pytest.CaptureFixture[str]) -> None:
    # What torch's ExceptionWrapper.reraise builds in the main process for an error in a loader worker.
    remote = ShardProblem("Caught ShardProblem in DataLoader worker process 1.\nOriginal Traceback (most recent "
                          "call last):\n  File \"packed_batches.py\", line 160, in batch\n    raise shard_error(...)\n"
                          "tests.shared.test_cli_basics.ShardProblem: shard 1 could not be read; re-extract it\n")
    assert user_message(remote) == "shard 1 could not be read; re-extract it"
    assert user_message(ShardProblem("plain message")) == "plain message"
    with pytest.raises(SystemExit) as stopped, user_facing_errors():
        raise remote
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "dflash: error: shard 1 could not be read; re-extract it\n"


def test_every_option_of_every_command_has_help_text() -> None:
    import click

    from dflash.shared.cli import SUBCOMMANDS

    context = click.Context(dflash)
    missing = [f"{name} {param.opts[-1]}" for name in SUBCOMMANDS
               for param in dflash.get_command(context, name).params  # type: ignore[union-attr]
               if isinstance(param, click.Option) and not param.help]
    assert missing == []


# Options a command has that its options dataclass does not hold (they are consumed by the command itself).
COMMAND_ONLY_OPTIONS = {"train": {"local_copy", "processes"}, "extract": {"staging", "yes", "repair"}, "generate": set()}


@pytest.mark.parametrize(("name", "options_class"), [
    ("train", "dflash.stage2_train.options:TrainOptions"),
    ("extract", "dflash.stage1_extract.options:ExtractOptions"),
    ("generate", "dflash.stage1_extract.options:GenerateOptions"),
])
def test_command_defaults_are_those_of_the_options_module(name: str, options_class: str) -> None:
    """Each option of the command defaults to its field's default in the options module (the one home of the
    defaults): `dflash train --help` shows what a TrainOptions made in code gets."""
    import dataclasses
    import importlib
    from pathlib import Path

    import click

    module, attribute = options_class.split(":")
    fields = {field.name: field for field in dataclasses.fields(getattr(importlib.import_module(module), attribute))}
    command = dflash.get_command(click.Context(dflash), name)
    context = click.Context(command)  # type: ignore[arg-type]
    compared = set()
    for param in command.params:  # type: ignore[union-attr]
        field_name = param.name.rstrip("_")  # type: ignore[union-attr]  # --compile is `compile_` in the command
        if field_name in COMMAND_ONLY_OPTIONS[name]:
            continue
        assert field_name in fields, f"dflash {name} --{field_name}: no field of that name in {options_class}"
        field = fields[field_name]
        if field.default is dataclasses.MISSING:  # required: no default to compare
            assert param.required, f"dflash {name} {param.opts[-1]} has a default, {options_class} has none"
            continue
        default = param.get_default(context)
        if isinstance(field.default, Path):  # extract --out also takes s3:// URLs: a string on the command line
            default = Path(default)
        assert default == field.default, f"dflash {name} {param.opts[-1]}: {default!r} != {field.default!r}"
        compared.add(field_name)
    assert len(compared) >= 10
