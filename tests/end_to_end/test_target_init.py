"""Target-initialised drafters: `dflash extract --export-layers` copies target decoder layers into the cache's
target/ folder, `dflash train --init-from-target` copies them into the drafter where names and shapes match.

The references are the target checkpoint's own safetensors (read here directly) and a drafter built with the same
seed and left alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError
from dflash.shared.target_layers import DECODER_LAYER_TENSORS, norm_weight_offset, select_layers
from dflash.shared.target_loading import local_model_files, resolve_target
from dflash.stage1_extract.target_export import export_decoder_layers
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from dflash.stage2_train.options import TrainOptions
from dflash.stage2_train.run_setup import setup_run
from dflash.stage2_train.target_init import init_from_target
from tests.conftest import EXTRACT_ARGS, run_dflash
from tests.end_to_end.families import build_family, family_config

SEED = 5


def smollm2_folder() -> Path:
    return local_model_files(resolve_target(None).load_path)


def drafter(config: object) -> DFlashDraftModel:
    torch.manual_seed(SEED)
    return training_drafter(config)  # type: ignore[arg-type]


def smollm2_drafter_config(layers: int) -> object:
    target_config = json.loads((smollm2_folder() / "config.json").read_text())
    return config_from_target(target_config, [1, 8, 14, 20, 27], layers, 16, 16)


def test_layer_choices() -> None:
    assert select_layers("last", 30, 5, "--x") == [25, 26, 27, 28, 29]
    assert select_layers("LAST:2", 30, 5, "--x") == [28, 29]
    assert select_layers("first", 30, 3, "--x") == [0, 1, 2]
    assert select_layers("all", 4, 1, "--x") == [0, 1, 2, 3]
    assert select_layers("29, 3,17", 30, 5, "--x") == [29, 3, 17]  # the order given: drafter layer j <- ids[j]
    for spec, message in (("last:31", "between 1 and 30"), ("first:0", "between 1 and 30"), ("30", "do not exist"),
                          ("3,3", "named twice"), ("middle", "give last, first"), ("all:3", "give last, first")):
        with pytest.raises(UserError, match=message):
            select_layers(spec, 30, 5, "--x")


@pytest.mark.parametrize("family, offset", [("llama", 0.0), ("qwen3", 0.0), ("gemma3_text", 1.0),
                                            ("qwen3_next", 1.0)])
def test_norm_weight_offset_is_read_off_the_families_norm_module(family: str, offset: float) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(family, 256, {}))
    assert norm_weight_offset(model) == offset


def test_init_copies_exactly_the_named_tensors_and_nothing_else(tmp_path: Path) -> None:
    folder = smollm2_folder()
    reference = load_file(str(folder / "model.safetensors"))
    cache = tmp_path / "cache"
    (cache / cf.TARGET_DIR).mkdir(parents=True)
    written = export_decoder_layers(folder, [29, 27], cache / cf.TARGET_DIR, 0.0)
    exported = {f"model.layers.{i}.{name}" for i in (27, 29) for name in DECODER_LAYER_TENSORS} | {"model.norm.weight"}
    assert written == sum(t.numel() * t.element_size() for k, t in reference.items() if k in exported)
    assert written == 2 * 7_077_888 + 2 * 2 * 576 * 2 + 576 * 2  # 2 SmolLM2 layers and 5 norms, bf16

    config = smollm2_drafter_config(2)
    fresh, model = drafter(config), drafter(config)
    record = init_from_target(model, cache, "27,29")
    expected = {f"layers.{j}.{name}": f"layers.{i}.{name}" for j, i in enumerate((27, 29))
                for name in DECODER_LAYER_TENSORS if f"model.layers.{i}.{name}" in reference}
    expected["norm.weight"] = "norm.weight"
    assert record["copied"] == expected and len(expected) == 2 * 9 + 1
    assert record["skipped"] == {f"layers.{j}.self_attn.{q}_norm.weight": f"the target has no self_attn.{q}_norm.weight"
                                 for j in (0, 1) for q in ("q", "k")}  # Llama layers have no q/k norms
    assert record["source_layer_ids"] == [27, 29] and record["norm_weight_offset"] == 0.0
    for name, parameter in model.named_parameters():
        if name in expected:
            assert torch.equal(parameter, reference[f"model.{expected[name]}"].float()), name
        else:
            assert torch.equal(parameter, fresh.get_parameter(name)), name

    # A later export adds layers and keeps the earlier ones; a cache without the layers asked for is refused.
    assert export_decoder_layers(folder, [27], cache / cf.TARGET_DIR, 0.0) == 0
    export_decoder_layers(folder, [0], cache / cf.TARGET_DIR, 0.0)
    path = cache / cf.TARGET_DIR / cf.DECODER_LAYERS_FILE
    assert cf.read_layer_record(path)["layer_ids"] == [0, 27, 29]
    with pytest.raises(UserError, match=r"needs target layers \[28, 29\], .* holds layers \[0, 27, 29\]: rerun "
                                        r"`dflash extract` into this cache with --export-layers 28,29"):
        init_from_target(drafter(config), cache, "last")
    with pytest.raises(UserError, match="names 1 target layers for a drafter of 2"):
        init_from_target(drafter(config), cache, "27")
    with pytest.raises(UserError, match="does not exist: rerun `dflash extract`"):
        init_from_target(drafter(config), tmp_path, "first")

    # Where shapes differ the tensor is skipped (and named); zero-centred norms get the offset added.
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    tensors["layers.29.mlp.up_proj.weight"] = tensors["layers.29.mlp.up_proj.weight"].t().contiguous()
    save_file(tensors, str(path), metadata={**metadata, "norm_weight_offset": "1.0"})
    model = drafter(config)
    record = init_from_target(model, cache, "27,29")
    assert record["skipped"]["layers.1.mlp.up_proj.weight"] == "shape [576, 1536] in the target, [1536, 576] here"
    assert "layers.1.mlp.up_proj.weight" not in record["copied"] and len(record["copied"]) == len(expected) - 1
    assert torch.equal(model.layers[1].mlp.up_proj.weight, fresh.layers[1].mlp.up_proj.weight)
    assert torch.equal(model.norm.weight, reference["model.norm.weight"].float() + 1)
    assert torch.equal(model.layers[0].input_layernorm.weight,
                       reference["model.layers.27.input_layernorm.weight"].float() + 1)
    assert torch.equal(model.layers[0].mlp.up_proj.weight, reference["model.layers.27.mlp.up_proj.weight"].float())


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_moe"])
def test_families_export_and_init_where_shapes_match(family: str, tmp_path: Path) -> None:
    """Qwen3 layers are the drafter's: every tensor is copied. Gemma 3's zero-centred norms arrive as 1 + w. A MoE
    layer's experts are no drafter MLP: left out by the export, skipped by the init."""
    folder = build_family(family, smollm2_folder(), tmp_path / family)
    target_config = json.loads((folder / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        offset = norm_weight_offset(AutoModelForCausalLM.from_config(family_config(family, 256, {})))
    cache = tmp_path / "cache"
    (cache / cf.TARGET_DIR).mkdir(parents=True)
    export_decoder_layers(folder, [2, 3], cache / cf.TARGET_DIR, offset)
    config = config_from_target(target_config, [1, 2], 2, 4, 16)
    fresh, model = drafter(config), drafter(config)
    record = init_from_target(model, cache, "last")
    reference = {k.removeprefix("model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    for name, source in record["copied"].items():
        want = reference[source].float() + (offset if "norm" in name else 0.0)
        assert torch.equal(model.get_parameter(name), want), name
    for name in record["skipped"]:
        assert torch.equal(model.get_parameter(name), fresh.get_parameter(name)), name
    per_layer = {name.split(".", 2)[2] for name in record["copied"] if name.startswith("layers.")}
    if family == "qwen3":
        assert per_layer == set(DECODER_LAYER_TENSORS) and not record["skipped"]
    elif family == "gemma3_text":
        assert offset == 1.0 and per_layer == set(DECODER_LAYER_TENSORS)
        assert any("feedforward_layernorm" in name for name in record["target_tensors_left_out"])
    else:
        assert {name.split(".", 2)[2] for name in record["skipped"]} == {
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
        assert any("experts" in name for name in record["target_tensors_left_out"])


def test_extract_adds_layers_to_a_finished_cache_and_train_starts_from_them(baseline_cache: Path, chat_jsonl: Path,
                                                                             tmp_path: Path) -> None:
    """The CLI path: extract again with --export-layers on a finished cache (no shard redone), then train with
    --init-from-target and lr 0: the export holds the target's last layer and final norm bit
    for bit, and records what was copied; refusals are one line."""
    cache = tmp_path / "cache"
    shutil.copytree(baseline_cache, cache)
    before = json.loads((cache / cf.MANIFEST_FILE).read_text())["shards"]
    result = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(cache), "--workers", "1", *EXTRACT_ARGS,
                        "--export-layers", "last:1", check=True)
    assert "target decoder layers [29] and the final norm written (7.1 MB)" in result.stderr
    assert json.loads((cache / cf.MANIFEST_FILE).read_text())["shards"] == before

    run = tmp_path / "run"
    args = ("--cache", str(cache), "--draft-layers", "1", "--max-steps", "2", "--eval-every", "0",
            "--checkpoint-every", "0", "--num-workers", "0", "--batch-tokens", "1024", "--max-anchors", "8",
            "--mixed-precision", "no")
    # --lr 1e-30: too small to move a weight but an exact zero (--lr 0 is refused)
    result = run_dflash("train", *args, "--out", str(run), "--lr", "1e-30", "--init-from-target")
    assert result.returncode == 0, result.stderr[-3000:]
    reference = load_file(str(smollm2_folder() / "model.safetensors"))
    weights = load_file(str(run / "export" / "model.safetensors"))
    record = json.loads((run / "export" / "target_init.json").read_text())
    assert record == json.loads((run / "target_init.json").read_text())
    assert record["spec"] == "last" and record["source_layer_ids"] == [29] and len(record["copied"]) == 10
    assert json.loads((run / "train_options.json").read_text())["init_from_target"] == "last"
    for name, source in record["copied"].items():
        got, want = weights[name], reference[f"model.{source}"]
        moved = got != want  # one step of lr 1e-30 moves exact zeros only (to ~1e-30): the rest is bit-equal
        assert torch.all(want[moved] == 0) and torch.all(got[moved].abs() < 1e-25), name

    refused = run_dflash("train", *args, "--out", str(tmp_path / "refused"), "--init-from-target", "first")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "needs target layers [0], " in refused.stderr and "with --export-layers 0 " in refused.stderr
    with pytest.raises(UserError, match="--init-from EXPORT_DIR and --init-from-target both .*: give one of them"):
        setup_run(TrainOptions(cache=cache, out=tmp_path / "both", init_from=run / "export", init_from_target="last"))
    assert not (tmp_path / "both").exists()
