"""`dflash extract --repair --out DIR|s3://...`: redo exactly the shards `dflash inspect --verify` finds damaged (and
any not finished), with the options recorded in the cache's manifest, so the user retypes nothing; every healthy
shard is left as it is, byte for byte (in a bucket: not even uploaded again)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dflash.shared import cache_format as cf
from dflash.shared import object_store
from dflash.stage1_extract.options import ExtractOptions
from dflash.stage1_extract.supervisor import ExtractRefused, run_extract

RETIRED_OPTIONS = ("export_layers",)  # recorded in manifests by earlier versions; nothing of a shard depends on them


def repair_options(out: Path, workers: int | None = None, verbose: bool = False) -> tuple[ExtractOptions, list[int]]:
    """The options of the run that made the cache `out` (from its manifest) and the shards to redo (those `dflash
    inspect --verify` finds damaged, and any not finished); ([] when all are sound). `out` may be the local mirror
    of a cache in a bucket (`object_store.mirror`): its shards are then verified in the bucket."""
    from dflash.shared.cache_commands import verify_cache

    manifest = cf.read_manifest(out)
    recorded = manifest[cf.OPTIONS_KEY]
    if recorded is None:
        raise ExtractRefused(
            f"{out / cf.MANIFEST_FILE} does not record the options of the run that made it: "
            "--repair cannot redo its shards; re-extract the damaged ones with `dflash extract --out "
            f"{out} --only-shards N --overwrite --yes` and exactly the options of the original run")
    damaged = set(verify_cache(out))
    unfinished = {int(k) for k, e in manifest["shards"].items() if e.get("status") != cf.SHARD_DONE}
    shards = sorted(damaged | unfinished)
    # `export_layers` (`--export-layers`, removed 2026-12-07 with `dflash train --init-from-target`) wrote no shard
    # data: a manifest of a cache made with it repairs without it.
    recorded = {name: value for name, value in recorded.items() if name not in RETIRED_OPTIONS}
    options = ExtractOptions(out=out, **recorded, only_shards=",".join(map(str, shards)) or None, redo=True,
                             workers=workers, verbose=verbose)
    return options, shards


def repair(out: str, staging: Path | None, workers: int | None, verbose: bool, say: Callable[[str], None]) -> int:
    """Repair the cache at `out` (a folder or s3://...); returns the exit code. A cache in a bucket is verified
    there, its damaged shards are extracted again into the staging cache (seeded from the bucket's manifest when
    it has none) and only those are published, each replacing the damaged store."""
    remote = object_store.is_remote(out)
    location = object_store.resolve_cache(out) if remote else Path(out)
    options, shards = repair_options(location, workers, verbose)
    if not shards:
        say(f"every shard of {out} is sound: nothing to repair")
        return 0
    say(f"repairing shards {shards} of {out} with the options it was made with")
    if not remote:
        return run_extract(options)
    staging = staging or object_store.default_root("staging", out)
    object_store.seed_staging(staging, out)
    code = run_extract(replace(options, out=staging))
    counts = object_store.publish(staging, out, only=set(shards), log=say)
    say(f"{counts['published']} repaired shards published to {out}")
    return code
