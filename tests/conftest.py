"""Shared fixtures: a small chat data file, a CLI runner, and one baseline cache reused by several tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.forked_cli import ForkServer, needs_fresh_interpreter

REPO = Path(__file__).resolve().parents[1]


def make_conversations(count: int) -> list[dict]:
    """Deterministic conversations of varied length, some multi-turn, with a system prompt on some."""
    records = []
    for i in range(count):
        messages = []
        if i % 4 == 1:
            messages.append({"role": "system", "content": "You are a concise assistant."})
        messages += [
            {"role": "user", "content": f"Question {i}: " + f"tell me about the number {i} and why it matters. " * (1 + i % 4)},
            {"role": "assistant", "content": f"The number {i} is interesting because " + "it is a number. " * (2 + i % 5)},
        ]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "And more?"},
                         {"role": "assistant", "content": "Yes: " + "more words here. " * (1 + i % 3)}]
        records.append({"id": f"conv-{i}", "messages": messages})
    return records


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build` once for the whole test run: under pytest-xdist the test processes share
    it (the first one to ask builds it while the others wait on its lock), so a session fixture's cache is extracted
    once, not once per process. Its users only read it (a test that writes works on a copy)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above the processes' own
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def chat_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def write(folder: Path) -> None:
        (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_conversations(14)))

    return built_once(tmp_path_factory, "data", write) / "chats.jsonl"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where torch sees no CUDA device (CI, the CPU machines); `make test-gpu` and
    `benchmarks/gpu_pipeline.sh gputests` run them on a GPU machine."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Keep on each test whether its body failed (a fixture's teardown can then report it)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_failed = report.failed  # type: ignore[attr-defined]


@pytest.fixture(scope="module", autouse=True)
def remove_module_folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Remove what a test module's fixtures made under this process's temporary folder once the module is done, if
    none of its tests failed (a failed module keeps everything to look at). Passing tests' own `tmp_path` folders go
    at once (`tmp_path_retention_policy = "failed"` in pyproject.toml). Without both, one `make test` left ~10 GB of
    caches and checkpoints behind and CI ran out of disk; the folders `built_once` shares across modules stay."""
    root = tmp_path_factory.getbasetemp()
    before, failed_before = {path.name for path in root.iterdir()}, request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        return
    for path in root.iterdir():
        shared = path.suffix in (".lock", ".done") or (root / f"{path.name}.done").exists()
        if path.name not in before and path.is_dir() and not shared:
            shutil.rmtree(path, ignore_errors=True)


_fork_server: ForkServer | None = None


def run_dflash(*args: str, timeout: float = 600, env: dict[str, str] | None = None,
               check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real `dflash` CLI in its own process (what a user runs): forked from the tests' CLI server, which has
    the libraries imported already (tests/forked_cli.py), or a fresh interpreter where the environment asks for one
    or DFLASH_TESTS_FRESH_INTERPRETER=1."""
    global _fork_server
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if needs_fresh_interpreter(env or {}) or os.environ.get("DFLASH_TESTS_FRESH_INTERPRETER") == "1":
        result = subprocess.run([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, env=full_env,
                                text=True, capture_output=True, timeout=timeout)
    else:
        if _fork_server is None or not _fork_server.alive():
            _fork_server = ForkServer(REPO)
        with tempfile.TemporaryDirectory(prefix="dflash-cli-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            code = _fork_server.run(list(args), full_env, REPO, out, err, timeout)
            result = subprocess.CompletedProcess(["dflash", *args], code, out.read_text(errors="replace"),
                                                 err.read_text(errors="replace"))
    if check and result.returncode != 0:
        raise AssertionError(f"dflash {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def step_records(run: Path) -> dict[int, dict]:
    """The last metrics.jsonl record of each training step of a run (a resumed run rewrites steps after its
    checkpoint)."""
    records: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            records[record["step"]] = record
    return records


def assert_same_training(run: Path, reference: Path, loss_rel: float) -> None:
    """Two training runs saw the same data, anchors and schedule (per-step supervised-label count and lr equal,
    not close) and computed the same losses up to float noise. Two fresh processes computing the very same step
    were seen in CI to differ by 3 ulp (before any checkpoint or optimizer step), which later steps grow, so
    separate processes are compared within `loss_rel`, never bit for bit."""
    got, want = step_records(run), step_records(reference)
    assert sorted(got) == sorted(want)
    assert {s: (r["labels"], r["lr"]) for s, r in got.items()} == {s: (r["labels"], r["lr"]) for s, r in want.items()}
    assert {s: r["loss"] for s, r in got.items()} == pytest.approx({s: r["loss"] for s, r in want.items()}, rel=loss_rel)


# bf16 features: the tests compare them bit for bit with transformers forwards and with each other.
EXTRACT_ARGS = ("--max-length", "96", "--shards", "3", "--batch-tokens", "256", "--feature-dtype", "bf16")


@pytest.fixture(scope="session")
def baseline_cache(tmp_path_factory: pytest.TempPathFactory, chat_jsonl: Path) -> Path:
    """An uninterrupted 1-worker extraction of the small chat file: the reference other runs must equal."""
    def extract(folder: Path) -> None:
        run_dflash("extract", "--data", str(chat_jsonl), "--out", str(folder / "cache"), "--workers", "1",
                   *EXTRACT_ARGS, check=True)

    return built_once(tmp_path_factory, "baseline", extract) / "cache"


@pytest.fixture(scope="module")
def smollm2() -> Iterator[object]:
    """The embedded bf16 target in this process, with torch on the thread count of a 1-worker extraction
    (`detect_devices`), as the forwards that compare with the caches above want; the process's own count is back
    after the module (set for good, it slowed every later file of the process)."""
    import torch

    from dflash.shared.target_loading import load_target_model, resolve_target
    from dflash.stage1_extract.supervisor import detect_devices

    threads = torch.get_num_threads()
    torch.set_num_threads(detect_devices(1)[1])
    try:
        yield load_target_model(resolve_target(None).load_path, "cpu")
    finally:
        torch.set_num_threads(threads)


TOPK = 8  # the top-k of the `topk_cache` fixture


@pytest.fixture(scope="session")
def topk_cache(tmp_path_factory: pytest.TempPathFactory, chat_jsonl: Path) -> Path:
    """The baseline extraction, with the target's top-k stored (`--store-target-topk 8`)."""
    def extract(folder: Path) -> None:
        run_dflash("extract", "--data", str(chat_jsonl), "--out", str(folder / "cache"), "--workers", "1",
                   *EXTRACT_ARGS, "--store-target-topk", str(TOPK), check=True)

    return built_once(tmp_path_factory, "topk", extract) / "cache"
