"""The baselines DFlash speculative decoding is compared to: plain autoregressive decoding (also the losslessness
reference) and prompt lookup decoding (transformers' candidate finder, verified by the same runner), plus the
figures `dflash eval` reports per step.

The speculative loop itself is `modeling_dflash.speculative_generate` (the one loop, shipped with every export);
plain decoding runs the target through the same `TargetRunner`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

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
    verify_greedy,
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
    runner = target_runner(target, (), max(len(prompt) + max_new_tokens, capacity), decode, planned=capacity > 0)
    runner.prewarm_prefill()
    synchronize(runner.device)
    started = time.perf_counter()
    logits, _ = runner.forward(prompt, 0, last_only=True)
    token = pick_token(logits[-1], temperature, generator)  # reads the token back: the prefill has run
    first_token_seconds = time.perf_counter() - started
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
                      decode=runner.path + runner.path_note, first_token_seconds=first_token_seconds)


PROMPT_LOOKUP_TOKENS = 10  # tokens prompt lookup proposes at most a step (a verify block holds one more)


@torch.inference_mode()
def prompt_lookup_generate(
    target: nn.Module,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    num_tokens: int = PROMPT_LOOKUP_TOKENS,
    max_ngram: int = 2,
    decode: str = "auto",
    capacity: int = 0,
) -> SpecResult:
    """Prompt lookup decoding (greedy), a training-free baseline, run through the loop's `TargetRunner`.

    Each step proposes up to ``num_tokens`` tokens: those that followed the first earlier occurrence of the
    sequence's last ``max_ngram`` (or fewer) tokens, as transformers' `PromptLookupCandidateGenerator` finds them
    (used as is; what `generate(prompt_lookup_num_tokens=...)` uses); the target verifies them in one forward and
    keeps the longest prefix equal to its own argmaxes, plus its next token. Written here rather than calling
    transformers' `generate`, which runs eagerly over a DynamicCache and refuses stateful targets: on the loop's
    decode path (``decode``, ``capacity`` as in `speculative_generate`: static caches and CUDA graphs on CUDA,
    snapshot and rollback for hybrid targets) its speedup compares like with like with DFlash's and plain
    decoding's. Lossless: its tokens equal plain greedy decoding's. ``accepted`` counts the accepted proposals of
    each step (tau = tokens per target step)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    prompt = prompt_ids(input_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    stops = {int(t) for t in stop_token_ids}
    finder = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor(sorted(stops)) if stops else None, num_output_tokens=num_tokens,
        max_matching_ngram_size=max_ngram, max_length=len(prompt) + max_new_tokens)
    runner = target_runner(target, (), max(len(prompt) + max_new_tokens + num_tokens + 1, capacity), decode,
                           planned=capacity > 0)
    # On the static path every block with proposals is verified at one width, num_tokens + 1 (the proposals padded
    # by repeating the last; what the padding computes is never read, and the rollback cuts it), so that one
    # fixed-width forward serves every step: one compiled graph under COMPILE_TARGET instead of ten eager widths,
    # whose figure undersold prompt lookup beside the compiled DFlash and plain loops. The padding should cost little
    # at batch 1 on a GPU, where a forward is bound by reading the weights: uncompiled, a 16-token verify forward
    # took 1.10x a one-token step on SmolLM2-135M and 1.16x on a Qwen3-8B shape (H100, 2026-12-06,
    # docs/benchmarks.md); compiled, not measured. On a hybrid target a block accepted whole but shorter than the
    # padded width now rolls back too (its recurrent state restored and the kept tokens fed again: one more forward).
    padded_width = num_tokens + 1 if runner.capacity is not None else 0
    if padded_width:
        runner.compile_widths.add(padded_width)
    runner.prewarm_prefill()
    synchronize(runner.device)
    started = time.perf_counter()
    logits, _ = runner.forward(prompt, 0, last_only=True)
    bonus = int(logits[-1].argmax())  # reads the token back: the prefill has run
    first_token_seconds = time.perf_counter() - started
    tokens, accepted = [bonus], []
    sequence = [*prompt, bonus]  # on the host: the lookup is a scan of a few thousand integers
    start = len(prompt)
    done = bonus in stops or len(tokens) >= max_new_tokens
    while not done:
        found, _ = finder.get_candidates(torch.tensor([sequence]))
        proposal = [bonus, *found[0, len(sequence):].tolist()]
        width = len(proposal)
        if padded_width and width > 1:
            proposal += [proposal[-1]] * (padded_width - width)
        block = torch.tensor(proposal, device=runner.device)
        target_logits, _ = runner.verify(block, start)
        n_acc, emitted = verify_greedy(block[1:width], target_logits[:width])
        next_token = emitted[-1]
        emitted, done = clip_step(emitted, max_new_tokens - len(tokens), stops)
        tokens.extend(emitted)
        sequence.extend(emitted)
        accepted.append(len(emitted) - 1)
        if done:
            break
        start += n_acc + 1
        runner.rollback(start)
        bonus = next_token
    synchronize(runner.device)
    seconds = time.perf_counter() - started
    return SpecResult(tokens=tokens, accepted=accepted, steps=len(accepted), seconds=seconds,
                      decode=runner.path + runner.path_note, first_token_seconds=first_token_seconds)


@torch.inference_mode()
def prewarm_prompt_lookup(target: nn.Module, capacity: int, decode: str = "auto",
                          num_tokens: int = PROMPT_LOOKUP_TOKENS) -> None:
    """Capture (and, under COMPILE_TARGET, compile) every forward width prompt lookup may use on the runner its
    generations of ``capacity`` positions will use, so that none falls inside a timed generation: the one-token step,
    the padded verify block (``num_tokens`` + 1), the prefill's chunk (`modeling_dflash.PREFILL_CHUNK`), and on a
    hybrid target the widths its rollbacks feed again."""
    runner = target_runner(target, (), capacity, decode, planned=capacity > 0)
    runner.compile_widths.add(num_tokens + 1)
    runner.prewarm((1, num_tokens + 1))
    runner.prewarm_prefill()
    runner.prewarm_rollbacks(num_tokens + 1)


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
