"""The target side both stages share: which target layers feed the drafter, where a model keeps its decoder
layers, and the forward hooks that capture their outputs.

Extraction (`dflash extract`) and evaluation (`dflash eval`) capture features through the same `LayerCapture`, so
"the drafter sees at inference what it was trained on" has one implementation: each captured tensor is exactly the
layer's output, i.e. what a full forward's `hidden_states[i + 1]` holds (same kernels, same inputs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dflash.shared.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used (benchmarks/sizing.py reads the layer rule without it)
    import torch


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: one layer in the middle, else spread from layer 1 to L - 3 (Python's round)."""
    if num_draft_layers < 1:
        raise UserError("--draft-layers must be at least 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if num_draft_layers > end - start + 1:
        raise UserError(f"--draft-layers {num_draft_layers}: the default choice spreads the captured layers over "
                        f"target layers {start}..{end}, so at most {max(1, end - start + 1)} for this "
                        f"{num_target_layers}-layer target; pass fewer, or name them with --target-layers")
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def validate_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """The layer ids, sorted, after checking that each exists once in a target of `num_target_layers` layers."""
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise UserError(f"--target-layers: layers {bad} do not exist: the target has layers 0..{num_target_layers - 1}")
    if len(set(layer_ids)) != len(layer_ids):
        raise UserError(f"--target-layers: {list(layer_ids)} contain duplicates")
    return sorted(layer_ids)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (or of its decoder)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}: dflash looks for "
                        "`model.get_decoder().layers`")
    return layers


def embedding_scale(model: Any) -> float:
    """The factor `model`'s input embedding module multiplies its rows by: transformers' scaled embeddings (Gemma's
    `Gemma3TextScaledWordEmbedding` & co.) keep it as `scalar_embed_scale` (a float) and `embed_scale`; 1.0 for a
    plain `nn.Embedding`. The drafter embeds its block with the same factor (stage2_train/target_parts.py)."""
    module = model.get_input_embeddings()
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None:
        scale = getattr(module, "embed_scale", None)
        if scale is not None and hasattr(scale, "is_meta"):
            scale = None if scale.is_meta else float(scale)
    return float(scale) if scale is not None else 1.0


class _StopForward(Exception):
    """Raised by the deepest captured layer's hook when nothing above it is needed."""


def check_embedding_path(model: Any, scale: float) -> None:
    """Refuse a target whose first decoder layer does not receive `embedding(ids) * scale`, which is how the
    drafter embeds its block (stage2_train/target_parts.py `scaled_embedding`): a target that transforms its
    embeddings elsewhere would train a drafter on inputs the target never sees. One short decoder forward, ended at
    the first layer."""
    import torch
    import torch.nn.functional as F

    first = decoder_layers(model)[0]
    received: dict[str, Any] = {}

    def pre_hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        received["hidden"] = args[0] if args else kwargs.get("hidden_states")
        raise _StopForward

    weight = model.get_input_embeddings().weight
    ids = torch.tensor([[1, 2, 3, min(1000, weight.shape[0] - 1)]], device=weight.device)
    handle = first.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.get_decoder()(input_ids=ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        handle.remove()
    expected = F.embedding(ids, weight)
    if scale != 1.0:
        expected = expected * torch.tensor(scale, dtype=weight.dtype, device=weight.device)
    hidden = received.get("hidden")
    if hidden is None or hidden.shape != expected.shape or not torch.equal(hidden, expected):
        raise UserError(f"{type(model).__name__}: its first decoder layer does not receive the token embedding times "
                        f"{scale:g}, which is how the drafter embeds its block; dflash does not support this target")


class LayerCapture:
    """Forward hooks on the decoder layers `layer_ids` of `model` that keep each layer's output, but only inside
    `active()`: other forwards of the model run untouched. With `stop_after_last`, the deepest captured layer ends
    the forward (the layers above it, the final norm and the LM head are never computed)."""

    def __init__(self, model: Any, layer_ids: Sequence[int], stop_after_last: bool = False) -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        layers = decoder_layers(model)
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise UserError(f"layers {bad} do not exist: the target has layers 0..{len(layers) - 1}")
        self._stop_at = max(self.layer_ids) if stop_after_last and self.layer_ids else None
        self._outputs: dict[int, torch.Tensor] = {}
        self._active = False
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if not self._active:
                return
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self._stop_at:
                raise _StopForward

        return hook

    @contextmanager
    def active(self) -> Iterator[None]:
        """Capture during the forward(s) run inside; a forward ended early by `stop_after_last` ends quietly."""
        self._outputs.clear()
        self._active = True
        try:
            yield
        except _StopForward:
            pass
        finally:
            self._active = False

    def features(self) -> torch.Tensor:
        """The captured outputs concatenated in `layer_ids` order: [..., len(layer_ids) * hidden]."""
        import torch

        missing = [i for i in self.layer_ids if i not in self._outputs]
        if missing:
            raise RuntimeError(f"layers {missing} produced no output in the last forward")
        features = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
        self._outputs.clear()
        return features

    def decoder_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Extraction's forward: the decoder alone over a padded batch, without a KV cache, ended after the deepest
        captured layer -> features [batch, length, len(layer_ids) * hidden]."""
        import torch

        with torch.inference_mode():
            with self.active():
                self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return self.features()

    def decoder_features_and_final(self, input_ids: torch.Tensor,
                                   attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decoder_features`, run to the end (a capture made without `stop_after_last`): (features, the decoder's
        last hidden state [batch, length, hidden], after its final norm: what the LM head scores)."""
        import torch

        if self._stop_at is not None:
            raise RuntimeError("decoder_features_and_final needs a LayerCapture made without stop_after_last")
        with torch.inference_mode():
            with self.active():
                final = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                                 use_cache=False).last_hidden_state
            return self.features(), final

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
