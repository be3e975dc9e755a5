"""A new user's bad-input tour (issue #19): each case ends in a clear one-line error or a safe result, checked by
its exit code, its message and the bytes on disk before and after.

Under `make reliability` (DFLASH_RELIABILITY_REPORT=1) each case is also a row of the reliability table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.shared import cache_format as cf
from tests.cache_compare import assert_same_cache
from tests.conftest import EXTRACT_ARGS, REPO, run_dflash

# The anchor rule the cases were set up with (1/6 of the positions, the default until 2026-12-06): with every
# position up to 24, case 6's damaged shard is read first by the main process's evaluation (eval_set), not by a
# loader worker, which is what case 6 is about.
TRAIN_ARGS = ("--draft-layers", "1", "--max-anchors", "24", "--anchor-density", str(1 / 6), "--batch-tokens", "768",
              "--num-workers", "1", "--eval-fraction", "0.15", "--eval-sequences", "6", "--mixed-precision", "no")


def tree_bytes(folder: Path) -> dict[str, str]:
    """Every file below `folder` (relative path -> sha256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def flip_feature_byte(cache: Path, shard: int) -> None:
    path = cf.shard_path(cache, shard) / "features" / "c" / "0" / "0"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))


def one_line_error(stderr: str) -> str:
    """The error line of a refused command; it must be the only non-log line and carry no traceback."""
    assert "Traceback" not in stderr and "DataLoader worker" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("dflash: error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


CASES = range(1, 9)  # the numbered cases of issue 19


def case(number: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a test as checking numbered case `number` of the issue (its row in the reliability table says so)."""
    def mark(test: Callable[..., None]) -> Callable[..., None]:
        test.tour_case = number  # type: ignore[attr-defined]
        return test

    return mark


@pytest.fixture(autouse=True)
def reliability_row(request: pytest.FixtureRequest) -> object:
    """Under `make reliability`: record this case in the reliability table (a failed case counts as data lost)."""
    yield
    if os.environ.get("DFLASH_RELIABILITY_REPORT"):
        from tests.end_to_end.test_reliability import _record

        failed = bool(getattr(request.node, "call_failed", True))
        number = getattr(request.function, "tour_case", None)
        name = request.node.originalname.removeprefix("test_")[:48]
        _record(f"bad input {number}: {name}" if number else f"bad input: {name}", not failed, int(failed))


def test_every_numbered_case_has_a_test() -> None:
    tested = {getattr(test, "tour_case", None) for name, test in globals().items() if name.startswith("test_")}
    assert set(CASES) <= tested


@pytest.fixture(scope="module")
def trained_run(baseline_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tour") / "run"
    run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "2", *TRAIN_ARGS,
               check=True)
    return run


# ------------------------------------------------------------------------- 1. repair, never a destroyed cache


@case(1)
def test_overwrite_of_an_existing_cache_is_refused_without_yes(baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    before = tree_bytes(cache)
    # The command the old `inspect --verify` printed, run as printed (defaults for everything else).
    result = run_dflash("extract", "--out", str(cache), "--only-shards", "1", "--overwrite")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "--yes" in result.stderr and f"dflash extract --repair --out {cache}" in result.stderr
    assert tree_bytes(cache) == before


def run_on_a_terminal(args: list[str], answer: str, timeout: float = 300) -> tuple[int, str]:
    """Run the real CLI with stdin, stdout and stderr on a pseudo-terminal (what a user at a shell has), answer its
    first question with `answer`, and return its exit code and everything it wrote there."""
    import select

    master, slave = os.openpty()
    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, stdin=slave,
                               stdout=slave, stderr=slave, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    output, answered, deadline = b"", False, time.time() + timeout
    try:
        while time.time() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every holder of the terminal's other side has closed it (the command ended)
                break
            if not chunk:
                break
            output += chunk
            if not answered and b"Continue? [y/N]:" in output:
                os.write(master, answer.encode() + b"\n")
                answered = True
    finally:
        os.close(master)
    return process.wait(timeout=60), output.decode(errors="replace").replace("\r\n", "\n")


@case(1)
@pytest.mark.parametrize("answer", ["n", "y"])
def test_overwrite_on_a_terminal_asks_first(baseline_cache: Path, chat_jsonl: Path, tmp_path: Path,
                                            answer: str) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    flip_feature_byte(cache, 1)
    before = tree_bytes(cache)
    # The options the cache was made with: a yes redoes shard 1 (other settings would discard the whole cache).
    code, output = run_on_a_terminal(["extract", "--data", str(chat_jsonl), "--out", str(cache), "--workers", "1",
                                      *EXTRACT_ARGS, "--only-shards", "1", "--overwrite"], answer)
    # The question says what is at stake: what the cache holds, and that other settings discard all of it.
    assert f"--overwrite: the cache {cache} holds 3 finished shard(s), " in output and "Continue? [y/N]:" in output
    assert "all of them are discarded if its settings differ" in output.replace("\n", " ")
    if answer == "n":
        assert code == 3 and "refused: not confirmed: nothing was changed" in output, output[-2000:]
        assert tree_bytes(cache) == before  # every byte as it was, the damaged one included
        return
    assert code == 0, output[-2000:]
    untouched = (f"{cf.SHARDS_DIR}/{cf.shard_name(0)}", f"{cf.SHARDS_DIR}/{cf.shard_name(2)}", cf.TARGET_DIR)
    assert {k: v for k, v in tree_bytes(cache).items() if k.startswith(untouched)} == \
        {k: v for k, v in before.items() if k.startswith(untouched)}
    assert_same_cache(baseline_cache, cache)  # shard 1 extracted again: the flipped byte is gone


@case(1)
def test_repair_of_a_cache_without_recorded_options_is_refused(baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    manifest = json.loads((cache / cf.MANIFEST_FILE).read_text())
    del manifest[cf.OPTIONS_KEY]
    (cache / cf.MANIFEST_FILE).write_text(json.dumps(manifest))
    flip_feature_byte(cache, 1)
    before = tree_bytes(cache)
    result = run_dflash("extract", "--repair", "--out", str(cache))
    assert result.returncode == 3 and "does not record the options" in result.stderr, result.stderr[-2000:]
    assert tree_bytes(cache) == before
    mixed = run_dflash("extract", "--repair", "--out", str(cache), "--max-length", "64")
    assert mixed.returncode == 2 and "leave out --max-length" in mixed.stderr


# Ways a shard goes bad: damaged bytes (same size: only checksums see it), a cut-off or missing file, a missing
# store, and a shard the manifest does not list as done (a run killed while writing it).
DAMAGES = ("flip", "truncate", "delete_chunk", "delete_store", "unfinished")


def damage(cache: Path, shard: int, how: str) -> None:
    store = cf.shard_path(cache, shard)
    if how == "flip":
        flip_feature_byte(cache, shard)
    elif how == "truncate":
        path = store / "features" / "c" / "0" / "0"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "delete_chunk":
        (store / "input_ids" / "c" / "0").unlink()
    elif how == "delete_store":
        shutil.rmtree(store)
    else:
        cf.update_manifest(cache, lambda manifest: manifest["shards"].__setitem__(str(shard), {"status": "pending"}))


def cheap_copy(cache: Path, to: Path) -> Path:
    """A copy of a cache to damage: its shards and manifest copied, its (large, read-only) target/ linked."""
    shutil.copytree(cache, to, ignore=lambda folder, _: [cf.TARGET_DIR] if Path(folder) == cache else [])
    (to / cf.TARGET_DIR).symlink_to(cache / cf.TARGET_DIR)
    return to


def stamps(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file below `folder` -> (sha256 of its bytes, its modification time): equal means never written."""
    return {k: (v, (folder / k).stat().st_mtime_ns) for k, v in tree_bytes(folder).items()}


damages = st.dictionaries(st.integers(0, 2), st.sampled_from(DAMAGES), min_size=1, max_size=3)


@case(1)
@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(damaged=damages)
def test_repair_redoes_exactly_the_damaged_shards(baseline_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                                                 damaged: dict[int, str]) -> None:
    """What --repair will redo, for any set of damaged shards and any kind of damage (cheap: no extraction)."""
    from dflash.stage1_extract.repair import repair_options

    cache = cheap_copy(baseline_cache, tmp_path_factory.mktemp("select") / "cache")
    for shard, how in damaged.items():
        damage(cache, shard, how)
    before = stamps(cache)
    options, shards = repair_options(cache)
    assert shards == sorted(damaged) and options.only_shards == ",".join(map(str, sorted(damaged)))
    recorded = cf.read_manifest(baseline_cache)[cf.OPTIONS_KEY]
    assert {k: getattr(options, k) for k in recorded} == recorded and options.redo and not options.overwrite
    assert stamps(cache) == before  # looking writes nothing


@case(1)
def test_repair_of_a_cache_recording_a_retired_option_leaves_it_out(baseline_cache: Path, tmp_path: Path) -> None:
    """A cache extracted before 2026-12-07 with --export-layers (removed) records `export_layers`: --repair redoes
    its damaged shards with the other recorded options (cheap: no extraction)."""
    from dflash.stage1_extract.repair import repair_options

    cache = cheap_copy(baseline_cache, tmp_path / "cache")
    manifest = json.loads((cache / cf.MANIFEST_FILE).read_text())
    recorded = dict(manifest[cf.OPTIONS_KEY])
    manifest[cf.OPTIONS_KEY]["export_layers"] = "last:5"
    (cache / cf.MANIFEST_FILE).write_text(json.dumps(manifest))
    damage(cache, 1, "flip")
    options, shards = repair_options(cache)
    assert shards == [1] and {k: getattr(options, k) for k in recorded} == recorded
    assert not hasattr(options, "export_layers")


def assert_repair_keeps_healthy_shards(baseline_cache: Path, cache: Path, damaged: dict[int, str]) -> None:
    for shard, how in damaged.items():
        damage(cache, shard, how)
    healthy = {s: stamps(cf.shard_path(cache, s)) for s in range(3) if s not in damaged}
    result = run_dflash("extract", "--repair", "--out", str(cache))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"repairing shards {sorted(damaged)}" in result.stderr
    assert {s: stamps(cf.shard_path(cache, s)) for s in healthy} == healthy  # not a byte, not a write
    assert_same_cache(baseline_cache, cache)  # the damaged shards hold again exactly what they held


@case(1)
def test_repair_leaves_healthy_shards_byte_identical(baseline_cache: Path, tmp_path: Path) -> None:
    assert_repair_keeps_healthy_shards(baseline_cache, cheap_copy(baseline_cache, tmp_path / "cache"),
                                       {0: "truncate", 2: "flip"})


@case(1)
@pytest.mark.slow  # one extraction per example: ~20 s each on 2 idle cores, 90 s on busy ones (make test-all, make reliability)
@pytest.mark.timeout(3600)
@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(damaged=damages)
def test_repair_leaves_healthy_shards_byte_identical_for_any_damage(
        baseline_cache: Path, tmp_path_factory: pytest.TempPathFactory, damaged: dict[int, str]) -> None:
    cache = cheap_copy(baseline_cache, tmp_path_factory.mktemp("repair") / "cache")
    assert_repair_keeps_healthy_shards(baseline_cache, cache, damaged)


# ---------------------------------------------------------------- 2. eval of a drafter made for another target


@case(2)
def test_eval_refuses_a_drafter_trained_for_another_target(trained_run: Path, tmp_path: Path) -> None:
    export = tmp_path / "export"
    shutil.copytree(trained_run / "export", export)
    info = json.loads((export / "dflash_target.json").read_text())
    info["target_hash"] = "0" * 64
    (export / "dflash_target.json").write_text(json.dumps(info))
    result = run_dflash("eval", "--draft", str(export), "--data", "mtbench", "--max-samples", "1",
                        "--max-new-tokens", "4", "--out", str(tmp_path / "eval"))
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert "0000000000000000" in line and "--allow-target-mismatch" in line
    assert not (tmp_path / "eval" / "eval.json").exists()


# ------------------------------------------------------------------------ 3. two trainings into one run folder


@case(3)
def test_train_into_an_existing_run_without_resume_is_refused(trained_run: Path, baseline_cache: Path,
                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = tree_bytes(run)
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "2", *TRAIN_ARGS)
    assert result.returncode == 2
    line = one_line_error(result.stderr)
    assert "already holds a training run" in line and "--resume" in line and "--overwrite" in line
    assert tree_bytes(run) == before


@case(3)
def test_second_train_into_a_run_being_written_is_refused(baseline_cache: Path, tmp_path: Path) -> None:
    from filelock import FileLock

    run = tmp_path / "run"
    run.mkdir()
    with FileLock(str(run / "train.lock")):  # what a running `dflash train` holds
        result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "2",
                            *TRAIN_ARGS)
    assert result.returncode == 2
    assert "another `dflash train` is writing into" in one_line_error(result.stderr)
    assert sorted(p.name for p in run.iterdir()) == ["train.lock"]


# ------------------------------------------------------------------------ 4. output folders that are not ours


@case(4)
def test_commands_refuse_an_output_folder_that_is_not_theirs(trained_run: Path, baseline_cache: Path,
                                                             chat_jsonl: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = tree_bytes(run)
    for command in ("extract", "generate"):
        result = run_dflash(command, "--data", str(chat_jsonl), "--out", str(run), "--max-samples", "2")
        assert result.returncode == 2, (command, result.stderr[-2000:])
        assert "is not empty and is not a dflash" in one_line_error(result.stderr)
        assert tree_bytes(run) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(mine), "--max-steps", "2", *TRAIN_ARGS)
    assert result.returncode == 2
    assert "is not empty and is not a dflash training run" in one_line_error(result.stderr)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


# -------------------------------------------------------------------------------- 5. a cache of 0 samples


@case(5)
def test_extract_that_keeps_no_sample_is_an_error(chat_jsonl: Path, tmp_path: Path) -> None:
    result = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(tmp_path / "cache"), "--max-length", "8",
                        "--max-samples", "3", "--workers", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    # The lengths the message must quote: the first 3 conversations, as the chat template tokenizes them.
    from dflash.shared.target_loading import load_tokenizer, resolve_target
    from dflash.stage1_extract.conversations import chat_token_ids, load_conversations

    tokenizer = load_tokenizer(resolve_target(None).load_path)
    lengths = sorted(len(chat_token_ids(tokenizer, [dict(m) for m in c.messages], add_generation_prompt=False))
                     for c in load_conversations(str(chat_jsonl), max_samples=3).conversations)
    line = one_line_error(result.stderr)
    assert line == (f"dflash: error: the cache {tmp_path / 'cache'} holds 0 samples: every conversation was skipped "
                    f"(no_assistant_tokens: 3); all 3 are longer than --max-length 8 (shortest {lengths[0]} tokens, "
                    f"median {lengths[1]}) and, cut there, keep no 2 assistant tokens to learn from: raise "
                    "--max-length (and rerun with --overwrite --yes)")


# ------------------------------------------------------------------ 6. a damaged shard read by a loader worker


@case(6)
def test_damaged_shard_in_a_dataloader_worker_is_one_line(baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    flip_feature_byte(cache, 1)  # same size: passes the checks at start, fails when a loader worker reads it
    run = tmp_path / "run"
    args = list(TRAIN_ARGS)
    args[args.index("--num-workers") + 1] = "2"
    result = run_dflash("train", "--cache", str(cache), "--out", str(run), "--max-steps", "2", "--eval-every", "0",
                        *args)
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert "shard 1" in line and f"dflash extract --repair --out {cache}" in line
    log = (run / "train.log").read_text()
    assert "DataLoader worker" in log and "Traceback" in log  # the traceback: in the log only


@case(6)
def test_damaged_shard_in_one_of_two_training_processes_is_one_line(baseline_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    flip_feature_byte(cache, 1)
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(cache), "--out", str(run), "--max-steps", "2", "--eval-every", "0",
                        "--processes", "2", *TRAIN_ARGS)
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert "shard 1" in line and f"dflash extract --repair --out {cache}" in line
    logs = "".join(path.read_text() for path in run.glob("train*.log"))
    assert "DataLoader worker" in logs and "Traceback" in logs  # the traceback: in the failing process's log only


# ------------------------------------------------------------------------------------ 7. Ctrl-C in train


@case(7)
def test_ctrl_c_in_train_exits_130_and_prints_the_resume_command(baseline_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "500", "--eval-every", "0",
            "--checkpoint-every", "1", *TRAIN_ARGS]
    # A child inherits an ignored SIGINT (and Python then installs no Ctrl-C handler), as when the tests run as a
    # background job of a non-interactive shell: give it the default disposition, as a terminal does.
    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    # Interrupt once a checkpoint is complete: the run is mid-training, with something to resume from.
    while not list((run / "checkpoints").glob("*/complete")) and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "Aborted!" not in stderr and "Traceback" not in stderr
    assert "interrupted (SIGINT)" in stderr and "--resume" in stderr and str(run) in stderr
    assert 1 <= len(list((run / "checkpoints").glob("*/complete"))) <= 3  # --keep-checkpoints 3 by default


def interrupt_when(args: list[str], ready: Callable[[], bool], signum: signal.Signals,
                   min_children: int = 1) -> tuple[int, str]:
    """Run the real CLI as a shell job (its own process group, Ctrl-C's default disposition), wait until `ready()`,
    then interrupt it as a user does: SIGINT to the whole group (Ctrl-C at a terminal), SIGTERM to the command's
    process alone (`kill PID`). Returns its exit code and stderr, once every process it had started (at least
    `min_children`) is gone: none may be left running, orphaned or unreaped."""
    import psutil

    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", *args], cwd=REPO, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while not ready() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()[1][-3000:]
    family = psutil.Process(process.pid).children(recursive=True)

    def command(member: psutil.Process) -> str:
        try:
            return " ".join(member.cmdline())
        except psutil.Error:  # a loader worker that has just ended
            return ""

    assert len([p for p in family if "spawn_main" in command(p) or "dflash" in command(p)]) >= min_children
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    deadline = time.time() + 10  # a multiprocessing resource tracker ends once the command has ended

    def left() -> list[psutil.Process]:
        return [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    while left() and time.time() < deadline:
        time.sleep(0.2)
    assert not left(), [command(p) for p in left()]
    assert "Traceback" not in stderr and "Aborted!" not in stderr, stderr[-3000:]
    return process.returncode, stderr


@case(7)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_train_with_two_processes_stops_them_all(baseline_cache: Path, tmp_path: Path,
                                                             signum: signal.Signals) -> None:
    run = tmp_path / "run"
    args = ["train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "500", "--eval-every", "0",
            "--checkpoint-every", "1", "--processes", "2", *TRAIN_ARGS]
    code, stderr = interrupt_when(args, lambda: bool(list((run / "checkpoints").glob("*/complete"))), signum,
                                  min_children=2)
    assert code == 128 + signum, stderr[-3000:]
    resume = [line for line in stderr.splitlines() if "--resume" in line]
    assert resume == [f"dflash train: interrupted ({signum.name}); the last checkpoint is kept; continue with: "
                      f"{shlex.join(['dflash', *args, '--resume'])}"]


@case(7)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_generate_exits_with_the_way_on(chat_jsonl: Path, tmp_path: Path, signum: signal.Signals) -> None:
    out = tmp_path / "generated"
    args = ["generate", "--data", str(chat_jsonl), "--out", str(out), "--max-new-tokens", "32", "--workers", "1"]
    code, stderr = interrupt_when(args, lambda: (out / cf.STATUS_DIR / "worker-0.json").is_file(), signum)
    assert code == 128 + signum, stderr[-3000:]
    assert stderr.splitlines()[-1] == (f"dflash generate: interrupted ({signum.name}); rerun the same command to "
                                       "resume (finished conversations are kept)")
    assert cf.read_status(out)["run"]["state"] == "interrupted" and not (out / "conversations.jsonl").exists()


@case(7)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_eval_exits_with_the_way_on(trained_run: Path, tmp_path: Path, signum: signal.Signals) -> None:
    out = tmp_path / "eval"
    args = ["eval", "--draft", str(trained_run / "export"), "--data", "mtbench", "--max-samples", "20",
            "--max-new-tokens", "16", "--out", str(out)]

    def evaluating() -> bool:
        return (out / "eval.log").is_file() and "warming up" in (out / "eval.log").read_text()

    code, stderr = interrupt_when(args, evaluating, signum, min_children=0)
    assert code == 128 + signum, stderr[-3000:]
    assert stderr.splitlines()[-1] == (f"dflash eval: interrupted ({signum.name}); nothing is kept of an unfinished "
                                       "evaluation: rerun the same command")
    assert sorted(p.name for p in out.iterdir()) == ["eval.log"]


# ------------------------------------------------------------------ 8. messages that name the file, not the cause


@case(8)
def test_damaged_model_file_and_malformed_json_are_named_with_their_cause(chat_jsonl: Path, tmp_path: Path) -> None:
    from dflash.shared import embedded

    gguf = tmp_path / "model.gguf"
    with open(embedded.smollm2_gguf(), "rb") as whole:
        gguf.write_bytes(whole.read(3000))  # a download cut off early
    result = run_dflash("extract", "--model", str(gguf), "--data", str(chat_jsonl), "--out", str(tmp_path / "a"))
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert line.startswith(f"dflash: error: {gguf} is truncated or damaged: its header and tensors do not fit in its "
                           "3,000 bytes") and line.endswith(": download or copy it again")
    data = tmp_path / "chats.jsonl"
    data.write_text(chat_jsonl.read_text().splitlines()[0] + '\n{"messages": "unterminated\n')
    result = run_dflash("extract", "--data", str(data), "--out", str(tmp_path / "b"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert one_line_error(result.stderr) == (
        "dflash: error: chats.jsonl:2: malformed JSON line (Unterminated string starting at column 14); fix or "
        "delete that line (JSON Lines needs one complete JSON object per line)")


# ------------------------------------------------------------------------------------ small first-day things


def test_status_reports_a_training_run(trained_run: Path) -> None:
    from click.testing import CliRunner
    from filelock import FileLock

    from dflash.shared.cli import dflash

    result = CliRunner().invoke(dflash, ["status", "--cache", str(trained_run)])
    assert result.exit_code == 0, result.output
    assert f"training run {trained_run}: finished, step 2/2" in result.output
    assert "latest checkpoint: step-00000002" in result.output
    with FileLock(str(trained_run / "train.lock")):  # what a running `dflash train` holds
        report = json.loads(CliRunner().invoke(dflash, ["status", "--cache", str(trained_run), "--json"]).output)
    assert report["state"] == "running" and report["step"] == 2 and report["tau"] is not None


def test_make_all_prints_the_final_table_once(tmp_path: Path) -> None:
    commands = subprocess.run(["make", "-n", "all", f"WORK={tmp_path}"], cwd=REPO, text=True, capture_output=True,
                              check=True).stdout
    # Its one table is what `dflash eval` prints (next test); nothing prints eval.md a second time.
    assert commands.count("dflash eval ") == 1 and "eval.md" not in commands


@pytest.mark.slow  # an evaluation: ~15 s on 2 idle cores, 40 s on busy ones
def test_eval_prints_its_table_once(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = run_dflash("eval", "--draft", str(trained_run / "export"), "--data", "mtbench", "--max-samples", "1",
                        "--max-new-tokens", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == (out / "eval.md").read_text() + "\n"  # what `dflash eval` prints: the table, once
    assert (result.stdout + result.stderr).count("| dataset | prompts |") == 1
