"""The memory plan of `dflash train` through the real CLI: the default flags report their planned and measured
peaks, a --memory-limit splits micro-batches to the same loss curve or refuses in one line, and a real cgroup
memory cap is planned for rather than killed; the cgroup files are read right (fake v1 / v2 trees)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.stage2_train.cache_index import CacheIndex
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch
from tests.conftest import REPO, run_dflash
from tests.faults import OOM_COPY_SEQUENCES_ENV, OOM_SEQUENCES_ENV, SMALLER_MEMORY_STEPS_ENV, fault_env
from tests.stage2_train.conftest import TEST_ANCHOR_DENSITY, TRAIN_ARGS, final_losses


def test_default_flags_train_and_report_the_memory_plan(train_cache: Path, tmp_path: Path) -> None:
    """`dflash train --cache C --out R` with every flag at its default (steps bounded by --max-steps) trains the
    5-layer drafter, exports it, and logs its planned and measured memory peaks."""
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--max-steps", "1")  # ~90 s: a step of 49,152 tokens
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run / "train.log").read_text()
    planned, measured, in_use = (float(x) for x in re.search(
        r"planned peak ([\d.]+) GiB, measured ([\d.]+) GiB above the ([\d.]+) GiB in use", log).groups())
    assert 0 < measured <= planned and 0 < in_use  # the plan errs on the high side
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["num_hidden_layers"] == 5 and sorted(final_losses(run)) == [1]
    # The loader's workers chosen for the CPU, said and recorded.
    assert "loader: 2 worker(s) a process (chosen for cpu; --num-workers N to change)" in result.stderr
    assert json.loads((run / "train_options.json").read_text())["num_workers"] == 2


PLAN_ARGS = ("--max-steps", "3", "--eval-every", "0", "--checkpoint-every", "0", *TRAIN_ARGS)


@pytest.fixture(scope="module")
def unconstrained_run(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps with PLAN_ARGS and no memory limit: the loss curve the memory-limited runs must reproduce."""
    run = tmp_path_factory.mktemp("unconstrained") / "run"
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(run), *PLAN_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_memory_plan_splits_micro_batches_to_the_same_losses_or_refuses(train_cache: Path, unconstrained_run: Path,
                                                                          tmp_path: Path) -> None:
    """Under a memory limit between what the longest sequence and the largest micro-batch need, micro-batches are
    split and accumulated: the same loss curve (float rounding, rel 1e-4); under a limit the longest sequence
    cannot meet, the run stops before its first step with one line naming the estimate, the limit and the flag."""
    from dflash.stage2_train import memory_plan as mp

    common = PLAN_ARGS
    config = DFlashConfig.from_dict(json.loads((unconstrained_run / "draft_config.json").read_text()))
    shape = mp.DrafterShape.of(config, sum(p.numel() for p in training_drafter(config).parameters()), 4)
    index = CacheIndex.from_cache(train_cache, 0.15, 0)
    rule = AnchorRule(TEST_ANCHOR_DENSITY, 24, 16)  # the rule of the runs' TRAIN_ARGS
    need = lambda samples: int(mp.step_bytes(shape, sum(s.length for s in samples),  # noqa: E731
                                             int(rule.count([s.n_anchor_candidates for s in samples]).sum())))
    single = max(need([s]) for s in index.train)
    largest = max(need(pack) for pack in plan_epoch(index, 0, 0, 2304, 1, rule))
    assert largest > 1.1 * single  # micro-batches of several sequences: there is something to split
    limit = (mp.fixed_bytes(shape) + mp.SAFETY * (single + largest) / 2) / mp.GIB  # fits one sequence, not all
    split = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / "split"), *common,
                       "--memory-limit", f"{limit:.6f}")
    assert split.returncode == 0, split.stderr[-3000:]
    assert "split and accumulated" in split.stderr
    expected, got = final_losses(unconstrained_run), final_losses(tmp_path / "split")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    refused = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / "refused"), *common,
                         "--memory-limit", f"{0.5 * single / mp.GIB:.6f}")
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("dflash: error: one training step on the longest sequence") and "--max-anchors" in line
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused" / "checkpoints").exists()


def test_a_step_out_of_memory_is_retried_smaller_to_the_same_losses_or_stops(train_cache: Path,
                                                                            unconstrained_run: Path,
                                                                            tmp_path: Path) -> None:
    """A step that runs out of memory although the plan let it through (here a fake error after the backward of
    every micro-batch of more than 1 sequence, so that half-accumulated gradients must be dropped) is retried from
    the same samples in smaller micro-batches: the same loss curve as the run that never ran out. When even single
    sequences run out (a fake limit of 0), the run stops with one line naming the flags, exit 2, no traceback."""
    common = ("train", "--cache", str(train_cache), *PLAN_ARGS)
    retried = run_dflash(*common, "--out", str(tmp_path / "retried"), env=fault_env(**{OOM_SEQUENCES_ENV: "1"}))
    assert retried.returncode == 0, retried.stderr[-3000:]
    assert "ran out of memory on cpu (fake out-of-memory error" in retried.stderr
    assert "retrying it in smaller micro-batches" in retried.stderr
    retries = int(re.search(r"; out of memory (\d+) time\(s\), each step retried in smaller micro-batches",
                            (tmp_path / "retried" / "train.log").read_text()).group(1))
    assert 1 <= retries <= 6  # the smaller budget stays: later steps do not run out again and again
    expected, got = final_losses(unconstrained_run), final_losses(tmp_path / "retried")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    # The same where the micro-batch runs out while it is copied in (before its forward): retried, the same losses;
    # here the smaller budget holds for one step only: step 2 returns to the planned budget, runs out again (the fake
    # error is no transient) and is retried again, and the smaller budget then holds twice as long (past step 3).
    copied = run_dflash(*common, "--out", str(tmp_path / "copied"),
                        env=fault_env(**{OOM_COPY_SEQUENCES_ENV: "1", SMALLER_MEMORY_STEPS_ENV: "1"}))
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert f"fake out-of-memory error ({OOM_COPY_SEQUENCES_ENV}=1" in copied.stderr
    assert "the planned budget again after 1 steps" in copied.stderr
    assert "the planned budget again after 2 steps" in copied.stderr
    returned = re.findall(r"step (\d+): back to the planned micro-batch budget .* after (\d+) steps in smaller ones",
                          copied.stderr)
    assert returned == [("2", "1")]
    got = final_losses(tmp_path / "copied")
    assert sorted(got) == [1, 2, 3] and all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in expected)
    stopped = run_dflash(*common, "--out", str(tmp_path / "stopped"), env=fault_env(**{OOM_SEQUENCES_ENV: "0"}))
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith("dflash: error: training step 1 ran out of memory on cpu with one sequence per "
                           "micro-batch") and "--memory-limit" in line and "--max-anchors" in line
    assert "Traceback" not in stopped.stderr


def test_the_smaller_budget_holds_its_steps_and_doubles_only_when_the_return_runs_out_again() -> None:
    """After a retry the smaller plan holds `SMALLER_MEMORY_STEPS` steps, then the planned one comes back; running
    out again while it holds restarts the hold at its length, running out soon after a return doubles it, and
    running out long after a return starts again from `SMALLER_MEMORY_STEPS`."""
    from types import SimpleNamespace

    from dflash.stage2_train import trainer

    base = trainer.SMALLER_MEMORY_STEPS
    planned, smaller = SimpleNamespace(budget_bytes=8 << 30), SimpleNamespace(budget_bytes=1 << 30)
    run = SimpleNamespace(planned_memory=planned, memory=planned, memory_hold=None, planned_memory_returns=0,
                          state=SimpleNamespace(step=10))

    def run_out_at(step: int) -> None:
        run.state.step = step
        run.memory, run.memory_hold = smaller, trainer.smaller_budget_hold(run)

    def step_to(step: int) -> None:
        run.state.step = step
        trainer.return_to_planned_memory(run)

    run_out_at(10)
    assert (run.memory_hold.until_step, run.memory_hold.steps, run.memory_hold.since_step) == (10 + base, base, 10)
    run_out_at(300)  # again while it holds: the same length from here
    assert (run.memory_hold.until_step, run.memory_hold.steps, run.memory_hold.since_step) == (300 + base, base, 10)
    step_to(300 + base - 1)
    assert run.memory is smaller and run.planned_memory_returns == 0
    step_to(300 + base)
    assert run.memory is planned and run.planned_memory_returns == 1
    run_out_at(300 + 2 * base - 1)  # soon after the return: twice as long
    assert run.memory_hold.steps == 2 * base
    step_to(run.memory_hold.until_step)
    assert run.memory is planned and run.planned_memory_returns == 2
    run_out_at(run.memory_hold.until_step + 2 * base)  # long after it: from the start again
    assert run.memory_hold.steps == base


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=30), data=st.data())
def test_each_out_of_memory_retry_halves_the_budget_until_single_sequences(lengths: list[int], data: st.DataObject) -> None:
    """`after_out_of_memory` always makes progress: each retry at least halves what the sequences of the costliest
    part of several sequences that failed may add to a step's fixed cost, the new parts still cover the micro-batch in order, every part of
    several sequences fits the new budget, and once all parts are single sequences it gives up (None), after a
    few retries (the budget halves from the whole micro-batch's estimate down to the cheapest pair's)."""
    import numpy as np

    from dflash.stage2_train import memory_plan as mp

    shape = mp.DrafterShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2,
                            context_dim=128, vocab=1000, block_size=16, element_bytes=4, trainable_params=10_000)
    lengths_array = np.array(lengths)
    blocks = np.array([data.draw(st.integers(1, max(1, n // 6))) for n in lengths])
    plan = mp.make_plan(shape, (int(lengths_array.sum()), int(blocks.sum())), (2000, 400), 1 << 40, "test")
    parts = plan.parts(lengths_array, blocks)
    assert parts == [(0, len(lengths))]  # everything fits the plan
    for retries in range(64):
        sizes = plan.part_sizes(lengths_array, blocks)
        smaller = plan.after_out_of_memory(sizes)
        if smaller is None:
            assert all(b - a == 1 for a, b in parts)
            break
        base = int(mp.step_bytes(shape, 0, 0))  # what any step costs, whatever its sequences (the loss chunk)
        assert smaller.budget_bytes - base <= (max(size for size, sequences in sizes if sequences > 1) - base) // 2
        cut = smaller.parts(lengths_array, blocks)
        assert cut[0][0] == 0 and cut[-1][1] == len(lengths) and all(b > a for a, b in cut)
        assert all(x[1] == y[0] for x, y in zip(cut, cut[1:]))
        assert all(size <= smaller.budget_bytes for size, sequences in smaller.part_sizes(lengths_array, blocks)
                   if sequences > 1)
        plan, parts = smaller, cut
    assert retries < 20


def test_a_failed_cpu_allocation_counts_as_out_of_memory() -> None:
    """The CPU allocator's failure (a real one: more bytes than any machine has) is recognised like CUDA's
    OutOfMemoryError; other runtime errors are not."""
    import torch

    from dflash.shared.errors import is_out_of_memory

    with pytest.raises(RuntimeError) as failed:
        torch.empty(1 << 60, dtype=torch.uint8)
    assert is_out_of_memory(failed.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))


def _own_memory_cgroup() -> tuple[Path, str, str] | None:
    """(folder, limit file, procs file) of a memory cgroup this test may create children in, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (folder / "cgroup.controllers").is_file() and "memory" in (folder / "cgroup.controllers").read_text():
                return folder, "memory.max", "cgroup.procs"
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if folder.is_dir():
                return folder, "memory.limit_in_bytes", "cgroup.procs"
    return None


def _train_in_memory_cgroup(limit_gib: float, args: tuple[str, ...], tmp_path: Path) -> subprocess.CompletedProcess:
    """`dflash train ARGS` as the only process of a new memory cgroup with this hard limit (the kernel's OOM killer
    ends what exceeds it, as on a container or a batch job's allocation)."""
    found = _own_memory_cgroup()
    if found is None or os.geteuid() != 0:
        pytest.skip("no writable memory cgroup here (needs root and a cgroup memory controller)")
    parent, limit_file, procs_file = found
    group = parent / f"dflash-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(int(limit_gib * (1 << 30))))
    except OSError as error:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {error}")
    join = lambda: (group / procs_file).write_text(str(os.getpid()))  # noqa: E731  (runs in the child, before exec)
    try:
        return subprocess.run([sys.executable, "-m", "dflash.shared.cli", "train", *args], cwd=REPO, text=True,
                              capture_output=True, timeout=600, preexec_fn=join,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        group.rmdir()


def test_cgroup_memory_limit_is_planned_for_not_killed(train_cache: Path, unconstrained_run: Path,
                                                       tmp_path: Path) -> None:
    """Under a real OS memory cap (a cgroup, no --memory-limit) the plan sees the cap: with 3 GiB the run finishes
    with the same loss curve as without a cap and logs less than 3 GiB free; with 1.5 GiB (the interpreter, torch
    and the data already take ~0.6 GiB, and 1 GiB stays free for the loader) it stops before its first step with
    the plan's one line, exit 2, instead of being killed by the kernel."""
    common = ("--cache", str(train_cache), *PLAN_ARGS)
    capped = _train_in_memory_cgroup(3.0, ("--out", str(tmp_path / "capped"), *common), tmp_path)
    assert capped.returncode == 0, capped.stderr[-3000:]
    seen = float(re.search(r"memory: [\d.]+ GiB in use, ([\d.]+) GiB free", capped.stderr).group(1))
    assert 0 < seen < 2.0  # the cap less what the process holds and the 1 GiB headroom, not the machine's RAM
    expected, got = final_losses(unconstrained_run), final_losses(tmp_path / "capped")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    refused = _train_in_memory_cgroup(1.5, ("--out", str(tmp_path / "refused"), *common), tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("dflash: error: one training step on the longest sequence") and "--max-anchors" in line
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused" / "checkpoints").exists()


def test_cgroup_free_bytes_reads_the_tightest_group(tmp_path: Path) -> None:
    """cgroup v1 and v2 files: limit - (usage - inactive file pages), the tightest of the group and its ancestors;
    no limit ("max", or v1's huge number) is None; a group path the mount does not show falls back to its root."""
    from dflash.shared.cgroups import cgroup_free_bytes

    def group(folder: Path, limit: str, usage: int, inactive: int, v2: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit + "\n")
        (folder / ("memory.current" if v2 else "memory.usage_in_bytes")).write_text(f"{usage}\n")
        key = "inactive_file" if v2 else "total_inactive_file"
        (folder / "memory.stat").write_text(f"anon 5\n{key} {inactive}\nactive_file 7\n")

    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    group(v2, "max", 10, 0, v2=True)
    group(v2 / "job", "8000", 5000, 1000, v2=True)  # 8000 - (5000 - 1000) = 4000
    group(v2 / "job" / "step", "max", 4000, 0, v2=True)
    proc.write_text("0::/job/step\n")
    assert cgroup_free_bytes(proc, v2) == 4000
    group(v2 / "job" / "step", "3000", 2500, 500, v2=True)  # 3000 - 2000 = 1000, tighter than the parent
    assert cgroup_free_bytes(proc, v2) == 1000
    group(v2 / "job", "max", 5000, 0, v2=True)
    group(v2 / "job" / "step", "max", 4000, 0, v2=True)
    assert cgroup_free_bytes(proc, v2) is None
    v1 = tmp_path / "v1"
    group(v1 / "memory", str(9223372036854771712), 10, 0, v2=False)  # v1's "no limit"
    group(v1 / "memory" / "batch", "6000", 7000, 2000, v2=False)  # 6000 - 5000
    proc.write_text("12:cpu,cpuacct:/batch\n4:memory:/batch\n0::/\n")
    assert cgroup_free_bytes(proc, v1) == 1000
    proc.write_text("4:memory:/not/visible/in/this/namespace\n")
    group(v1 / "memory", "4000", 1000, 0, v2=False)
    assert cgroup_free_bytes(proc, v1) == 3000
    assert cgroup_free_bytes(tmp_path / "missing", v1) is None


def test_cgroup_cpu_limit_reads_the_tightest_quota(tmp_path: Path) -> None:
    """cgroup v2's cpu.max ("QUOTA PERIOD", "max PERIOD") and v1's cfs quota and period (-1: none), the tightest of
    the group and its ancestors; v1's cpu controller found mounted as "cpu,cpuacct" or as "cpu"."""
    from dflash.shared.cgroups import cgroup_cpu_limit

    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    for folder, text in ((v2, "max 100000"), (v2 / "pod", "400000 100000"), (v2 / "pod" / "c", "max 100000")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(text + "\n")
    proc.write_text("0::/pod/c\n")
    assert cgroup_cpu_limit(proc, v2) == 4.0
    (v2 / "pod" / "c" / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs, tighter than the pod's 4
    assert cgroup_cpu_limit(proc, v2) == 2.5
    (v2 / "pod" / "c" / "cpu.max").write_text("max 100000\n")
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(proc, v2) is None
    for mounted in ("cpu,cpuacct", "cpu"):
        v1 = tmp_path / f"v1-{mounted}"
        for folder, quota in ((v1 / mounted, -1), (v1 / mounted / "job", 150000)):
            folder.mkdir(parents=True)
            (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (folder / "cpu.cfs_period_us").write_text("100000\n")
        proc.write_text("12:cpu,cpuacct:/job\n4:memory:/job\n0::/\n")
        assert cgroup_cpu_limit(proc, v1) == 1.5
    assert cgroup_cpu_limit(tmp_path / "missing", v2) is None


def test_on_cuda_the_plan_counts_two_steps_of_stored_features_copied_aside(
        train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the features are copied on a side stream (trainer.stored_features), whose freed copies are reused
    only once the device has passed their last use, two micro-batches' at most: the plan holds two loader batches
    of stored features (--batch-tokens, bucketed) as fixed memory beside every step, whatever --grad-accum; on the
    CPU nothing."""
    import torch

    from dflash.stage2_train import memory_plan, run_setup
    from dflash.stage2_train.options import TrainOptions

    options = TrainOptions(cache=train_cache, out=tmp_path / "run", max_steps=2, draft_layers=1, batch_tokens=1024,
                           grad_accum=3, num_workers=0, eval_fraction=0.0, test_fraction=0.0, mixed_precision="no",
                           memory_limit=4.0)
    run = run_setup.setup_run(options)
    try:
        assert run.memory is not None and run.memory.shape.copied_aside_bytes == 0
        monkeypatch.setattr(run_setup, "in_use_bytes", lambda device: 0)
        monkeypatch.setattr(type(run), "device", property(lambda self: torch.device("cuda")))
        plan = run_setup.plan_memory(run)
    finally:
        if run.lock is not None:
            run.lock.release()
    layers, hidden = run.config.num_context_layers, run.config.hidden_size
    token_bytes = layers * hidden * run.codec.stored_dtype.itemsize + (4 * layers if run.codec.scaled else 0)
    assert plan.shape.copied_aside_bytes == 2 * 1024 * token_bytes  # (1,024 is its own bucket)
    assert memory_plan.fixed_bytes(plan.shape) == 12 * plan.shape.trainable_params + plan.shape.copied_aside_bytes
    assert plan.budget_bytes == int((plan.limit_bytes - memory_plan.fixed_bytes(plan.shape)) / memory_plan.SAFETY)


def test_fsdp_processes_refuse_micro_batches_the_plan_would_split(train_cache: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Several FSDP processes gather every layer in every forward, so each must run the same forwards a step: a
    micro-batch the plan would split (each process on its own) stops the run in one line, at the plan or at the step
    that meets one; DDP and one process split as before. (FSDP needs GPUs: its flag and world are set by hand.)"""
    from dataclasses import replace

    from dflash.shared.errors import UserError
    from dflash.stage2_train import memory_plan as mp
    from dflash.stage2_train import run_setup, trainer
    from dflash.stage2_train.options import TrainOptions
    from dflash.stage2_train.packed_loader import start_loader, stop_loader

    options = TrainOptions(cache=train_cache, out=tmp_path / "run", max_steps=2, draft_layers=1, max_anchors=24,
                           anchor_density=TEST_ANCHOR_DENSITY, batch_tokens=2304, num_workers=0, eval_fraction=0.05,
                           test_fraction=0.1, mixed_precision="no")
    run = run_setup.setup_run(options)
    try:
        shape = run.memory.shape
        single = max(int(mp.step_bytes(shape, s.length, int(run.anchor_rule.count([s.n_anchor_candidates]).sum())))
                     for s in run.index.train)
        largest = max(int(mp.step_bytes(shape, sum(s.length for s in pack),
                                        int(run.anchor_rule.count([s.n_anchor_candidates for s in pack]).sum())))
                      for pack in run.plan(0))
        limit = (mp.fixed_bytes(shape) + mp.SAFETY * (single + largest) / 2) / mp.GIB  # one sequence fits, not all
        run.options = replace(run.options, memory_limit=limit)
        split_plan = run_setup.plan_memory(run)  # one process: split and accumulated
        batches = start_loader(run.loader(0, 0))
        splitting = next(b for b in batches if len(split_plan.parts(b["lengths"].numpy(),
                                                                     trainer.sequence_blocks(b))) > 1)
        stop_loader(batches)
        monkeypatch.setattr(type(run), "world", property(lambda self: 2))
        assert run_setup.plan_memory(run) is not None  # DDP on 2 processes: split as well
        run.options = replace(run.options, fsdp=True)
        with pytest.raises(UserError, match=r"--fsdp on 2 processes: the largest micro-batch \(\d+ tokens, \d+ "
                                            r"blocks\) needs ~.* GiB.*lower --batch-tokens"):
            run_setup.plan_memory(run)
        run.memory = split_plan  # a later epoch's batch the first epoch's plan did not foresee
        with pytest.raises(UserError, match=r"--fsdp on 2 processes: a micro-batch of step 1 \(\d+ tokens\) does "
                                            "not fit whole"):
            trainer.step_parts(run, [splitting])
        run.options = replace(run.options, fsdp=False)
        assert len(trainer.step_parts(run, [splitting])) > 1  # DDP: split
    finally:
        if run.lock is not None:
            run.lock.release()


@pytest.mark.parametrize("tokens, workers, want_per_process", [
    (1_000_000, 2, 25_000_000), (3_250_000, 0, 81_250_000), (13_000_000, 6, 325_000_000), (30_000_000, 6, 512 << 20), (0, 2, 0)])
def test_the_cpu_plan_leaves_room_for_the_loaders_side_arrays(tokens: int, workers: int,
                                                               want_per_process: int) -> None:
    """Each loader process (a worker, or the trainer without workers) may hold the cache's side arrays up to its
    budget (fp8 over 5 layers: 25 bytes a token), two epochs' loaders at a time: the CPU plan subtracts that."""
    from types import SimpleNamespace

    from dflash.shared.feature_codecs import FP8
    from dflash.stage2_train import cache_index
    from dflash.stage2_train.run_setup import loader_side_bytes

    half = tokens // 2
    run = SimpleNamespace(manifest={"shards": {"0": {"tokens": half}, "1": {"tokens": tokens - half}}}, codec=FP8,
                          config=SimpleNamespace(num_context_layers=5),
                          options=SimpleNamespace(num_workers=workers))
    assert cache_index.side_array_bytes(tokens, FP8, 5) == 25 * tokens
    assert loader_side_bytes(run) == 2 * max(1, workers) * want_per_process
