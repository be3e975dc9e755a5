"""Train/serve parity: are eval's prompts rendered as the drafter's training cache was, and is live tau near offline?

The most common complaint about trained drafters is "high training accuracy, low acceptance in serving"; the causes
users found were a different chat template, thinking mode on in serving but off in the training data, or different
special tokens. Before decoding, `dflash eval` compares the cache's record of its rendering (`chat_rendering`
`rendering_record`, carried by the export's dflash_target.json) with its own (`compare_rendering`), and says in one
line what differs (`summary`). A cache made before that record existed is checked by its `tokenizer_hash` alone and the
rest is reported as unknown. After decoding, `tau_gap` compares each dataset's live tau with the drafter's offline tau
on the cache's test split and flags a live tau far below it, naming the likely causes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash.shared.cache_format import RENDERING_KEY
from dflash.shared.run_files import run_of_export

MATCH, DIFFERS, UNKNOWN, NOTE = "match", "differs", "unknown", "note"
# A live tau is flagged when it is below this fraction of the offline test tau AND below it by more than
# TAU_GAP_SIGMAS combined standard errors. Healthy SmolLM2 drafters measured 0.76-0.98 x their offline (validation)
# tau live at 512 new tokens (docs/benchmarks.md: 2.28 / 2.23 live vs 2.57 offline, 2.02 / 2.24 vs 2.28, 2.33 / 2.49 /
# 2.97 vs 3.07); the train/serve mismatches users report are acceptance collapsing (0.12 after a training accuracy of
# 0.99), far below that. The s.e. condition keeps a handful of prompts from raising a false alarm.
TAU_RATIO_FLOOR = 0.7
TAU_GAP_SIGMAS = 3.0
# Fewer new tokens than this per prompt is named as a cause: tau grows along an answer (SmolLM2's H200 drafter: live tau
# 1.42 / 1.64 on MT-Bench / HumanEval at 128 tokens, 2.33 / 2.49 at 512; docs/benchmarks.md); eval's default is 512.
SHORT_ANSWER_TOKENS = 512
TAU_GAP_RULE = (f"live tau < {TAU_RATIO_FLOOR} x offline test tau and below it by more than {TAU_GAP_SIGMAS:g} "
                "combined standard errors")
_UNRECORDED = "the cache does not record it (extracted before dflash recorded how prompts were rendered)"


@dataclass(frozen=True)
class Finding:
    """One parity check: what was compared, its status (match / differs / unknown / note), and what was found."""

    check: str
    status: str
    detail: str


def trained_rendering(info: Mapping[str, Any], draft_dir: Path) -> dict[str, Any] | None:
    """The rendering record of the drafter's training cache: from the export's dflash_target.json, else from the
    cache manifest its run kept (RUN/cache_manifest.json, for exports made before the record was carried); None when
    neither has one."""
    if info.get(RENDERING_KEY):
        return dict(info[RENDERING_KEY])
    run = run_of_export(draft_dir)
    if run is not None and run.cache_manifest.is_file():
        try:
            record = json.loads(run.cache_manifest.read_text()).get(RENDERING_KEY)
        except (OSError, json.JSONDecodeError):
            return None
        return dict(record) if record else None
    return None


def _thinking_text(thinking: Mapping[str, Any] | None) -> str:
    if not thinking:
        return "n/a (the template has no thinking switch)"
    state = {True: "on", False: "off", None: "neither on nor off"}[thinking.get("on")]
    how = f"{thinking['switch']} set" if thinking.get("set") else f"{thinking['switch']} unset: the template's default"
    return f"{state} ({how})"


def _probe_difference(trained: str | None, serving: str | None) -> str:
    """Where the two probe prompts first differ, with a little context, as repr() text."""
    if trained is None or serving is None:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(trained, serving)) if a != b), min(len(trained), len(serving)))
    start = max(0, at - 20)
    return f"; the probe prompt from character {at}: cache {trained[start:at + 40]!r}, eval {serving[start:at + 40]!r}"


def compare_rendering(trained: Mapping[str, Any] | None, serving: Mapping[str, Any],
                      trained_tokenizer_hash: str | None = None, serving_tokenizer_hash: str | None = None,
                      ) -> list[Finding]:
    """The parity findings of eval's rendering (`serving`, a `rendering_record`) against the training cache's
    (`trained`; None for a cache made before the record existed, then only the identity's `tokenizer_hash` can be
    compared)."""
    if trained is None:
        if trained_tokenizer_hash and serving_tokenizer_hash:
            same = trained_tokenizer_hash == serving_tokenizer_hash
            findings = [Finding("tokenizer and chat template", MATCH if same else DIFFERS,
                                "same tokenizer_hash (chat template, vocabulary size, special tokens)" if same else
                                f"tokenizer_hash {serving_tokenizer_hash[:12]} != the cache's "
                                f"{trained_tokenizer_hash[:12]}: the chat template, vocabulary size or special tokens "
                                "differ (the cache does not record which)")]
        else:
            findings = [Finding("tokenizer and chat template", UNKNOWN, _UNRECORDED)]
        return findings + [Finding("thinking", UNKNOWN, _UNRECORDED), Finding("stop tokens", UNKNOWN, _UNRECORDED)]

    findings = []
    probe = _probe_difference(trained.get("probe_prompt"), serving.get("probe_prompt"))
    if trained.get("chat_template_sha256") != serving.get("chat_template_sha256"):
        findings.append(Finding("chat template", DIFFERS, f"sha256 {str(serving.get('chat_template_sha256'))[:12]} != "
                                f"the cache's {str(trained.get('chat_template_sha256'))[:12]}{probe}"))
    else:
        findings.append(Finding("chat template", MATCH, "same template text"))

    trained_thinking, serving_thinking = trained.get("thinking"), serving.get("thinking")
    trained_on = trained_thinking.get("on") if trained_thinking else None
    serving_on = serving_thinking.get("on") if serving_thinking else None
    findings.append(Finding("thinking", MATCH if trained_on == serving_on else DIFFERS,
                            f"cache {_thinking_text(trained_thinking)}, eval {_thinking_text(serving_thinking)}"))

    switches = {thinking["switch"] for thinking in (trained_thinking, serving_thinking) if thinking}
    trained_kwargs = {k: v for k, v in (trained.get("chat_template_kwargs") or {}).items() if k not in switches}
    serving_kwargs = {k: v for k, v in (serving.get("chat_template_kwargs") or {}).items() if k not in switches}
    if trained_kwargs != serving_kwargs:
        findings.append(Finding("template arguments", DIFFERS,
                                f"chat_template_kwargs {serving_kwargs} != the cache's {trained_kwargs}{probe}"))

    if (trained.get("vocab_size"), trained.get("vocab_sha256")) != (serving.get("vocab_size"),
                                                                    serving.get("vocab_sha256")):
        findings.append(Finding("tokenizer", DIFFERS,
                                f"vocabulary of {serving.get('vocab_size')} tokens (sha256 "
                                f"{str(serving.get('vocab_sha256'))[:12]}) != the cache's {trained.get('vocab_size')} "
                                f"(sha256 {str(trained.get('vocab_sha256'))[:12]})"))
    else:
        findings.append(Finding("tokenizer", MATCH, f"same vocabulary of {serving.get('vocab_size')} tokens"))

    trained_special, serving_special = trained.get("special_token_ids") or {}, serving.get("special_token_ids") or {}
    changed = [f"{name} {serving_special.get(name)} (cache {trained_special.get(name)})"
               for name in sorted(set(trained_special) | set(serving_special))
               if trained_special.get(name) != serving_special.get(name)]
    findings.append(Finding("special tokens", DIFFERS if changed else MATCH,
                            "ids " + ", ".join(changed) if changed else f"same ids {serving_special}"))

    trained_stops, serving_stops = trained.get("stop_token_ids"), serving.get("stop_token_ids")
    findings.append(Finding("stop tokens", MATCH if trained_stops == serving_stops else DIFFERS,
                            f"eval stops at {serving_stops}" + ("" if trained_stops == serving_stops else
                                                               f", the cache's answers ended at {trained_stops}")))

    if trained.get("sanitize_control_tokens") != serving.get("sanitize_control_tokens"):
        findings.append(Finding("control-token text", DIFFERS,
                                f"eval {'keeps' if serving.get('sanitize_control_tokens') else 'does not keep'} "
                                "control-token text inside messages as plain text, the cache "
                                f"{'did' if trained.get('sanitize_control_tokens') else 'did not'} (another "
                                "transformers version)"))
    return findings


def system_turn_finding(dataset: str, cache_share: float | None, prompts: Sequence[Sequence[Mapping[str, str]]],
                        ) -> Finding | None:
    """A note when the cache's conversations never had a system turn and this dataset's prompts do, or the reverse
    (the template then renders a different prefix: its default system prompt, or none); None when both agree or the
    cache's share is unknown."""
    if cache_share is None or not prompts:
        return None
    share = sum(any(m["role"] == "system" for m in messages) for messages in prompts) / len(prompts)
    if (cache_share == 0) == (share == 0):
        return None
    return Finding(f"system turns ({dataset})", NOTE, f"{share:.0%} of the prompts have a system turn, "
                   f"{cache_share:.0%} of the cache's conversations had one")


def summary(findings: Sequence[Finding]) -> str:
    """One line: what differs from the training cache (and what is unknown), or that everything checked matches."""
    differs = [f"{f.check}: {f.detail}" for f in findings if f.status == DIFFERS]
    unknown = sorted({f.check for f in findings if f.status == UNKNOWN})
    notes = [f"{f.check}: {f.detail}" for f in findings if f.status == NOTE]
    if differs:
        line = "prompts are NOT rendered as the training cache's: " + "; ".join(differs)
    else:
        matched = [f.check for f in findings if f.status == MATCH]
        line = ("prompts are rendered as the training cache's (" + ", ".join(matched) + " match)" if matched
                else "the training cache's rendering is not known")
    if unknown:
        line += "; unknown: " + ", ".join(unknown)
    if notes:
        line += "; note: " + "; ".join(notes)
    return line


def parity_report(findings: Sequence[Finding], trained: Mapping[str, Any] | None,
                  serving: Mapping[str, Any]) -> dict[str, Any]:
    """What eval.json records of the checks: the summary line, each finding, and both rendering records."""
    return {"summary": summary(findings), "mismatches": sum(f.status == DIFFERS for f in findings),
            "findings": [asdict(f) for f in findings], "cache": dict(trained) if trained else None,
            "eval": dict(serving)}


def tau_gap(live_tau: float, live_stderr: float, offline: Mapping[str, Any] | None, max_new_tokens: int,
            findings: Sequence[Finding], thinking_on: bool | None = None, from_cache: bool = False,
            ) -> dict[str, Any] | None:
    """Live tau beside the drafter's offline tau (`offline`: {"split", "tau_walk", "tau_walk_stderr"}) and whether
    it is far below it (`TAU_GAP_RULE`), with the likely causes (the parity `findings` that differ or are unknown
    first; `thinking_on`: eval's thinking mode; `from_cache`: the prompts are the cache's own, `--data heldout`);
    None without an offline tau."""
    if not offline or offline.get("tau_walk") is None or not math.isfinite(live_tau):
        return None
    offline_tau = float(offline["tau_walk"])
    offline_stderr = offline.get("tau_walk_stderr")
    errors = [e for e in (live_stderr, offline_stderr) if e is not None and math.isfinite(e)]
    combined = math.sqrt(sum(e * e for e in errors)) if errors else 0.0
    ratio = live_tau / offline_tau if offline_tau > 0 else math.nan
    flagged = bool(ratio < TAU_RATIO_FLOOR and offline_tau - live_tau > TAU_GAP_SIGMAS * combined)
    causes = []
    if flagged:
        causes += [f"{f.check} differs ({f.detail})" for f in findings if f.status == DIFFERS]
        causes += [f"{f.check} unknown: check it by hand" for f in findings if f.status == UNKNOWN]
        if thinking_on:
            causes.append("thinking is on in eval: the target reasons first, which the training answers may not do")
        causes.append("the cached answers are not the target's own (the offline walk follows them, live decoding the "
                      "target's greedy continuation): regenerate the data with `dflash generate`" if from_cache else
                      "the prompts are from another domain than the training data (the offline tau is on the cache's "
                      "own test split)")
        if max_new_tokens < SHORT_ANSWER_TOKENS:
            causes.append(f"short answers ({max_new_tokens} new tokens): tau grows along an answer and the offline "
                          "walk covers whole answers")
    return {"offline_split": offline.get("split"), "offline_tau": offline_tau, "offline_stderr": offline_stderr,
            "live_tau": live_tau, "live_stderr": live_stderr, "ratio": ratio, "flagged": flagged,
            "rule": TAU_GAP_RULE, "likely_causes": causes}
