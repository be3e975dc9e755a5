"""The export loads the way published DFlash drafters do: `AutoModel.from_pretrained(EXPORT,
trust_remote_code=True)` gives the drafter (ours, from the shipped modeling_dflash.py, every weight used) whose
`spec_generate` emits the tokens, with the tau, of `speculative_generate` (what `dflash eval` runs), for a plain
target (Llama), a sliding-window one with a scaled embedding (Gemma 3) and a hybrid recurrent one (Qwen3-Next).

A random drafter accepts nothing, so the loops are also compared with an oracle drafter (the target's own greedy
continuation with a wrong token at a varying block offset) patched into both, after the drafter networks themselves
are compared on the same context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.stage2_train import speculative as spec
from dflash.stage2_train.draft_model import DFlashDraftModel, config_from_target
from dflash.stage2_train.export import export_draft
from dflash.stage2_train.target_parts import scaled_embedding
from tests.end_to_end.families import build_family

BLOCK = 4
LAYER_IDS = [1, 2]


def _oracle(reference: list[int], prompt_len: int, vocab: int):
    wrong = [2, None, 1, 3, None, 2]
    calls = [0]

    def logits(start: int) -> torch.Tensor:
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
    from transformers import AutoModel, AutoModelForCausalLM

    from dflash.shared.target_layers import embedding_scale
    from dflash.shared.target_loading import resolve_target

    torch.set_num_threads(1)
    model_dir = build_family(family, Path(resolve_target(None).load_path), tmp_path / family)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scale = embedding_scale(target)
    config = config_from_target(target.config.to_dict(), LAYER_IDS, 1, BLOCK, 5, embed_scale=scale)
    torch.manual_seed(0)
    draft = DFlashDraftModel(config).eval()
    export_draft(draft, tmp_path / "export", {"identity": {}})
    draft = draft.to(torch.bfloat16).float()  # what the export holds

    loaded = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DFlashDraftModel" and hasattr(loaded, "spec_generate")
    assert sorted(loaded.state_dict()) == sorted(draft.state_dict())
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    embed = scaled_embedding(target.get_input_embeddings().weight, scale)
    head = target.get_output_embeddings().weight
    prompt = list(range(200, 220))
    # The networks: same draft logits for the same context features (the target's layers 1 and 2 of the prompt).
    runner = spec.TargetRunner(target, LAYER_IDS)
    with runner.hooked(), torch.inference_mode():
        _, features = runner.forward(prompt, 0)
        drafter = spec.DraftRunner(draft, embed, head)
        drafter.extend(features)
        expected = drafter.propose(7, len(prompt))
        got = loaded.draft_logits(target, 7, features, len(prompt))
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)  # float32, other kernels
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    # The loops: a random drafter (nothing accepted), then an oracle (partly and wholly accepted blocks).
    ours = spec.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 32, [2])
    output = loaded.spec_generate(input_ids=torch.tensor([prompt]), target=target, max_new_tokens=32,
                                  temperature=0.0, stop_token_ids=[2])
    assert output[0, len(prompt):].tolist() == ours.tokens
    assert loaded.last_acceptance_lengths == [a + 1 for a in ours.accepted]

    reference = spec.greedy_generate(target, prompt, 32 + BLOCK, [2]).tokens
    ours_oracle = _oracle(reference, len(prompt), head.shape[0])
    monkeypatch.setattr(spec.DraftRunner, "propose", lambda self, bonus, start: ours_oracle(start))
    ours = spec.speculative_generate(target, draft, embed, head, prompt, LAYER_IDS, 32, [2])
    theirs_oracle = _oracle(reference, len(prompt), head.shape[0])
    monkeypatch.setattr(loaded, "draft_logits", lambda target, bonus, context, start: theirs_oracle(start))
    output = loaded.spec_generate(input_ids=torch.tensor([prompt]), target=target, max_new_tokens=32,
                                  temperature=0.0, stop_token_ids=[2])
    assert output[0, len(prompt):].tolist() == ours.tokens == reference[:len(ours.tokens)]
    assert loaded.last_acceptance_lengths == [a + 1 for a in ours.accepted]
    assert ours.tau > 2
