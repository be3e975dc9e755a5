"""The `dflash` command: a click group whose subcommands live in the stage packages.

Subcommands are imported only when used, so `dflash --help` and `dflash status` start fast and the stages
stay independent of each other (this module names them; they never import one another).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from dflash.shared.errors import user_facing_errors

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dflash.stage1_extract.cli", "generate_command"),
    "extract": ("dflash.stage1_extract.cli", "extract_command"),
    "status": ("dflash.shared.cache_commands", "status_command"),
    "inspect": ("dflash.shared.cache_commands", "inspect_command"),
    "train": ("dflash.stage2_train.cli", "train_command"),
    "export": ("dflash.stage2_train.cli", "export_command"),
    "eval": ("dflash.stage2_train.cli", "eval_command"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, attribute = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dflash", prog_name="dflash", message="%(prog)s %(version)s")
def dflash() -> None:
    """dflash: train DFlash block-diffusion drafters for speculative decoding, in two stages.

    \b
    0. dflash generate  (optional) regenerate the answers of chat data with the target itself
    1. dflash extract   run the target over chat data, cache its hidden states (Zarr v3)
    2. dflash train     train the drafter from that cache (HF Accelerate), measure acceptance, export
    dflash export       export a checkpoint as a Hugging Face folder
    dflash eval         live speculative decoding with the target: tau, speedup, lossless check
    dflash status / inspect   look at a cache and the run filling it
    """


def main(argv: list[str] | None = None) -> Any:
    # dflash never downloads at run time: models and datasets must be local or in the HF cache.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # Bit-equal CPU math from one process to the next (a resumed run must repeat the loss curve exactly). By
    # default MKL picks its gemm code path at run time and, per Intel's conditional numerical reproducibility
    # notes, may vary it with alignment and thread availability; AUTO,STRICT fixes one path for this CPU and
    # MKL_DYNAMIC=FALSE a constant thread count. MKL reads both once, at its first call (torch is not yet
    # imported here). Measured on 2 cores: same speed; the path differs, so losses move in the last bits.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    with user_facing_errors():
        return dflash.main(args=argv, prog_name="dflash")


if __name__ == "__main__":
    sys.exit(main())
