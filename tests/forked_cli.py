"""Run `dflash` commands for the tests in processes forked from one interpreter that has already imported torch,
transformers, accelerate, zarr and the project.

Each command is still its own process, started with its own command line, environment and working directory, with
its own stdout, stderr, exit code, signals and exit handlers, as `python -m dflash.shared.cli ...` would be; only the
imports are paid once per test session instead of once per command. Measured on the 2-core machine: those imports
take ~3 s of CPU per command, and the suite runs the CLI over a hundred times (docs/tests.md).

The server is a child of the test process (`python -m tests.forked_cli`), so it never inherits the test process's
thread pools: it imports, runs nothing, and forks one command at a time. A command whose environment changes what
libraries read when imported (HF_*, TRANSFORMERS_*, torch and thread variables) runs in a fresh interpreter instead
(`needs_fresh_interpreter`). A command run with faults (`tests/faults.py`) installs them in the forked child; the
processes it spawns get them from the PYTHONPATH the faults set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA",
                        "PYTHON")


def needs_fresh_interpreter(overrides: dict[str, str]) -> bool:
    from tests.faults import fault_env

    fault_path = fault_env()["PYTHONPATH"]  # read at start-up only by the processes a command spawns
    return any(key.upper().startswith(IMPORT_TIME_PREFIXES) and key != "PYTHONUNBUFFERED"
               and not (key == "PYTHONPATH" and value == fault_path) for key, value in overrides.items())


class ForkServer:
    """The test side: one server process for the session, asked to run one command at a time."""

    def __init__(self, repo: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.forked_cli"], cwd=repo, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready = self.process.stdout.readline()  # type: ignore[union-attr]
        if ready.strip() != "ready":
            raise RuntimeError(f"the forked-CLI server did not start: {ready!r}")

    def run(self, args: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path, timeout: float) -> int:
        request = {"args": args, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err), "timeout": timeout}
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        reply = json.loads(self.process.stdout.readline())  # type: ignore[union-attr]
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(["dflash", *args], timeout)
        return int(reply["returncode"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive():
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(timeout=30)


def _run_command(request: dict[str, Any]) -> None:
    """In the forked child: become the command, run it, exit as the interpreter would."""
    import atexit
    import runpy
    import threading

    os.setpgid(0, 0)  # its own process group, so that a timeout ends its workers too
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for source, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(source, target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 0
    try:
        from tests.faults import install_from_environment

        install_from_environment()
        sys.argv = ["-m", *request["args"]]  # runpy puts the module's path first, as `python -m` does
        runpy.run_module("dflash.shared.cli", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): the interpreter prints it and exits 1
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at interpreter exit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.02)


def serve() -> None:
    """The server: import what every command imports, then fork one child per request line on stdin."""
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import zarr  # noqa: F401

    import dflash.shared.cli  # noqa: F401
    import dflash.stage1_extract.supervisor  # noqa: F401
    import dflash.stage1_extract.worker  # noqa: F401
    import dflash.stage2_train.evaluate  # noqa: F401
    import dflash.stage2_train.run_setup  # noqa: F401
    import dflash.stage2_train.trainer  # noqa: F401

    reply = sys.stdout
    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_command(request)
        print(json.dumps(_wait(pid, float(request["timeout"]))), file=reply, flush=True)


if __name__ == "__main__":
    serve()
