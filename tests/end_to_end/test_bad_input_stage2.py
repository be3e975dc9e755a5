"""The second bad-input tour (issue 32), stage 2 and the disk: damaged checkpoints, write errors (read-only file
system, full disk, file-size limit), training options that cannot work, a damaged drafter export. Each case ends in
one line (exit code, message, no traceback) and leaves what was written before intact, checked on disk."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash.shared.errors import UserError, hidden_os_error, os_error_message
from dflash.shared.run_files import RunFiles
from tests.conftest import REPO, assert_same_training, run_dflash
from tests.end_to_end.test_bad_input_tour import TRAIN_ARGS, one_line_error, tree_bytes

STEP_ARGS = ("--eval-every", "0", "--checkpoint-every", "1", "--keep-checkpoints", "0", *TRAIN_ARGS)


def step(n: int) -> str:
    return f"step-{n:08d}"


@pytest.fixture(scope="module")
def checkpointed_run(baseline_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step run with a checkpoint after every step."""
    run = tmp_path_factory.mktemp("stage2_tour") / "run"
    run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "3", *STEP_ARGS,
               check=True)
    return run


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("train.lock"))
    return to


def cut(path: Path, keep: int = 1000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ------------------------------------------------------------------------- checkpoints, verified


def test_checkpoints_record_their_files_and_leave_no_temporary_folder(checkpointed_run: Path) -> None:
    from dflash.stage2_train.checkpoints import checkpoint_damage, has_checkpoint, sha256_of

    folders = sorted(p.name for p in (checkpointed_run / "checkpoints").iterdir())
    assert folders == [step(1), step(2), step(3)]  # no .step-N.partial left behind
    for name in folders:
        checkpoint = checkpointed_run / "checkpoints" / name
        record = json.loads((checkpoint / "complete").read_text())
        on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {"complete"}
        assert record["step"] == int(name.split("-")[1]) and set(record["files"]) == on_disk
        assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= on_disk
        for file, written in record["files"].items():  # compared with hashlib directly, not the recorded values
            assert written == {"bytes": (checkpoint / file).stat().st_size, "sha256": sha256_of(checkpoint / file)}
        assert checkpoint_damage(checkpoint) is None
    assert has_checkpoint(RunFiles(checkpointed_run), 3)


def test_resume_passes_over_damaged_checkpoints_to_the_newest_intact_one(checkpointed_run: Path, baseline_cache: Path,
                                                                         tmp_path: Path) -> None:
    """The latest checkpoint has a truncated model.safetensors, the one before lost its optimizer.bin: --resume
    names both in one warning and continues from step 1, replaying steps 2 and 3 as the first run did."""
    run = copy_run(checkpointed_run, tmp_path / "run")
    cut(run / "checkpoints" / step(3) / "model.safetensors")
    (run / "checkpoints" / step(2) / "optimizer.bin").unlink()
    intact = tree_bytes(run / "checkpoints" / step(1))
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "3", *STEP_ARGS,
                        "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if "damaged checkpoint" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert f"{step(3)} (model.safetensors has 1,000 bytes, " in warnings[0]
    assert f"{step(2)} (optimizer.bin is missing)" in warnings[0] and f"using {step(1)}" in warnings[0]
    assert f"resumed from {run / 'checkpoints' / step(1)} (step 1," in result.stderr
    assert tree_bytes(run / "checkpoints" / step(1)) == intact
    assert_same_training(run, checkpointed_run, loss_rel=1e-4)
    from dflash.stage2_train.checkpoints import checkpoint_damage

    for n in (2, 3):  # saved again, whole
        assert checkpoint_damage(run / "checkpoints" / step(n)) is None


def test_export_passes_over_a_damaged_checkpoint_and_refuses_it_by_name(checkpointed_run: Path,
                                                                        tmp_path: Path) -> None:
    run = copy_run(checkpointed_run, tmp_path / "run")
    cut(run / "checkpoints" / step(3) / "custom_checkpoint_0.pkl", keep=10)
    result = run_dflash("export", "--run", str(run), "--out", str(tmp_path / "export"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{step(3)} (custom_checkpoint_0.pkl has 10 bytes, " in result.stderr
    assert f"using {step(2)}, the newest intact one" in result.stderr
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    saved = load_file(str(run / "checkpoints" / step(2) / "model.safetensors"))
    assert sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    refused = run_dflash("export", "--run", str(run), "--checkpoint", str(run / "checkpoints" / step(3)),
                         "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = one_line_error(refused.stderr)
    assert f"{step(3)} is damaged (custom_checkpoint_0.pkl has 10 bytes" in line
    assert not (tmp_path / "refused").exists()


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_with_the_list(checkpointed_run: Path,
                                                                          baseline_cache: Path,
                                                                          tmp_path: Path) -> None:
    run = copy_run(checkpointed_run, tmp_path / "run")
    cut(run / "checkpoints" / step(3) / "model.safetensors")
    (run / "checkpoints" / step(2) / "optimizer.bin").unlink()
    cut(run / "checkpoints" / step(1) / "custom_checkpoint_0.pkl", keep=10)
    before = tree_bytes(run / "checkpoints")
    from dflash.stage2_train.checkpoints import has_checkpoint

    # a run that reaches step 3 again saves it anew (the damaged one does not count as saved)
    assert not has_checkpoint(RunFiles(run), 3)
    for args in (("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "3", *STEP_ARGS,
                  "--resume"), ("export", "--run", str(run))):
        result = run_dflash(*args)
        assert result.returncode == 2, result.stderr[-2000:]
        line = one_line_error(result.stderr)
        assert "every checkpoint in" in line and "is damaged" in line, line
        for n in (1, 2, 3):
            assert step(n) in line, line
        assert tree_bytes(run / "checkpoints") == before
    assert "error: --resume: every checkpoint in" in (run / "train.log").read_text()  # the log has the line too


# ------------------------------------------------------------------------- write errors: one line, nothing lost


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An empty 1 MiB tmpfs (resize or remount it with `_mount("-o", "remount,...", path)`). Needs root."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a tmpfs (run the suite as root to test a full or read-only disk)")
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_out_on_a_read_only_file_system_is_one_line_in_every_command(small_tmpfs: Path, baseline_cache: Path,
                                                                       checkpointed_run: Path,
                                                                       chat_jsonl: Path) -> None:
    assert _mount("-o", "remount,ro", str(small_tmpfs)).returncode == 0
    commands = {
        "train": ("train", "--cache", str(baseline_cache), "--out", str(small_tmpfs / "run"), "--max-steps", "1",
                  *TRAIN_ARGS),
        "extract": ("extract", "--data", str(chat_jsonl), "--out", str(small_tmpfs / "cache"), "--workers", "1"),
        "eval": ("eval", "--draft", str(checkpointed_run / "export"), "--data", str(chat_jsonl), "--max-samples", "1",
                 "--out", str(small_tmpfs / "eval")),
        "export": ("export", "--run", str(checkpointed_run), "--out", str(small_tmpfs / "export")),
        "generate": ("generate", "--data", str(chat_jsonl), "--out", str(small_tmpfs / "generated"),
                     "--max-samples", "1", "--workers", "1"),
    }
    for name, args in commands.items():
        result = run_dflash(*args, timeout=300)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        line = one_line_error(result.stderr)
        assert f"{small_tmpfs}" in line and "is on a read-only file system: write to a folder on a writable disk" \
            in line, (name, line)
    assert list(small_tmpfs.iterdir()) == []


def test_full_disk_while_saving_a_checkpoint_keeps_the_last_one_and_resumes(small_tmpfs: Path, baseline_cache: Path,
                                                                            checkpointed_run: Path) -> None:
    """Room for one checkpoint and a half: step 1's is saved, step 2's runs out of space inside torch.save (whose
    own message, "unexpected pos", says nothing of the disk). One line says the disk is full and how to go on; step
    1's checkpoint is intact and no half-written one is left; with space freed, --resume finishes the run."""
    from dflash.stage2_train.checkpoints import checkpoint_damage

    checkpoint_bytes = sum(p.stat().st_size for p in (checkpointed_run / "checkpoints" / step(1)).iterdir())
    assert _mount("-o", f"remount,size={checkpoint_bytes * 3 // 2 // 1024}k", str(small_tmpfs)).returncode == 0
    run = small_tmpfs / "run"
    args = ("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "3", *STEP_ARGS)
    failed = run_dflash(*args)
    assert failed.returncode == 2, failed.stderr[-3000:]
    line = one_line_error(failed.stderr)
    assert f"disk full (no space left on device) while writing {run / 'checkpoints'}" in line, line
    assert "free space on that disk; the last checkpoint is kept; continue with: dflash train " in line, line
    assert line.endswith(" --resume"), line
    assert line.removeprefix("dflash: ") in (run / "train.log").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [step(1)]
    assert checkpoint_damage(run / "checkpoints" / step(1)) is None
    assert _mount("-o", f"remount,size={checkpoint_bytes * 5 // 1024}k", str(small_tmpfs)).returncode == 0
    resumed = run_dflash(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / step(1)}" in resumed.stderr
    assert_same_training(run, checkpointed_run, loss_rel=1e-4)


def test_file_size_limit_while_saving_a_checkpoint_is_one_line_also_in_the_log(checkpointed_run: Path,
                                                                               baseline_cache: Path,
                                                                               tmp_path: Path) -> None:
    """`ulimit -f` below the optimizer state's size: model.safetensors fits, optimizer.bin does not (torch.save's
    "unexpected pos" again). SIGXFSZ is ignored, as Python itself does, so the write fails with EFBIG."""
    sizes = {p.name: p.stat().st_size for p in (checkpointed_run / "checkpoints" / step(1)).iterdir()}
    limit = (sizes["model.safetensors"] + sizes["optimizer.bin"]) // 2
    assert sizes["model.safetensors"] < limit < sizes["optimizer.bin"]

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "dflash.shared.cli", "train", "--cache", str(baseline_cache),
                             "--out", str(run), "--max-steps", "1", *STEP_ARGS], cwd=REPO, preexec_fn=limited,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, capture_output=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert f"file too large: writing {run / 'checkpoints'}" in line and "optimizer.bin" in line, line
    assert f"(`ulimit -f`: {limit:,} bytes)" in line and "raise the limit (`ulimit -f unlimited`)" in line, line
    assert line.removeprefix("dflash: ") in (run / "train.log").read_text()
    assert list((run / "checkpoints").iterdir()) == []  # nothing half written, not even the temporary folder


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM])
def test_each_os_error_family_names_the_path_and_what_to_change(code: int) -> None:
    line = os_error_message(OSError(code, os.strerror(code), "/data/run/metrics.jsonl"))
    assert line is not None and "/data/run/metrics.jsonl" in line
    advice = {errno.ENOSPC: "free space", errno.EFBIG: "raise the limit", errno.EROFS: "writable disk",
              errno.EACCES: "chmod / chown", errno.EPERM: "chmod / chown"}[code]
    assert advice in line
    assert os_error_message(OSError(errno.ENOENT, "No such file or directory", "x")) is None


def test_os_errors_hidden_in_safetensors_and_torch_messages_are_found(tmp_path: Path) -> None:
    rust = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    found = hidden_os_error(rust, tmp_path)
    assert found is not None and found.errno == errno.EFBIG and found.filename == str(tmp_path)
    # torch's zip writer with room on the disk and no file-size limit: not a write error dflash can name
    assert hidden_os_error(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                           tmp_path) is None
    assert hidden_os_error(RuntimeError("something else"), tmp_path) is None


# ------------------------------------------------------------------------- options that cannot work


@pytest.mark.parametrize("lr", ["0", "-1"])
def test_a_learning_rate_that_is_not_positive_is_refused_by_the_cli(baseline_cache: Path, tmp_path: Path,
                                                                    lr: str) -> None:
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(tmp_path / "run"), "--lr", lr)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"Invalid value for '--lr': {float(lr)} is not in the range x>0" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_loss_that_does_not_move_stops_the_training_and_small_batch_tokens_are_explained(baseline_cache: Path,
                                                                                           tmp_path: Path) -> None:
    """--lr 1e6 drives the drafter to predict every token alike (loss = ln 49152 = 10.8027 on every batch): the
    run stops after 10 such steps with one line, instead of training on and exporting a drafter of tau 1.0. Its
    --batch-tokens 16, below any sequence, is said up front with what it does."""
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(baseline_cache), "--out", str(run), "--max-steps", "40",
                        "--eval-every", "0", "--checkpoint-every", "5", *TRAIN_ARGS, "--lr", "1e6",
                        "--batch-tokens", "16")
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert "training stopped at step 11: the loss has stayed at 10.8027 (the log of the vocabulary size" in line
    assert "for 10 steps" in line and "lower --lr (now 1e+06)" in line, line
    notes = [n for n in result.stderr.splitlines() if n.startswith("WARNING --batch-tokens 16 is below the cost of")]
    assert len(notes) == 1 and "every micro-batch holds one sequence" in notes[0], result.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [step(5), step(10)]  # kept, not exported
    assert not (run / "export").exists()


def test_a_loss_that_is_not_finite_stops_the_training() -> None:
    from dflash.stage2_train.trainer import STUCK_STEPS, check_loss

    run = SimpleNamespace(state=SimpleNamespace(step=7), options=SimpleNamespace(lr=3.0),
                          config=SimpleNamespace(vocab_size=100))
    for loss in (float("nan"), float("inf")):
        with pytest.raises(UserError, match=rf"step 7: the loss is {loss} \(not finite\).*lower --lr \(now 3\)"):
            check_loss(run, [], loss)  # type: ignore[arg-type]
    recent: list[float] = []
    for i in range(3 * STUCK_STEPS):  # a loss that moves by 1e-4 relative per step goes on
        recent = check_loss(run, recent, 2.0 * (1 + 1e-4 * (i % 2)))  # type: ignore[arg-type]
    assert len(recent) == STUCK_STEPS


# ------------------------------------------------------------------------- eval and the loss plot


def test_eval_of_a_truncated_drafter_is_one_line(checkpointed_run: Path, chat_jsonl: Path, tmp_path: Path) -> None:
    draft = tmp_path / "export"
    shutil.copytree(checkpointed_run / "export", draft)
    cut(draft / "model.safetensors", keep=4096)
    before = tree_bytes(draft)
    result = run_dflash("eval", "--draft", str(draft), "--data", str(chat_jsonl), "--max-samples", "1",
                        "--out", str(tmp_path / "eval"))
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert f"{draft / 'model.safetensors'} is damaged (" in line and "export the drafter again" in line, line
    assert tree_bytes(draft) == before
    assert line.removeprefix("dflash: ") in (tmp_path / "eval" / "eval.log").read_text()


def test_the_loss_plot_is_on_a_log_scale() -> None:
    from dflash.stage2_train.plots import training_figure

    records = [{"step": s, "loss": 75.0 if s == 1 else 3.0 - s / 100} for s in range(1, 50)]
    figure = training_figure(records)
    assert figure.axes[0].get_yscale() == "log" and "log scale" in figure.axes[0].get_ylabel()
