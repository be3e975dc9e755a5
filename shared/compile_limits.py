"""torch.compile's recompile limit: how many compiled versions of one function it keeps before running new inputs
uncompiled, without a word (torch's default 8). Raised by the commands whose compiled functions see more shapes
(`dflash generate --static-cache`'s decoding step, `dflash train --compile`'s decoder layers)."""

from __future__ import annotations


def raise_recompile_limit(at_least: int) -> None:
    """torch.compile's recompile limit raised to `at_least` in this process (a higher one is kept). The setting is
    `recompile_limit` since torch 2.7, `cache_size_limit` before."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), at_least))
