"""The target's top-k next-token distribution at chosen positions, for `dflash extract --store-target-topk K`.

Logits are the target's own: its output head (`get_output_embeddings()`, the LM head) applied to the decoder's
last hidden state (after the final norm), in the model's dtype, followed by the family's final logit transform
where it has one (Gemma's soft-capping, Granite's and Cohere's scaling; `logit_transform`). `TargetTopK.check`
compares them with the model's own forward on a short probe and refuses a target whose logits come out otherwise.
Log-probabilities are computed in float32 against the full vocabulary (logit - logsumexp).

Memory: only the positions whose next token is supervised are scored, and in chunks of rows sized so that one
chunk's buffers (float32 logits, the int64 sort keys and their int64 temporary: ~20 bytes per vocabulary entry,
counted as 24) stay within CHUNK_BYTES = 512 MiB: 455 rows of SmolLM2's 49,152-token vocabulary, 147 of Qwen3's
151,936. The [tokens, vocab] logits never exist whole (a 32,768-token batch of Qwen3 would take 20 GB in float32);
512 MiB is below the MLP activations of a 32K-token batch of an 8B target (~0.8 GB), so the chunks do not raise
the forward's peak, and a chunk's LM head matmul (147 x 4096 x 151,936) is still large enough to keep a GPU busy.

Order: by log-probability, ties by id (the lower first). bf16 logits tie often (a SmolLM2 top-33 holds ~18 ties on
average), and `torch.topk` leaves the order of ties open, so the top-k is taken over int64 keys that combine the
logit's order-preserving bits with the id: the stored ids are a function of the logits alone, on any device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dflash.shared.errors import UserError

CHUNK_BYTES = 512 << 20
BYTES_PER_LOGIT = 24  # float32 logits (4) + int64 keys (8) + their int64 temporary (8), rounded up
FLOAT16_LOWEST = -65504.0


def logit_transform(config: Any) -> Any:
    """The transform a transformers causal LM applies to `lm_head(hidden)` before returning its logits, read from
    its config (None: none). Known: final_logit_softcapping (Gemma 2/3: cap * tanh(logits / cap)), logits_scaling
    (Granite: logits / s), logit_scale (Cohere: logits * s); `TargetTopK.check` catches any other."""
    config = getattr(config, "text_config", None) or config
    cap = getattr(config, "final_logit_softcapping", None)
    divide = getattr(config, "logits_scaling", None)
    multiply = getattr(config, "logit_scale", None)

    def transform(logits: Tensor) -> Tensor:
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if divide is not None:
            logits = logits / divide
        if multiply is not None:
            logits = logits * multiply
        return logits

    return transform if cap is not None or divide is not None or multiply is not None else None


def order_keys(logits: Tensor) -> Tensor:
    """int64 [n, V] keys whose descending order is (logit descending, id ascending): the float32 bits mapped to an
    order-preserving integer (negative floats get their magnitude bits flipped; -0.0 is +0.0), times 2**32, plus
    2**32 - 1 - id. Built in place: one int64 temporary beside the keys."""
    keys = logits.float().contiguous().view(torch.int32).to(torch.int64)
    keys[keys == -(1 << 31)] = 0  # -0.0 -> +0.0, so the two tie
    flip = keys >> 63  # -1 for negative floats, else 0
    keys ^= flip.bitwise_and_(0x7FFFFFFF)
    del flip
    ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
    return keys.mul_(1 << 32).add_((1 << 32) - 1 - ids)


class TargetTopK:
    """Scores final hidden states with the target's LM head; `__call__` gives each row's top-k (ids int32 [n, K],
    log-probs float16 [n, K]), computed in chunks of `chunk_rows` rows."""

    def __init__(self, model: Any, k: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.model = model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise UserError(f"{type(model).__name__} has no output embeddings (LM head): --store-target-topk needs one")
        self.vocab_size = int(self.head.weight.shape[0])
        if not 1 <= k <= self.vocab_size:
            raise UserError(f"--store-target-topk {k}: choose K between 1 and the target's vocabulary size "
                            f"({self.vocab_size})")
        self.k = int(k)
        self.transform = logit_transform(model.config)
        self.chunk_rows = max(1, chunk_bytes // (BYTES_PER_LOGIT * self.vocab_size))

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's logits (model dtype) of final hidden states [n, H]."""
        logits = self.head(hidden)
        return logits if self.transform is None else self.transform(logits)

    def __call__(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        count = hidden.shape[0]
        ids = torch.empty((count, self.k), dtype=torch.int32, device=hidden.device)
        logprobs = torch.empty((count, self.k), dtype=torch.float16, device=hidden.device)
        with torch.inference_mode():
            for start in range(0, count, self.chunk_rows):
                end = min(start + self.chunk_rows, count)
                logits = self.logits(hidden[start:end]).float()
                top = torch.topk(order_keys(logits), self.k, dim=-1, sorted=True).indices
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                ids[start:end] = top.to(torch.int32)
                logprobs[start:end] = (logits.gather(1, top) - lse).clamp_min(FLOAT16_LOWEST).to(torch.float16)
                del logits, top
        return ids, logprobs

    def check(self) -> None:
        """Refuse a target whose forward's logits are not `logits(decoder last hidden state)` (a logit transform
        this module does not know): one short forward of the whole model."""
        weight = self.head.weight
        ids = torch.tensor([[1, 2, 3, min(1000, self.vocab_size - 1), 5, 6]], device=weight.device)
        with torch.inference_mode():
            direct = self.model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
            ours = self.logits(hidden).float()
        scale = direct.abs().amax().clamp_min(1e-6)
        if ours.shape != direct.shape or bool(((ours - direct).abs() > 0.02 * scale).any()):
            raise UserError(f"{type(self.model).__name__}: its output logits are not its LM head applied to the final "
                            "hidden state (a logit transform dflash does not know), so dflash cannot store its "
                            "top-k; extract without --store-target-topk")
