"""`dflash status` and `dflash inspect`: look at a cache, and at the run filling it, from any shell."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from dflash.shared import cache_format as cf
from dflash.shared.feature_codecs import SCALES_ARRAY, FeatureCodec, manifest_codec

HEARTBEAT_STALE_S = 30.0


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_state(run: dict[str, Any] | None) -> str:
    """running / done / failed / interrupted / dead (a 'running' run whose process is gone or silent) / none."""
    if not run:
        return "none"
    state = str(run.get("state", "unknown"))
    if state != "running":
        return state
    age = time.time() - float(run.get("heartbeat", 0))
    same_host = run.get("host") == socket.gethostname()
    if (same_host and not _pid_alive(int(run.get("pid", -1)))) or age > HEARTBEAT_STALE_S:
        return "dead"
    return "running"


def cache_summary(cache_dir: Path) -> dict[str, Any]:
    manifest = cf.read_manifest(cache_dir)
    shards = manifest["shards"]
    counts: dict[str, int] = {}
    for entry in shards.values():
        counts[entry.get("status", "pending")] = counts.get(entry.get("status", "pending"), 0) + 1
    done = [e for e in shards.values() if e.get("status") == cf.SHARD_DONE]
    skipped: dict[str, int] = dict(manifest.get("data", {}).get("skipped_on_load", {}))
    for entry in done:
        for reason, count in entry.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + count
    tokens = sum(e["tokens"] for e in done)
    stored = sum(e.get("bytes", 0) for e in done)
    topk_stored = sum(e.get("topk_bytes", 0) for e in done)
    identity = manifest["identity"]
    topk = cf.TopKFormat.of_manifest(manifest)
    return {
        "cache": str(cache_dir),
        "format_version": manifest["format_version"],
        "target": manifest.get("target", {}).get("name", identity.get("target_source")),
        "layer_ids": identity["layer_ids"],
        "hidden_size": identity["hidden_size"],
        "feature_dtype": identity["feature_dtype"],
        "shards": len(shards),
        "shard_status": counts,
        "samples": sum(e["samples"] for e in done),
        "tokens": tokens,
        "loss_tokens": sum(e.get("loss_tokens", 0) for e in done),
        "truncated": sum(e.get("truncated", 0) for e in done),
        "skipped": skipped,
        "feature_bytes": stored,
        "bytes_per_token": round(stored / tokens, 1) if tokens else None,  # features only
        "target_topk": topk.record() if topk is not None else None,
        "topk_bytes": topk_stored,
        "topk_bytes_per_supervised_token": topk.row_bytes if topk is not None else None,
        "bytes_per_token_with_topk": round((stored + topk_stored) / tokens, 1) if tokens else None,
        "disk_bytes": _disk_bytes(cache_dir / cf.SHARDS_DIR),
        "complete": counts.get(cf.SHARD_DONE, 0) == len(shards),
    }


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


# --------------------------------------------------------------------------------------------- verification


def verify_shard(cache_dir: Path, shard: int, entry: dict[str, Any], vocab_size: int, feature_dim: int,
                 codec: FeatureCodec, topk: cf.TopKFormat | None = None) -> list[str]:
    """Re-read one shard completely; return the problems found (empty when it is sound). `topk`: the target top-k
    the cache's manifest records (its arrays are re-read too)."""
    import torch

    from dflash.shared.object_store import shard_source

    path = shard_source(cache_dir, shard)
    if isinstance(path, Path) and not path.exists():
        return ["store is missing"]
    try:
        reader = cf.ShardReader(path, codec)
        offsets = reader.offsets
        problems = []
        if len(offsets) != entry["samples"] + 1 or int(offsets[-1]) != entry["tokens"]:
            problems.append(f"holds {len(offsets) - 1} samples / {int(offsets[-1])} tokens, the manifest says "
                            f"{entry['samples']} / {entry['tokens']}")
        if np.any(np.diff(offsets) <= 0) or offsets[0] != 0:
            problems.append("offsets are not strictly increasing from 0")
        features = reader.features
        if tuple(features.shape) != (int(offsets[-1]), feature_dim):
            problems.append(f"features have shape {tuple(features.shape)}, expected ({int(offsets[-1])}, {feature_dim})")
        group = reader.group
        # zarr reads a chunk whose object is missing as its fill value (zeros): the shapes and the token-id range
        # would pass, and training would read zeros. zarr also leaves out a chunk that is all fill value, so only
        # arrays where that cannot happen are checked: features, their scales, token ids and loss masks (every
        # sample has supervised tokens); sample_index may be [0], offsets are checked by their order below.
        for name in ("features", SCALES_ARRAY, "input_ids", "loss_mask"):
            if name in group and group[name].nchunks_initialized < group[name].nchunks:
                problems.append(f"{name}: stored chunks are missing (they would read as zeros)")
        input_ids = np.asarray(group["input_ids"][:])
        loss_mask = np.asarray(group["loss_mask"][:])
        for name, array in (("input_ids", input_ids), ("loss_mask", loss_mask)):
            if len(array) != int(offsets[-1]):
                problems.append(f"{name} has {len(array)} entries, expected {int(offsets[-1])}")
        if len(input_ids) and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
            problems.append(f"token ids outside [0, {vocab_size})")
        if len(loss_mask) and loss_mask.max() > 1:
            problems.append("loss_mask holds values other than 0/1")
        if (scales_problem := reader.scales_problem()) is not None:
            return [*problems, scales_problem]
        if (topk_problem := reader.topk_problem(topk)) is not None:
            return [*problems, topk_problem]
        if topk is not None:
            problems += _topk_problems(reader, loss_mask, vocab_size)
        step = max(1, cf.StoreLayout.for_feature_dim(feature_dim, features.dtype.itemsize).shard_rows)
        for start in range(0, int(features.shape[0]), step):
            block = reader.rows_tensor(start, min(start + step, int(features.shape[0])))
            if not bool(torch.isfinite(block).all()):
                problems.append(f"NaN/Inf features in rows {start}..{start + len(block) - 1}")
                break
        return problems
    except Exception as error:  # noqa: BLE001 - checksum failures and damaged files surface as exceptions
        return [f"unreadable: {type(error).__name__}: {error}"]


def _topk_problems(reader: cf.ShardReader, loss_mask: np.ndarray, vocab_size: int) -> list[str]:
    """The stored target top-k of a shard: one row per `topk_positions` token, ids inside the vocabulary and
    distinct in a row, log-probabilities finite, <= 0 and sorted (read in blocks of one zarr shard file)."""
    if not np.array_equal(reader.topk_offsets, cf.topk_offsets(loss_mask, reader.offsets)):
        return [f"{cf.TOPK_OFFSETS} do not count the supervised tokens of each sample"]
    ids_array, logprobs_array = reader.topk_ids, reader.topk_logprobs
    rows = int(ids_array.shape[0])
    step = max(1, int(ids_array.shards[0]))
    for start in range(0, rows, step):
        ids = np.asarray(ids_array[start : start + step]).astype(np.int64)
        logprobs = np.asarray(logprobs_array[start : start + step]).astype(np.float32)
        where = f"top-k rows {start}..{start + len(ids) - 1}"
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            return [f"{where}: token ids outside [0, {vocab_size})"]
        if ids.shape[1] > 1 and bool((np.diff(np.sort(ids, axis=1), axis=1) == 0).any()):
            return [f"{where}: a token id appears twice in one row"]
        if not bool(np.isfinite(logprobs).all()) or bool((logprobs > 0).any()):
            return [f"{where}: log-probabilities that are not finite and <= 0"]
        if bool((np.diff(logprobs, axis=1) > 0).any()):
            return [f"{where}: log-probabilities not sorted from the most likely token"]
    return []


def verify_cache(cache_dir: Path) -> dict[int, list[str]]:
    manifest = cf.read_manifest(cache_dir)
    config = json.loads((cache_dir / cf.TARGET_DIR / "config.json").read_text())
    vocab_size = int(config.get("text_config", config)["vocab_size"])
    feature_dim = int(manifest["identity"]["hidden_size"]) * len(manifest["identity"]["layer_ids"])
    problems: dict[int, list[str]] = {}
    for key, entry in sorted(manifest["shards"].items(), key=lambda item: int(item[0])):
        if entry.get("status") != cf.SHARD_DONE:
            continue
        found = verify_shard(cache_dir, int(key), entry, vocab_size, feature_dim, manifest_codec(manifest),
                             cf.TopKFormat.of_manifest(manifest))
        if found:
            problems[int(key)] = found
    return problems


def missing_stores(cache_dir: Path, manifest: dict[str, Any]) -> dict[int, str]:
    """Finished shards of a local cache whose store is gone, or its group metadata (zarr.json) or an array's: what
    is missing, by shard (a cheap look at the files; `--verify` reads them). Empty for the mirror of a bucket."""
    from dflash.shared.object_store import is_mirror

    if is_mirror(cache_dir):
        return {}
    missing = {}
    for key, entry in manifest["shards"].items():
        store = cf.shard_path(cache_dir, int(key))
        if entry.get("status") != cf.SHARD_DONE:
            continue
        if not store.is_dir():
            missing[int(key)] = "store is missing"
            continue
        gone = [str(path.relative_to(store)) for path in [store / "zarr.json"] + [
            store / name / "zarr.json" for name in ("features", "input_ids", "loss_mask", "offsets")]
            if not path.is_file()]
        if gone:
            missing[int(key)] = f"{', '.join(gone)} missing"
    return dict(sorted(missing.items()))


# ------------------------------------------------------------------------------------------------ commands


@click.command("inspect")
@click.option("--cache", "location", required=True, metavar="DIR|s3://BUCKET/PREFIX",
              help="Cache made by `dflash extract`: a directory or a bucket.")
@click.option("--verify", is_flag=True,
              help="Re-read every stored chunk: checksums, shapes, counts, NaN/Inf features and token ids.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect_command(location: str, verify: bool, as_json: bool) -> None:
    """Describe a feature cache: samples, tokens, bytes per token, shards, skipped counts.

    Exit code 1 when a finished shard's store (or its zarr.json) is missing; with --verify also when any shard is
    damaged or not finished (pending, running, failed). Each problem names the shard and the command that fixes it.
    """
    from dflash.shared.object_store import resolve_cache

    cache_dir = resolve_cache(location)
    summary = cache_summary(cache_dir)
    manifest = cf.read_manifest(cache_dir)
    problems = verify_cache(cache_dir) if verify else {
        shard: [found] for shard, found in missing_stores(cache_dir, manifest).items()}
    unfinished = cf.unfinished_shards(manifest)
    summary["problems"] = {str(k): v for k, v in problems.items()}
    if verify:
        summary["verify"] = {"ok": not problems and not unfinished, "problems": summary["problems"],
                             "unfinished": unfinished}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
        for shard, found in problems.items():
            for problem in found:
                click.echo(f"DAMAGED shard {shard} ({cf.shard_name(shard)}): {problem}")
        if problems:
            click.echo(f"fix: {cf.repair_command(location)} (redoes shards {sorted(problems)} with the "
                       "options recorded in the cache; healthy shards are not touched)")
        if unfinished:
            click.echo(f"{'NOT FINISHED' if verify else 'note'}: {cf.finish_advice(location, unfinished)}")
        if verify and not problems and not unfinished:
            click.echo(f"verify: OK ({summary['shard_status'].get('done', 0)} shards re-read)")
    sys.exit(1 if problems or (verify and unfinished) else 0)


def _print_summary(summary: dict[str, Any]) -> None:
    rows = [
        ("cache", summary["cache"]),
        ("target", summary["target"]),
        ("layers", f"{summary['layer_ids']} x hidden {summary['hidden_size']} ({summary['feature_dtype']})"),
        ("shards", f"{summary['shards']} ({', '.join(f'{v} {k}' for k, v in sorted(summary['shard_status'].items()))})"),
        ("samples", f"{summary['samples']:,}"),
        ("tokens", f"{summary['tokens']:,} ({summary['loss_tokens']:,} with loss)"),
        ("truncated", f"{summary['truncated']:,}"),
        ("skipped", ", ".join(f"{k}: {v}" for k, v in sorted(summary["skipped"].items())) or "none"),
        ("bytes/token", _bytes_per_token(summary)),
        ("on disk", f"{summary['disk_bytes'] / 1e6:,.1f} MB"),
    ]
    for name, value in rows:
        click.echo(f"{name:>12}  {value}")


def _bytes_per_token(summary: dict[str, Any]) -> str:
    """Feature bytes per token, and with the target's top-k where the cache holds it."""
    topk = summary["target_topk"]
    if topk is None:
        return f"{summary['bytes_per_token']} (no target top-k)"
    return (f"{summary['bytes_per_token']} without the target top-k, {summary['bytes_per_token_with_topk']} with it "
            f"(k = {topk['k']}: {summary['topk_bytes_per_supervised_token']} bytes per supervised token, "
            f"{topk['ids_dtype']} ids + {topk['logprobs_dtype']} log-probs)")


def _generate_summary(out_dir: Path) -> dict[str, Any]:
    """A `dflash generate` output directory: conversations finished so far (whole lines of the part files)."""
    finished = 0
    for part in (out_dir / "parts").glob("*.jsonl.part"):
        finished += part.read_bytes().count(b"\n")
    return {"output": str(out_dir), "finished": finished}


def train_summary(run_dir: Path) -> dict[str, Any]:
    """A `dflash train` run directory: running (its lock is held) / finished / stopped, the last step of the total,
    the last loss and validation tau, the test split's tau (once training ended), the latest checkpoint, and an ETA
    from this session's pace."""
    from filelock import FileLock, Timeout

    from dflash.shared.run_files import RunFiles

    files = RunFiles(run_dir.resolve())
    options = json.loads(files.options.read_text())
    records = []
    if files.metrics.is_file():
        for line in files.metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/tau_walk" in r]
    session = steps
    for i in range(1, len(steps)):  # a resumed run starts its clock again: pace from the last session only
        if steps[i].get("elapsed_s", 0) < steps[i - 1].get("elapsed_s", 0):
            session = steps[i:]
    total = options.get("total_steps")
    step = steps[-1]["step"] if steps else 0
    eta = None
    if total and len(session) > 1:
        pace = (session[-1]["elapsed_s"] - session[0]["elapsed_s"]) / (session[-1]["step"] - session[0]["step"])
        eta = max(0.0, (total - step) * pace)
    try:
        with FileLock(str(files.lock), timeout=0):
            running = False
    except Timeout:
        running = True
    latest = files.latest_checkpoint()
    state = ("running" if running else "finished" if total and step >= total and files.export.is_dir()
             else "stopped")
    test = json.loads(files.test_results.read_text()) if files.test_results.is_file() else None
    return {"run": str(files.root), "state": state, "step": step, "total_steps": total,
            "loss": steps[-1]["loss"] if steps else None, "tau": evals[-1]["eval/tau_walk"] if evals else None,
            "tau_step": evals[-1]["step"] if evals else None, "eta_s": eta,
            "test": {k: test.get(k) for k in ("drafter", "step", "sequences", "tau_walk", "tau_walk_stderr")} if test
            else None,
            "latest_checkpoint": latest.name if latest else None, "cache": options.get("cache")}


def _print_train_status(report: dict[str, Any]) -> None:
    click.echo(f"training run {report['run']}: {report['state']}, step {report['step']:,}/"
               f"{report['total_steps'] or '?'}" + (f", ETA {report['eta_s']:,.0f} s" if report["state"] == "running"
                                                     and report["eta_s"] is not None else ""))
    if report["loss"] is not None:
        click.echo(f"  last loss {report['loss']:.4f}" + (f"; validation tau {report['tau']:.3f} at step "
                                                          f"{report['tau_step']}" if report["tau"] else ""))
    if report["test"] is not None:
        test = report["test"]
        click.echo(f"  test split ({test['sequences']} sequences, evaluated once): tau {test['tau_walk']:.3f} +- "
                   f"{test['tau_walk_stderr'] or float('nan'):.3f} for {test['drafter']}/ (step {test['step']})")
    click.echo(f"  latest checkpoint: {report['latest_checkpoint'] or 'none'}")
    if report["state"] == "stopped":
        click.echo("  continue it with the `dflash train` command it was started with, plus --resume")


@click.command("status")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Cache directory of a `dflash extract`, output directory of a `dflash generate`, or run directory "
                   "of a `dflash train`.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def status_command(cache_dir: Path, as_json: bool) -> None:
    """What is running, done and failed in a cache, a generate output or a training run, and how fast (works from
    another shell).

    A run whose process is gone or whose heartbeat is older than 30 s is reported as dead.
    """
    from dflash.shared.run_files import RunFiles

    if RunFiles(cache_dir).is_run():
        report = train_summary(cache_dir)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            _print_train_status(report)
        return
    generate_output = not (cache_dir / cf.MANIFEST_FILE).exists() and (cache_dir / "generate.json").exists()
    summary = _generate_summary(cache_dir) if generate_output else cache_summary(cache_dir)
    status = cf.read_status(cache_dir)
    run = status.get("run")
    state = run_state(run)
    workers = {name: data for name, data in status.items() if name.startswith("worker-")}
    report = {"state": state, "run": run, "workers": workers, "cache": summary}
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    click.echo(f"run: {state}" + (f" (pid {run.get('pid')} on {run.get('host')})" if run else ""))
    if run and state == "running":
        eta = run.get("eta_s")
        click.echo(f"  {run.get('samples_done', 0):,}/{run.get('samples_total', 0):,} samples, "
                   f"{run.get('tokens_per_s', 0):,.0f} tok/s, ETA {'?' if eta is None else f'{eta:,.0f} s'}")
        for name, data in sorted(workers.items()):
            alive = "alive" if _pid_alive(int(data.get("pid", -1))) else "gone"
            where = f"chunk {data.get('chunk')}" if generate_output else f"shard {data.get('shard')}"
            click.echo(f"  {name}: {data.get('device')} {where} ({alive}), "
                       f"{data.get('samples', 0):,} samples, {data.get('tokens', 0):,} tokens")
    if generate_output:
        click.echo(f"generate output: {summary['finished']:,} conversations finished")
        return
    counts = summary["shard_status"]
    click.echo(f"shards: {summary['shards']} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
               f"{summary['samples']:,} samples and {summary['tokens']:,} tokens stored")
    failed = [k for k, e in cf.read_manifest(cache_dir)["shards"].items() if e.get("status") == cf.SHARD_FAILED]
    if failed:
        click.echo(f"failed shards: {', '.join(failed)} (see {cache_dir / cf.LOG_FILE}; rerun to retry)")
