"""Speculative decoding with a DFlash drafter (the reference inference loop), plus the two baselines it is compared to.

`speculative_generate` follows the semantics of z-lab `dflash_generate`, batch size 1:

1. Prefill: the target runs the prompt with its KV cache; forward hooks on the decoder layers ``layer_ids`` capture
   the context features (the raw layer outputs, what HF calls ``hidden_states[i + 1]``, exactly as stage 1 caches
   them). The target's next token is the first "bonus" token. The features of every prompt position become the
   drafter's context (projected once through ``fc``/``hidden_norm`` and kept: the drafter's only cache).
2. Draft: one drafter forward over the block [bonus, MASK x (B - 1)] at positions start..start + B - 1 with the
   context of positions 0..start - 1; offsets 1..B-1 give the draft tokens (argmax, or samples at temperature T).
3. Verify: one target forward over the whole block with its KV cache. Greedy: accept the longest prefix where
   draft token k equals the target's argmax at block position k - 1; emit the accepted drafts plus the target's own
   next token. Sampling: standard speculative rejection sampling (accept d_k with probability
   min(1, p(d_k) / q(d_k)); on the first rejection sample from norm(max(0, p - q)); if all are accepted sample the
   extra token from p), so the output is distributed exactly as the target's own samples.
4. The accepted positions' (bonus + accepted drafts) target features are appended to the drafter context; the
   target cache is rolled back to the accepted length (`TargetRunner.rollback`): KV layers are cropped
   (`crop_cache`; sliding-window layers record their past until then), recurrent layers of hybrid linear-attention
   targets (Qwen3-Next, Qwen3.5), which cannot be cropped, are restored from a snapshot taken before the block and
   fed the accepted tokens again; a cache that refuses `crop` is rebuilt from the kept tokens.
   tau = mean over steps of accepted + 1.

Greedy output equals plain greedy decoding (`greedy_generate`) token for token, up to floating-point near-ties
(the target verifies a block of B tokens in one forward, plain decoding one token at a time).

Cache cropping: transformers >= 5.15 `Cache.crop(n)` takes the number of tokens to REMOVE as a negative integer and
rejects a positive n (older versions read a positive n as the length to keep, and a negative one as the count to
remove). `crop_cache(cache, keep)` therefore always calls ``crop(-(length - keep))``, which means the same on both,
never ``crop(0)`` (= "keep 0 tokens" on old versions), and falls back to slicing the layers' key/value tensors.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.shared.target_layers import LayerCapture


@dataclass
class SpecResult:
    """What one generation produced: new tokens only, per-step accepted draft counts, target steps, wall time."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    target_forwards: int | None = None  # prompt lookup: target forward calls made by `generate` (prefill included)

    @property
    def tau(self) -> float:
        """Mean acceptance length: mean over steps of accepted + 1 (nan without steps)."""
        if not self.accepted:
            return float("nan")
        return sum(a + 1 for a in self.accepted) / len(self.accepted)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


# ---------------------------------------------------------------------------
# Target helpers: cache creation / cropping, layer hooks, one forward
# ---------------------------------------------------------------------------


def _forward_params(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def new_cache(model: nn.Module) -> Any:
    """An empty DynamicCache for the target (layer types from its config where the version supports it)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # versions whose DynamicCache takes no config
        cache = DynamicCache()
    # Sliding-window layers keep what a rollback needs until `crop`; recurrent layers are snapshotted instead (their
    # past recording covers only the conv state, and it grows without bound when nothing is cropped).
    for layer in getattr(cache, "layers", None) or []:
        if hasattr(layer, "activate_past_recording") and not has_recurrent_state(layer):
            layer.activate_past_recording()
    return cache


def has_recurrent_state(layer: Any) -> bool:
    """A cache layer with a state that `crop` cannot rewind: linear attention / SSM (conv and recurrent states)."""
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: Any, keep: int) -> None:
    """Cut the cache back to its first ``keep`` positions, on old and new transformers alike.

    ``crop(-k)`` removes k tokens on every version that has `crop` (a positive argument is an absolute length before
    5.15 and an error after); ``crop(0)`` is never called (it means "keep nothing" on old versions). If `crop` is
    missing or leaves the wrong length, the layers' key/value tensors are sliced directly.
    """
    current = cache_length(cache)
    if keep > current:
        raise ValueError(f"cannot crop a cache of {current} positions to {keep}")
    remove = current - keep
    if remove == 0:
        return
    if hasattr(cache, "crop"):
        try:
            cache.crop(-remove)
        except (ValueError, RuntimeError, NotImplementedError):
            pass
        if cache_length(cache) == keep:
            return
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if any(getattr(layer, "is_sliding", False) or has_recurrent_state(layer) for layer in layers):
            raise RuntimeError(f"{type(cache).__name__} refused crop and holds windowed or recurrent layers")
        for layer in layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :keep, :]
                layer.values = layer.values[..., :keep, :]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = keep
    elif hasattr(cache, "key_cache"):  # transformers 4.4x-4.5x
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = cache.key_cache[i][..., :keep, :]
            cache.value_cache[i] = cache.value_cache[i][..., :keep, :]
        if hasattr(cache, "_seen_tokens"):
            cache._seen_tokens = keep
    if cache_length(cache) != keep:
        raise RuntimeError(f"could not crop the KV cache ({type(cache).__name__}) to {keep} positions")


class TargetRunner:
    """Runs the target with its KV cache; optionally captures the outputs of ``layer_ids`` through forward hooks."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int] = ()) -> None:
        self.target = target
        self.layer_ids = list(layer_ids)
        self.device = next(target.parameters()).device
        self.cache = new_cache(target)
        params = _forward_params(target)
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._capture: LayerCapture | None = None
        self.history: list[int] = []  # the token ids the cache holds, in order (for recomputation)
        self._snapshot: dict[int, Any] | None = None  # recurrent layers as they were before the block being verified
        self._block_start = 0  # the cache length when that snapshot was taken

    @contextmanager
    def hooked(self) -> Iterator[TargetRunner]:
        """Capture the outputs of `layer_ids` in every forward inside (the hooks stage 1 extracts with)."""
        self._capture = LayerCapture(self.target, self.layer_ids)
        try:
            yield self
        finally:
            self._capture.remove()
            self._capture = None

    def forward(self, ids: Sequence[int] | Tensor, start: int, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """Run positions start..start + len(ids) - 1 (the cache must hold exactly ``start`` positions).

        Returns float32 logits [L, V] (or [1, V] with ``last_only``) and the captured features [1, L, n * H] (None
        without layer_ids).
        """
        if cache_length(self.cache) != start:
            raise RuntimeError(f"target cache holds {cache_length(self.cache)} positions, expected {start}")
        ids_list = [int(t) for t in (ids.reshape(-1).tolist() if isinstance(ids, Tensor) else ids)]
        if self.layer_ids and self._capture is None:
            raise RuntimeError("TargetRunner.forward with layer_ids needs `with runner.hooked():`")
        if self._capture is None or not self.layer_ids:
            out = self._run(ids_list, start, last_only)
            features = None
        else:
            with self._capture.active():
                out = self._run(ids_list, start, last_only)
            features = self._capture.features()
        logits = out.logits[0]
        if last_only:
            logits = logits[-1:]
        return logits.float(), features

    def _run(self, ids: list[int], start: int, last_only: bool = False) -> Any:
        """One target forward of ``ids`` at positions start.. through the cache (extends `history`)."""
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache, "use_cache": True}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.target(input_ids=ids_t, position_ids=positions, **kwargs)
        self.history.extend(ids)
        return out

    def verify(self, ids: Sequence[int], start: int) -> tuple[Tensor, Tensor | None]:
        """`forward` of a block that `rollback` may later cut: first snapshots the layers `crop` cannot rewind
        (recurrent states of linear-attention layers; small and of fixed size, unlike a KV cache)."""
        layers = getattr(self.cache, "layers", None) or []
        recurrent = {i: layer for i, layer in enumerate(layers) if has_recurrent_state(layer)}
        self._snapshot = {i: copy.deepcopy(layer) for i, layer in recurrent.items()} if recurrent else None
        self._block_start = start
        return self.forward(ids, start)

    def rollback(self, keep: int) -> None:
        """Make the cache hold exactly its first ``keep`` positions, as if only they had been fed.

        KV layers (full and, with past recording, sliding-window) are cropped. Recurrent layers cannot be cropped:
        they are restored from the snapshot taken by `verify` (the state before the block) and the kept part of
        the block is fed again. A cache whose `crop` refuses is rebuilt by feeding the kept tokens from scratch.
        Either way the result is what a forward of the kept prefix alone gives (up to kernel shapes).
        """
        current = cache_length(self.cache)
        if keep > current:
            raise ValueError(f"cannot roll a cache of {current} positions back to {keep}")
        snapshot, self._snapshot = self._snapshot, None
        if keep == current:
            return
        kept = self.history[:keep]
        if snapshot is not None:
            start = self._block_start
            if keep < start:
                raise ValueError(f"cannot roll back to {keep}: the snapshot holds position {start} onwards")
            for index, layer in snapshot.items():
                self.cache.layers[index] = layer
            for index, layer in enumerate(self.cache.layers):
                if index not in snapshot and layer.get_seq_length() > start:
                    layer.crop(start - layer.get_seq_length())
            del self.history[start:]
            if keep > start:
                self._run(kept[start:], start)
        else:
            try:
                crop_cache(self.cache, keep)
                del self.history[keep:]
            except (RuntimeError, ValueError, NotImplementedError):
                if len(self.history) != current:
                    raise
                self.cache = new_cache(self.target)
                self.history = []
                self._run(kept, 0)
        if cache_length(self.cache) != keep:
            raise RuntimeError(f"could not roll the target cache ({type(self.cache).__name__}) back to {keep}")


# ---------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------


def _projected_forward(draft: nn.Module, noise: Tensor, context: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """DFlashDraftModel.forward with an already projected context (hidden_norm(fc(features))) and no mask."""
    backend = draft._backend(noise.device)
    all_k_pos = torch.cat([k_pos, q_pos], dim=1)
    q_rope = draft.rotary_emb(noise, q_pos)
    k_rope = draft.rotary_emb(noise, all_k_pos)
    masks = {t: draft._prepare_mask(None, draft._window(t), q_pos, all_k_pos, backend) for t in set(draft.layer_types)}
    hidden = noise
    for layer, layer_type in zip(draft.layers, draft.layer_types):
        hidden = layer(hidden, context, q_rope, k_rope, masks[layer_type], backend)
    return draft.norm(hidden)


class DraftRunner:
    """The drafter side of the loop: its context (projected once per new feature row) and one block proposal."""

    def __init__(self, draft: nn.Module, embed_weight: Tensor, lm_head_weight: Tensor,
                 cache_context: bool = True) -> None:
        self.draft = draft
        param = next(draft.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = int(draft.block_size)
        mask_id = draft.mask_token_id
        if mask_id is None:
            raise ValueError("the drafter config has no dflash_config.mask_token_id")
        self.mask_token_id = int(mask_id)
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        # The projected-context shortcut needs the internals of our DFlashDraftModel; anything else is recomputed.
        self.cache_context = cache_context and all(
            hasattr(draft, name) for name in ("project_context", "_backend", "_prepare_mask", "_window", "rotary_emb")
        )
        self.context: Tensor | None = None  # projected [1, C, H] when cached, else raw features [1, C, n * H]

    @property
    def context_length(self) -> int:
        return 0 if self.context is None else int(self.context.shape[1])

    def extend(self, features: Tensor) -> None:
        """Append the target features [1, n, n_layers * H] of the next n positions to the drafter context."""
        features = features.to(self.device, self.dtype)
        if self.cache_context:
            features = self.draft.project_context(features)
        self.context = features if self.context is None else torch.cat([self.context, features], dim=1)

    def block_hidden(self, bonus: int, start: int) -> Tensor:
        """Drafter hidden states [1, B, H] of the block [bonus, MASK...] at positions start..start + B - 1."""
        if self.context_length != start:
            raise RuntimeError(f"drafter context holds {self.context_length} positions, expected {start}")
        ids = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=self.embed_weight.device)
        ids[0, 0] = bonus
        noise = F.embedding(ids, self.embed_weight).to(self.device, self.dtype)
        q_pos = torch.arange(start, start + self.block_size, device=self.device).unsqueeze(0)
        k_pos = torch.arange(start, device=self.device).unsqueeze(0)
        assert self.context is not None
        if self.cache_context:
            return _projected_forward(self.draft, noise, self.context, q_pos, k_pos)
        return self.draft(noise, self.context, q_pos, k_pos)

    def propose(self, bonus: int, start: int) -> Tensor:
        """float32 logits [B - 1, V] of block offsets 1..B-1 (the draft positions)."""
        hidden = self.block_hidden(bonus, start)[0, 1:]
        weight = self.lm_head_weight
        return (hidden.to(weight.device, weight.dtype) @ weight.T).float()


# ---------------------------------------------------------------------------
# Sampling helpers
# ---------------------------------------------------------------------------


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One sample per row of probs [N, V] -> [N] (on the generator's device when one is given)."""
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _uniform(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=gen_device)


def _pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy argmax or a temperature sample from logits [V]."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    return int(_sample(torch.softmax(logits[None] / temperature, dim=-1), generator)[0])


def verify_greedy(draft_tokens: list[int], target_logits: Tensor) -> tuple[int, int]:
    """(accepted, next token): longest prefix with d_k == argmax at block position k - 1; next = argmax there."""
    posterior = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == posterior[accepted]:
        accepted += 1
    return accepted, posterior[accepted]


def verify_sampling(draft_tokens: list[int], draft_probs: Tensor, target_probs: Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling. draft_probs [B-1, V] (q), target_probs [B, V] (p at block positions 0..B-1).

    d_k is accepted with probability min(1, p_{k-1}(d_k) / q_k(d_k)); at the first rejection the next token comes
    from norm(max(0, p - q)); if all drafts pass it comes from p at the last block position.
    """
    n = len(draft_tokens)
    index = torch.tensor(draft_tokens, dtype=torch.long, device=draft_probs.device).unsqueeze(-1)
    q = draft_probs.gather(-1, index).squeeze(-1)
    p = target_probs[:n].to(draft_probs.device).gather(-1, index).squeeze(-1)
    ratio = (p / q.clamp_min(1e-30)).clamp(max=1.0)
    passed = (_uniform(n, generator, draft_probs.device).to(ratio.device) < ratio).tolist()
    accepted = 0
    while accepted < n and passed[accepted]:
        accepted += 1
    if accepted == n:
        return accepted, int(_sample(target_probs[n:n + 1], generator)[0])
    residual = (target_probs[accepted].to(draft_probs.device) - draft_probs[accepted]).clamp_min(0.0)
    total = residual.sum()
    if not bool(total > 0):  # p == q exactly: rejection has probability 0, kept for numerical safety
        residual, total = target_probs[accepted], target_probs[accepted].sum()
    return accepted, int(_sample((residual / total)[None], generator)[0])


def _clip_step(emitted: list[int], room: int, stops: set[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens after the first stop token and to ``room`` tokens; True if generation ends here."""
    for i, token in enumerate(emitted):
        if token in stops:
            emitted = emitted[: i + 1]
            return emitted[:room], True
    if len(emitted) >= room:
        return emitted[:room], True
    return emitted, False


# ---------------------------------------------------------------------------
# Generation loops
# ---------------------------------------------------------------------------


def _prompt_list(input_ids: Tensor | Sequence[int]) -> list[int]:
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size 1 only; got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    input_ids: Tensor | Sequence[int],
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    cache_context: bool = True,
) -> SpecResult:
    """DFlash speculative decoding of one prompt (batch size 1); see the module docstring.

    ``embed_weight`` / ``lm_head_weight``: the target's input embedding and LM head matrices [V, H].
    ``layer_ids``: the target layers whose outputs form the drafter context (the drafter's target_layer_ids).
    Returns the new tokens (cut after the first stop token, which is kept, and to ``max_new_tokens``), and per step
    the accepted draft count (a step cut short counts what it emitted, minus one).
    """
    prompt = _prompt_list(input_ids)
    if not prompt:
        raise ValueError("empty prompt")
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    stops = {int(t) for t in stop_token_ids}
    runner = TargetRunner(target, layer_ids)
    drafter = DraftRunner(draft, embed_weight, lm_head_weight, cache_context=cache_context)
    sampling = temperature > 0
    tokens: list[int] = []
    accepted: list[int] = []
    with runner.hooked():
        _sync(runner.device)
        started = time.perf_counter()
        logits, features = runner.forward(prompt, 0, last_only=True)
        bonus = _pick(logits[-1], temperature, generator)
        tokens.append(bonus)
        assert features is not None
        drafter.extend(features)
        start = len(prompt)
        done = bonus in stops or len(tokens) >= max_new_tokens
        while not done:
            draft_logits = drafter.propose(bonus, start)
            if sampling:
                draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
                draft_tokens = _sample(draft_probs, generator).tolist()
            else:
                draft_tokens = draft_logits.argmax(-1).tolist()
            target_logits, features = runner.verify([bonus, *draft_tokens], start)
            if sampling:
                target_probs = torch.softmax(target_logits / temperature, dim=-1)
                n_acc, next_token = verify_sampling(draft_tokens, draft_probs, target_probs, generator)
            else:
                n_acc, next_token = verify_greedy(draft_tokens, target_logits)
            emitted, done = _clip_step([*draft_tokens[:n_acc], next_token], max_new_tokens - len(tokens), stops)
            tokens.extend(emitted)
            accepted.append(len(emitted) - 1)
            if done:
                break
            assert features is not None
            drafter.extend(features[:, : n_acc + 1])
            start += n_acc + 1
            runner.rollback(start)
            bonus = next_token
        _sync(runner.device)
        seconds = time.perf_counter() - started
    return SpecResult(tokens=tokens, accepted=accepted, steps=len(accepted), seconds=seconds)


@torch.inference_mode()
def greedy_generate(
    target: nn.Module,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Plain autoregressive decoding with a KV cache (greedy by default): the baseline and the losslessness reference.

    Every target step emits one token, so ``accepted`` is all zeros (tau = 1).
    """
    prompt = _prompt_list(input_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    stops = {int(t) for t in stop_token_ids}
    runner = TargetRunner(target)
    _sync(runner.device)
    started = time.perf_counter()
    logits, _ = runner.forward(prompt, 0, last_only=True)
    token = _pick(logits[-1], temperature, generator)
    tokens = [token]
    position = len(prompt)
    while token not in stops and len(tokens) < max_new_tokens:
        logits, _ = runner.forward([token], position, last_only=True)
        position += 1
        token = _pick(logits[-1], temperature, generator)
        tokens.append(token)
    _sync(runner.device)
    seconds = time.perf_counter() - started
    return SpecResult(tokens=tokens, accepted=[0] * (len(tokens) - 1), steps=len(tokens) - 1, seconds=seconds)


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
    prompt = _prompt_list(input_ids)
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
        _sync(device)
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
        _sync(device)
        seconds = time.perf_counter() - started
    finally:
        handle.remove()
    new = [int(t) for t in out[0, len(prompt):].tolist()]
    tokens, _ = _clip_step(new, max_new_tokens, set(stops))
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
