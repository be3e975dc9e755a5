"""Read throughput of the training loader from a cache in object storage vs the same cache on local disk.

Publishes a local cache to an S3-compatible server (by default a moto server started here on localhost: a
stand-in, since no real bucket is reachable offline; point AWS_ENDPOINT_URL at a real one and pass --url to
measure it), then iterates one epoch of micro-batches with the real DataLoader (CacheBatches + make_loader) from:
the local cache, the bucket, the bucket with --local-copy (first epoch: copies; second epoch: local reads).

    python benchmarks/bench_remote_loader.py --cache CACHE --out benchmarks/results/remote_loader_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any


def epoch_throughput(cache: Path, workers: int, batch_tokens: int) -> dict[str, float]:
    from dflash.stage2_train.cache_index import CacheIndex
    from dflash.stage2_train.epoch_plan import plan_epoch
    from dflash.stage2_train.packed_batches import CacheBatches
    from dflash.stage2_train.packed_loader import make_loader

    index = CacheIndex.from_cache(cache, eval_fraction=0.0, seed=0)
    plan = plan_epoch(index, 0, 0, batch_tokens)
    started = time.time()
    feature_bytes = 0
    for batch in make_loader(CacheBatches(cache, plan, epoch=0, seed=0), workers, pin_memory=False):
        feature_bytes += batch["features"].numel() * batch["features"].element_size()
    seconds = time.time() - started
    return {"seconds": round(seconds, 2), "feature_bytes": feature_bytes,
            "MB_per_s": round(feature_bytes / seconds / 1e6, 1)}


def start_moto() -> Any:
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ALLOW_HTTP": "true"})
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
    return server


def main() -> None:
    from dflash.shared import object_store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, required=True, help="A local cache to publish and read.")
    parser.add_argument("--url", default=None, help="Bucket prefix to use (default: a moto server on localhost).")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    server = start_moto() if args.url is None else None
    url = args.url or "s3://bench/cache"
    started = time.time()
    counts = object_store.publish(args.cache, url, log=lambda _: None)
    result: dict[str, Any] = {"server": "moto (localhost)" if server else url, "workers": args.workers,
                              "publish": {"seconds": round(time.time() - started, 2), **counts}}
    result["local"] = epoch_throughput(args.cache, args.workers, args.batch_tokens)
    mirror = object_store.mirror(url)
    # The first epoch from a bucket also starts the forkserver its workers come from (~2 s once per process).
    result["bucket_first_epoch_with_forkserver_start"] = epoch_throughput(mirror, args.workers, args.batch_tokens)
    result["bucket"] = epoch_throughput(mirror, args.workers, args.batch_tokens)
    mirror = object_store.mirror(url, read_through=True)
    shutil.rmtree(mirror / "read_through", ignore_errors=True)
    result["bucket_local_copy_first_epoch"] = epoch_throughput(mirror, args.workers, args.batch_tokens)
    result["bucket_local_copy_second_epoch"] = epoch_throughput(mirror, args.workers, args.batch_tokens)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
