"""The drafter's configuration: a Qwen3 config plus the DFlash fields, sized from the target's config.

`config_from_target` is how `dflash train` sizes a drafter; `DFlashConfig` is what training, checkpoints and
`dflash eval` read an export's `config.json` into. The network itself is `modeling_dflash.DFlashDraftModel`, which
takes any Qwen3 config carrying these fields (an export loaded by `AutoModel` gives a plain `Qwen3Config`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

from dflash.shared.target_layers import default_layer_ids
from dflash.stage2_train.options import ARCHITECTURES

# DFlash 2's added parts as published (z-lab DFlash2DraftModel): conv kernel K, conv group g, selector rank r and
# top-k; its `dflash_config` fields.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}

@strict
class DFlashConfig(Qwen3Config):
    """A Qwen3 config plus the DFlash fields the reference loader reads.

    ``block_size`` and ``num_target_layers`` (the target's layer count) are top-level keys; ``mask_token_id``,
    ``target_layer_ids`` and, for DFlash 2 (``architectures: ["DFlash2DraftModel"]``), ``conv_kernel_size``,
    ``conv_group_size``, ``selector_rank`` and ``selector_top_k`` live in ``dflash_config`` (as in the reference
    ``config.json``); ``block_size`` is written there too (DFlash 2 readers look for it there). ``to_dict`` also
    writes ``rope_theta`` (and ``rope_scaling`` for non-default RoPE) at the top level because older loaders silently
    fall back to 10000 without it, and ``is_causal: false`` (the block is bidirectional; the reference loader treats
    sliding-window layers as causal unless told).
    """

    model_type = "qwen3"
    block_size: int = 16
    num_target_layers: int = 36
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.dflash_config = dict(self.dflash_config or {})
        for key in ("mask_token_id", "target_layer_ids"):  # tolerate top-level keys written by other tools
            if key in kwargs:
                self.dflash_config.setdefault(key, kwargs.pop(key))
        if "block_size" in self.dflash_config:  # the reference readers' home of the block size
            self.block_size = int(self.dflash_config["block_size"])
        kwargs.pop("is_causal", None)  # always false for a drafter (to_dict writes it)
        if self.architectures is None:
            self.architectures = ["DFlashDraftModel"]
        super().__post_init__(**kwargs)

    @property
    def architecture(self) -> str:
        """`dflash` or `dflash2` (the --architecture of `dflash train`)."""
        return "dflash2" if "DFlash2DraftModel" in (self.architectures or []) else "dflash"

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids is None:
            return default_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return list(ids)

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def embed_scale(self) -> float:
        """The target's embedding scale the block is embedded with (1.0 unless the target scales, e.g. Gemma)."""
        return float(self.dflash_config.get("embed_scale", 1.0))

    @property
    def num_context_layers(self) -> int:
        """How many target layers are concatenated into the context features (fc input = this * hidden)."""
        return len(self.target_layer_ids)

    @property
    def rope_theta(self) -> float:
        # transformers 5.17 reads this while the config is still being built (rope_parameters not set yet):
        # an AttributeError there means "use the default", any other error breaks every config load.
        rope = getattr(self, "rope_parameters", None) or {}
        if "rope_theta" not in rope:
            raise AttributeError("rope_theta")
        return float(rope["rope_theta"])

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        rope = dict(out.get("rope_parameters") or {})
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["is_causal"] = False
        out["dflash_config"] = {**(out.get("dflash_config") or {}), "block_size": int(self.block_size)}
        return out


def _target_rope_parameters(target_config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE parameters of a target config dict written by transformers 4.x (rope_theta/rope_scaling) or 5.x.

    Per-layer-type parameters (Gemma 3: {sliding_attention: ..., full_attention: ...}) give the full-attention
    entry; a partial rotary factor (Qwen3-Next, GLM-4) is the target's attention detail and is not copied (the
    drafter rotates its whole head)."""
    rope = dict(target_config.get("rope_parameters") or {})
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    rope.pop("partial_rotary_factor", None)
    scaling = target_config.get("rope_scaling") or {}
    if not rope.get("rope_type") and scaling:
        rope.update(scaling)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", float(target_config.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    return rope


def config_from_target(
    target_config: Mapping[str, Any],
    target_layer_ids: Sequence[int] | None,
    num_draft_layers: int,
    block_size: int,
    mask_token_id: int,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    embed_scale: float = 1.0,
    architecture: str = "dflash",
    dflash2: Mapping[str, int] | None = None,
) -> DFlashConfig:
    """Size a draft config from the target's config dict (hidden, heads, KV heads, MLP, head_dim, RoPE, eps).

    ``target_layer_ids=None`` uses the reference default for ``num_draft_layers``. All draft layers use full
    attention unless ``layer_types`` (and ``sliding_window``) are given. ``embed_scale`` (the target's embedding
    scale) and the target's ``model_type`` are recorded in ``dflash_config``. ``architecture="dflash2"`` makes a
    DFlash 2 drafter with the fields of `DFLASH2_DEFAULTS`, updated by ``dflash2``.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: choose one of {', '.join(ARCHITECTURES)}")
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    kv_heads = int(target_config.get("num_key_value_heads") or heads)
    head_dim = int(target_config.get("head_dim") or hidden // heads)
    num_target_layers = int(target_config["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else None
    if ids is None:
        ids = default_layer_ids(num_target_layers, num_draft_layers)
    if any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} outside [0, {num_target_layers})")
    uses_window = layer_types is not None and "sliding_attention" in layer_types
    if uses_window and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=int(target_config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=num_draft_layers,
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_parameters=_target_rope_parameters(target_config),
        max_position_embeddings=int(target_config.get("max_position_embeddings", 32768)),
        vocab_size=int(target_config["vocab_size"]),
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=uses_window,
        sliding_window=sliding_window if uses_window else None,
        layer_types=list(layer_types) if layer_types is not None else None,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": ids, "embed_scale": float(embed_scale),
                       **({"target_model_type": target_config["model_type"]} if target_config.get("model_type")
                          else {}),
                       **({**DFLASH2_DEFAULTS, **(dflash2 or {})} if architecture == "dflash2" else {})},
        architectures=["DFlash2DraftModel" if architecture == "dflash2" else "DFlashDraftModel"],
    )
