"""What a training run uses when the user leaves `--attention auto` and `--compile` unset: the fastest path measured
for the device and the run's length.

Measured on an H100, SmolLM2's 5-layer drafter on the real cache, ~28K block tokens a step (docs/benchmarks.md,
"The fast training path in whole runs"; benchmarks/results/h100_fast_path_and_loss_2026-12-06), two whole
600-step runs alone on the GPU, the same data and schedule, test tau equal (1.335 +- 0.013 vs 1.341 +- 0.014):

| path | steady s/step | seconds to step 50 / 600 |
|---|---:|---:|
| grouped SDPA, uncompiled (the plain path) | 0.196 | 13.9 / 123.3 |
| flex_attention + `--compile` (the fast path) | 0.083 (2.37x) | 94.9 / 151.6 |

The fast path's compilation (~100 s on a fresh machine: flex's kernels, the decoder layers for static then dynamic
shapes, one recompile at step 108) pays back at step ~850 (`benchmarks/break_even.py`); COMPILE_MIN_STEPS rounds
that up. On a machine whose inductor cache already holds the kernels (a rerun, the recipe bench's later variants)
it compiles in ~12 s and pays back within ~120 steps: pass `--compile --attention flex` there.
Large drafters (hidden size >= FLEX_MIN_HIDDEN_SIZE, e.g. the Qwen3-8B shape) take flex on CUDA at any length (on
an H200 flex's step was 0.755 s against 1.041 with grouped SDPA, and its compilation is small beside such steps).
`--compile` with grouped SDPA crashed in inductor on torch 2.11 CUDA, so the compiled path is always the flex one.
On the CPU the plain path: flex_attention has no fast CPU kernel, and compiling costs more than tests ever run.
Not compiled by default until a whole run on a GPU confirms it: `--fsdp` (sharded layers under torch.compile) and
DFlash 2 (`--architecture dflash2`: its compiled step ran in a 20-step benchmark on an H100, 0.145 s against
0.244 s uncompiled in the session before; docs/benchmarks.md).
The compiled path was measured with inductor's split reductions off, which `run_setup` sets (`compile_layers`).
"""

from __future__ import annotations

from dflash.stage2_train.draft_attention import FLEX_MIN_HIDDEN_SIZE
from dflash.stage2_train.options import COMPILE_MIN_STEPS  # (there, so that the CLI's help can say it without torch)


def training_path(attention: str, compile: bool | None, device_type: str, total_steps: int, hidden_size: int,
                  fsdp: bool = False, architecture: str = "dflash") -> tuple[str, bool]:
    """The attention kernel and whether to compile, for `--attention` (auto / flex / sdpa / eager) and `--compile`
    (True, False or None = not given) on `device_type` ("cuda", "cpu", ...) in a run of `total_steps` steps.
    What the user gave is kept; only `auto` and None are chosen here. `--compile` alone on CUDA takes flex (compiled
    grouped SDPA crashed, see above). On `--resume` the run's total steps count, not the steps left."""
    cuda = device_type == "cuda"
    long_run = cuda and total_steps >= COMPILE_MIN_STEPS and not fsdp
    if attention == "auto":
        flex = long_run or compile is True or hidden_size >= FLEX_MIN_HIDDEN_SIZE
        attention = "flex" if cuda and flex else "sdpa"
    if compile is None:
        compile = long_run and attention == "flex" and architecture == "dflash"
    return attention, compile


# Loader workers a process when `--num-workers` is not given. On CUDA, 6: what every GPU bench trained with, not
# shown to be enough. One worker builds a micro-batch of the 49,152-token budget (~20K context and ~26K block tokens)
# in 0.11-0.15 s on 2 CPU cores (`benchmarks/bench_loader.py`, a page-cached fp8 SmolLM2 cache, 2026-12-07; the
# shared-memory copy of a worker's batch not counted), so the old default of 2 could not feed the SmolLM2 drafter's
# 0.043 s step; but the 9,000-step H100 run with 6 stalled every ~6 steps, as if a worker there took ~0.33 s a
# batch (docs/benchmarks.md): `loader_wait_s` in metrics.jsonl says how long a run waits. At most the CPUs a process
# has less one (the training loop's own), at least one. Elsewhere 2: on the 2-core machines the training itself uses
# the cores.
CUDA_LOADER_WORKERS = 6
OTHER_LOADER_WORKERS = 2


def loader_workers(num_workers: int | None, device_type: str, cpus_per_process: int) -> int:
    """The DataLoader workers of a process on `device_type` that has `cpus_per_process` CPUs: what `--num-workers`
    gave, else the default above."""
    if num_workers is not None:
        return num_workers
    if device_type != "cuda":
        return OTHER_LOADER_WORKERS
    return max(1, min(CUDA_LOADER_WORKERS, cpus_per_process - 1))


def describe(attention: str, compile: bool, chosen: bool, total_steps: int) -> str:
    """One log line saying which path the run takes, whether the rule above chose it (`chosen`: the user left
    `--compile` unset) or the user did, and how to change it."""
    path = f"--attention {attention}" + (" --compile" if compile else "")
    if compile and chosen:
        return (f"training path: {path} (chosen for {total_steps} steps >= {COMPILE_MIN_STEPS} on CUDA: its ~100 s "
                "of compilation pay back; --no-compile --attention sdpa for the plain path)")
    if compile:
        return f"training path: {path} (as given)"
    return (f"training path: {path} (uncompiled; on a GPU --attention flex --compile pays back its compilation "
            f"after ~850 steps, and from ~120 on a machine that has compiled it before)")
