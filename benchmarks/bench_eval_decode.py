"""Decode speed of `dflash eval`'s loop: the dynamic path (DynamicCache, eager forwards) against the fast path
(static KV caches, fixed-shape forwards replayed from CUDA graphs), plain and speculative decoding alike.

Recipe (the GPU machine, one H100; about 4 minutes, most of it the dynamic path of part a):

    python benchmarks/bench_eval_decode.py --out benchmarks/results/eval_decode_h100 [--draft RUN/export]
        [--compile-drafter] [--compile-target] [--phases] [--part all|smollm2|qwen3-8b|qwen3.5-9b]

(a) ``smollm2``: SmolLM2-135M-Instruct (the embedded default target, bf16) with the drafter export --draft, or
    without one a random-weight drafter of the shape `dflash train` builds by default (speed only: its tau is about
    1). --prompts MT-Bench first turns x --new-tokens tokens (no stop token, so every run emits them all), each
    prompt decoded plainly and speculatively on both paths: tokens/s, tau, the fast path's speedup over the dynamic
    one, the speculative speedup over plain decoding of the same path, and whether the tokens of the two paths and
    of plain vs speculative decoding agree (bf16: the paths' kernels differ, so a near-tie may flip a token).
(b) ``qwen3-8b``: a Qwen3-8B-shaped random-weight target (bf16; speed does not depend on weight values) with a
    5-layer drafter of its shape (block 16), a random prompt of --context tokens. Measured on the fast path: one
    verify forward of a block, one plain decode step (each with the one read-back its loop does), one drafter block
    forward, median over --repeats; then the loops themselves over --qwen-new-tokens tokens (time per step). The
    speedup the loop would give at tau 3, 4, 6 is computed from these measured step times:
    forwards: tau * t_decode / (t_verify + t_draft); loop: tau * t_plain_step / t_speculative_step (its measured
    step at tau about 1 includes the loop's own overhead).

(c) ``qwen3.5-9b`` (only with --part qwen3.5-9b): the same as b on a random-weight target of transformers' default
    Qwen3.5 text shape (hidden 4096, 32 layers, three of every four gated delta-net linear attention; ~9B, ~18 GB in
    bf16), a hybrid on the static path: besides b's forwards, the forward a rollback feeds again for each kept
    length 1..block - 1 (``refeed_forward``), which the speedup from forwards adds to a step that keeps round(tau)
    tokens of its block. transformers' reference PyTorch kernels of the linear attention (the GPU image has neither
    flash-linear-attention nor causal-conv1d), so it measures this loop as `dflash eval` runs it there, not a
    serving engine's kernels.

Opt-in parts (issue 31: speedup >= 0.7 x tau):
--compile-drafter adds the path ``static+compiled-drafter``: the fast path with the drafter's block forward compiled
    by torch.compile before its CUDA graph is captured (`modeling_dflash.COMPILE_DRAFTER`; `dflash eval`'s default
    with CUDA graphs since it was measured here on 2026-12-06, while this benchmark's ``static`` path keeps the
    eager drafter block, the one before), in parts a and b (its
    loops, and in b the drafter block forward alone as ``draft_block_compiled``), beside the default in the same run:
    ``compiled_over_static`` (speculative tokens/s and time per step), ``compiled_agrees_with_static`` (prompts with
    equal tokens), and the compile time in ``warmup_seconds``.
--compile-target adds the path ``static+compiled-target`` in part a (its loops, plain and speculative): the fast path
    with the drafter's block forward and the target's fixed-width forwards (the verify block, the one-token step)
    compiled before their CUDA graphs are captured (`modeling_dflash.COMPILE_TARGET`, opt-in and not yet measured),
    beside the other paths, which keep their meaning: ``compiled_target_over_static`` (tokens/s and time per step,
    plain and speculative), ``compiled_target_agrees_with_static`` (prompts with equal tokens, plain and
    speculative), and the compile time in ``warmup_seconds``.
--eager-extend adds, in part a, the last of the paths above again with ``+eager-extend``: the verified block's
    features projected into the drafter's context eagerly at `DraftRunner.extend`, as before 2026-12-07, instead of
    inside the next block forward (`modeling_dflash.FUSED_EXTEND`): ``fused_over_eager_extend`` (speculative tokens/s
    and time per step), ``fused_agrees_with_eager_extend`` (prompts with equal tokens) and
    ``fused_accepts_as_eager_extend`` (prompts with equal acceptance at every step, which a drafter context that
    differs would rarely keep). Measured on an H100 on 2026-12-07, before the pipelined draft: 1.064-1.066x
    (docs/benchmarks.md). The pipelined draft needs the fused projection, so this path drafts after the read-back
    too: alone it compares both changes at once; with --serial-draft, with that path (the fused projection alone).
--serial-draft adds, likewise, the last path with ``+serial-draft``: each block drafted after the host read back the
    acceptance of the block before (`modeling_dflash.PIPELINED_DRAFT` off), as before 2026-12-07, instead of drafted
    on the device while the host reads it: ``pipelined_over_serial_draft``, ``pipelined_agrees_with_serial_draft``
    and ``pipelined_accepts_as_serial_draft`` (the same drafts from the same context: every prompt, expected).
    Its phases are not those of 2026-12-07's table: ``accept`` was the acceptance with its read-back; it is the
    acceptance's kernels now, the read-back's wait falling in ``other`` on the serial path.
--phases (part a, CUDA only; skipped on CPU): the fast path(s) decode the prompts again with CUDA events around the
    loop's calls (patched inside this benchmark only) and report per step after the prefill the GPU-timeline ms of
    draft / verify / accept (the acceptance's kernels; its read-back overlaps the next draft where that is pipelined)
    / extend (without the pipelined draft only), of the plain step's forward / pick, each step's total (the mean
    interval between consecutive verify starts) and ``other`` (the step minus its phases: where the GPU waits for
    the host).

Warm-up first: every path decodes the first prompt (graphs captured, kernels chosen) before the timed runs, and the
static buffers are sized for the longest prompt, so compile/capture time stays out of the timed window. Results:
OUT/bench_eval_decode.json (and the table on stdout).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_extract import build_qwen3_random  # noqa: E402

from dflash.shared.target_layers import default_layer_ids  # noqa: E402
from dflash.stage1_extract.supervisor import ExtractOptions  # noqa: E402
from dflash.stage2_train import modeling_dflash as loop  # noqa: E402
from dflash.stage2_train.draft_config import config_from_target  # noqa: E402
from dflash.stage2_train.options import DEFAULT_BLOCK_SIZE  # noqa: E402
from dflash.stage2_train.speculative import first_difference, greedy_generate  # noqa: E402
from dflash.stage2_train.target_parts import scaled_embedding  # noqa: E402

PATHS = ("dynamic", "static")  # "static" = the fast path (CUDA graphs on a GPU)
COMPILED = "static+compiled-drafter"  # the fast path with the drafter's block forward compiled (--compile-drafter)
BOTH_COMPILED = "static+compiled-target"  # the drafter's block and the target's fixed-width forwards compiled
# A path's suffix that turns one of the loop's options off: suffix -> (the option's name, the name of its absence, in
# the comparison's keys; the `modeling_dflash` flag). The pipelined draft needs the fused projection, so
# +eager-extend drafts after the read-back too: with both suffixes its comparison is with +serial-draft's path.
EAGER_EXTEND = "+eager-extend"  # the verified block projected at `extend` (FUSED_EXTEND off)
SERIAL_DRAFT = "+serial-draft"  # the next block drafted after the acceptance's read-back (PIPELINED_DRAFT off)
LOOP_OPTIONS = {EAGER_EXTEND: ("fused", "eager_extend", "FUSED_EXTEND"),
                SERIAL_DRAFT: ("pipelined", "serial_draft", "PIPELINED_DRAFT")}
TAUS = (3.0, 4.0, 6.0)
DRAFT_LAYERS = ExtractOptions.draft_layers  # `dflash extract`'s default: 5 captured layers, 5 drafter layers


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_drafter(target: torch.nn.Module, mask_token_id: int, device: torch.device) -> loop.DFlashDraftModel:
    """A random-weight DFlash drafter of `dflash train`'s default shape for this target: DRAFT_LAYERS layers over
    the default captured layers, block DEFAULT_BLOCK_SIZE."""
    config = target.config.get_text_config()
    layer_ids = default_layer_ids(int(config.num_hidden_layers), DRAFT_LAYERS)
    draft_config = config_from_target(config.to_dict(), layer_ids, DRAFT_LAYERS, DEFAULT_BLOCK_SIZE, mask_token_id)
    torch.manual_seed(0)
    with device:
        draft = loop.drafter_for(draft_config)
    return draft.to(next(target.parameters()).dtype).eval()


@contextmanager
def compiled_parts(path: str) -> Iterator[None]:
    """`loop.COMPILE_DRAFTER` on for the COMPILED and BOTH_COMPILED paths, `loop.COMPILE_TARGET` on for BOTH_COMPILED,
    both off for the others; a LOOP_OPTIONS flag off for a path ending in its suffix, on otherwise (all restored
    after)."""
    flags = ["COMPILE_DRAFTER", "COMPILE_TARGET", *(flag for _, _, flag in LOOP_OPTIONS.values())]
    saved = {flag: getattr(loop, flag) for flag in flags}
    base = base_path(path)
    loop.COMPILE_DRAFTER, loop.COMPILE_TARGET = base in (COMPILED, BOTH_COMPILED), base == BOTH_COMPILED
    for suffix, (_, _, flag) in LOOP_OPTIONS.items():
        setattr(loop, flag, not path.endswith(suffix))
    try:
        yield
    finally:
        for flag, value in saved.items():
            setattr(loop, flag, value)


def base_path(path: str) -> str:
    """The path without its LOOP_OPTIONS suffix."""
    for suffix in LOOP_OPTIONS:
        path = path.removesuffix(suffix)
    return path


def decode_mode(path: str) -> str:
    """The `decode` argument of a benchmark path."""
    return "dynamic" if path == "dynamic" else "static"


def summary(results: list[loop.SpecResult]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    steps = sum(r.steps for r in results)
    accepted = [a for r in results for a in r.accepted]
    return {"tokens": tokens, "seconds": seconds, "steps": steps,
            "tokens_per_second": tokens / seconds if seconds else float("nan"),
            "seconds_per_step": seconds / steps if steps else float("nan"),
            "tau": sum(a + 1 for a in accepted) / len(accepted) if accepted else float("nan"),
            "decode": sorted({r.decode for r in results})}


def decoders(target: torch.nn.Module, draft: loop.DFlashDraftModel,
             capacity: int) -> tuple[Callable[..., loop.SpecResult], Callable[..., loop.SpecResult]]:
    """(speculative, plain): decode(ids, n, path) -> SpecResult on a benchmark path (greedy, no stop token)."""
    embed = scaled_embedding(target.get_input_embeddings().weight, draft.embed_scale)
    head = target.get_output_embeddings().weight
    layer_ids = draft.target_layer_ids

    def speculative(ids: list[int], n: int, path: str) -> loop.SpecResult:
        with compiled_parts(path):
            return loop.speculative_generate(target, draft, embed, head, ids, layer_ids, n, [],
                                             decode=decode_mode(path), capacity=capacity)

    def plain(ids: list[int], n: int, path: str) -> loop.SpecResult:
        with compiled_parts(path):  # the target's one-token step is compiled on BOTH_COMPILED
            return greedy_generate(target, ids, n, [], decode=decode_mode(path), capacity=capacity)

    return speculative, plain


def decode_all(target: torch.nn.Module, draft: loop.DFlashDraftModel, prompts: list[list[int]], new_tokens: int,
               capacity: int, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    """Plain and speculative decoding of every prompt on each path (after a warm-up of each on the first prompt:
    graph capture, and with COMPILED the drafter's compilation, whose time `warmup_seconds` shows)."""
    speculative, plain = decoders(target, draft, capacity)
    runs: dict[str, dict[str, list[loop.SpecResult]]] = {p: {"plain": [], "dflash": []} for p in paths}
    warmup: dict[str, float] = {}
    for path in paths:
        started = time.perf_counter()
        speculative(prompts[0], 2 * DEFAULT_BLOCK_SIZE, path)
        plain(prompts[0], 8, path)
        sync()
        warmup[path] = time.perf_counter() - started
    for ids in prompts:
        for path in paths:
            runs[path]["plain"].append(plain(ids, new_tokens, path))
            runs[path]["dflash"].append(speculative(ids, new_tokens, path))
    out: dict[str, Any] = {"warmup_seconds": warmup}
    for path in paths:
        plain_s, spec_s = summary(runs[path]["plain"]), summary(runs[path]["dflash"])
        lossless = [first_difference(p.tokens, s.tokens) for p, s in zip(runs[path]["plain"], runs[path]["dflash"])]
        out[path] = {"plain": plain_s, "dflash": spec_s,
                     "speedup": spec_s["tokens_per_second"] / plain_s["tokens_per_second"],
                     "speculative_equals_plain": sum(d is None for d in lossless),
                     "first_differences": lossless,
                     "projected_speedup": {str(tau): tau * plain_s["seconds_per_step"] / spec_s["seconds_per_step"]
                                           for tau in TAUS}}
    out["fast_over_dynamic"] = {method: out["static"][method]["tokens_per_second"]
                                / out["dynamic"][method]["tokens_per_second"] for method in ("plain", "dflash")}
    def agreeing(path: str, other: str, method: str) -> int:  # prompts whose tokens are equal on the two paths
        return sum(a.tokens == b.tokens for a, b in zip(runs[path][method], runs[other][method]))

    def over_static(path: str, methods: tuple[str, ...]) -> dict[str, float]:
        return {f"{method}_{measure}": out[path][method][measure] / out["static"][method][measure]
                for method in methods for measure in ("tokens_per_second", "seconds_per_step")}

    out["paths_agree"] = {method: agreeing("dynamic", "static", method) for method in ("plain", "dflash")}
    if COMPILED in paths:
        out["compiled_over_static"] = over_static(COMPILED, ("dflash",))
        out["compiled_agrees_with_static"] = agreeing("static", COMPILED, "dflash")
    if BOTH_COMPILED in paths:
        out["compiled_target_over_static"] = over_static(BOTH_COMPILED, ("plain", "dflash"))
        out["compiled_target_agrees_with_static"] = {method: agreeing("static", BOTH_COMPILED, method)
                                                     for method in ("plain", "dflash")}
    for path in paths:
        for suffix, (on, off, _) in LOOP_OPTIONS.items():
            if not path.endswith(suffix):
                continue
            # the option against its absence, on the same path otherwise
            with_option = path.removesuffix(suffix)
            if suffix == EAGER_EXTEND and with_option + SERIAL_DRAFT in paths:
                with_option += SERIAL_DRAFT  # the eager projection drafts after the read-back: so does the other
            out[f"{on}_over_{off}"] = {
                f"dflash_{measure}": out[with_option]["dflash"][measure] / out[path]["dflash"][measure]
                for measure in ("tokens_per_second", "seconds_per_step")}
            out[f"{on}_agrees_with_{off}"] = agreeing(with_option, path, "dflash")
            # tokens agree whatever the drafter's context (greedy decoding is lossless); each step's acceptance
            # does only where the drafts do (bf16 kernels may still flip a near-tie)
            out[f"{on}_accepts_as_{off}"] = sum(
                a.accepted == b.accepted for a, b in zip(runs[with_option]["dflash"], runs[path]["dflash"]))
    out["prompts"] = len(prompts)
    out["new_tokens"] = new_tokens
    return out


class PhaseTimer:
    """GPU time of the loop's phases: CUDA events recorded around each call of the functions `timing` patches (on
    the current stream, so an interval holds the phase's kernels and any wait for the host to launch them)."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[int, torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self.generation = 0  # which decode the events belong to (a step never spans two)

    def wrap(self, name: str, function: Callable[..., Any],
             rename: Callable[..., str | None] | None = None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = rename(*args, **kwargs) if rename else name
            if phase is None:
                return function(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = function(*args, **kwargs)
            end.record()
            self.events[phase].append((self.generation, start, end))
            return out
        return timed

    def milliseconds(self, step_phase: str) -> dict[str, float]:
        """Mean ms of each phase per call, and ``step``: the mean interval between consecutive starts of
        ``step_phase`` within one decode (one step on the GPU's timeline, gaps included); ``other``: the step minus
        its phases (the prefill's extension is not one)."""
        torch.cuda.synchronize()
        means = {name: statistics.mean(s.elapsed_time(e) for _, s, e in calls) for name, calls in self.events.items()}
        starts = self.events[step_phase]
        step = statistics.mean(a.elapsed_time(b) for (g, a, _), (h, b, _) in zip(starts, starts[1:]) if g == h)
        return {"step": step, **means, "other": step - sum(v for k, v in means.items() if k != "prefill_extend")}


@contextmanager
def timing(timer: PhaseTimer, method: str) -> Iterator[None]:
    """Patch (for this benchmark only) the calls one step makes, so ``timer`` records them: speculative steps:
    draft (`DraftRunner.draft_greedy`, `DraftRunner.draft_block_ahead`), verify (`TargetRunner.verify`), accept
    (`greedy_record`), extend (`DraftRunner.extend` of the accepted rows; the prefill's own extension is kept apart);
    plain steps: forward (the one-token `TargetRunner.forward`) and pick (`pick_token`, with its read-back)."""
    from dflash.stage2_train import speculative as plain_module

    if method == "dflash":
        patches = [(loop.DraftRunner, "draft_greedy", "draft", None),
                   (loop.DraftRunner, "draft_block_ahead", "draft", None),
                   (loop.TargetRunner, "verify", "verify", None),
                   (loop, "greedy_record", "accept", None),
                   (loop.DraftRunner, "extend", "extend",  # (count 0: the staging inside draft_block_ahead)
                    lambda _self, _features, count=None: "prefill_extend" if count is None else
                    "extend" if count else None)]
    else:
        patches = [(loop.TargetRunner, "forward", "forward",
                    lambda _self, ids, _start, last_only=False: "forward" if len(ids) == 1 else None),
                   (plain_module, "pick_token", "pick", None)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _, _ in patches]
    try:
        for owner, name, phase, rename in patches:
            setattr(owner, name, timer.wrap(phase, getattr(owner, name), rename))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def phase_times(target: torch.nn.Module, draft: loop.DFlashDraftModel, prompts: list[list[int]], new_tokens: int,
                capacity: int, paths: tuple[str, ...]) -> dict[str, Any]:
    """Per step after the prefill, GPU ms of each phase of speculative and plain decoding on the fast path(s),
    decoded again after `decode_all` (graphs captured). CUDA only. The events add two launches per phase."""
    speculative, plain = decoders(target, draft, capacity)
    out: dict[str, Any] = {}
    for path in paths:
        out[path] = {}
        for method, decode in (("dflash", speculative), ("plain", plain)):
            timer = PhaseTimer()
            with timing(timer, method):
                for timer.generation, ids in enumerate(prompts):
                    decode(ids, new_tokens, path)
            out[path][method] = timer.milliseconds("verify" if method == "dflash" else "forward")
        out[path]["dflash_step_in_plain_steps"] = out[path]["dflash"]["step"] / out[path]["plain"]["step"]
    return out


def bench_smollm2(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dflash.shared.target_loading import load_target_model, load_tokenizer, resolve_target
    from dflash.stage2_train.evaluate import load_prompts, tokenize_prompt
    from dflash.stage2_train.export import load_draft

    resolved = resolve_target(None)
    target = load_target_model(resolved.load_path, str(device), torch.bfloat16).eval()
    tokenizer = load_tokenizer(resolved.load_path)
    if args.draft:
        draft = load_draft(Path(args.draft)).to(device=device, dtype=torch.bfloat16).eval()
        drafter_name = str(args.draft)
    else:
        draft = random_drafter(target, len(tokenizer) - 1, device)
        drafter_name = f"random weights, {DRAFT_LAYERS} layers, block {DEFAULT_BLOCK_SIZE} (speed only)"
    prompts = [tokenize_prompt(tokenizer, p.messages) for p in load_prompts("mtbench", args.prompts)]
    capacity = max(map(len, prompts)) + args.new_tokens + draft.block_size
    paths = (*bench_paths(args), BOTH_COMPILED) if args.compile_target else bench_paths(args)
    fastest = paths[-1]
    if args.eager_extend:  # the fastest path again with the eager extension
        paths = (*paths, fastest + EAGER_EXTEND)
    if args.serial_draft:  # and with the draft after the read-back
        paths = (*paths, fastest + SERIAL_DRAFT)
    result = decode_all(target, draft, prompts, args.new_tokens, capacity, paths)
    if args.phases:
        fast = tuple(p for p in paths if p != "dynamic")
        result["phases_ms"] = (phase_times(target, draft, prompts, args.new_tokens, capacity, fast)
                               if device.type == "cuda" else "skipped: CUDA only")
    return {"target": resolved.display_name, "drafter": drafter_name, "block_size": draft.block_size,
            "draft_layers": int(draft.config.num_hidden_layers), **result}


def bench_paths(args: argparse.Namespace) -> tuple[str, ...]:
    return (*PATHS, COMPILED) if args.compile_drafter else PATHS


def median_seconds(step: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def build_qwen35_random(device: torch.device) -> torch.nn.Module:
    """A random-weight target of transformers' default Qwen3.5 text shape (hidden 4096, 32 layers, three of every
    four gated delta-net linear-attention layers; ~9B parameters, bf16): a hybrid on the static path."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def bench_qwen3(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return bench_large(args, device, build_qwen3_random(device), "Qwen3-8B-shaped, random weights (bf16)")


def bench_qwen35(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return bench_large(args, device, build_qwen35_random(device), "Qwen3.5-9B-shaped hybrid, random weights (bf16)")


def bench_large(args: argparse.Namespace, device: torch.device, target: torch.nn.Module,
                label: str) -> dict[str, Any]:
    """Parts b and c: one verify forward of a block, one plain decode step, one drafter block forward, on the fast
    path, median over --repeats, then the loops; on a hybrid target also the forward a rollback feeds again for
    each kept length (1 to block - 1), which a step pays when the block is accepted in part."""
    vocab = int(target.config.get_text_config().vocab_size)
    draft = random_drafter(target, vocab - 1, device)
    block, layer_ids = draft.block_size, draft.target_layer_ids
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.context,), generator=generator).tolist()
    capacity = args.context + args.qwen_new_tokens + block
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    forwards: dict[str, Any] = {}
    with torch.inference_mode():
        verifier = loop.target_runner(target, layer_ids, capacity, "static", planned=True)
        verifier.compile_widths.add(block)  # as speculative_generate names its verify block
        with compiled_parts("static"):  # the eager block (draft_block); the compiled one below (draft_block_compiled)
            drafter = loop.draft_runner(draft, embed, head, 1.0, capacity, "static", planned=True)
        with verifier.hooked():
            _, features = verifier.forward(prompt, 0, last_only=True)
            drafter.extend(features)
            block_ids = torch.tensor(prompt[:block], device=device)

            def verify() -> None:
                logits, _ = verifier.verify(block_ids, args.context)
                loop.verify_greedy(block_ids[1:], logits)  # the loop's one read-back
                verifier.rollback(args.context)

            def propose() -> None:
                drafter.draft_greedy(prompt[0], args.context)

            for step in (verify, propose):  # warm-up: capture
                step()
            forwards["verify_block"] = median_seconds(verify, args.repeats)
            forwards["draft_block"] = median_seconds(propose, args.repeats)
            if verifier.keeps_recurrent_states:  # what a rollback feeds again
                refeed = {}
                for kept in range(1, block):
                    def feed_again(kept: int = kept) -> None:
                        verifier.verify(block_ids[:kept], args.context)
                        verifier.rollback(args.context)  # only the states copied back: nothing fed
                    feed_again()
                    refeed[kept] = median_seconds(feed_again, args.repeats)
                forwards["refeed_forward"] = refeed
            if args.compile_drafter:
                with compiled_parts(COMPILED):
                    compiled = loop.draft_runner(draft, embed, head, 1.0, capacity, "static", planned=True)
                compiled.extend(features)

                def propose_compiled() -> None:
                    compiled.draft_greedy(prompt[0], args.context)

                propose_compiled()  # warm-up: compile, then capture
                forwards["draft_block_compiled"] = median_seconds(propose_compiled, args.repeats)
        decoder = loop.target_runner(target, (), capacity, "static", planned=True)
        decoder.forward(prompt, 0, last_only=True)

        def decode_step() -> None:
            logits, _ = decoder.verify([prompt[1]], args.context)  # a forward that the rollback below may undo
            int(logits[-1].argmax())  # the plain loop's one read-back
            decoder.rollback(args.context)

        decode_step()
        forwards["decode_step"] = median_seconds(decode_step, args.repeats)
        paths = {"verify_block": verifier.path, "draft_block": "static+cuda-graphs" if drafter.graph_failure is None
                 else drafter.graph_failure, "decode_step": decoder.path}
    loops = decode_all(target, draft, [prompt], args.qwen_new_tokens, capacity, bench_paths(args))
    fast = loops["static"]

    def spec_step(tau: float) -> float:  # a step that keeps tau tokens of the block pays the feed-again of as many
        kept = round(tau)
        refeed = forwards.get("refeed_forward", {}).get(kept, 0.0) if kept < block else 0.0
        return forwards["verify_block"] + forwards["draft_block"] + refeed

    return {
        "target": label,
        "drafter": f"random weights, {DRAFT_LAYERS} layers, block {block}",
        "context": args.context,
        "forward_seconds": forwards,
        "forward_paths": paths,
        "verify_over_decode": forwards["verify_block"] / forwards["decode_step"],
        "loops": loops,
        "speedup_at_tau": [
            {"tau": tau,
             "from_forwards": tau * forwards["decode_step"] / spec_step(tau),
             "from_loop_steps": tau * fast["plain"]["seconds_per_step"] / fast["dflash"]["seconds_per_step"]}
            for tau in TAUS],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_eval_decode.json")
    parser.add_argument("--part", choices=["all", "smollm2", "qwen3-8b", "qwen3.5-9b"], default="all",
                        help="all: smollm2 and qwen3-8b; qwen3.5-9b (a hybrid, ~18 GB) only when named")
    parser.add_argument("--draft", type=Path, default=None, help="a drafter export for SmolLM2 (default: random)")
    parser.add_argument("--prompts", type=int, default=5, help="MT-Bench prompts (part a)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per prompt (part a)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of the Qwen3-8B-shaped target")
    parser.add_argument("--qwen-new-tokens", type=int, default=64, help="tokens of the Qwen3-8B-shaped loops")
    parser.add_argument("--repeats", type=int, default=50, help="timed repeats of each single forward")
    parser.add_argument("--compile-drafter", action="store_true",
                        help=f"also run the fast path with the drafter's block forward compiled ({COMPILED}: "
                             "modeling_dflash.COMPILE_DRAFTER, eval's default with CUDA graphs) beside the static "
                             "path with the eager drafter block, in one run")
    parser.add_argument("--compile-target", action="store_true",
                        help=f"part a: also run the fast path with the drafter's block and the target's fixed-width "
                             f"forwards compiled ({BOTH_COMPILED}: modeling_dflash.COMPILE_TARGET, opt-in)")
    parser.add_argument("--eager-extend", action="store_true",
                        help="part a: also run the last path with the verified block projected eagerly at extend "
                             "(modeling_dflash.FUSED_EXTEND off), beside the fused projection, in one run")
    parser.add_argument("--serial-draft", action="store_true",
                        help="part a: also run the last path with each block drafted after the acceptance's "
                             "read-back (modeling_dflash.PIPELINED_DRAFT off), beside the pipelined draft, in one run")
    parser.add_argument("--phases", action="store_true",
                        help="part a: GPU ms per step of draft / verify / accept / extend and of the plain step "
                             "(CUDA only)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }
    if args.part in ("all", "smollm2"):
        report["smollm2"] = bench_smollm2(args, device)
        print(json.dumps(report["smollm2"], indent=1, default=str)[:4000])
    if args.part in ("all", "qwen3-8b"):
        if "smollm2" in report:
            torch.cuda.empty_cache() if device.type == "cuda" else None
        report["qwen3_8b"] = bench_qwen3(args, device)
    if args.part == "qwen3.5-9b":
        report["qwen3_5_9b"] = bench_qwen35(args, device)
    for part in ("qwen3_8b", "qwen3_5_9b"):
        for row in report.get(part, {}).get("speedup_at_tau", []):
            print(f"{part} tau {row['tau']}: speedup {row['from_forwards']:.2f}x (forwards), "
                  f"{row['from_loop_steps']:.2f}x (loop steps)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_eval_decode.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
