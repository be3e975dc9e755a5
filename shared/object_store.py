"""A dflash cache in S3-compatible object storage (`s3://bucket/prefix`), through obstore and zarr's ObjectStore.

The layout in the bucket is the local one (docs/cache-format.md): manifest.json, target/, shards/shard-NNNNN.zarr.
Object storage has no rename and no file locks, so the local guarantees are kept this way:

- Extraction (`dflash extract --out s3://...`) runs into a local staging cache, with every local guarantee (one
  writer per store, shard locks, atomic rename, resume), then publishes each finished shard: if the bucket lists
  it as done (an --overwrite rerun) it is first marked pending there; every object of the store is uploaded,
  the group's zarr.json last; then its manifest entry is set to done. Manifest updates are conditional PUTs
  (If-None-Match on creation, If-Match the ETag read on update, retried on conflict), so machines publishing
  disjoint shards into one bucket never lose each other's entries. Readers use only shards the manifest lists as
  done, so they never see a half-uploaded store. A rerun resumes: a staging cache that is gone is seeded from the
  bucket's manifest, so shards done there are not extracted again.
- Readers (`dflash train --cache s3://...`, `dflash inspect`) work on a local mirror folder holding manifest.json,
  target/ and remote.json (the URL); shard stores are read by zarr straight from the bucket, optionally through a
  read-through copy of each zarr shard file on local disk (`ReadThroughStore`).

Credentials and endpoint come from the usual environment variables, as for any S3 client: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL (for S3-compatible servers), AWS_ALLOW_HTTP=true for http.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zarr.storage import LocalStore
from zarr.storage._wrapper import WrapperStore

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError

REMOTE_FILE = "remote.json"  # in a mirror folder: {"url": "s3://..."}
SCHEMES = ("s3://",)
MANIFEST_RETRIES = 100


class RemoteCacheError(UserError):
    """The bucket cannot be reached, or its cache does not match what was asked."""


def is_remote(location: str | os.PathLike[str]) -> bool:
    return str(location).startswith(SCHEMES)


def open_bucket(url: str) -> Any:
    """An obstore store rooted at `url` (credentials and endpoint from the environment)."""
    from obstore.store import from_url

    try:
        return from_url(url.rstrip("/"))
    except Exception as error:  # noqa: BLE001 - obstore raises its own types for bad URLs and configuration
        raise RemoteCacheError(f"cannot open {url}: {error}") from error


def default_root(kind: str, url: str) -> Path:
    """~/.cache/dflash/{staging,remote}/<hash of the URL>: where a remote cache's local side lives by default."""
    home = Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash"))
    return home / kind / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------- manifest


def read_remote_json(bucket: Any, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(document, ETag), or (None, None) when the object does not exist."""
    import obstore

    try:
        result = obstore.get(bucket, key)
        return json.loads(bytes(result.bytes())), result.meta["e_tag"]
    except FileNotFoundError:
        return None, None
    except json.JSONDecodeError as error:
        raise RemoteCacheError(f"{key} in the bucket is not valid JSON ({error})") from error


def update_remote_manifest(bucket: Any, change: Callable[[dict[str, Any]], None],
                           create: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read-modify-write the bucket's manifest.json with a conditional PUT, retried when another writer got in
    between. `create`: the manifest to start from when the bucket has none (else a missing one is an error)."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    for attempt in range(MANIFEST_RETRIES):
        manifest, etag = read_remote_json(bucket, cf.MANIFEST_FILE)
        if manifest is None:
            if create is None:
                raise RemoteCacheError(f"the bucket has no {cf.MANIFEST_FILE}")
            manifest = json.loads(json.dumps(create))
        change(manifest)
        manifest["updated"] = time.time()
        body = json.dumps(manifest, indent=2, sort_keys=True).encode()
        try:
            obstore.put(bucket, cf.MANIFEST_FILE, body, mode="create" if etag is None else {"e_tag": etag})
            return manifest
        except (PreconditionError, AlreadyExistsError):
            time.sleep(min(1.0, 0.01 * 2**min(attempt, 7)))  # another machine updated it: read again
    raise RemoteCacheError(f"could not update {cf.MANIFEST_FILE} in the bucket: {MANIFEST_RETRIES} conflicts")


# ------------------------------------------------------------------------------------------- publishing


def _upload_files(bucket: Any, files: list[tuple[Path, str]], threads: int = 16) -> int:
    import obstore

    def put(item: tuple[Path, str]) -> int:
        path, key = item
        obstore.put(bucket, key, path)
        return path.stat().st_size

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(put, files))


def upload_store(bucket: Any, store_dir: Path, key: str) -> int:
    """Upload one zarr store folder to `key`, its group zarr.json (which says complete) last; returns bytes. Objects
    under `key` that the store does not hold (left by a damaged or half-uploaded earlier store) are deleted first,
    so the store in the bucket is exactly the local one."""
    import obstore

    files = sorted(p for p in store_dir.rglob("*") if p.is_file())
    group_json = store_dir / "zarr.json"
    keys = {f"{key}/{p.relative_to(store_dir).as_posix()}" for p in files}
    stale = [meta["path"] for batch in obstore.list(bucket, key + "/") for meta in batch if meta["path"] not in keys]
    if stale:
        obstore.delete(bucket, stale)
    data = [(p, f"{key}/{p.relative_to(store_dir).as_posix()}") for p in files if p != group_json]
    total = _upload_files(bucket, data)
    return total + _upload_files(bucket, [(group_json, f"{key}/zarr.json")])


def seed_staging(staging: Path, url: str) -> bool:
    """When the staging cache has no manifest but the bucket has one, start from the bucket's, so that shards done
    there are skipped (this machine may never have extracted them). Returns whether it seeded."""
    if (staging / cf.MANIFEST_FILE).exists():
        return False
    manifest, _ = read_remote_json(open_bucket(url), cf.MANIFEST_FILE)
    if manifest is None:
        return False
    for entry in manifest["shards"].values():
        if entry.get("status") != cf.SHARD_DONE:
            entry.clear()
            entry["status"] = cf.SHARD_PENDING
        else:
            entry["remote_only"] = True  # done in the bucket; no local store to publish
    staging.mkdir(parents=True, exist_ok=True)
    cf.write_json_atomic(staging / cf.MANIFEST_FILE, manifest)
    return True


def publish(staging: Path, url: str, *, overwrite: bool = False, only: set[int] | None = None,
            log: Callable[[str], None] = print) -> dict[str, int]:
    """Publish the finished shards of a local staging cache to the bucket (see the module docstring); with `only`,
    just those shards (`dflash extract --repair`: the others in the bucket are not touched)."""
    bucket = open_bucket(url)
    local = cf.read_manifest(staging)
    remote, _ = read_remote_json(bucket, cf.MANIFEST_FILE)
    fresh = {**local, "shards": {k: {"status": cf.SHARD_PENDING} for k in local["shards"]}}
    if remote is not None and (differences := cf.identity_mismatch(remote["identity"], local["identity"])):
        if not overwrite:
            raise RemoteCacheError(f"{url} holds a cache extracted with different settings:\n  "
                                   + "\n  ".join(differences) + "\nuse another --out, or pass --overwrite")
        log(f"--overwrite: replacing the manifest of {url}")
        update_remote_manifest(bucket, lambda m: (m.clear(), m.update(json.loads(json.dumps(fresh)))))
        remote = None
    target_files = [(p, f"{cf.TARGET_DIR}/{p.relative_to(staging / cf.TARGET_DIR).as_posix()}")
                    for p in sorted((staging / cf.TARGET_DIR).rglob("*")) if p.is_file()]
    if remote is None:  # the target files first: a manifest in the bucket promises them
        _upload_files(bucket, target_files)
    else:  # target files made since the first publish or changed in size
        import obstore

        sizes = {meta["path"]: meta["size"] for batch in obstore.list(bucket, cf.TARGET_DIR + "/") for meta in batch}
        _upload_files(bucket, [(p, key) for p, key in target_files if sizes.get(key) != p.stat().st_size])
    counts = {"published": 0, "already": 0, "bytes": 0}
    for key, entry in sorted(local["shards"].items(), key=lambda item: int(item[0])):
        store = cf.shard_path(staging, int(key))
        if entry.get("status") != cf.SHARD_DONE or entry.get("remote_only") or not store.is_dir():
            continue
        if only is not None and int(key) not in only:
            continue
        remote_entry = (remote or {}).get("shards", {}).get(key, {})
        if remote_entry.get("status") == cf.SHARD_DONE and remote_entry.get("finished") == entry.get("finished"):
            counts["already"] += 1
            continue
        if remote_entry.get("status") == cf.SHARD_DONE:  # replacing a published store: unpublish it first

            def unpublish(manifest: dict[str, Any], key: str = key) -> None:
                manifest["shards"][key] = {"status": cf.SHARD_PENDING}

            update_remote_manifest(bucket, unpublish)
        started = time.time()
        counts["bytes"] += upload_store(bucket, store, f"{cf.SHARDS_DIR}/{cf.shard_name(int(key))}")

        def mark_done(manifest: dict[str, Any], key: str = key, entry: dict[str, Any] = entry) -> None:
            manifest["shards"][key] = dict(entry)

        remote = update_remote_manifest(bucket, mark_done, create=fresh)
        counts["published"] += 1
        log(f"published shard {key} to {url} ({time.time() - started:.1f} s)")
    return counts


# -------------------------------------------------------------------------------------------- reading


def mirror(url: str, root: Path | None = None, read_through: bool = False) -> Path:
    """A local folder that stands for the remote cache: manifest.json (fresh), target/ (downloaded when missing
    or of another size) and remote.json. Shards stay in the bucket (`shard_store`); with `read_through`, each
    shard file is copied into the folder's read_through/ when first read, and read from there afterwards."""
    import obstore

    bucket = open_bucket(url)
    root = root or default_root("remote", url)
    manifest, _ = read_remote_json(bucket, cf.MANIFEST_FILE)
    if manifest is None:
        raise RemoteCacheError(f"{url} is not a dflash cache: {cf.MANIFEST_FILE} not found "
                               "(run `dflash extract --out` to it first)")
    (root / cf.TARGET_DIR).mkdir(parents=True, exist_ok=True)
    for batch in obstore.list(bucket, cf.TARGET_DIR + "/"):
        for meta in batch:
            local = root / meta["path"]
            if local.name in cf.RETIRED_TARGET_FILES or (local.is_file() and local.stat().st_size == meta["size"]):
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
            tmp.write_bytes(bytes(obstore.get(bucket, meta["path"]).bytes()))
            os.replace(tmp, local)
    cf.write_json_atomic(root / cf.MANIFEST_FILE, manifest)
    cf.write_json_atomic(root / REMOTE_FILE, {"url": url.rstrip("/"), "read_through": read_through})
    return root


def resolve_cache(location: str | Path, read_through: bool = False) -> Path:
    """A --cache argument as a local folder: itself, or the refreshed mirror of a cache in a bucket."""
    return mirror(str(location), read_through=read_through) if is_remote(location) else Path(location)


def is_mirror(cache_dir: Path) -> bool:
    """Whether `cache_dir` is the local mirror of a cache in a bucket (`mirror`)."""
    return (Path(cache_dir) / REMOTE_FILE).is_file()


def shard_source(cache_dir: Path, shard: int) -> Any:
    """Where to read shard `shard` of a cache from: its folder, or for the local mirror of a cache in a bucket
    (`mirror`) a zarr store in the bucket."""
    remote = remote_source(cache_dir, shard)
    return cf.shard_path(cache_dir, shard) if remote is None else remote


def remote_source(cache_dir: Path, shard: int) -> Any | None:
    """The zarr store of shard `shard` when `cache_dir` is the mirror of a remote cache, else None."""
    if not is_mirror(cache_dir):
        return None
    remote = json.loads((Path(cache_dir) / REMOTE_FILE).read_text())
    if not remote.get("read_through"):
        return shard_store(remote["url"], shard)
    # Local copies are kept per publication of the shard: a store published again (an --overwrite rerun) gets
    # a new folder, so a stale copy is never read.
    entry = cf.read_manifest(Path(cache_dir))["shards"].get(str(shard), {})
    folder = Path(cache_dir) / "read_through" / f"{entry.get('finished', 0):.6f}"
    return shard_store(remote["url"], shard, folder)


def shard_store(url: str, shard: int, read_through: Path | None = None) -> Any:
    """A read-only zarr store for one shard in the bucket, through a local read-through copy when asked."""
    from zarr.storage import ObjectStore

    key = f"{cf.SHARDS_DIR}/{cf.shard_name(shard)}"
    store = ObjectStore(open_bucket(f"{url}/{key}"), read_only=True)
    if read_through is not None:
        return ReadThroughStore(store, read_through / key)
    return store


class ReadThroughStore(WrapperStore[Any]):
    """Reads each object once from the bucket, whole, into a local folder; serves every later read (and every
    byte range: the sharding codec reads an index, then inner chunks) from the local file.

    Written by hand because zarr's own CacheStore keeps byte-range reads in memory only, and the training loader
    reads nothing but byte ranges of the (64 MB) shard files. Each local copy is written under a temporary name
    and renamed, so concurrent DataLoader workers never see half a file."""

    def __init__(self, store: Any, folder: Path) -> None:
        super().__init__(store)
        self.folder = Path(folder)
        self._local_store = LocalStore(self.folder, read_only=True)

    def _with_store(self, store: Any) -> Any:
        return type(self)(store, self.folder)

    async def _fetch(self, key: str, prototype: Any) -> bool:
        """Make sure the local copy of `key` exists; False when the bucket has no such object."""
        path = self.folder / key
        if path.is_file():
            return True
        whole = await self._store.get(key, prototype)
        if whole is None:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{id(whole)}")
        await asyncio.to_thread(tmp.write_bytes, whole.to_bytes())
        os.replace(tmp, path)
        return True

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if not await self._fetch(key, prototype):
            return None
        return await self._local_store.get(key, prototype, byte_range)
