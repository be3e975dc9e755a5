"""Exports load in z-lab's own DFlash code, unchanged: its `DFlashDraftModel` / `DFlash2DraftModel` (the `dflash`
package on PyPI, the reference implementation vLLM and SGLang follow) load every DFlash and DFlash 2 export with no
missing and no unexpected weight, compute the drafter hidden states ours computes for the same context and block,
and (DFlash 2) walk the same candidate path.

`make install` puts the reference package's files in `.venv/reference/` (`pip download dflash==0.1.0`; it is not
installed: its import name `dflash` is ours too), and this test loads its `model.py` from there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.export import export_draft
from tests.end_to_end.families import build_family

REFERENCE_MODEL = Path(sys.prefix) / "reference" / "dflash" / "model.py"
BLOCK, LAYER_IDS = 4, [1, 2]


def reference_module():
    if not REFERENCE_MODEL.is_file():
        pytest.fail(f"{REFERENCE_MODEL} is missing: `make install` downloads z-lab's dflash package there")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", REFERENCE_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from dflash.shared.target_loading import resolve_target

    folder = build_family("llama", Path(resolve_target(None).load_path), tmp_path_factory.mktemp("llama") / "llama")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("architecture,sliding", [("dflash", False), ("dflash", True), ("dflash2", False)])
def test_reference_loads_every_export_and_computes_the_same_drafter(target, architecture: str, sliding: bool,
                                                                     tmp_path: Path) -> None:
    torch.set_num_threads(1)
    zlab = reference_module()
    layers = 2
    config = config_from_target(target.config.to_dict(), LAYER_IDS, layers, BLOCK, 5, architecture=architecture,
                                layer_types=["sliding_attention", "full_attention"] if sliding else None,
                                sliding_window=8 if sliding else None,
                                dflash2={"conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4})
    torch.manual_seed(0)
    ours = loop.drafter_for(config).eval()
    with torch.no_grad():  # off the identity, so that the DFlash 2 parts are compared too
        for name, param in ours.named_parameters():
            if name in getattr(ours, "added_parameter_names", list)():
                param.add_(torch.randn_like(param) * 0.1)
    export_draft(ours, tmp_path, {"identity": {}})
    with torch.no_grad():  # the weights the export holds (the rotary buffers stay float32, as on loading)
        for param in ours.parameters():
            param.copy_(param.to(torch.bfloat16))

    reference_class = zlab.DFlash2DraftModel if architecture == "dflash2" else zlab.DFlashDraftModel
    theirs, info = reference_class.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert type(theirs).__name__ == {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[architecture]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs.eval()

    context_len = 21  # longer than the sliding window
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, context_len, len(LAYER_IDS) * target.config.hidden_size, generator=generator)
    block = torch.tensor([[17] + [5] * (BLOCK - 1)])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        runner = loop.DraftRunner(ours, embed.weight, head.weight)
        runner.extend(features)
        expected = runner.block_hidden(17, context_len)
        got = theirs(target_hidden=features, noise_embedding=embed(block),
                     position_ids=torch.arange(context_len + BLOCK)[None])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        if architecture == "dflash2":
            path, _, _ = theirs.propose(expected[:, 1:], block[:, 0], head, 0.0)
            tokens, _ = ours.candidate_selector.propose(expected[0, 1:], runner.logits(expected[0, 1:]), 17)
            assert path[0].tolist() == tokens
