"""The training path a run takes when `--attention auto` and `--compile` are left unset (fast_path.py): flex and
compiled on CUDA for runs long enough to pay for the compilation, the plain path on CPU and in short runs, and
whatever the user gave kept."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash.shared.run_files import RunFiles
from dflash.stage2_train.draft_attention import FLEX_MIN_HIDDEN_SIZE, training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.fast_path import (
    COMPILE_MIN_STEPS,
    CUDA_LOADER_WORKERS,
    OTHER_LOADER_WORKERS,
    describe,
    loader_workers,
    training_path,
)
from dflash.stage2_train.objective import block_cross_entropy
from dflash.stage2_train.options import TrainOptions
from dflash.stage2_train.run_setup import choose_training_path, cpus_per_process
from tests.conftest import run_dflash

SMALL, LARGE = 576, FLEX_MIN_HIDDEN_SIZE  # SmolLM2's drafter width; the first width that takes flex at any length


def test_cuda_long_runs_take_flex_compiled() -> None:
    assert training_path("auto", None, "cuda", COMPILE_MIN_STEPS, SMALL) == ("flex", True)
    assert training_path("auto", None, "cuda", 20_000, LARGE) == ("flex", True)


def test_cuda_short_runs_stay_uncompiled() -> None:
    assert training_path("auto", None, "cuda", COMPILE_MIN_STEPS - 1, SMALL) == ("sdpa", False)
    assert training_path("auto", None, "cuda", COMPILE_MIN_STEPS - 1, LARGE) == ("flex", False)


def test_compile_alone_takes_flex_on_cuda() -> None:
    """Compiled grouped SDPA crashed in inductor on CUDA: `--compile` without `--attention` compiles flex."""
    assert training_path("auto", True, "cuda", 10, SMALL) == ("flex", True)
    assert training_path("auto", True, "cuda", 10**6, SMALL, fsdp=True) == ("flex", True)
    assert training_path("auto", True, "cpu", 10, SMALL) == ("sdpa", True)  # CPU has no flex backward


def test_cpu_takes_the_plain_path_at_any_length() -> None:
    assert training_path("auto", None, "cpu", 10**6, SMALL) == ("sdpa", False)
    assert training_path("auto", None, "cpu", 10**6, LARGE) == ("sdpa", False)


def test_fsdp_and_dflash2_are_not_compiled_by_default() -> None:
    """Neither has a measured compiled run on a GPU yet."""
    assert training_path("auto", None, "cuda", 10**6, LARGE, fsdp=True) == ("flex", False)
    assert training_path("auto", None, "cuda", 10**6, SMALL, fsdp=True) == ("sdpa", False)
    assert training_path("auto", None, "cuda", 10**6, SMALL, architecture="dflash2") == ("flex", False)


@given(attention=st.sampled_from(["auto", "flex", "sdpa", "eager"]), compile_=st.sampled_from([None, True, False]),
       device=st.sampled_from(["cuda", "cpu"]), steps=st.integers(1, 5 * COMPILE_MIN_STEPS),
       hidden=st.sampled_from([SMALL, LARGE]), fsdp=st.booleans(), architecture=st.sampled_from(["dflash", "dflash2"]))
def test_given_choices_are_kept_and_compile_only_with_flex(attention: str, compile_: bool | None, device: str,
                                                           steps: int, hidden: int, fsdp: bool,
                                                           architecture: str) -> None:
    chosen_attention, chosen_compile = training_path(attention, compile_, device, steps, hidden, fsdp, architecture)
    assert chosen_attention in ("flex", "sdpa", "eager")
    if attention != "auto":
        assert chosen_attention == attention
    if chosen_compile and device == "cuda" and attention == "auto":
        assert chosen_attention == "flex"  # never compiled grouped SDPA on CUDA unless asked for
    if compile_ is not None:
        assert chosen_compile is compile_
    else:  # compiled by default only where it was measured to work and pay: flex on CUDA in a long run
        assert chosen_compile == (chosen_attention == "flex" and device == "cuda" and steps >= COMPILE_MIN_STEPS
                                  and not fsdp and architecture == "dflash")


def test_the_log_line_says_who_chose_the_path() -> None:
    assert "chosen for 2000 steps >= " in describe("flex", True, True, 2000)
    assert describe("flex", True, False, 600).endswith("(as given)")  # e.g. the recipe bench's 600-step runs
    assert "uncompiled" in describe("flex", False, True, 5000)  # e.g. DFlash 2, not compiled by default


def tiny_run(device: str, total_steps: int, **options: object) -> SimpleNamespace:
    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, num_target_layers=4,
                          dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 2]})
    return SimpleNamespace(options=TrainOptions(cache=Path("."), **options), device=SimpleNamespace(type=device),
                           total_steps=total_steps, config=config, model=training_drafter(config, "auto"),
                           objective=block_cross_entropy, is_main=False, world=1)


def test_the_run_follows_the_chosen_path() -> None:
    """The drafter's kernel, the objective's compiled chunks and the recorded options all follow the choice."""
    run = tiny_run("cuda", COMPILE_MIN_STEPS)
    choose_training_path(run)  # type: ignore[arg-type]
    assert (run.options.attention, run.options.compile) == ("flex", True)
    assert run.model.attention.implementation == "flex"
    assert isinstance(run.objective, functools.partial) and run.objective.keywords == {"fused": True}
    run = tiny_run("cuda", COMPILE_MIN_STEPS, loss="ce", compile=False)
    choose_training_path(run)  # type: ignore[arg-type]
    assert (run.options.attention, run.options.compile) == ("flex", False)
    assert run.objective is block_cross_entropy
    assert run.options.num_workers == loader_workers(None, "cuda", cpus_per_process(1))  # chosen, recorded
    run = tiny_run("cpu", 10**6)
    choose_training_path(run)  # type: ignore[arg-type]
    assert (run.options.attention, run.options.compile) == ("sdpa", False)
    assert run.model.attention.implementation == "sdpa"
    assert run.options.num_workers == OTHER_LOADER_WORKERS
    run = tiny_run("cuda", COMPILE_MIN_STEPS, num_workers=0)
    choose_training_path(run)  # type: ignore[arg-type]
    assert run.options.num_workers == 0  # given: kept


def test_loader_workers_on_cuda_are_the_default_where_the_cpus_allow() -> None:
    assert CUDA_LOADER_WORKERS == 6 and OTHER_LOADER_WORKERS == 2
    assert loader_workers(None, "cuda", 16) == 6  # the lent H100 machine: 16 CPUs, one process
    assert loader_workers(None, "cuda", 2) == 1  # eight processes on 16 CPUs: one worker each
    assert loader_workers(None, "cuda", 4) == 3  # the training loop keeps a CPU of its own
    assert loader_workers(None, "cuda", 1) == 1  # never none: the loop would build its batches itself
    assert loader_workers(None, "cpu", 64) == 2 and loader_workers(0, "cuda", 64) == 0


@given(st.integers(1, 512), st.sampled_from(["cuda", "cpu", "mps"]), st.none() | st.integers(0, 32))
def test_loader_workers_leave_the_process_a_cpu_of_its_own(cpus: int, device: str, given_workers: int | None) -> None:
    workers = loader_workers(given_workers, device, cpus)
    if given_workers is not None:
        assert workers == given_workers
    elif device != "cuda":
        assert workers == OTHER_LOADER_WORKERS
    else:
        assert 1 <= workers <= CUDA_LOADER_WORKERS and (workers < cpus or cpus == 1)
        assert workers == CUDA_LOADER_WORKERS or workers == max(1, cpus - 1)  # the default, or all the CPUs allow


@pytest.mark.parametrize("machine, usable, quota, processes, want", [
    (16, 16, None, 1, 16), (16, 16, None, 8, 2), (128, 128, None, 8, 16), (128, 16, None, 8, 2), (4, 4, None, 8, 1),
    (128, 128, 4.0, 1, 4), (128, 128, 2.5, 1, 2), (128, 128, 0.5, 1, 1), (128, 8, 32.0, 2, 4), (64, 64, 16.0, 8, 2)])
def test_cpus_a_process_has(monkeypatch: pytest.MonkeyPatch, machine: int, usable: int, quota: float | None,
                            processes: int, want: int) -> None:
    """The CPUs the process may use (a container's or a job's CPU set, not the host's; fewer where its cgroup's CPU
    quota grants fewer, as a Kubernetes CPU limit of 4 on a 128-core host does), shared by the processes on the
    machine: 8 ranks in a 16-CPU set of a 128-core host get 2 each, not 16."""
    import os

    from dflash.shared import cgroups

    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)), raising=False)
    monkeypatch.setattr(cgroups, "cgroup_cpu_limit", lambda: quota)
    assert cpus_per_process(processes) == want


@pytest.mark.parametrize("flags, expected", [((), ("sdpa", False)), (("--attention", "eager"), ("eager", False))])
def test_cli_records_the_chosen_path(train_cache: Path, tmp_path: Path, flags: tuple[str, ...],
                                     expected: tuple[str, bool]) -> None:
    """A CPU run with no flags takes the plain path, says so, and records it in train_options.json."""
    out = tmp_path / "run"
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(out), "--max-steps", "1",
                        "--eval-every", "0", "--checkpoint-every", "0", "--eval-fraction", "0", "--test-fraction", "0",
                        "--num-workers", "0", "--batch-tokens", "256", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads(RunFiles(out).options.read_text())
    assert (recorded["attention"], recorded["compile"]) == expected
    assert f"training path: --attention {expected[0]} (uncompiled" in result.stderr
    assert recorded["num_workers"] == 0 and "loader: 0 worker(s) a process (as given)" in result.stderr


@pytest.mark.parametrize("device_type,fused_setting,want", [("cuda", True, True), ("cuda", False, None),
                                                           ("cpu", True, None)])
def test_adamw_is_fused_on_cuda_only(device_type: str, fused_setting: bool, want: bool | None,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_optimizer` asks for the fused AdamW on CUDA (unless bench_train.py --foreach-adamw turned it off) and
    leaves the CPU's default; the rest of the optimizer as always (betas, lr, weight decay). This machine has no
    GPU: the constructor's arguments are recorded and a CPU AdamW built from the others."""
    import torch

    from dflash.stage2_train import run_setup

    asked: dict = {}

    def adamw(params, **kwargs):  # noqa: ANN001, ANN202
        asked.update(kwargs)
        return torch.optim.Adam(params)  # (the real class is patched out; any optimizer does here)

    monkeypatch.setattr(run_setup, "FUSED_ADAMW", fused_setting)
    monkeypatch.setattr(run_setup.torch.optim, "AdamW", adamw)
    model = torch.nn.Linear(2, 2)
    run = SimpleNamespace(options=SimpleNamespace(lr=1e-3, weight_decay=0.0, warmup=0.1), total_steps=10,
                          device=torch.device(device_type), model=model,
                          accelerator=SimpleNamespace(prepare=lambda m, o: (m, o),
                                                      register_for_checkpointing=lambda s: None))
    run_setup.make_optimizer(run)  # type: ignore[arg-type]
    assert asked == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0, "fused": want}


@pytest.mark.parametrize("saved_fused,run_fused", [(None, True), (True, None)])
def test_a_resumed_optimizer_keeps_the_runs_adamw_implementation(saved_fused: bool | None,
                                                                 run_fused: bool | None) -> None:
    """torch's load_state_dict brings the saved `fused` back; `keep_adamw_implementation` puts the run's back, and
    the resumed step equals the step the saved optimizer would have made (to float rounding). On the CPU, where
    torch has both implementations."""
    import copy

    import torch

    from dflash.stage2_train.run_setup import keep_adamw_implementation

    def fresh(fused: bool | None) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
        parameter = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))
        return parameter, torch.optim.AdamW([parameter], lr=1e-2, betas=(0.9, 0.95), fused=fused)

    gradients = [torch.linspace(0.5, -0.3, 6) * (k + 1) for k in range(3)]
    saved_parameter, saved = fresh(saved_fused)
    for gradient in gradients[:2]:
        saved_parameter.grad = gradient.clone()
        saved.step()
    state = copy.deepcopy(saved.state_dict())  # (a checkpoint: not the live tensors the next step updates)
    resumed_parameter, resumed = fresh(run_fused)
    with torch.no_grad():
        resumed_parameter.copy_(saved_parameter)
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["fused"] == saved_fused  # what torch does by itself
    keep_adamw_implementation(resumed, run_fused)
    assert resumed.param_groups[0]["fused"] == run_fused
    for parameter, optimizer in ((saved_parameter, saved), (resumed_parameter, resumed)):
        parameter.grad = gradients[2].clone()
        optimizer.step()
    torch.testing.assert_close(resumed_parameter, saved_parameter, rtol=1e-6, atol=1e-7)
    assert resumed.state[resumed_parameter]["step"].item() == 3.0
