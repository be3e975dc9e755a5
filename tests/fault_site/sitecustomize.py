"""Imported by Python at the start of every process whose PYTHONPATH holds this folder (`tests.faults.fault_env`
puts it there for a test's `dflash` command, whose spawned workers inherit it): installs the faults its
environment names."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.faults`

from tests.faults import install_from_environment  # noqa: E402

install_from_environment()
