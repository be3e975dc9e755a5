"""The export loads the way published DFlash drafters do: `AutoModel.from_pretrained(EXPORT,
trust_remote_code=True)` gives the drafter of the shipped modeling_dflash.py (the very file training and `dflash eval`
import, every weight used), whose `spec_generate` runs the loop `dflash eval` runs and emits its tokens, with its
tau, for a plain target (Llama), a sliding-window one with a scaled embedding (Gemma 3) and a hybrid recurrent one
(Qwen3-Next).

A random drafter accepts nothing, so the loops are also compared with an oracle drafter (the target's own greedy
continuation with a wrong token at a varying block offset) patched into both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.export import MODELING_FILE, export_draft
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from tests.end_to_end.families import build_family

BLOCK = 4
LAYER_IDS = [1, 2]


def test_training_eval_and_export_share_one_drafter_and_one_loop(tmp_path: Path) -> None:
    """The trainer, the offline walk, eval and the export use the same drafter class and the same loop code."""
    from dflash.stage2_train import acceptance, draft_attention, evaluate, export, run_setup, trainer

    assert trainer.DFlashDraftModel is run_setup.DFlashDraftModel is loop.DFlashDraftModel
    assert draft_attention.DFlashDraftModel is loop.DFlashDraftModel
    assert evaluate.speculative_generate is loop.speculative_generate
    assert spec.TargetRunner is loop.TargetRunner  # plain decoding runs the target as the loop does
    assert isinstance(draft_attention.training_drafter(_tiny_config()), loop.DFlashDraftModel)
    assert export.training_drafter is draft_attention.training_drafter  # what load_draft builds
    assert "nn.Module" in acceptance.draft_predictions.__annotations__["model"]  # it takes whatever drafter it is given
    export_draft(DFlashDraftModel(_tiny_config()), tmp_path / "export", {"identity": {}})
    assert (tmp_path / "export" / MODELING_FILE).read_bytes() == Path(loop.__file__).read_bytes()
    source = (tmp_path / "export" / MODELING_FILE).read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "copy", "inspect", "time", "collections", "contextlib", "dataclasses", "typing",
                       "torch", "transformers"}  # self-contained: it runs outside dflash


def _tiny_config():
    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "num_hidden_layers": 6, "vocab_size": 100}
    return config_from_target(target, LAYER_IDS, 1, BLOCK, 5)


def _oracle(reference: list[int], prompt_len: int, vocab: int):
    wrong = [2, None, 1, 3, None, 2]
    calls = [0]

    def logits(self, bonus: int, start: int) -> torch.Tensor:
        offset = wrong[calls[0] % len(wrong)]
        calls[0] += 1
        out = torch.zeros(BLOCK - 1, vocab)
        for k in range(1, BLOCK):
            index = start - prompt_len + k
            token = reference[index] if index < len(reference) else 0
            out[k - 1, (token + 1) % vocab if k == offset else token] = 1.0
        return out

    return logits


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_auto_model_spec_generate_equals_dflash_eval(family: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModel, AutoModelForCausalLM, BatchEncoding

    from dflash.shared.target_layers import embedding_scale
    from dflash.shared.target_loading import resolve_target

    torch.set_num_threads(1)
    model_dir = build_family(family, Path(resolve_target(None).load_path), tmp_path / family)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scale = embedding_scale(target)
    config = config_from_target(target.config.to_dict(), LAYER_IDS, 1, BLOCK, 5, embed_scale=scale)
    torch.manual_seed(0)
    draft = DFlashDraftModel(config).eval()
    buffers = {name: buffer.clone() for name, buffer in draft.named_buffers()}
    export_draft(draft, tmp_path / "export", {"identity": {}})
    draft = draft.to(torch.bfloat16).float()  # what the export holds

    loaded = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DFlashDraftModel" and hasattr(loaded, "spec_generate")
    assert sorted(loaded.state_dict()) == sorted(draft.state_dict())
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # The buffers the state dict leaves out (the rotary frequencies), which transformers 5 fills after loading on
    # the meta device: computed, not left uninitialised.
    assert buffers and {name: b for name, b in loaded.named_buffers()}.keys() == buffers.keys()
    for name, buffer in loaded.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    shipped = sys.modules[type(loaded).__module__]  # the export's own copy of the modeling file

    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    prompt = list(range(200, 220))
    # A random drafter (nothing accepted); the prompt given as apply_chat_template(..., return_tensors="pt") gives it
    # in transformers 5 (a BatchEncoding).
    ours = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 32, [2], embed_scale=scale)
    encoding = BatchEncoding({"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt))})
    output = loaded.spec_generate(input_ids=encoding, target=target, max_new_tokens=32, temperature=0.0,
                                  stop_token_ids=[2])
    assert output[0, len(prompt):].tolist() == ours.tokens
    assert loaded.last_acceptance_lengths == [a + 1 for a in ours.accepted]

    # An oracle drafter (partly and wholly accepted blocks), patched into both copies of the loop.
    reference = spec.greedy_generate(target, prompt, 32 + BLOCK, [2]).tokens
    monkeypatch.setattr(loop.DraftRunner, "propose", _oracle(reference, len(prompt), head.shape[0]))
    ours = loop.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 32, [2], embed_scale=scale)
    monkeypatch.setattr(shipped.DraftRunner, "propose", _oracle(reference, len(prompt), head.shape[0]))
    output = loaded.spec_generate(input_ids=torch.tensor([prompt]), target=target, max_new_tokens=32,
                                  temperature=0.0, stop_token_ids=[2])
    assert output[0, len(prompt):].tolist() == ours.tokens == reference[:len(ours.tokens)]
    assert loaded.last_acceptance_lengths == [a + 1 for a in ours.accepted]
    assert ours.tau > 2
