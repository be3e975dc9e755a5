"""End-to-end evaluation of an exported drafter: real speculative decoding against the real target.

For every prompt, in the same run and on the same target: DFlash speculative decoding (`speculative_generate`),
plain autoregressive decoding (`greedy_generate`, the baseline and the losslessness reference) and transformers'
prompt lookup decoding (a training-free baseline). At temperature 0 the speculative output must equal plain greedy
decoding token for token; a difference raises `LosslessnessError` naming the prompt, unless at the first differing
position the two tokens' logits are a floating-point tie (bf16 logits near 25 are spaced 0.125 apart, so exact ties
are common, and a block of B tokens runs different kernels than one token: either token is a correct greedy
choice). Such ties are counted in the report (`tie_divergences`) and only the common prefix is compared.

Reported per dataset: tau (mean accepted + 1 over all speculative steps), P(accepted >= k) by block position,
tokens/s of the three methods and the speedups over plain decoding with their standard errors over prompts, the same
after the first token (each method's time to it, the prompt's forward, left out), and per prompt its time, time to
the first token and tokens/s by method. Written to OUT/eval.json, eval.md, eval.png.

Train/serve parity (`parity.py`): before decoding, the prompts' rendering (chat template and its arguments, e.g.
``--chat-template-kwargs '{"enable_thinking": false}'``, thinking mode, special and stop tokens, vocabulary) is compared
with the training cache's and what differs is said in one line (`parity` in the report); after decoding, each
dataset's live tau is set beside the drafter's offline tau on the cache's test split and flagged when far below it
(`tau_gap`, rule `parity.TAU_GAP_RULE`).

Datasets: ``humaneval`` (164 HumanEval prompts, the prompt as the user message), ``mtbench`` (first turn of the 80
MT-Bench questions), or a JSONL/JSON file whose records hold ``messages`` / ``conversations`` (role/content or
ShareGPT from/value; the conversation up to the first assistant turn is the prompt) or a ``prompt`` string.
``heldout`` takes the test split of the training cache of the run the drafter was exported from (never trained on
nor used to choose a checkpoint; a run trained with --test-fraction 0 has only its validation split, which is then
used and named in the report) - the cached prompt tokens up to the first response; for it the report adds
the offline acceptance length of the same sequences over the same number of tokens (`datasets.heldout.offline`),
so live and offline tau can be compared. Several may be given, comma-separated.

Noise: tau is pooled over all speculative steps of a dataset; its standard error over prompts (`tau_stderr`, the
ratio estimator's, `acceptance.tau_standard_error`) and a 95 % interval (`tau_ci95`, +- 1.96 s.e.) come with it.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.shared.chat_records import prompt_messages
from dflash.shared.chat_rendering import chat_token_ids, rendering_record, template_fingerprint
from dflash.shared.errors import UserError
from dflash.shared.logs import get_logger
from dflash.shared.run_files import TARGET_INFO_FILE, run_of_export
from dflash.shared.target_layers import embedding_scale
from dflash.stage2_train.acceptance import json_safe, offline_acceptance, tau_standard_error
from dflash.stage2_train.export import load_draft, read_target_info
from dflash.stage2_train.parity import (
    DIFFERS,
    Finding,
    compare_rendering,
    parity_report,
    system_turn_finding,
    tau_gap,
    trained_rendering,
)
from dflash.stage2_train.target_parts import scaled_embedding
from dflash.stage2_train.modeling_dflash import SpecResult, speculative_generate
from dflash.stage2_train.speculative import (
    PROMPT_LOOKUP_TOKENS,
    acceptance_by_position,
    first_difference,
    greedy_generate,
    prewarm_prompt_lookup,
    prompt_lookup_generate,
)

log = get_logger(__name__)

BUILTIN_DATASETS = ("humaneval", "mtbench")
HELDOUT = "heldout"
TIE_ULPS = 4  # a divergence whose two logits differ by at most this many ulps of the target dtype is a tie
TIE_RELATIVE = 1e-4  # ... or by this fraction of the top logit (float32 targets: kernel-shape noise exceeds 4 ulps)


class LosslessnessError(RuntimeError):
    """Greedy speculative decoding produced a different token than plain greedy decoding (a bug, not a tie)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    ids: list[int] | None = None  # already tokenized (held-out cache samples)
    cached: dict[str, Any] | None = None  # the held-out sample's cached features/ids/mask, for the offline walk


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def _humaneval() -> Iterator[Prompt]:
    from dflash.shared.embedded import humaneval_jsonl_gz

    with gzip.open(humaneval_jsonl_gz(), "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                yield Prompt(str(record["task_id"]), [{"role": "user", "content": record["prompt"]}])


def _mtbench() -> Iterator[Prompt]:
    from dflash.shared.embedded import mtbench_questions

    with open(mtbench_questions(), encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                yield Prompt(f"mtbench/{record['question_id']}",
                             [{"role": "user", "content": record["turns"][0]}])


def _file_prompts(path: Path) -> Iterator[Prompt]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:  # type: ignore[operator]
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--data {path}: cannot read ({error})") from error
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"--data {path}: not valid JSON ({error})") from error
        numbered = list(enumerate(records, 1))
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    numbered.append((number, json.loads(line)))
                except json.JSONDecodeError as error:
                    raise UserError(f"--data {path}:{number}: not valid JSON ({error.msg})") from error
    for number, record in numbered:
        messages = prompt_messages(record)
        if messages is not None:
            rid = record.get("id") if isinstance(record, Mapping) else None
            yield Prompt(str(rid) if rid is not None else f"{path.name}:{number}", messages)


def dataset_names(data: str) -> list[str]:
    names = [name.strip() for name in data.split(",") if name.strip()]
    if not names:
        raise UserError("--data is empty: use humaneval, mtbench or a path to a JSONL file")
    return names


def heldout_prompts(draft_dir: Path, max_samples: int, max_new_tokens: int) -> tuple[list[Prompt], str]:
    """Test-split samples of the run that exported `draft_dir` (its validation split if it has no test split):
    cached prompt ids, and the cached sample cut to the prompt plus `max_new_tokens` response positions (what the
    live run generates); and the name of the split."""
    from dflash.stage2_train.cache_index import CacheIndex
    from dflash.stage2_train.eval_set import eval_sequences

    run = run_of_export(draft_dir)
    if run is None:
        raise UserError(f"--data {HELDOUT} needs a drafter exported by `dflash train` ({draft_dir} names no run "
                        "directory with its train_options.json); pass a run's export folder")
    options = run.recorded_options("cache", "eval_fraction", "test_fraction", "seed")
    cache = Path(options["cache"])
    if not cache.is_dir():
        raise UserError(f"--data {HELDOUT}: the run's cache {cache} is gone")
    test_fraction = float(options["test_fraction"])
    index = CacheIndex.from_cache(cache, float(options["eval_fraction"]), int(options["seed"]), test_fraction)
    split = "test" if test_fraction else "validation"
    prompts = []
    for sample in eval_sequences(index, max_samples, split):
        first = int(sample["loss_mask"].nonzero()[0, 0])
        end = first + max_new_tokens
        cut = {key: sample[key][:end] for key in ("features", "input_ids", "loss_mask")}
        prompts.append(Prompt(str(sample["sample_id"]), [], sample["input_ids"][:first].tolist(), cut))
    if not prompts:
        raise UserError(f"--data {HELDOUT}: the run's {split} split is empty (it was trained with "
                        f"--{'test' if split == 'test' else 'eval'}-fraction 0)")
    return prompts, split


def load_prompts(name: str, max_samples: int) -> list[Prompt]:
    """The first ``max_samples`` prompts of a built-in dataset or a JSONL/JSON file."""
    if name.lower() in BUILTIN_DATASETS:
        source = _humaneval() if name.lower() == "humaneval" else _mtbench()
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"unknown dataset {name!r}: use {', '.join(BUILTIN_DATASETS)}, {HELDOUT}, or a path to a JSONL "
                            "file with 'messages'/'conversations' or 'prompt' records")
        source = _file_prompts(path)
    prompts: list[Prompt] = []
    for prompt in source:
        if len(prompts) >= max_samples:
            break
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--data {name}: no usable prompt (records need a user turn before any assistant turn)")
    return prompts


def tokenize_prompt(tokenizer: Any, messages: list[dict[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt's ids, rendered as extract rendered the cache's prompts (`chat_token_ids`)."""
    return chat_token_ids(tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs)


def load_chat_template(path: Path) -> str:
    """The text of a --chat-template file (a Jinja chat template, as serving engines take one)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--chat-template {path}: cannot read ({error})") from error
    if not text.strip():
        raise UserError(f"--chat-template {path} is empty: pass a Jinja chat template file")
    return text


# ---------------------------------------------------------------------------
# Drafter / target compatibility
# ---------------------------------------------------------------------------


def check_compatibility(draft: Any, target: Any, info: Mapping[str, Any], draft_dir: Path | str = "the drafter",
                        ) -> None:
    """Refuse a drafter whose sizes do not fit the target (hidden size, vocabulary, captured layers, mask token)."""
    cfg = draft.config
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    target_hidden = int(tcfg.hidden_size)
    target_layers = int(tcfg.num_hidden_layers)
    target_vocab = int(target.get_input_embeddings().weight.shape[0])
    head_vocab = int(target.get_output_embeddings().weight.shape[0])
    problems = []
    if int(cfg.hidden_size) != target_hidden:
        problems.append(f"hidden size {cfg.hidden_size} != the target's {target_hidden}")
    if info.get("hidden_size") is not None and int(info["hidden_size"]) != target_hidden:
        problems.append(f"it was trained on target features of hidden size {info['hidden_size']}, the target has "
                        f"{target_hidden}")
    if int(cfg.vocab_size) != target_vocab or head_vocab != target_vocab:
        problems.append(f"vocabulary size {cfg.vocab_size} != the target's {target_vocab} (embedding) / "
                        f"{head_vocab} (LM head)")
    layer_ids = list(cfg.target_layer_ids)
    bad = [i for i in layer_ids if not 0 <= int(i) < target_layers]
    if bad:
        problems.append(f"target_layer_ids {layer_ids} include layers {bad} that the target (layers "
                        f"0..{target_layers - 1}) does not have")
    if info.get("layer_ids") is not None and list(info["layer_ids"]) != layer_ids:
        problems.append(f"config target_layer_ids {layer_ids} != the recorded layer_ids {info['layer_ids']}")
    if int(getattr(cfg, "num_target_layers", target_layers)) != target_layers:
        problems.append(f"it was trained for a target of {cfg.num_target_layers} layers, this one has {target_layers}")
    if cfg.mask_token_id is None or not 0 <= int(cfg.mask_token_id) < target_vocab:
        problems.append(f"mask_token_id {cfg.mask_token_id} is not a token of the target")
    draft_scale = float(getattr(cfg, "embed_scale", 1.0))
    if abs(draft_scale - embedding_scale(target)) > 1e-6 * max(1.0, draft_scale):
        problems.append(f"it embeds its block with scale {draft_scale:g}, the target's embedding scales by "
                        f"{embedding_scale(target):g}")
    if problems:
        raise UserError(f"drafter {draft_dir} does not match target: " + "; ".join(problems)
                        + " (pass --model with the target it was trained for)")


def check_target_identity(info: Mapping[str, Any], resolved: Any, draft_dir: Path, allow_mismatch: bool) -> None:
    """Refuse a target whose content differs from the one the drafter was trained for (its export records the
    hash of the target's config and weights): a target of the same shape passes every size check and would be
    measured with a drafter that never saw its features. `allow_mismatch` (--allow-target-mismatch) warns only."""
    from dflash.shared.target_loading import target_content_hash

    trained_for = info.get("target_hash")
    if not trained_for:
        log.warning("%s does not record the hash of its target: it cannot be checked", draft_dir)
        return
    loaded = target_content_hash(resolved.load_path, like=trained_for)
    if loaded == trained_for:
        return
    message = (f"drafter {draft_dir} was trained for target {info.get('target_source') or 'embedded'} (hash "
               f"{trained_for[:16]}), the target {resolved.display_name} has hash {loaded[:16]}")
    if not allow_mismatch:
        raise UserError(f"{message}: pass --model with the target it was trained for, or --allow-target-mismatch "
                        "to measure it anyway")
    log.warning("--allow-target-mismatch: %s", message)


def _resolve_target_source(info: Mapping[str, Any], model: str | None, draft_dir: Path) -> Any:
    from dflash.shared.target_loading import resolve_target

    if model:
        source = info.get("target_source")
        if source and not str(source).startswith("embedded:") and source != model:
            log.warning("drafter %s was trained for %s; evaluating against %s", draft_dir, source, model)
        return resolve_target(model)
    source = info.get("target_source")
    if source is None:
        raise UserError(f"{draft_dir} does not record its target ({TARGET_INFO_FILE} missing or without "
                        "target_source): pass --model")
    if source == "" or str(source).startswith("embedded:"):
        return resolve_target(None)
    return resolve_target(str(source))


# ---------------------------------------------------------------------------
# Losslessness check
# ---------------------------------------------------------------------------


@torch.inference_mode()
def divergence_gap(target: Any, prompt_ids: list[int], prefix: list[int], token_a: int, token_b: int,
                   ) -> tuple[float, float]:
    """(|logit_a - logit_b|, tolerance) at the position after prompt + prefix, from a cache-free target forward."""
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids + prefix], dtype=torch.long, device=device)
    logits = target(input_ids=ids).logits[0, -1]
    dtype = logits.dtype
    logits = logits.float()
    top = float(logits.max())
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))  # spacing of dtype at top
    tolerance = max(TIE_ULPS * ulp, TIE_RELATIVE * max(abs(top), 1.0))
    gap = abs(float(logits[token_a]) - float(logits[token_b]))
    # both must also be (near-)maximal: a tie between two non-argmax tokens is no excuse
    near_top = top - max(float(logits[token_a]), float(logits[token_b])) <= tolerance
    return (gap if near_top else math.inf), tolerance


def compare_greedy(target: Any, prompt: Prompt, prompt_ids: list[int], reference: list[int], speculative: list[int],
                   ) -> dict[str, Any]:
    """Compare speculative tokens with plain greedy ones; raise LosslessnessError unless any difference is a tie."""
    index = first_difference(reference, speculative)
    if index is None:
        return {"identical": True, "compared_tokens": len(reference)}
    if index >= min(len(reference), len(speculative)):
        raise LosslessnessError(
            f"prompt {prompt.id}: greedy speculative decoding emitted {len(speculative)} tokens, plain greedy "
            f"{len(reference)}, equal up to {index}")
    a, b = reference[index], speculative[index]
    gap, tolerance = divergence_gap(target, prompt_ids, reference[:index], a, b)
    if gap > tolerance:
        raise LosslessnessError(
            f"prompt {prompt.id}: greedy speculative decoding differs from plain greedy decoding at new token {index}"
            f" (plain {a}, speculative {b}; logit gap {gap:.4g} > tie tolerance {tolerance:.3g}): this is a bug")
    log.info("prompt %s: numerical tie at token %d (%d vs %d, gap %.3g): comparing the prefix only",
             prompt.id, index, a, b, gap)
    return {"identical": False, "tie_at": index, "tie_gap": gap, "compared_tokens": index}


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _offline_walk(draft: Any, embed: torch.Tensor, head: torch.Tensor, prompts: list[Prompt]) -> dict[str, Any]:
    """Training's offline acceptance walk over the same cached sequences (features of the cache, not live ones)."""
    dtype = next(draft.parameters()).dtype
    sequences = [{**p.cached, "features": p.cached["features"].to(dtype)} for p in prompts if p.cached is not None]
    with torch.no_grad():
        result = offline_acceptance(draft, embed.to(dtype), head.to(dtype), sequences, max_random_anchors=0)
    return {"tau_walk": result["tau_walk"], "tau_walk_stderr": result["tau_walk_stderr"], "steps": result["steps"],
            "sequences": result["sequences"], "acceptance_by_position": result["acceptance_by_position"]}


def training_acceptance(draft_dir: Path) -> dict[str, Any] | None:
    """Held-out offline tau of the run that made this export: untrained (step 0) and last (RUN/metrics.jsonl)."""
    run = run_of_export(draft_dir)
    path = run.metrics if run is not None else None
    if path is None or not path.is_file():
        return None
    evals = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/tau_walk" in record:
            evals.append(record)
    if not evals:
        return None
    untrained = next((r for r in evals if r["step"] == 0), None)
    test = json.loads(run.test_results.read_text()) if run is not None and run.test_results.is_file() else None
    return {"untrained_tau_walk": untrained["eval/tau_walk"] if untrained else None,
            "trained_tau_walk": evals[-1]["eval/tau_walk"], "trained_step": evals[-1]["step"],
            "metrics": str(path),
            "test": {key: test.get(key) for key in ("drafter", "step", "sequences", "tau_walk", "tau_walk_stderr")}
            if test else None}


def _rate(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """Tokens per second pooled over prompts (nan where nothing was decoded)."""
    return sum(tokens) / sum(seconds) if sum(tokens) > 0 and sum(seconds) > 0 else math.nan


def _over_plain(rates: Mapping[str, float]) -> dict[str, float]:
    """Each method's rate over plain decoding's (nan where either is)."""
    return {method: rates[method] / rates["plain"] if rates["plain"] > 0 else math.nan
            for method in ("dflash", "prompt_lookup")}


def _whole(results: Sequence[SpecResult]) -> tuple[list[int], list[float]]:
    """Per prompt: the tokens made and the seconds they took."""
    return [len(r.tokens) for r in results], [r.seconds for r in results]


def _after_first_token(results: Sequence[SpecResult]) -> tuple[list[int], list[float]]:
    """Per prompt: the tokens after the first and the seconds after the first token (`SpecResult.decode_seconds`)."""
    return [max(len(r.tokens) - 1, 0) for r in results], [r.decode_seconds for r in results]


def _first_token_seconds(result: SpecResult) -> float:
    """A generation's time to its first token (nan where the method did not run: no token)."""
    return result.first_token_seconds if result.tokens else math.nan


def _mean_first_token_seconds(results: Sequence[SpecResult]) -> float:
    """The mean time to the first token over the prompts a method decoded (nan where it decoded none)."""
    firsts = [seconds for seconds in map(_first_token_seconds, results) if not math.isnan(seconds)]
    return sum(firsts) / len(firsts) if firsts else math.nan


def speedup_standard_error(fast_tokens: Sequence[float], fast_seconds: Sequence[float],
                           base_tokens: Sequence[float], base_seconds: Sequence[float]) -> float:
    """The standard error over prompts of speedup = (sum fast_tokens / sum fast_seconds) / (sum base_tokens /
    sum base_seconds), prompt i having made fast_tokens[i] tokens in fast_seconds[i] seconds with one method and
    base_tokens[i] in base_seconds[i] with the baseline: the delta method's linearisation over independent prompts
    (as `tau_standard_error`; with equal token counts it is that ratio estimator's error of sum base_seconds /
    sum fast_seconds), sqrt(n / (n - 1) * sum_i z_i^2) with z_i = speedup * (fast_tokens_i / sum fast_tokens -
    fast_seconds_i / sum fast_seconds - base_tokens_i / sum base_tokens + base_seconds_i / sum base_seconds).
    NaN with fewer than 2 prompts or nothing decoded."""
    n = len(fast_tokens)
    totals = [sum(values) for values in (fast_tokens, fast_seconds, base_tokens, base_seconds)]
    if n < 2 or any(total <= 0 for total in totals):
        return math.nan
    speedup = (totals[0] / totals[1]) / (totals[2] / totals[3])
    influence = [speedup * (ft / totals[0] - fs / totals[1] - bt / totals[2] + bs / totals[3])
                 for ft, fs, bt, bs in zip(fast_tokens, fast_seconds, base_tokens, base_seconds, strict=True)]
    return math.sqrt(n / (n - 1) * sum(z * z for z in influence))


def _summarise(name: str, samples: list[dict[str, Any]], runs: dict[str, list[SpecResult]], block_size: int,
               greedy: bool) -> dict[str, Any]:
    accepted = [a for r in runs["dflash"] for a in r.accepted]
    whole = {method: _whole(results) for method, results in runs.items()}
    rates = {method: _rate(*per_prompt) for method, per_prompt in whole.items()}
    taus = [r.tau for r in runs["dflash"] if r.accepted]
    tau = (sum(a + 1 for a in accepted) / len(accepted)) if accepted else math.nan
    stderr = tau_standard_error([sum(a + 1 for a in r.accepted) for r in runs["dflash"]],
                                [len(r.accepted) for r in runs["dflash"]])
    lookup_accepted = [a for r in runs["prompt_lookup"] for a in r.accepted]
    speedup = _over_plain(rates)
    speedup_stderr = {method: speedup_standard_error(*whole[method], *whole["plain"]) for method in speedup}
    # The decoding after the first token: every method runs the prompt's forward once (speculative decoding with the
    # hooked layers' features too), which pulls every speedup towards 1, by more the shorter the answers; these
    # figures leave it out.
    after = {method: _after_first_token(results) for method, results in runs.items()}
    decode_rates = {method: _rate(*per_prompt) for method, per_prompt in after.items()}
    decode_speedup = _over_plain(decode_rates)
    decode_speedup_stderr = {method: speedup_standard_error(*after[method], *after["plain"]) for method in speedup}
    for index, sample in enumerate(samples):  # per prompt: tokens/s by method and the speedups over plain decoding
        sample["tokens_per_second"] = {method: results[index].tokens_per_second for method, results in runs.items()}
        base = sample["tokens_per_second"]["plain"]
        sample["speedup"] = {method: sample["tokens_per_second"][method] / base if base > 0 else math.nan
                             for method in speedup}
    return {
        "dataset": name,
        "prompts": len(samples),
        "steps": len(accepted),
        "tau": tau,
        "tau_stderr": stderr,
        "tau_ci95": [tau - 1.96 * stderr, tau + 1.96 * stderr],
        "tau_mean_over_prompts": sum(taus) / len(taus) if taus else math.nan,
        "acceptance_by_position": acceptance_by_position(accepted, block_size),
        "new_tokens": {method: sum(len(r.tokens) for r in results) for method, results in runs.items()},
        "seconds": {method: sum(r.seconds for r in results) for method, results in runs.items()},
        "seconds_per_prompt": {method: sum(r.seconds for r in results) / len(results) if results else math.nan
                               for method, results in runs.items()},
        "tokens_per_second": rates,
        "speedup": speedup,
        "speedup_stderr": speedup_stderr,
        "speedup_ci95": {method: [speedup[method] - 1.96 * speedup_stderr[method],
                                  speedup[method] + 1.96 * speedup_stderr[method]] for method in speedup},
        "first_token_seconds_per_prompt": {method: _mean_first_token_seconds(results)
                                           for method, results in runs.items()},
        "decode_tokens_per_second": decode_rates,
        "decode_speedup": decode_speedup,
        "decode_speedup_stderr": decode_speedup_stderr,
        "prompt_lookup_tau": (sum(a + 1 for a in lookup_accepted) / len(lookup_accepted) if lookup_accepted
                              else math.nan),
        "greedy_identical": sum(1 for s in samples if s.get("identical")) if greedy else None,
        "tie_divergences": sum(1 for s in samples if "tie_at" in s) if greedy else None,
        "prompt_lookup_identical": (sum(1 for s in samples if s.get("prompt_lookup_identical"))
                                    if any("prompt_lookup_identical" in s for s in samples) else None),
        "samples": samples,
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def write_markdown(report: dict[str, Any], path: Path) -> None:
    lines = [
        "# DFlash evaluation",
        "",
        f"- drafter: `{report['draft_dir']}` (block size {report['block_size']}, "
        f"{report['draft_layers']} layers, target layers {report['target_layer_ids']})",
        f"- target: {report['target']} on {report['device']} ({report['target_dtype']}, "
        f"{report['torch_threads']} CPU threads)",
        f"- temperature {report['temperature']}, max new tokens {report['max_new_tokens']}, decode path "
        f"{report['decode_path']}",
        *([f"- train/serve parity: {report['parity']['summary']}"] if report.get("parity") else []),
        "",
        "| dataset | prompts | steps | tau | tau s.e. | dflash tok/s | plain tok/s | prompt lookup tok/s "
        "| dflash speedup +- s.e. | prompt lookup speedup +- s.e. | greedy identical | ties |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, d in report["datasets"].items():
        tps, speedup, stderr = d["tokens_per_second"], d["speedup"], d["speedup_stderr"]
        lines.append(
            f"| {name} | {d['prompts']} | {d['steps']} | {_fmt(d['tau'], 3)} | {_fmt(d['tau_stderr'], 3)} | "
            f"{_fmt(tps['dflash'])} | "
            f"{_fmt(tps['plain'])} | {_fmt(tps['prompt_lookup'])} | {_fmt(speedup['dflash'])}x +- "
            f"{_fmt(stderr['dflash'])} | {_fmt(speedup['prompt_lookup'])}x +- {_fmt(stderr['prompt_lookup'])} | "
            f"{_fmt(d['greedy_identical'])} | {_fmt(d['tie_divergences'])} |")
    lines += ["", "After the first token (each method's time to it, the prompt's forward, left out):", "",
              "| dataset | first token ms, dflash / plain / prompt lookup | dflash tok/s | plain tok/s "
              "| prompt lookup tok/s | dflash speedup +- s.e. | prompt lookup speedup +- s.e. |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, d in report["datasets"].items():
        first, tps = d["first_token_seconds_per_prompt"], d["decode_tokens_per_second"]
        speedup, stderr = d["decode_speedup"], d["decode_speedup_stderr"]
        lines.append(
            f"| {name} | {' / '.join(_fmt(first[m] * 1000, 1) for m in ('dflash', 'plain', 'prompt_lookup'))} | "
            f"{_fmt(tps['dflash'])} | {_fmt(tps['plain'])} | {_fmt(tps['prompt_lookup'])} | "
            f"{_fmt(speedup['dflash'])}x +- {_fmt(stderr['dflash'])} | "
            f"{_fmt(speedup['prompt_lookup'])}x +- {_fmt(stderr['prompt_lookup'])} |")
    block = report["block_size"]
    lines += ["", "Acceptance by block position, P(accepted >= k):", "",
              "| dataset | " + " | ".join(f"k={k}" for k in range(1, block)) + " |",
              "|---|" + "---:|" * (block - 1)]
    for name, d in report["datasets"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(p) for p in d["acceptance_by_position"]) + " |")
        if "offline" in d:
            lines.append(f"| {name} (offline walk) | "
                         + " | ".join(_fmt(p) for p in d["offline"]["acceptance_by_position"]) + " |")
    for name, d in report["datasets"].items():
        if "offline" in d:
            lines += ["", f"{name} ({d['split']} split of the training run): live tau {_fmt(d['tau'], 3)} vs "
                      f"offline walk tau {_fmt(d['offline']['tau_walk'], 3)} on the same {d['prompts']} cached sequences "
                      f"({d['offline']['steps']} offline steps). The offline walk compares drafts with the cached "
                      "response; live decoding with the target's own greedy continuation."]
    training = report.get("training")
    if training:
        untrained = training["untrained_tau_walk"]
        lines += ["", f"Training run (validation split, offline walk): tau {_fmt(training['trained_tau_walk'], 3)} after "
                  f"{training['trained_step']} steps"
                  + (f" vs {_fmt(untrained, 3)} for the untrained drafter (step 0)." if untrained is not None
                     else " (no step-0 evaluation in this run).")]
        test = training.get("test")
        if test:
            lines += ["", f"Test split (offline walk, {test['sequences']} sequences, evaluated once): tau "
                      f"{_fmt(test['tau_walk'], 3)} +- {_fmt(test['tau_walk_stderr'], 3)} (s.e.) for "
                      f"{test['drafter']}/ (step {test['step']})."]
    lines += _parity_lines(report)
    lines += ["", "tau = mean over speculative steps of (accepted drafts + 1); s.e. = its standard error over prompts "
              "(95 % interval: tau +- 1.96 s.e.). Plain = autoregressive decoding of the "
              "same target with a KV cache; prompt lookup = up to 10 tokens found by transformers' "
              "`PromptLookupCandidateGenerator`, verified greedily by the same target runner. "
              "Speedup = tokens/s over plain decoding's tokens/s, pooled over prompts; its s.e. is over prompts.", ""]
    lines += _per_prompt_lines(report)
    path.write_text("\n".join(lines))


def _parity_lines(report: dict[str, Any]) -> list[str]:
    """eval.md's train/serve parity section: each check, and live tau beside the offline test tau."""
    parity = report.get("parity")
    if not parity:
        return []
    lines = ["", "## Train/serve parity", "", "| check | status | detail |", "|---|---|---|"]
    lines += [f"| {f['check']} | {f['status']} | {f['detail'].replace('|', '/')} |" for f in parity["findings"]]
    for name, d in report["datasets"].items():
        gap = d.get("tau_gap")
        if gap:
            verdict = (f"**far below it** ({gap['rule']}); likely causes: " + "; ".join(gap["likely_causes"])
                       if gap["flagged"] else "not far below it")
            lines += ["", f"{name}: live tau {_fmt(gap['live_tau'], 3)} +- {_fmt(gap['live_stderr'], 3)} vs offline "
                      f"tau {_fmt(gap['offline_tau'], 3)} +- {_fmt(gap['offline_stderr'], 3)} on the cache's "
                      f"{gap['offline_split']} split (ratio {_fmt(gap['ratio'])}): {verdict}."]
    return lines


def _per_prompt_lines(report: dict[str, Any]) -> list[str]:
    """eval.md's per-prompt table: time and tokens/s of speculative and plain decoding, and the speedup."""
    lines = ["## Per prompt", "", "| dataset | prompt | prompt tokens | new tokens | tau | dflash s | plain s "
             "| dflash tok/s | plain tok/s | speedup |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, d in report["datasets"].items():
        for sample in d["samples"]:
            seconds, tps = sample["seconds"], sample["tokens_per_second"]
            lines.append(f"| {name} | {str(sample['id']).replace('|', '/')} | {sample['prompt_tokens']} | "
                         f"{sample['new_tokens']} | {_fmt(sample['tau'])} | {_fmt(seconds['dflash'])} | "
                         f"{_fmt(seconds['plain'])} | {_fmt(tps['dflash'], 1)} | {_fmt(tps['plain'], 1)} | "
                         f"{_fmt(sample['speedup']['dflash'])}x |")
    return lines + [""]


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["datasets"])
    positions = list(range(1, report["block_size"]))
    width = 0.8 / max(len(names), 1)
    figure, axis = plt.subplots(figsize=(8, 3.6))
    for i, name in enumerate(names):
        values = [0.0 if math.isnan(v) else v for v in report["datasets"][name]["acceptance_by_position"]]
        axis.bar([p - 0.4 + width * (i + 0.5) for p in positions], values, width=width,
                 label=f"{name} (tau {_fmt(report['datasets'][name]['tau'], 2)})")
    axis.set(title="DFlash acceptance by block position", xlabel="block position k", ylabel="P(accepted >= k)",
             ylim=(0, 1), xticks=positions)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")


def target_dtype_for(device: str, dtype: str) -> torch.dtype:
    """`--dtype auto`: float32 on CPU (greedy equality with plain decoding is then exact; bf16 logits tie), bf16 on
    GPUs; otherwise the named dtype."""
    from dflash.shared.target_loading import default_dtype

    if dtype == "auto":
        return default_dtype(device)
    if dtype not in TARGET_DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(TARGET_DTYPES)}")
    return getattr(torch, dtype)



def _check_parity(info: Mapping[str, Any], draft_dir: Path, tokenizer: Any, template_kwargs: dict[str, Any],
                  stops: list[int], prompts_by_dataset: Mapping[str, list[Prompt]],
                  ) -> tuple[list[Finding], dict[str, Any]]:
    """The train/serve parity findings (`parity.py`) of this rendering against the drafter's training cache,
    logged in one line before decoding. Held-out prompts come tokenized from the cache: nothing of theirs to check."""
    trained = trained_rendering(info, draft_dir)
    serving = rendering_record(tokenizer, template_kwargs, stops)
    findings = compare_rendering(trained, serving, info.get("tokenizer_hash"), template_fingerprint(tokenizer))
    for name, prompts in prompts_by_dataset.items():
        if name.lower() != HELDOUT:
            note = system_turn_finding(name, trained.get("system_turn_share") if trained else None,
                                       [prompt.messages for prompt in prompts])
            findings += [note] if note is not None else []
    report = parity_report(findings, trained, serving)
    if any(f.status == DIFFERS for f in findings):
        log.warning("train/serve parity: %s", report["summary"])
    else:
        log.info("train/serve parity: %s", report["summary"])
    return findings, report


def _thinking_on(record: Mapping[str, Any]) -> bool | None:
    thinking = record.get("thinking")
    return thinking.get("on") if thinking else None


def _offline_test_tau(training: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The drafter's offline tau to set live tau beside: the training run's test split (test_results.json), else
    the last validation evaluation (no standard error recorded); None without a training run."""
    if not training:
        return None
    test = training.get("test")
    if test and test.get("tau_walk") is not None:
        return {"split": "test", "tau_walk": test["tau_walk"], "tau_walk_stderr": test.get("tau_walk_stderr")}
    return {"split": "validation", "tau_walk": training.get("trained_tau_walk"), "tau_walk_stderr": None}


def run_eval(
    draft_dir: Path,
    data: str,
    out_dir: Path,
    max_samples: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    model: str | None = None,
    device: str = "auto",
    seed: int = 0,
    allow_target_mismatch: bool = False,
    dtype: str = "auto",
    baselines: bool = True,
    chat_template: Path | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    decode: str = "auto",
) -> dict[str, Any]:
    """Evaluate an exported drafter against its target on one or more datasets; write eval.json/.md/.png.

    baselines=False decodes only speculatively: tau, acceptance and dflash tokens/s, without plain and prompt-lookup
    decoding (so no speedups and no greedy equality check), in about a third of the time. chat_template (a Jinja
    file) and chat_template_kwargs render the prompts as the user's serving does (the target's template and none by
    default); the parity checks compare that rendering with the training cache's. decode: the decode path of dflash
    and plain decoding alike (`modeling_dflash.resolve_decode`: auto = static caches and CUDA graphs on CUDA,
    dynamic on CPU)."""
    from dflash.shared.target_loading import load_target_model, load_tokenizer, stop_token_ids

    draft_dir = Path(draft_dir)
    out_dir = Path(out_dir)
    if max_samples < 1 or max_new_tokens < 1:
        raise UserError("--max-samples and --max-new-tokens must be at least 1")
    if temperature < 0:
        raise UserError("--temperature must be >= 0")
    if not (draft_dir / "config.json").is_file():
        raise UserError(f"no exported drafter in {draft_dir} (config.json not found): run `dflash export` or "
                        "pass the export folder")
    names = dataset_names(data)
    template_kwargs = dict(chat_template_kwargs or {})
    template_text = load_chat_template(chat_template) if chat_template is not None else None
    heldout_split: str | None = None
    prompts_by_dataset: dict[str, list[Prompt]] = {}
    for name in names:  # fail early on bad --data
        if name.lower() == HELDOUT:
            prompts_by_dataset[name], heldout_split = heldout_prompts(draft_dir, max_samples, max_new_tokens)
        else:
            prompts_by_dataset[name] = load_prompts(name, max_samples)
    info = read_target_info(draft_dir)
    resolved = _resolve_target_source(info, model, draft_dir)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    draft = load_draft(draft_dir)
    target = load_target_model(resolved.load_path, device, target_dtype_for(device, dtype))
    check_compatibility(draft, target, info, draft_dir)  # sizes first: the clearest message
    check_target_identity(info, resolved, draft_dir, allow_target_mismatch)
    tokenizer = load_tokenizer(resolved.load_path)
    if template_text is not None:
        tokenizer.chat_template = template_text
    stops = stop_token_ids(resolved.load_path, tokenizer)
    findings, parity = _check_parity(info, draft_dir, tokenizer, template_kwargs, stops, prompts_by_dataset)
    target_dtype = next(target.parameters()).dtype
    draft = draft.to(device=device, dtype=torch.float32 if device == "cpu" else target_dtype).eval()
    embed = scaled_embedding(target.get_input_embeddings().weight, draft.config.embed_scale)
    head = target.get_output_embeddings().weight
    layer_ids = list(draft.config.target_layer_ids)
    block_size = int(draft.config.block_size)
    greedy = temperature == 0
    # Sampling draws on the target's device (a CPU generator copied each block's [B - 1, V] probabilities to the host
    # inside the timed loop), one generator per method, so dflash's samples do not depend on whether plain
    # decoding ran between its prompts (--no-baselines).
    generators = {method: torch.Generator(device=device).manual_seed(seed) for method in ("dflash", "plain")}

    # Every prompt's token ids as the timed loop decodes them (rendered with --chat-template-kwargs), and static
    # buffers sized once for the longest and the widest verify block (DFlash's, or prompt lookup's), so the warm-up
    # captures the graphs every prompt reuses.
    prompt_ids = {name: [p.ids or tokenize_prompt(tokenizer, p.messages, template_kwargs) for p in prompts]
                  for name, prompts in prompts_by_dataset.items()}
    capacity = (max(len(ids) for per_dataset in prompt_ids.values() for ids in per_dataset) + max_new_tokens
                + max(block_size, PROMPT_LOOKUP_TOKENS + 1))

    def dflash(ids: list[int], n: int, stop_ids: list[int] = stops) -> SpecResult:
        return speculative_generate(target, draft, embed, head, ids, layer_ids, n, stop_ids, temperature=temperature,
                                    generator=generators["dflash"], decode=decode, capacity=capacity)

    # Warm-up (untimed): first calls allocate, pick kernels, compile and capture graphs. Without stop tokens, so that
    # a first prompt answered by a stop token at once still runs the steps it warms up.
    first = next(iter(prompt_ids.values()))[0]
    lookup_refused = ("not run (--no-baselines)" if not baselines
                      else "not run: greedy only (--temperature > 0)" if not greedy else None)

    def lookup(ids: list[int], n: int, stop_ids: list[int] = stops) -> SpecResult:
        return SpecResult(tokens=[]) if lookup_refused else prompt_lookup_generate(target, ids, n, stop_ids,
                                                                                    decode=decode, capacity=capacity)

    log.info("evaluating %s with the target %s on %s (%d prompts): warming up", draft_dir, resolved.display_name,
             device, sum(len(prompts) for prompts in prompts_by_dataset.values()))
    decode_path = dflash(first, 4, []).decode  # what --decode resolved to (e.g. a target it cannot run keeps the dynamic one)
    plain_decode_path = None
    if baselines:
        plain_decode_path = greedy_generate(target, first, 4, [], decode=decode, capacity=capacity).decode
    if not lookup_refused:
        lookup(first, 4, [])
        prewarm_prompt_lookup(target, capacity, decode)  # every verify width it may use, not inside a timed prompt

    training = training_acceptance(draft_dir)
    offline = _offline_test_tau(training)
    datasets: dict[str, Any] = {}
    total_prompts = sum(len(prompts) for prompts in prompts_by_dataset.values())
    started, done = time.time(), 0
    for name, prompts in prompts_by_dataset.items():
        runs: dict[str, list[SpecResult]] = {"dflash": [], "plain": [], "prompt_lookup": []}
        samples: list[dict[str, Any]] = []
        for prompt, ids in zip(prompts, prompt_ids[name]):
            prompt_started = time.time()
            spec = dflash(ids, max_new_tokens)
            plain = (greedy_generate(target, ids, max_new_tokens, stops, temperature=temperature,
                                     generator=generators["plain"], decode=decode, capacity=capacity)
                     if baselines else SpecResult(tokens=[]))
            lookup_result = lookup(ids, max_new_tokens)
            sample: dict[str, Any] = {"id": prompt.id, "prompt_tokens": len(ids), "new_tokens": len(spec.tokens),
                                      "steps": spec.steps, "tau": spec.tau, "accepted": spec.accepted,
                                      "seconds": {"dflash": spec.seconds, "plain": plain.seconds,
                                                  "prompt_lookup": lookup_result.seconds},
                                      "first_token_seconds": {  # null for a method that did not run
                                          method: _first_token_seconds(result)
                                          for method, result in (("dflash", spec), ("plain", plain),
                                                                 ("prompt_lookup", lookup_result))}}
            if greedy and baselines:
                sample.update(compare_greedy(target, prompt, ids, plain.tokens, spec.tokens))
                sample["prompt_lookup_identical"] = lookup_result.tokens == plain.tokens
            samples.append(sample)
            runs["dflash"].append(spec)
            runs["plain"].append(plain)
            runs["prompt_lookup"].append(lookup_result)
            done += 1
            log.info("[%d/%d] %s %s: %d tokens, tau %.2f, %.1f / %.1f / %.1f tok/s (dflash / plain / lookup); "
                     "%.1f s, ETA %s", done, total_prompts, name, prompt.id, len(spec.tokens), spec.tau,
                     spec.tokens_per_second, plain.tokens_per_second, lookup_result.tokens_per_second,
                     time.time() - prompt_started,
                     time.strftime("%H:%M:%S", time.gmtime((time.time() - started) / done * (total_prompts - done))))
        datasets[name] = _summarise(name, samples, runs, block_size, greedy and baselines)
        if any(prompt.cached is not None for prompt in prompts):
            datasets[name]["offline"] = _offline_walk(draft, embed, head, prompts)
            datasets[name]["split"] = heldout_split
        gap = tau_gap(datasets[name]["tau"], datasets[name]["tau_stderr"], offline, max_new_tokens,
                      findings, _thinking_on(parity["eval"]), from_cache=name.lower() == HELDOUT)
        datasets[name]["tau_gap"] = gap
        if gap and gap["flagged"]:
            log.warning("%s: live tau %.3f is far below the offline %s tau %.3f (%s); likely causes: %s", name,
                        gap["live_tau"], gap["offline_split"], gap["offline_tau"], gap["rule"],
                        "; ".join(gap["likely_causes"]))

    report = {
        "draft_dir": str(draft_dir),
        "target": resolved.display_name,
        "target_load_path": resolved.load_path,
        "device": device,
        "target_dtype": str(target_dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        "temperature": temperature,
        "baselines": baselines,
        "decode": decode,
        "decode_path": decode_path,
        "decode_path_plain": plain_decode_path,
        "max_new_tokens": max_new_tokens,
        "max_samples": max_samples,
        "block_size": block_size,
        "draft_layers": int(draft.config.num_hidden_layers),
        "target_layer_ids": layer_ids,
        "mask_token_id": int(draft.config.mask_token_id),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "prompt_lookup_unavailable": lookup_refused,
        "chat_template": str(chat_template) if chat_template is not None else None,
        "chat_template_kwargs": template_kwargs,
        "parity": parity,
        "datasets": datasets,
    }
    if training:
        report["training"] = training
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".eval.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    os.replace(tmp, out_dir / "eval.json")
    write_markdown(report, out_dir / "eval.md")
    write_plot(report, out_dir / "eval.png")
    return report
