"""What a training run uses when the user leaves `--attention auto` and `--compile` unset: the fastest path measured
for the device and the run's length.

Measured on an H100 (benchmarks/results/h100_train_speed_and_warm_start_2026-12-05, SmolLM2's 5-layer drafter on
the real cache, ~28K block tokens a step; docs/benchmarks.md "The real training step by attention path"):

| path | s/step | compilation before the first fast step |
|---|---:|---:|
| grouped SDPA (the plain path) | 0.223 | none |
| flex_attention | 0.141 | ~62 s |
| flex_attention + `--compile` | 0.110 | ~55 s more |

Flex and `--compile` together pay back their ~117 s of compilation after ~480 steps at that step size (each step
saves 0.113 s); COMPILE_MIN_STEPS rounds that up. Large drafters (hidden size >= FLEX_MIN_HIDDEN_SIZE, e.g. the
Qwen3-8B shape) take flex on CUDA at any length (their steps are seconds, flex was faster at every size measured).
`--compile` with grouped SDPA crashed in inductor on torch 2.11 CUDA, so the compiled path is always the flex one.
On the CPU the plain path: flex_attention has no fast CPU kernel, and compiling costs more than tests ever run.
Not compiled by default until measured on a GPU: `--fsdp` (sharded layers under torch.compile) and DFlash 2
(`--architecture dflash2`: its compiled step equals the eager one on CPU, tests/stage2_train/test_dflash2_cli.py).
The compiled path was measured with inductor's split reductions off, which `run_setup` sets (`compile_layers`).
"""

from __future__ import annotations

from dflash.stage2_train.draft_attention import FLEX_MIN_HIDDEN_SIZE

COMPILE_MIN_STEPS = 500  # runs of at least this many steps compile by default on CUDA (break-even ~480, see above)


def training_path(attention: str, compile: bool | None, device_type: str, total_steps: int, hidden_size: int,
                  fsdp: bool = False, architecture: str = "dflash") -> tuple[str, bool]:
    """The attention kernel and whether to compile, for `--attention` (auto / flex / sdpa / eager) and `--compile`
    (True, False or None = not given) on `device_type` ("cuda", "cpu", ...) in a run of `total_steps` steps.
    What the user gave is kept; only `auto` and None are chosen here."""
    cuda = device_type == "cuda"
    long_run = cuda and total_steps >= COMPILE_MIN_STEPS and not fsdp
    if attention == "auto":
        attention = "flex" if cuda and (long_run or hidden_size >= FLEX_MIN_HIDDEN_SIZE) else "sdpa"
    if compile is None:
        compile = long_run and attention == "flex" and architecture == "dflash"
    return attention, compile


def describe(attention: str, compile: bool, total_steps: int) -> str:
    """One log line saying which path the run takes and how to change it."""
    path = f"--attention {attention}" + (" --compile" if compile else "")
    if compile:
        return (f"training path: {path} ({total_steps} steps >= {COMPILE_MIN_STEPS}: its ~2 minutes of compilation "
                "pay back; --no-compile or --attention sdpa for the plain path)")
    return f"training path: {path} (uncompiled; --compile and --attention flex for long runs on a GPU)"
