"""The targets users bring, end to end on CPU: one tiny random-weight model per architecture family
(tests/end_to_end/families.py) through `dflash extract`, `dflash train` (a few steps), the export and `dflash eval`
(greedy, against plain greedy decoding of the same target).

One family (`CLI_FAMILY`) goes through the real `dflash extract` and `dflash eval` commands (the two that load the
target; training only reads the cache, and its CLI runs in tests/stage2_train/test_train.py). The others call the
same entry points in process (`run_extract`, `train`, `run_eval`), because process startup would dominate these tiny
runs: their extraction runs the real supervisor and worker code, with the worker forked from a fork server instead
of spawned (a spawned worker imports torch and transformers afresh, ~5 s each). The run writes docs/support-matrix.md (the README's
support matrix) from what it observed, when every family ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.shared import cache_format as cf
from tests.conftest import REPO, make_conversations, run_dflash
from tests.end_to_end.families import FAMILIES, build_family

LAYER_IDS = [1, 2]
BLOCK = 4
NEW_TOKENS = 24
CLI_FAMILY = "gemma3_text"
MATRIX = REPO / "docs" / "support-matrix.md"
RESULTS: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from dflash.shared.target_loading import resolve_target

    root = tmp_path_factory.mktemp("families")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(5)))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                               for i, text in enumerate(["Name three colours.", "Count from one to five."])))
    yield {"root": root, "data": data, "prompts": prompts, "tokenizer": Path(resolve_target(None).load_path)}
    if set(RESULTS) == set(FAMILIES):
        write_matrix(RESULTS)


def write_matrix(results: dict[str, dict[str, str]]) -> None:
    rows = ["| family | extract | train | eval (greedy = plain) | notes |", "|---|---|---|---|---|"]
    for name in FAMILIES:
        r = results[name]
        rows.append(f"| {name} | {r.get('extract', 'FAILED')} | {r.get('train', 'FAILED')} | "
                    f"{r.get('eval', 'FAILED')} | {r.get('notes', '')} |")
    MATRIX.write_text(
        "# Supported target families\n\n"
        "Written by `tests/end_to_end/test_families.py` (part of `make test`) from what the run observed: for each\n"
        "family a tiny random-weight model built from transformers' own config (4 layers, hidden 64, the SmolLM2\n"
        "tokenizer and chat template standing in for the family's own, which is not available offline) goes through\n"
        "`dflash extract` (features equal to a plain forward's `hidden_states`, bit for bit), `dflash train`\n"
        "(a few steps; the drafter's sizes and embedding scale follow the target), the export, and `dflash eval`\n"
        "(greedy speculative output identical to plain greedy decoding, float32 on CPU).\n\n"
        + "\n".join(rows) + "\n")


def _features_equal_a_plain_forward(cache: Path, model_dir: Path) -> None:
    """Every cached sample equals hidden_states[i + 1] of a batch-1 bf16 transformers forward of its tokens, bit for
    bit, or (a sample batched with others, whose kernels CPUs choose by shape) is as close to a float32 forward as
    that batch-1 forward is (the criterion of tests/stage1_extract/test_extract.py). Most samples must be equal."""
    from dflash.shared.target_loading import load_target_model

    model = load_target_model(str(model_dir), "cpu")
    fp32: list[torch.nn.Module] = []  # loaded only when a sample is not bit-identical

    def layers_of(target: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            hidden = target(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True)
        return torch.cat([hidden.hidden_states[j + 1][0] for j in LAYER_IDS], dim=-1)

    def error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a.float() - b).norm(dim=-1) / b.norm(dim=-1)).mean()

    checked, equal = 0, 0
    for store in sorted((cache / "shards").glob("shard-*.zarr")):
        reader = cf.ShardReader(store)
        for i in range(reader.num_samples):
            ids, _ = reader.sample_tokens(i)
            stored, direct = reader.sample_feature_tensor(i), layers_of(model, ids)
            if torch.equal(stored, direct):
                equal += 1
            else:
                fp32 = fp32 or [load_target_model(str(model_dir), "cpu", torch.float32)]
                reference = layers_of(fp32[0], ids)
                assert error(stored, reference) <= 1.25 * error(direct, reference), f"{store.name} sample {i}"
            checked += 1
    assert checked == sum(entry["samples"] for entry in cf.read_manifest(cache)["shards"].values()) >= 4
    assert equal >= checked // 2


def _drafter_follows_the_target(export: Path, model_dir: Path, family: str) -> dict:
    """The exported config's sizes come from the target; the block embedding is what the target feeds layer 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.stage2_train.draft_config import DFlashConfig
    from dflash.stage2_train.target_parts import load_target_parts

    config = json.loads((export / "config.json").read_text())
    target = AutoConfig.from_pretrained(model_dir).get_text_config()
    assert config["dflash_config"]["target_model_type"] == family
    assert config["hidden_size"] == target.hidden_size and config["vocab_size"] == target.vocab_size
    assert config["num_attention_heads"] == target.num_attention_heads
    assert config["num_key_value_heads"] == target.num_key_value_heads
    assert config["head_dim"] == getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    assert config["rms_norm_eps"] == target.rms_norm_eps
    rope = target.rope_parameters
    rope = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    assert config["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    assert config["rope_parameters"]["rope_type"] == rope["rope_type"]
    DFlashConfig.from_dict(config)  # loads back

    # The noise embedding stage 2 uses (from the cache's target/ folder) = the input of the target's first layer.
    parts = load_target_parts(export.parent.parent / "cache")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 17, 300, 4000]])
    with torch.inference_mode():
        first_layer_input = model(input_ids=ids, output_hidden_states=True).hidden_states[0][0]
    assert torch.equal(torch.nn.functional.embedding(ids[0], parts.embed_tokens), first_layer_input)
    assert config["dflash_config"]["embed_scale"] == parts.embed_scale
    return {"embed_scale": parts.embed_scale}


def _notes(model_dir: Path, scale: float) -> str:
    from transformers import AutoModelForCausalLM

    from dflash.stage2_train.modeling_dflash import has_recurrent_state, new_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config.get_text_config()
    kinds = []
    for layer in new_cache(model).layers:
        kind = ("recurrent (snapshot + refeed)" if has_recurrent_state(layer)
                else "sliding window" if getattr(layer, "is_sliding", False) else "full attention")
        if kind not in kinds:
            kinds.append(kind)
    notes = [f"cache: {', '.join(kinds)}", f"attention: {config._attn_implementation}"]
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    if experts:
        notes.append(f"MoE ({experts} experts)")
    if scale != 1.0:
        notes.append(f"embedding scale {scale:g}")
    return "; ".join(notes)


def _fork_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Extraction workers forked from a fork server that has imported the worker module once (forking the test
    process itself can deadlock on locks held by its other threads)."""
    import multiprocessing
    from types import SimpleNamespace

    from dflash.stage1_extract import supervisor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dflash.stage1_extract.worker"])
    monkeypatch.setattr(supervisor, "mp", SimpleNamespace(get_context=lambda _method: context,
                                                          process=multiprocessing.process))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_end_to_end(family: str, workspace: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.stage1_extract.options import ExtractOptions
    from dflash.stage1_extract.supervisor import run_extract
    from dflash.stage2_train.evaluate import run_eval
    from dflash.stage2_train.run_setup import TrainOptions
    from dflash.stage2_train.trainer import train

    torch.set_num_threads(1)
    root = workspace["root"] / family
    model_dir = build_family(family, workspace["tokenizer"], root / "model")
    result = RESULTS.setdefault(family, {})
    cache, run, export = root / "cache", root / "run", root / "run" / "export"
    via_cli = family == CLI_FAMILY

    extract_args = {"model": str(model_dir), "data": str(workspace["data"]), "max_length": 96, "shards": 1,
                    "workers": 1, "batch_tokens": 96, "feature_dtype": "bf16", "target_layers": LAYER_IDS}
    if via_cli:
        run_dflash("extract", "--out", str(cache), "--model", str(model_dir), "--data", str(workspace["data"]),
                   "--max-length", "96", "--shards", "1", "--workers", "1", "--batch-tokens", "96",
                   "--feature-dtype", "bf16", "--target-layers", ",".join(map(str, LAYER_IDS)), check=True)
    else:
        _fork_workers(monkeypatch)
        assert run_extract(ExtractOptions(out=cache, **extract_args)) == 0  # type: ignore[arg-type]
    _features_equal_a_plain_forward(cache, model_dir)
    result["extract"] = "yes"

    train_args = {"max_steps": 3, "draft_layers": 1, "block_size": BLOCK, "batch_tokens": 256, "max_anchors": 8,
                  "eval_every": 1000, "checkpoint_every": 1000, "eval_fraction": 0.2, "eval_sequences": 1}
    train(TrainOptions(cache=cache, out=run, num_workers=0, **train_args))  # type: ignore[arg-type]
    facts = _drafter_follows_the_target(export, model_dir, family)
    result["train"] = "yes"

    eval_dir = root / "eval"
    if via_cli:
        run_dflash("eval", "--draft", str(export), "--data", str(workspace["prompts"]), "--out", str(eval_dir),
                   "--max-samples", "2", "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", check=True)
        report = json.loads((eval_dir / "eval.json").read_text())
    else:
        report = run_eval(export, str(workspace["prompts"]), eval_dir, max_samples=2, max_new_tokens=NEW_TOKENS)
    stats = next(iter(report["datasets"].values()))
    assert report["target_dtype"] == "float32"
    assert stats["prompts"] == 2 and stats["greedy_identical"] == 2 and stats["tie_divergences"] == 0
    assert stats["steps"] >= 2
    result["eval"] = f"yes (tau {stats['tau']:.2f})"
    result["notes"] = _notes(model_dir, facts["embed_scale"])


# ---------------------------------------------------------------------------
# Targets dflash cannot work with: refused up front, in one line, naming the reason
# ---------------------------------------------------------------------------


def test_a_model_without_a_causal_lm_class_is_refused(workspace: dict, tmp_path: Path) -> None:
    """Refused before any work (a UserError: the CLI prints its one line and exits 2, see test_extract.py)."""
    from transformers import AutoConfig

    from dflash.shared.errors import UserError
    from dflash.stage1_extract.options import ExtractOptions
    from dflash.stage1_extract.supervisor import run_extract

    folder = tmp_path / "t5"
    AutoConfig.for_model("t5", d_model=64, num_layers=2).save_pretrained(folder)
    with pytest.raises(UserError, match="model type 't5' has no causal language model class"):
        run_extract(ExtractOptions(out=tmp_path / "cache", model=str(folder), data=str(workspace["data"])))
    assert not (tmp_path / "cache" / "target").exists()


def test_embeddings_transformed_outside_the_embedding_module_are_refused(workspace: dict) -> None:
    from transformers import AutoModelForCausalLM

    from dflash.shared.errors import UserError
    from dflash.shared.target_layers import check_embedding_path, embedding_scale

    model_dir = build_family("llama", workspace["tokenizer"], workspace["root"] / "llama" / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    check_embedding_path(model, embedding_scale(model))  # as it comes: accepted
    embed = model.get_input_embeddings()
    plain_forward = embed.forward
    embed.forward = lambda ids: plain_forward(ids) * 2.0  # a scale the module does not declare
    with pytest.raises(UserError, match="first decoder layer does not receive the token embedding times 1"):
        check_embedding_path(model, embedding_scale(model))
