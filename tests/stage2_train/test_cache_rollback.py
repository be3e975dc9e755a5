"""Rolling the target's cache back after a verified block (TargetRunner.verify / rollback), for the cache kinds
that a plain crop cannot rewind: the recurrent states of a hybrid linear-attention target (Qwen3-Next) and the
sliding-window layers of gpt-oss and Gemma 3 (window 8, shorter than the prompts). Reference: a cache-free forward
of the kept prefix, and plain greedy decoding, of the same float32 target."""

from __future__ import annotations


import pytest
import torch

from dflash.stage2_train import modeling_dflash as loop
from dflash.stage2_train import speculative as spec
from dflash.stage2_train.draft_config import config_from_target
from dflash.stage2_train.modeling_dflash import DFlashDraftModel
from tests.end_to_end.families import load_families

FAMILIES = ["qwen3_next", "gpt_oss", "gemma3_text", "llama"]
BLOCK = 4


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return load_families(FAMILIES, tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_equals_a_fresh_forward_of_the_kept_prefix(targets: dict, family: str) -> None:
    target = targets[family]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(100, 5000, (60,), generator=generator).tolist()
    runner = loop.TargetRunner(target)
    position = 20
    with torch.inference_mode():
        runner.forward(tokens[:position], 0)
        for keep in (0, 3, 1, 6, 2, 5, 0):  # kept block positions of 6 (6 = all accepted, nothing to roll back)
            runner.verify(tokens[position:position + 6], position)
            runner.rollback(position + keep)
            assert loop.cache_length(runner.cache) == position + keep
            position += keep
            tokens[position] = (tokens[position] + 7) % 5000  # the next block differs from the rejected tail
        logits, _ = runner.forward(tokens[position:position + 3], position)
        fresh = target(input_ids=torch.tensor([tokens[:position + 3]])).logits[0, position:].float()
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
    if family == "qwen3_next":
        assert any(loop.has_recurrent_state(layer) for layer in runner.cache.layers)


def _oracle(monkeypatch: pytest.MonkeyPatch, reference: list[int], prompt_len: int, vocab: int) -> None:
    """Drafts = the target's own greedy continuation with one wrong token at a varying offset (or none)."""
    wrong = [2, None, 1, 3, 2, None]
    steps = [0]

    def propose(self: loop.DraftRunner, bonus: int, start: int) -> torch.Tensor:
        offset = wrong[steps[0] % len(wrong)]
        steps[0] += 1
        logits = torch.zeros(BLOCK - 1, vocab)
        for k in range(1, BLOCK):
            index = start - prompt_len + k
            token = reference[index] if index < len(reference) else 0
            logits[k - 1, (token + 1) % vocab if k == offset else token] = 1.0
        return logits

    monkeypatch.setattr(loop.DraftRunner, "propose", propose)


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("crop_refused", [False, True])
def test_partly_accepted_blocks_stay_lossless(targets: dict, family: str, crop_refused: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = targets[family]
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    config = config_from_target(target.config.to_dict(), [1, 2], 1, BLOCK, 5)
    draft = DFlashDraftModel(config).eval()
    prompt = list(range(300, 318))
    reference = spec.greedy_generate(target, prompt, 40 + BLOCK, []).tokens
    _oracle(monkeypatch, reference, len(prompt), embed.shape[0])
    if crop_refused:  # any cache whose crop refuses: rebuilt from the kept tokens
        def refuse(_cache: object, _keep: int) -> None:
            raise RuntimeError("refused")

        monkeypatch.setattr(loop, "crop_cache", refuse)
    result = loop.speculative_generate(target, draft, embed, head, prompt, [1, 2], 40, [])
    assert result.tokens == reference[:40]
    assert {1, 2} & set(result.accepted) and BLOCK - 1 in result.accepted  # partial and whole blocks
