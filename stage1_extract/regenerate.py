"""Regenerate the assistant turns of conversations with the target (the model side of `dflash generate`).

A drafter learns best from what the target itself says, so every assistant turn is replaced by the target's own
answer to the conversation so far (system and user turns are kept, earlier assistant turns are the regenerated
ones). Conversations advance turn by turn: all conversations waiting for their k-th answer are generated
together in token-budget batches (left padded, transformers' `generate`), longest prompts first.

With `static_cache`, every batch has one of a few shapes: a fixed number of rows (the token budget over
`cache_len` = max_length + max_new_tokens, the last batch of a turn filled with copies of its last prompt whose
answers are dropped) and a KV cache (transformers' StaticCache) of the batch's longest prompt plus its most new
tokens, rounded up to a multiple of STATIC_CACHE_STEP positions per row. Few shapes are what let transformers
compile the decoding step once per shape and worker on CUDA (CUDA graphs): a small target's decoding is otherwise
bound by the host's per-step Python and kernel launches, not by the GPU.

With `max_turns`, a conversation ends after that many regenerated answers. A turn that reaches its token
limit without an end-of-turn token ends the conversation there: later user turns answer the original reply, not
this one. A prompt that no longer fits `max_length` ends it too (at its last answer); a conversation
whose first prompt does not fit is skipped ("prompt_too_long").

With `continuous_batching`, all prompts of a turn go to transformers' continuous batching (`generate_batch`) at
once: a paged KV cache (sized from the free GPU memory on CUDA, from the token budget on CPU), no padding, and a
finished answer's slot taken by the next prompt at once; each answer is cut to its own budget afterwards (the call
takes one --max-new-tokens for all); greedy only.

Lengths are counted as `dflash extract` will count them: a conversation is the chat template's rendering, where each
answer is closed by the template's end-of-turn tokens (`end_of_turn_tokens`), so an answer may take at most
max_length - prompt - end-of-turn tokens, and a conversation generated with --max-length N is not truncated by an
extraction with --max-length N (up to the rare answer whose text encodes to other tokens than were generated).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from dflash.shared.compile_limits import raise_recompile_limit
from dflash.shared.errors import UserError, is_out_of_memory
from dflash.shared.logs import get_logger
from dflash.stage1_extract.conversations import Conversation, chat_token_ids
from dflash.stage1_extract.worker import SampleOutOfMemory, plan_batches

log = get_logger(__name__)

FINISH_STOP, FINISH_LENGTH, FINISH_CONTEXT = "stop", "length", "context_full"
# Why a conversation has no regenerated answer: its first prompt leaves no room for MIN_ANSWER_TOKENS, or it has no
# assistant turn after a prompt.
SKIP_TOO_LONG, SKIP_NOTHING = "prompt_too_long", "no_assistant_turn"
MIN_ANSWER_TOKENS = 2  # what extract needs to keep a sample: 2 supervised tokens (an answer and its end of turn)
REPORT_EVERY_S = 1.0  # how often a batch being generated reports the tokens it has made so far
STATIC_CACHE_STEP = 512  # with `static_cache`, a batch's KV cache length is a multiple of this (batch_cache_len)


@dataclass(frozen=True)
class GenerateSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    max_length: int = 2048  # prompt + answer, in tokens; also bounds the conversation
    max_turns: int | None = None  # regenerate at most this many assistant turns; the conversation ends there
    batch_tokens: int = 65536  # rows x (longest prompt + max_new_tokens) per generate call
    static_cache: bool = False  # fixed-shape batches and KV cache (see the module docstring)
    continuous_batching: bool = False  # transformers' generate_batch (see the module docstring)

    @property
    def cache_len(self) -> int:
        """KV positions per row with `static_cache` that any batch may need: the longest prompt plus the most new
        tokens. It sizes the rows of every static batch (`batch_tokens` over it)."""
        return self.max_length + self.max_new_tokens

    def batch_cache_len(self, needed: int) -> int:
        """KV positions per row of one static batch that needs `needed` (its longest prompt plus its most new
        tokens): rounded up to a multiple of STATIC_CACHE_STEP, at most `cache_len`. Attention reads the whole
        static cache at every step; ShareGPT's first prompts have a median of ~195 tokens, so with prompts sorted by
        length (generate_run) most batches need 1,024 positions instead of 2,560 (at --max-length 2048,
        --max-new-tokens 512): half the cache positions read over a whole run, by a count over 5,876 of its first
        prompts. Each distinct length is one more compiled shape (at most 5 at those settings)."""
        return min(self.cache_len, -(-needed // STATIC_CACHE_STEP) * STATIC_CACHE_STEP)

    def identity(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "seed": self.seed,
                "max_length": self.max_length, "max_turns": self.max_turns}


@dataclass
class _Progress:
    """One conversation being regenerated."""

    conversation: Conversation
    key: str
    messages: list[dict[str, str]] = field(default_factory=list)
    next_index: int = 0  # next original message to look at
    generated_turns: int = 0
    generated_tokens: int = 0
    finish_reason: str = FINISH_STOP
    skip_reason: str = SKIP_TOO_LONG
    done: bool = False

    def advance(self) -> None:
        """Copy original messages until the next assistant turn that has a prompt before it (or the end)."""
        original = self.conversation.messages
        while self.next_index < len(original):
            message = original[self.next_index]
            if message["role"] == "assistant" and self.messages:
                return
            self.messages.append(dict(message))
            self.next_index += 1
        self.done = True

    def record(self) -> dict[str, Any]:
        if self.generated_turns == 0:
            return {"id": self.key, "skipped": self.skip_reason}
        # The conversation ends at its last answer: a user turn after it, whose answer was not generated (its prompt
        # did not fit, or the data ends there), would hold no answer to learn and only lengthen the sample.
        last_answer = max(i for i, message in enumerate(self.messages) if message["role"] == "assistant")
        return {
            "id": self.key,
            "messages": self.messages[: last_answer + 1],
            "dflash": {"source_index": self.conversation.index, "source_id": self.conversation.sample_id,
                       "generated_turns": self.generated_turns, "generated_tokens": self.generated_tokens,
                       "finish_reason": self.finish_reason},
        }


def end_of_turn_tokens(tokenizer: Any) -> int:
    """Tokens the chat template puts after an answer's text (ChatML: `<|im_end|>` and a newline): the rendering of
    a conversation with one answer, less its generation prompt and the answer's own tokens."""
    prompt = [{"role": "user", "content": "Hello."}]
    answer = "Hello! How can I help you today?"
    whole = chat_token_ids(tokenizer, [*prompt, {"role": "assistant", "content": answer}], add_generation_prompt=False)
    opened = chat_token_ids(tokenizer, prompt, add_generation_prompt=True)
    return max(0, len(whole) - len(opened) - len(tokenizer.encode(answer, add_special_tokens=False)))


def answer_budget(settings: GenerateSettings, prompt_tokens: int, end_tokens: int) -> int:
    """New tokens an answer to a prompt of `prompt_tokens` may take: --max-new-tokens, or less so that the prompt,
    the answer and its `end_tokens` fit --max-length. Below MIN_ANSWER_TOKENS the prompt does not fit."""
    return min(settings.max_new_tokens, settings.max_length - prompt_tokens - end_tokens)


def first_prompt_tokens(tokenizer: Any, conversation: Conversation) -> int | None:
    """Tokens of the prompt of the first answer that is regenerated (None: the conversation has no answer to
    regenerate, SKIP_NOTHING): with `prompt_fits`, what says before any generation which conversations are skipped."""
    state = _Progress(conversation, conversation.sample_id)
    state.advance()
    return None if state.done else len(chat_token_ids(tokenizer, state.messages, add_generation_prompt=True))


def prompt_fits(settings: GenerateSettings, prompt_tokens: int, end_tokens: int) -> bool:
    """Whether a prompt leaves room for an answer of MIN_ANSWER_TOKENS (else SKIP_TOO_LONG, or FINISH_CONTEXT for
    a later turn)."""
    return answer_budget(settings, prompt_tokens, end_tokens) >= MIN_ANSWER_TOKENS


class _TokenCounter:
    """A transformers streamer (`generate` calls `put` with the prompt, then with each step's new token of every
    row) that counts the answer tokens of a batch while it is generated and reports them about once a second, so
    the progress moves during a long batch instead of only when it ends. A row's tokens count up to its budget
    and through its first stop token, as `_generate` counts them afterwards."""

    def __init__(self, budgets: list[int], stops: list[int], report: Callable[[int], None]) -> None:
        self.budgets = torch.tensor(budgets)
        self.stops = torch.tensor(stops)
        self.finished = torch.zeros(len(budgets), dtype=torch.bool)
        self.step = -1  # the first `put` is the prompt
        self.counted = self.reported = 0
        self.report = report
        self.last_report = time.monotonic()

    def put(self, value: torch.Tensor) -> None:
        self.step += 1
        if self.step == 0:
            return
        tokens = value.reshape(-1)[: len(self.budgets)]  # a static batch's filler rows come last
        live = ~self.finished & (self.step <= self.budgets)
        self.counted += int(live.sum())
        self.finished |= torch.isin(tokens, self.stops)
        if time.monotonic() - self.last_report >= REPORT_EVERY_S:
            self.report(self.counted - self.reported)
            self.reported, self.last_report = self.counted, time.monotonic()

    def end(self) -> None:
        pass


class ConversationRegenerator:
    """Holds the target and tokenizer; `regenerate` turns conversations into output records. `report(conversations,
    tokens, skipped)` is told of finished conversations and generated tokens as they come (tokens also while a
    batch is being generated), and of conversations skipped because their first prompt is too long."""

    def __init__(self, model: Any, tokenizer: Any, stop_token_ids: list[int], settings: GenerateSettings,
                 report: Callable[[int, int, int], None] | None = None) -> None:
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.stops = list(stop_token_ids) or [int(tokenizer.eos_token_id)]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        # The target's own next-token choice (greedy, or sampled at --temperature) and nothing else: transformers'
        # `generate` fills every setting its generation config leaves unset from the model's generation_config.json,
        # which may ask for a repetition penalty (Qwen2.5-Instruct's 1.05), banned n-grams, beams or suppressed
        # tokens; continuous batching applies only what it is given. Both paths get a neutral one, so their answers
        # are those plain decoding verifies in speculative decoding.
        model.generation_config = GenerationConfig(eos_token_id=self.stops, pad_token_id=self.pad_id)
        self.settings = settings
        self.end_tokens = end_of_turn_tokens(tokenizer)
        self.report = report or (lambda conversations, tokens, skipped: None)
        self.device = next(model.parameters()).device
        self.batch_tokens = settings.batch_tokens
        self.oom_retries = 0
        # transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        if settings.static_cache:
            # One compiled decoding step per (rows, cache length): every length batch_cache_len can give, again for
            # each row count out-of-memory retries may halve to; past torch's recompile limit (8) a new shape would
            # run uncompiled without a word (e.g. --max-length 4096 --max-new-tokens 1024 allows 10 lengths).
            lengths = -(-settings.cache_len // STATIC_CACHE_STEP)
            row_counts = self._static_rows().bit_length()  # the rows, halved down to one
            raise_recompile_limit(lengths * row_counts + 4)

    def regenerate(self, conversations: list[tuple[str, Conversation]]) -> list[dict[str, Any]]:
        """(key, conversation) pairs -> one output record each, in the same order."""
        states = [_Progress(conversation, key) for key, conversation in conversations]
        for state in states:
            state.advance()
            if state.done:  # nothing to regenerate (e.g. only an opening assistant turn)
                state.skip_reason = SKIP_NOTHING
                self.report(0, 0, 1)
        while waiting := [s for s in states if not s.done]:
            prompts = []
            for state in waiting:
                ids = chat_token_ids(self.tokenizer, state.messages, add_generation_prompt=True)
                if not prompt_fits(self.settings, len(ids), self.end_tokens):
                    state.done, state.finish_reason = True, FINISH_CONTEXT
                    self.report(*((1, 0, 0) if state.generated_turns else (0, 0, 1)))
                else:
                    prompts.append((state, ids))
            prompts.sort(key=lambda item: (-len(item[1]), item[0].conversation.index))
            for batch in self._plan(prompts):
                self._generate_with_backoff([prompts[i] for i in batch])
        return [state.record() for state in states]

    def _plan(self, prompts: list[tuple[_Progress, list[int]]]) -> list[list[int]]:
        if self.settings.continuous_batching:  # it schedules the prompts itself
            return [list(range(len(prompts)))]
        if self.settings.static_cache:
            rows = self._static_rows()
            return [list(range(i, min(i + rows, len(prompts)))) for i in range(0, len(prompts), rows)]
        lengths = [len(ids) + self._budget(ids) for _, ids in prompts]
        return plan_batches(lengths, self.batch_tokens, 1)

    def _static_rows(self) -> int:
        """Rows of every static batch (the token budget may have been halved by an out-of-memory retry)."""
        return max(1, self.batch_tokens // self.settings.cache_len)

    def static_cache(self, needed: int) -> Any:
        """A StaticCache of `GenerateSettings.batch_cache_len(needed)` positions per row for one batch, made here:
        with `cache_implementation="static"` transformers gives every later call of a model at least the longest
        cache it has had (`_previous_max_cache_length`), so a worker whose first batch needs the longest cache (the
        chunks come longest prompts first) would keep it for every batch. Its decoding step compiles with static
        shapes (`CompileConfig(dynamic=False)`), one CUDA graph set per length, instead of recompiling with a
        symbolic length at the second length (transformers' default)."""
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=self.settings.batch_cache_len(needed))

    def _shape_text(self, batch: list[tuple[_Progress, list[int]]]) -> str:
        """How a batch was laid out, for the log: rows, longest prompt and, with a static cache, its length."""
        width = max(len(ids) for _, ids in batch)
        if self.settings.continuous_batching:
            return f"continuous batching, longest prompt {width}"
        if not self.settings.static_cache:
            return f"longest prompt {width}"
        needed = width + max(self._budget(ids) for _, ids in batch)
        return (f"{max(len(batch), self._static_rows())} rows, longest prompt {width}, "
                f"{self.settings.batch_cache_len(needed)} KV positions")

    def _budget(self, prompt: list[int]) -> int:
        return answer_budget(self.settings, len(prompt), self.end_tokens)

    def _generate_with_backoff(self, batch: list[tuple[_Progress, list[int]]]) -> None:
        """Generate one batch; on out-of-memory halve it and retry both halves, instead of dying."""
        counter = _TokenCounter([self._budget(ids) for _, ids in batch], self.stops,
                                lambda tokens: self.report(0, tokens, 0))
        started = time.monotonic()
        try:
            answers = self._generate(batch, counter)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            self.report(0, -counter.reported, 0)  # the tokens it reported are not kept
            if not is_out_of_memory(error):
                raise
            if len(batch) == 1:
                state, prompt = batch[0]
                raise SampleOutOfMemory(
                    f"conversation {state.key} ({len(prompt):,} prompt tokens + up to {self._budget(prompt):,} "
                    f"new) does not fit in the memory of {self.device} even alone: lower --max-length (now "
                    f"{self.settings.max_length}) or --max-new-tokens (now {self.settings.max_new_tokens}) (a new "
                    "--out, or --overwrite), or generate on a device with more memory") from error
            self.oom_retries += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.batch_tokens = max(64, self.batch_tokens // 2)
            log.warning("out of memory generating %d answers: retrying as two halves (token budget now %d)",
                        len(batch), self.batch_tokens)
            half = len(batch) // 2
            self._generate_with_backoff(batch[:half])
            self._generate_with_backoff(batch[half:])
            return
        finished, tokens = 0, -counter.reported  # the batch's tokens, less those reported while it ran
        log.info("batch of %d answers (%s): %d new tokens in %.1f s", len(batch), self._shape_text(batch),
                 sum(count for _, count, _ in answers), time.monotonic() - started)
        for (state, _), (text, count, reason) in zip(batch, answers):
            state.messages.append({"role": "assistant", "content": text})
            state.next_index += 1
            state.generated_turns += 1
            state.generated_tokens += count
            tokens += count
            if reason == FINISH_STOP and state.generated_turns != self.settings.max_turns:
                state.advance()
            else:
                state.done, state.finish_reason = True, reason
            finished += state.done
        self.report(finished, tokens, 0)

    def _generate(self, batch: list[tuple[_Progress, list[int]]], streamer: _TokenCounter | None = None
                  ) -> list[tuple[str, int, str]]:
        """(text, generated tokens, finish reason) per row; `streamer` counts the tokens while they are made."""
        from transformers import CompileConfig, GenerationConfig

        if self.settings.continuous_batching:
            return self._generate_continuous(batch)
        width = max(len(ids) for _, ids in batch)
        budgets = [self._budget(ids) for _, ids in batch]
        new_tokens = max(budgets)
        static = self.settings.static_cache
        rows = max(len(batch), self._static_rows()) if static else len(batch)
        # Left padding: every row's answer starts at column `width`. Static batches are filled up to `rows` with
        # copies of the last prompt, so every batch has the shape the compiled decoding step was made for.
        filled = [ids for _, ids in batch] + [batch[-1][1]] * (rows - len(batch))
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for row, ids in enumerate(filled):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        sampling = self.settings.temperature > 0
        config = GenerationConfig(
            max_new_tokens=new_tokens, do_sample=sampling, temperature=self.settings.temperature if sampling else None,
            top_k=None, top_p=None, eos_token_id=self.stops, pad_token_id=self.pad_id,
            compile_config=CompileConfig(dynamic=False) if static else None,
        )
        if sampling:
            torch.manual_seed(_batch_seed(self.settings.seed, [state.key for state, _ in batch]))
        cache = {self._cache_kwarg: self.static_cache(width + new_tokens)} if static else {}
        output = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                     generation_config=config, streamer=streamer, **cache)
        return [self._answer(output[row, width:].tolist(), budget) for row, budget in enumerate(budgets)]

    def _generate_continuous(self, batch: list[tuple[_Progress, list[int]]]) -> list[tuple[str, int, str]]:
        """`_generate` through transformers' continuous batching (`generate_batch`). It logs a request's failure
        (an out-of-memory error included) instead of raising: any failed or missing answer raises here."""
        from transformers import GenerationConfig
        from transformers import ContinuousBatchingConfig

        budgets = [self._budget(ids) for _, ids in batch]
        # Greedy only (the CLI refuses a temperature): its sampling would depend on its thread's batching.
        config = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, top_k=None, top_p=None,
                                  eos_token_id=self.stops, pad_token_id=self.pad_id)
        if self.device.type == "cuda":  # the cache from the free GPU memory (one worker per GPU)
            batching = ContinuousBatchingConfig()
        else:  # the token budget (transformers would size it from the machine's memory, and allocate it all)
            page = 64
            # A cache page's tokens: `page_size`, `block_size` in the transformers before its rename (the GPU
            # machines' 5.17 runs generate; pyproject's floor is for the decode loop's sliding windows).
            page_field = "page_size" if "page_size" in {f.name for f in fields(ContinuousBatchingConfig)} \
                else "block_size"
            batching = ContinuousBatchingConfig(**{page_field: page}, max_batch_tokens=min(4096, self.batch_tokens),
                                                num_blocks=max(16, -(-self.batch_tokens // page)))
        results = self.model.generate_batch(inputs=[ids for _, ids in batch], generation_config=config,
                                            continuous_batching_config=batching, warmup=self.device.type == "cuda",
                                            progress_bar=False)
        outputs = list(results.values())
        failed = [output.error for output in outputs if output.error is not None]
        if len(outputs) != len(batch) or failed:
            reason = failed[0] if failed else f"{len(batch) - len(outputs)} answers missing"
            if "out of memory" in reason.lower():  # it sizes its cache from the free memory: halving would not help
                raise UserError(f"continuous batching ran out of memory on {self.device} ({reason.splitlines()[0]}):"
                                " generate without --continuous-batching (its batches halve on out-of-memory), or "
                                "lower --max-length or --max-new-tokens; finished conversations are kept")
            raise RuntimeError(f"continuous batching failed for {len(failed) or len(batch) - len(outputs)} of "
                               f"{len(batch)} prompts: {reason}")
        return [self._answer(list(output.generated_tokens), budget) for output, budget in zip(outputs, budgets)]

    def _answer(self, generated: list[int], budget: int) -> tuple[str, int, str]:
        """(text, tokens counted, finish reason) of a row's new tokens, the first `budget` of them (a batch decodes
        its rows to the largest budget): up to and through its first stop token, or all of them when it has none
        (the token limit)."""
        generated = generated[:budget]
        stop_at = next((i for i, token in enumerate(generated) if token in self.stops), None)
        if stop_at is not None:
            return self.tokenizer.decode(generated[:stop_at], skip_special_tokens=True), stop_at + 1, FINISH_STOP
        return self.tokenizer.decode(generated, skip_special_tokens=True), len(generated), FINISH_LENGTH


def _batch_seed(seed: int, keys: list[str]) -> int:
    """Sampling seed of one batch: the same batch of the same run draws the same answers."""
    digest = hashlib.sha256(f"{seed}\0{chr(0).join(keys)}".encode()).digest()
    return int.from_bytes(digest[:7], "little")
