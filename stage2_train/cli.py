"""Command line of stage 2: `dflash train` and `dflash export`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from dflash.shared.run_files import RunFiles
from dflash.stage2_train.objective import LOSSES
from dflash.stage2_train.options import ARCHITECTURES, COMPILE_MIN_STEPS, SELECTOR_MISSING, TrainOptions


@click.command("train")
@click.option("--cache", required=True, metavar="DIR|s3://BUCKET/PREFIX",
              help="Feature cache made by `dflash extract`: a folder, or a bucket (read by zarr from the bucket; the "
                   "manifest and target/ are mirrored to ~/.cache/dflash/remote/).")
@click.option("--local-copy/--no-local-copy", default=True, show_default=True,
              help="With an s3:// cache: fetch each ~64 MB shard file whole on its first read and keep it on local "
                   "disk (read-through; needs the disk space of the cache). Without it every read is a ranged GET: "
                   "17x slower in benchmarks/results/remote_loader_moto_cpu.json.")
@click.option("--out", type=click.Path(path_type=Path), default=TrainOptions.out, show_default=True,
              help="Run directory: logs, metrics, TensorBoard, plots, checkpoints/, export/.")
@click.option("--epochs", type=click.IntRange(min=1), default=TrainOptions.epochs, show_default=True,
              help="Passes over the training split (each with a new shuffle and new anchors).")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after N optimizer steps.")
@click.option("--draft-layers", type=click.IntRange(1, 16), default=None,
              help="Drafter layers. Default: the number of captured target layers.")
@click.option("--block-size", type=click.IntRange(2, 64), default=TrainOptions.block_size, show_default=True,
              help="Tokens the drafter proposes per block (the first is the target's own token).")
@click.option("--sliding-window", type=click.IntRange(min=1), default=None,
              help="Make every drafter layer but the last a sliding-window layer of this many positions.")
@click.option("--mask-token-id", type=int, default=None,
              help="Token whose embedding fills unknown block positions. Default: the reference resolution order.")
@click.option("--loss", type=click.Choice(LOSSES), default=TrainOptions.loss, show_default=True,
              help="Training objective (stage2_train/objective.py): ce = the reference's gamma-weighted "
                   "cross-entropy on the target's tokens; kl = KL from the target's top-k distribution (its other "
                   "tokens as one bucket) to the drafter's, same weights; mix = (1 - w) ce + w kl. kl and mix need a "
                   "cache extracted with --store-target-topk K.")
@click.option("--kl-weight", type=click.FloatRange(0, 1), default=TrainOptions.kl_weight, show_default=True,
              help="w of --loss mix: the KL term's share.")
@click.option("--architecture", type=click.Choice(ARCHITECTURES), default=TrainOptions.architecture,
              show_default=True,
              help="dflash = the DFlash drafter; dflash2 = DFlash 2: the same drafter plus a dynamic convolution "
                   "around each sublayer and a pairwise path selector over the top-16 candidates (exports as "
                   "DFlash2DraftModel). With --init-from a DFlash export, a dflash2 run starts from that drafter, "
                   "its new parts identity-initialised.")
@click.option("--selector-weight", type=click.FloatRange(min=0), default=TrainOptions.selector_weight,
              show_default=True, help="dflash2: weight of the path selector's loss beside the block loss.")
@click.option("--selector-missing", type=click.Choice(SELECTOR_MISSING), default=TrainOptions.selector_missing,
              show_default=True,
              help="dflash2: where the true token is not among the candidates, drop the position from the "
                   "selector loss (measured better: docs/benchmarks.md) or inject it (in place of the last "
                   "candidate). The run logs the candidate recall.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=TrainOptions.lr, show_default=True,
              help="Peak learning rate of AdamW (warm-up, then cosine to 0).")
@click.option("--warmup", type=float, default=TrainOptions.warmup, show_default=True,
              help="Warm-up fraction of the steps.")
@click.option("--weight-decay", type=float, default=TrainOptions.weight_decay, show_default=True,
              help="AdamW weight decay.")
@click.option("--clip", type=float, default=TrainOptions.clip, show_default=True, help="Gradient-norm clip (0 = off).")
@click.option("--batch-tokens", type=click.IntRange(min=16), default=TrainOptions.batch_tokens, show_default=True,
              help="Tokens per micro-batch (per process): the packed context tokens of its sequences plus their "
                   "block tokens (anchors x block size).")
@click.option("--grad-accum", type=click.IntRange(min=1), default=TrainOptions.grad_accum, show_default=True,
              help="Micro-batches per optimizer step (per process).")
@click.option("--anchor-density", type=click.FloatRange(0, 1, min_open=True), default=TrainOptions.anchor_density,
              show_default=True,
              help="Anchors (blocks) drawn per sequence and epoch, as a fraction of its anchor positions (pairs of "
                   "supervised tokens), rounded up, at most --max-anchors: 1 takes every position up to the cap. "
                   "The blocks of a micro-batch are packed without padding.")
@click.option("--max-anchors", type=click.IntRange(min=1), default=TrainOptions.max_anchors, show_default=True,
              help="Cap on the anchors per sequence and epoch (64 trained the better drafter per step on ~770-token "
                   "conversations; the reference draws 512 in 3,072-token sequences).")
@click.option("--gamma", type=float, default=None, help="Loss decay over block positions (default 7 for B=16).")
@click.option("--eval-fraction", type=click.FloatRange(0, 0.5), default=TrainOptions.eval_fraction,
              show_default=True,
              help="Fraction of the cache's samples in the validation split (never trained on): evaluated every "
                   "--eval-every steps; its best evaluation picks export_best/.")
@click.option("--test-fraction", type=click.FloatRange(0, 0.5), default=TrainOptions.test_fraction,
              show_default=True,
              help="Fraction in the test split, disjoint from validation and training: the drafter in export_best/ "
                   "is evaluated on all of it once, at the end (RUN/test_results.json); `dflash eval --data "
                   "heldout` takes its prompts from it.")
@click.option("--train-fraction", type=click.FloatRange(0, 1, min_open=True), default=TrainOptions.train_fraction,
              show_default=True,
              help="Train on this fraction of the samples left after the validation and test splits (a uniform random "
                   "subset, nested: 0.25's samples are among 0.5's), the held-out splits unchanged: how much better "
                   "does the drafter get with more data, asked on one cache.")
@click.option("--eval-every", type=click.IntRange(min=0), default=TrainOptions.eval_every, show_default=True,
              help="Evaluate on the validation split every N steps (0 = only at the end).")
@click.option("--eval-untrained/--no-eval-untrained", default=TrainOptions.eval_untrained, show_default=True,
              help="With --eval-every, also evaluate the untrained drafter before the first step (the baseline of "
                   "the later figures; about a minute of the GPU for the whole validation split of a large cache).")
@click.option("--eval-sequences", type=click.IntRange(min=1), default=None,
              help="Validation sequences per evaluation (the same ones each time). Default: the whole split; cap it "
                   "on large caches, where each evaluation walks every sequence.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=TrainOptions.checkpoint_every,
              show_default=True,
              help="Save a resumable checkpoint every N steps (0 = only at the end).")
@click.option("--keep-checkpoints", type=click.IntRange(min=0), default=TrainOptions.keep_checkpoints,
              show_default=True,
              help="Keep the newest N checkpoints, delete older ones (0 = keep all).")
@click.option("--resume", is_flag=True,
              help="Continue exactly from the latest checkpoint in --out (the run's own length, schedule and step "
                   "size where not given).")
@click.option("--overwrite", is_flag=True,
              help="Discard the run already in --out (metrics, checkpoints, exports; logs are kept) and start afresh. "
                   "Without it or --resume an existing run is refused.")
@click.option("--init-from", type=click.Path(path_type=Path), default=None, metavar="EXPORT_DIR",
              help="Start from the weights of an exported drafter of the same shape and target (a new optimizer and "
                   "schedule): train on across sessions, or fine-tune on other data.")
@click.option("--seed", type=int, default=TrainOptions.seed, show_default=True,
              help="Seed of the split, the shuffles, the anchors and the initial weights.")
@click.option("--attention", type=click.Choice(["auto", "flex", "sdpa", "eager"]), default=TrainOptions.attention,
              show_default=True,
              help=f"auto = on CUDA, flex_attention for runs of >= {COMPILE_MIN_STEPS} steps (but not with "
                   "--fsdp), with --compile, and for drafters of hidden size >= 2048; grouped SDPA otherwise and on "
                   "CPU (docs/train.md).")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="torch.compile each drafter layer and the cross-entropy's chunks, in each training process "
                   f"(masks are built eagerly). Default: on for DFlash runs of >= {COMPILE_MIN_STEPS} steps on "
                   "CUDA with flex attention (2.4x the plain step for SmolLM2's drafter on an H100, after ~100 s "
                   "of compilation on a fresh machine, ~12 s once its caches hold the kernels; docs/benchmarks.md), "
                   "off on CPU, with --fsdp, for DFlash 2 and in shorter runs. With SDPA it crashed on torch 2.11 "
                   "CUDA when packed batch shapes vary.")
@click.option("--fsdp", is_flag=True,
              help="Shard the drafter with FSDP instead of DDP (GPUs only; eval and export gather the weights).")
@click.option("--mixed-precision", type=click.Choice(["auto", "bf16", "no"]), default=TrainOptions.mixed_precision,
              show_default=True,
              help="auto = bf16 on CUDA, float32 on CPU.")
@click.option("--num-workers", type=click.IntRange(min=0), default=None,
              help="DataLoader workers per process. Default: on CUDA 6 (fewer where the machine has fewer CPUs a "
                   "process), elsewhere 2.")
@click.option("--memory-limit", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GIB",
              help="Memory a training step may use, in GiB (default: what the device has free when the run starts). "
                   "Micro-batches that would not fit are split and accumulated (same result); a sequence that "
                   "cannot fit alone stops the run before its first step.")
@click.option("--processes", type=click.IntRange(min=1), default=None,
              help="Training processes to spawn on this machine (default: one per GPU, 1 on CPU). "
                   "`accelerate launch -m dflash.shared.cli train ...` works too.")
@click.option("-v", "--verbose", is_flag=True, help="Debug messages on the console.")
def train_command(processes: int | None, compile_: bool | None, **kwargs: object) -> None:
    """Stage 2: train a DFlash drafter from a feature cache, measure its offline acceptance, export it.

    The target model is never loaded: the cache's target/ folder supplies the frozen embedding and LM head.
    Every --eval-every steps the validation split reports the offline acceptance length tau (a greedy decoding
    walk over cached features). The export lands in OUT/export/; the drafter of the best validation evaluation
    after step 0 in OUT/export_best/ (with best.json: its step and tau), which is then evaluated once on the test
    split (OUT/test_results.json).
    """
    from dflash.shared.interrupts import exit_on_interrupt, rerun_command

    if click.get_current_context().get_parameter_source("kl_weight") == ParameterSource.COMMANDLINE \
            and kwargs["loss"] != "mix":
        raise click.BadParameter(f"it weighs the KL term of --loss mix only; --loss {kwargs['loss']} would ignore "
                                 "it: add --loss mix, or leave --kl-weight out", param_hint="--kl-weight")
    for name in ("selector_weight", "selector_missing"):
        if click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE \
                and kwargs["architecture"] != "dflash2":
            flag = "--" + name.replace("_", "-")
            raise click.BadParameter(f"it sets DFlash 2's path selector; --architecture {kwargs['architecture']} has "
                                     f"none: add --architecture dflash2, or leave {flag} out", param_hint=flag)
    if kwargs["resume"] and not kwargs["overwrite"]:  # (--overwrite discards the run: the pair is refused later)
        context = click.get_current_context()
        kept = recorded_recipe(Path(str(kwargs["out"])), {
            name: value for name, value in kwargs.items()
            if context.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)})
        changed = {name: value for name, value in kept.items() if value != kwargs[name]}
        if changed and os.environ.get("RANK", "0") == "0":
            flags = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in changed.items())
            click.echo(f"--resume: the run's own {flags} (not given here; today's defaults differ)", err=True)
        kwargs.update(kept)
    resume = rerun_command("--resume", drop_flags=("--overwrite",))
    with exit_on_interrupt("train", f"the last checkpoint is kept; continue with: {resume}"):
        _train(processes, compile_, kwargs)


# What --resume takes from the run it continues (its train_options.json) where the command does not give it: the
# run's length, schedule and step size. Defaults change between versions (on 2026-12-07 --epochs 1 -> 16, --lr
# 6e-4 -> 1e-3, --batch-tokens 8192 -> 49152), and a run resumed with others would stretch its schedule or, for a
# step size, be refused (its saved data position belongs to its own plan).
RESUME_KEEPS = ("epochs", "max_steps", "lr", "warmup", "weight_decay", "clip", "batch_tokens", "grad_accum")


# Held by the run's optimizer state, which a resume restores whole (its groups' rates and the schedule's base
# rates): a value given on --resume would be ignored, so one that differs from the run's is refused.
RESUME_FIXED = ("lr", "weight_decay")


def recorded_recipe(out: Path, given: dict[str, object]) -> dict[str, object]:
    """The RESUME_KEEPS options recorded by the run in `out` that the command leaves to their defaults (`given`: the
    options it gave, with their values); empty for a folder with no recorded run. The length is one choice:
    --epochs or --max-steps given takes neither from the run (--epochs alone: no --max-steps)."""
    record_file = RunFiles(out).options
    if not record_file.is_file():
        return {}
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: the run's own checks say so when it resumes
    for name in RESUME_FIXED:
        if name in given and name in record and given[name] != record[name]:
            flag = "--" + name.replace("_", "-")
            raise click.BadParameter(f"the run in {out} trains at {flag} {record[name]}, which its optimizer state "
                                     f"holds, so a resume cannot change it: leave {flag} out, or train into a new "
                                     "--out", param_hint=flag)
    kept = {name: record[name] for name in RESUME_KEEPS if name in record and name not in given}
    if "epochs" in given or "max_steps" in given:
        kept.pop("epochs", None)
        kept.pop("max_steps", None)
        if "max_steps" not in given:
            kept["max_steps"] = None
    return kept


def _train(processes: int | None, compile_: bool | None, kwargs: dict[str, object]) -> None:
    import os

    import torch

    from dflash.shared.object_store import resolve_cache
    from dflash.stage2_train.launch import spawn_processes
    from dflash.stage2_train.trainer import train

    kwargs["cache"] = resolve_cache(str(kwargs["cache"]), read_through=bool(kwargs.pop("local_copy")))
    options = TrainOptions(compile=compile_, **kwargs)  # type: ignore[arg-type]
    if processes is None:
        processes = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if processes > 1 and "RANK" not in os.environ:
        sys.exit(spawn_processes(options, processes))
    refuse_cpu_launch_without_ranks()
    train(options)


def refuse_cpu_launch_without_ranks() -> None:
    """Refuse `accelerate launch --cpu` asked for several processes or machines but started without ranks.

    Hand-written because Accelerate cannot tell: with --cpu its launcher starts ONE plain process per launch (its
    multi-CPU mode expects mpirun, `--mpirun_hostfile`), exporting MASTER_ADDR only when more than one process or
    machine was asked for, and no RANK / WORLD_SIZE. Each launch would then train alone into the same --out.
    """
    import os

    from accelerate.utils import get_int_from_env, str_to_bool

    # The variables Accelerate itself reads for the world size of a CPU run (torchrun, mpirun flavours).
    world = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    if str_to_bool(os.environ.get("ACCELERATE_USE_CPU", "false")) and "MASTER_ADDR" in os.environ and world == 1:
        from dflash.shared.errors import UserError

        raise UserError("`accelerate launch --cpu` started this process without a rank: with --cpu Accelerate starts "
                        "one process per launch (more need mpirun, --mpirun_hostfile), so each would train alone; "
                        "launch with --multi_gpu instead (torchrun; without CUDA dflash trains on the CPU with gloo), "
                        "see docs/multinode.md")


@click.command("export")
@click.option("--run", "run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True,
              help="Run directory of `dflash train`.")
@click.option("--checkpoint", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Checkpoint folder (default: the latest complete one).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Default: RUN/export.")
def export_command(run_dir: Path, checkpoint: Path | None, out: Path | None) -> None:
    """Export a checkpoint of a run as a Hugging Face folder (config.json + model.safetensors)."""
    from dflash.stage2_train.checkpoints import export_checkpoint

    path = export_checkpoint(run_dir, checkpoint, out)
    click.echo(f"exported {path}")


@click.command("eval")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Exported drafter folder (RUN/export).")
@click.option("--data", default="mtbench,humaneval", show_default=True,
              help="humaneval, mtbench, heldout (the training run's test split of its cache, also walked offline), "
                   "a JSONL/JSON file of conversations, or a comma-separated list of these.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("dflash_eval"), show_default=True,
              help="Where eval.json, eval.md and eval.png go.")
@click.option("--max-samples", type=click.IntRange(min=1), default=20, show_default=True,
              help="Prompts per dataset.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens generated per prompt (by each decoding method).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 = greedy (checked against plain greedy decoding on every prompt); > 0 = rejection sampling.")
@click.option("--model", default=None, help="Target model (default: the one recorded with the drafter).")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads (0 = torch default).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (with --temperature > 0).")
@click.option("--allow-target-mismatch", is_flag=True,
              help="Evaluate even when the target's content hash differs from the one the drafter was trained for "
                   "(recorded in its dflash_target.json).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="The target's dtype: auto = float32 on CPU (exact greedy equality), bf16 on GPU.")
@click.option("--baselines/--no-baselines", default=True, show_default=True,
              help="Also decode each prompt plainly and with prompt lookup (speedups, greedy equality check). "
                   "--no-baselines measures tau alone, in about a third of the time.")
@click.option("--chat-template", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              metavar="FILE", help="Render the prompts with this Jinja chat template (as your serving engine does) "
                                   "instead of the target's own.")
@click.option("--chat-template-kwargs", default=None, metavar="JSON", callback=lambda _c, _p, v: _json_object(v),
              help="Template arguments your serving passes, e.g. '{\"enable_thinking\": false}'. Eval says before "
                   "decoding if the rendering differs from the one the drafter's training cache used.")
@click.option("--decode", type=click.Choice(["auto", "dynamic", "static"]), default="auto", show_default=True,
              help="Decode path of dflash and plain decoding alike: static = static KV caches and fixed-shape "
                   "forwards (CUDA-graphed on GPUs); dynamic = transformers' DynamicCache; auto = static on CUDA, "
                   "dynamic on CPU. Hybrid linear-attention targets (Qwen3-Next, Qwen3.5) decode statically too.")
@click.option("--compile-target", is_flag=True,
              help="On the static path, compile the target's one-token step and the verify blocks (DFlash's, and "
                   "prompt lookup's, padded to one width) with torch.compile before capturing them: plain and "
                   "speculative decoding ran 2.2x faster on an H100 (SmolLM2-135M), for ~35 s more warm-up; tokens "
                   "may differ from the uncompiled path's at bf16 near-ties.")
def eval_command(draft_dir: Path, data: str, out: Path, max_samples: int, max_new_tokens: int, temperature: float,
                 model: str | None, threads: int, seed: int, allow_target_mismatch: bool, dtype: str,
                 baselines: bool, chat_template: Path | None, chat_template_kwargs: dict | None,
                 decode: str, compile_target: bool) -> None:
    """Speculative decoding with the target and an exported drafter: acceptance length tau, acceptance by block
    position, tokens/s and speedup against plain autoregressive decoding and prompt-lookup decoding, measured in
    the same run. Greedy mode must reproduce the target's own greedy output. Before decoding it checks that the
    prompts are rendered as the drafter's training cache was (chat template, thinking mode, special tokens) and
    says what differs; it flags a live tau far below the drafter's offline tau on the cache's test split."""
    import torch

    from dflash.shared.logs import setup_logging
    from dflash.stage2_train.evaluate import run_eval

    if threads:
        torch.set_num_threads(threads)
    if compile_target:  # read by each TargetRunner this process makes (it evaluates once)
        from dflash.stage2_train import modeling_dflash

        modeling_dflash.COMPILE_TARGET = True
    setup_logging(Path(out) / "eval.log")
    from dflash.shared.interrupts import exit_on_interrupt

    with exit_on_interrupt("eval", "nothing is kept of an unfinished evaluation: rerun the same command"):
        result = run_eval(draft_dir, data, out, max_samples, max_new_tokens, temperature=temperature, model=model,
                          seed=seed, allow_target_mismatch=allow_target_mismatch, dtype=dtype, baselines=baselines,
                          chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                          decode=decode)
    click.echo((Path(out) / "eval.md").read_text() if (Path(out) / "eval.md").is_file() else json_dump(result))


def _json_object(text: str | None) -> dict | None:
    """--chat-template-kwargs: a JSON object, or a one-line usage error."""
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise click.BadParameter(f"not valid JSON ({error.msg} at column {error.colno})") from error
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def json_dump(value: object) -> str:
    import json

    return json.dumps(value, indent=2, default=str)
