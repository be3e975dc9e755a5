"""The baselines DFlash speculative decoding is compared to: plain autoregressive decoding (also the losslessness
reference) and transformers' prompt lookup decoding, plus the figures `dflash eval` reports per step.

The speculative loop itself is `modeling_dflash.speculative_generate` (the one loop, shipped with every export);
plain decoding runs the target through the same `TargetRunner`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dflash.stage2_train.modeling_dflash import (
    SpecResult,
    TargetRunner,  # noqa: F401 (plain decoding runs the target as the loop does)
    clip_step,
    pick_token,
    prompt_ids,
    synchronize,
    target_runner,
)


@torch.inference_mode()
def greedy_generate(
    target: nn.Module,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    decode: str = "auto",
    capacity: int = 0,
) -> SpecResult:
    """Plain autoregressive decoding with a KV cache (greedy by default): the baseline and the losslessness reference.

    Every target step emits one token, so ``accepted`` is all zeros (tau = 1). ``decode`` as in
    `speculative_generate` (on CUDA by default a static cache and a CUDA-graphed one-token step, so the speedup
    compares like with like); ``capacity`` as there.
    """
    prompt = prompt_ids(input_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    stops = {int(t) for t in stop_token_ids}
    runner = target_runner(target, (), max(len(prompt) + max_new_tokens, capacity), decode)
    synchronize(runner.device)
    started = time.perf_counter()
    logits, _ = runner.forward(prompt, 0, last_only=True)
    token = pick_token(logits[-1], temperature, generator)
    tokens = [token]
    position = len(prompt)
    while token not in stops and len(tokens) < max_new_tokens:
        logits, _ = runner.forward([token], position, last_only=True)
        position += 1
        token = pick_token(logits[-1], temperature, generator)
        tokens.append(token)
    synchronize(runner.device)
    seconds = time.perf_counter() - started
    return SpecResult(tokens=tokens, accepted=[0] * (len(tokens) - 1), steps=len(tokens) - 1, seconds=seconds,
                      decode=runner.path)


@torch.inference_mode()
def prompt_lookup_generate(
    target: nn.Module,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    num_tokens: int = 10,
) -> SpecResult:
    """transformers' prompt lookup decoding (greedy), a training-free baseline.

    transformers does not report acceptance counts; ``target_forwards`` counts the target forwards `generate`
    made (its first one is the prefill, which may already verify candidates), so tokens / target_forwards is this
    method's tokens per target step. ``accepted`` stays empty.
    """
    prompt = prompt_ids(input_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    device = next(target.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    stops = [int(t) for t in stop_token_ids]
    calls = [0]

    def count(_module: Any, _args: Any) -> None:
        calls[0] += 1

    handle = target.register_forward_pre_hook(count)
    try:
        synchronize(device)
        started = time.perf_counter()
        out = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            prompt_lookup_num_tokens=num_tokens,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else None,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        synchronize(device)
        seconds = time.perf_counter() - started
    finally:
        handle.remove()
    new = [int(t) for t in out[0, len(prompt):].tolist()]
    tokens, _ = clip_step(new, max_new_tokens, set(stops))
    return SpecResult(tokens=tokens, steps=calls[0], seconds=seconds, target_forwards=calls[0])


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def acceptance_by_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """P(accepted >= k) for k = 1..block_size - 1 over the given steps."""
    if not accepted:
        return [math.nan] * (block_size - 1)
    n = len(accepted)
    return [sum(1 for a in accepted if a >= k) / n for k in range(1, block_size)]
