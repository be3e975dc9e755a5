"""Run the frozen target and capture the outputs of chosen decoder layers, stopping after the last one.

Forward hooks collect each captured layer's output; the hook of the deepest captured layer raises to end the
forward there, so the layers above it, the final norm and the LM head are never computed. The captured tensors
are exactly what a full forward's `hidden_states[i + 1]` holds (same kernels, same inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.shared.errors import UserError


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


def validate_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise UserError(f"--target-layers: layers {bad} do not exist: the target has layers 0..{num_target_layers - 1}")
    if len(set(layer_ids)) != len(layer_ids):
        raise UserError(f"--target-layers: {layer_ids} contain duplicates")
    return sorted(layer_ids)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class _StopForward(Exception):
    """Raised by the deepest captured layer's hook: nothing above it is needed."""


class FeatureCapture:
    """Callable: (input_ids, attention_mask) -> features [batch, length, len(layer_ids) * hidden]."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, torch.Tensor] = {}
        self._active = False  # hooks act only inside __call__: other forwards of the model run untouched
        layers = decoder_layers(model)
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int) -> Any:
        last = max(self.layer_ids)

        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if not self._active:
                return
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == last:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._outputs.clear()
        self._active = True
        try:
            self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._active = False
        features = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
        self._outputs.clear()
        return features

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
