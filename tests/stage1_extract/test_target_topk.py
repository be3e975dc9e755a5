"""`dflash extract --store-target-topk K`: the stored top-k is the target's own next-token distribution, aligned with
the labels, chunked without changing a bit, for every logit transform dflash knows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError
from dflash.shared.target_layers import LayerCapture
from dflash.shared.target_loading import resolve_target
from dflash.stage1_extract import target_topk
from dflash.stage1_extract.target_topk import TargetTopK
from dflash.stage1_extract.worker import ShardExtractor, plan_batches
from tests.conftest import EXTRACT_ARGS, TOPK, run_dflash


def canonical_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The reference order, by another route than `order_keys`: a stable descending sort (ties keep id order)."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def assert_topk_matches(ids: torch.Tensor, logprobs: torch.Tensor, reference_logits: torch.Tensor) -> float:
    """Stored top-k rows (ids [n, K], float16 log-probs [n, K]) against the reference logits [n, V] of the same
    positions: every log-prob is the reference's log-prob of its id to float16 rounding, and the ids are the
    reference's top-k in (logit descending, id ascending) order. Where the reference logits are bit-identical to
    the extraction's (same kernels and shapes) that holds exactly; where kernels chose by shape round differently,
    only ids whose reference logits lie within one bf16 step (2**-7 relative) of each other may trade places.
    Returns the fraction of rows whose ids are exactly the reference's."""
    ids, logprobs = ids.long(), logprobs.float()
    reference = reference_logits.float()
    torch.testing.assert_close(logprobs, torch.log_softmax(reference, dim=-1).gather(1, ids), rtol=1e-3, atol=1e-3)
    expected = canonical_topk(reference, ids.shape[1])
    exact = (ids == expected).all(dim=1)
    ours, theirs = reference.gather(1, ids), reference.gather(1, expected)
    assert bool(((ours - theirs).abs() <= 2**-7 * theirs.abs() + 1e-6).all()), "stored ids are not the top-k"
    return float(exact.float().mean())


# --------------------------------------------------------------------------------------- the computation


def test_order_keys_sort_by_logit_then_id() -> None:
    logits = (torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16).float()
    logits[0, :6], logits[0, 6:9], logits[1] = -0.0, 0.0, float("-inf")  # ties of +-0, a row of -inf
    logits[1, 7] = 2.0
    top = torch.topk(target_topk.order_keys(logits), 40, dim=-1).indices
    assert torch.equal(top, canonical_topk(logits, 40))
    assert top[1, 0] == 7 and torch.equal(top[1, 1:4], torch.tensor([0, 1, 2]))  # -inf ties by id


def test_chunked_topk_equals_a_direct_forward_of_the_batch(smollm2: torch.nn.Module) -> None:
    """The extraction path (decoder to its final norm, LM head over chosen rows in chunks) against the model's own
    forward of the same padded batch: ids exact, log-probs to float16 rounding; every chunk size gives the same
    bits."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 49152, (3, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 29:] = 0
    attention_mask[2, 11:] = 0
    capture = LayerCapture(smollm2, [1, 8], stop_after_last=False)
    try:
        _, final = capture.decoder_features_and_final(input_ids, attention_mask)
    finally:
        capture.remove()
    with torch.inference_mode():
        logits = smollm2(input_ids=input_ids, attention_mask=attention_mask).logits
    rows = attention_mask.bool()
    results = []
    for chunk_rows in (13, 10_000):
        head = TargetTopK(smollm2, 32, chunk_bytes=chunk_rows * target_topk.BYTES_PER_LOGIT * 49152)
        assert head.chunk_rows == chunk_rows
        results.append(head(final[rows]))
    for ids, logprobs in results[1:]:
        assert torch.equal(ids, results[0][0]) and torch.equal(logprobs, results[0][1])
    ids, logprobs = results[0]
    assert ids.dtype == torch.int32 and logprobs.dtype == torch.float16 and ids.shape == (int(rows.sum()), 32)
    assert assert_topk_matches(ids, logprobs, logits[rows]) == 1.0
    assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())


def _tiny_model(family: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                  max_position_embeddings=128, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)  # logits of a few units, where soft-capping and scaling bite
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("family,overrides", [
    ("qwen3", {}),
    ("gemma2", {"final_logit_softcapping": 2.0}),  # cap * tanh(logits / cap)
    ("granite", {"logits_scaling": 3.0}),  # logits / s
    ("cohere", {"logit_scale": 0.5}),  # logits * s
])
def test_topk_follows_each_family_logit_transform(family: str, overrides: dict) -> None:
    model = _tiny_model(family, **overrides)
    head = TargetTopK(model, 16)
    head.check()
    input_ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        final = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state[0]
        logits = model(input_ids=input_ids).logits[0]
    ids, logprobs = head(final)
    assert assert_topk_matches(ids, logprobs, logits) == 1.0


def test_a_logit_transform_dflash_does_not_know_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_model("gemma2", final_logit_softcapping=2.0)
    monkeypatch.setattr(target_topk, "logit_transform", lambda config: None)
    with pytest.raises(UserError, match="extract without --store-target-topk"):
        TargetTopK(model, 16).check()


# --------------------------------------------------------------------------------------------- the cache


def test_cached_topk_is_the_target_forward_of_the_extraction_batches(topk_cache: Path,
                                                                     smollm2: torch.nn.Module) -> None:
    """Every stored row against the model's own forward of the batch extraction formed (samples sorted longest
    first, token-budget batches, right padding): row r of a sample is the distribution the target predicted for
    its r-th supervised token, from the position before it. Where the data's next token is the target's greedy
    choice, the stored top-1 is that label. (Shard 0 of 3: the others are made by the same code.)"""
    manifest = cf.read_manifest(topk_cache)
    assert manifest["identity"]["target_topk"] == {"k": TOPK, "ids_dtype": "uint16", "logprobs_dtype": "float16"}
    batch_tokens = int(EXTRACT_ARGS[EXTRACT_ARGS.index("--batch-tokens") + 1])
    rows = greedy_labels = 0
    for store in [cf.shard_path(topk_cache, 0)]:
        reader = cf.ShardReader(store)
        assert reader.topk_problem(cf.TopKFormat.of_manifest(manifest)) is None
        lengths = np.diff(reader.offsets).tolist()
        for batch in plan_batches(lengths, batch_tokens, 8):
            width = -(-max(lengths[i] for i in batch) // 8) * 8
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(batch):
                input_ids[row, : lengths[i]] = torch.from_numpy(reader.sample_tokens(i)[0].astype(np.int64))
                attention_mask[row, : lengths[i]] = 1
            with torch.inference_mode():
                logits = smollm2(input_ids=input_ids, attention_mask=attention_mask).logits
            for row, i in enumerate(batch):
                tokens, mask = reader.sample_tokens(i)
                positions = np.flatnonzero(cf.topk_positions(mask, np.array([0, len(tokens)])))
                ids, logprobs = (torch.from_numpy(a.astype(np.float32 if a.dtype == np.float16 else np.int64))
                                 for a in reader.sample_topk(i))
                assert ids.shape == (len(positions), TOPK)
                assert_topk_matches(ids, logprobs, logits[row, positions - 1])
                greedy = logits[row, positions - 1].float().argmax(dim=-1).numpy() == tokens[positions]
                assert np.array_equal(ids[greedy, 0].numpy(), tokens[positions][greedy])
                rows += len(positions)
                greedy_labels += int(greedy.sum())
    assert rows == manifest["shards"]["0"]["loss_tokens"] and greedy_labels > 0


def test_topk_cache_keeps_the_features_and_verifies(topk_cache: Path, baseline_cache: Path) -> None:
    """Storing the top-k changes nothing else (the forward now runs to the end, the captured layers are the same);
    `inspect` states the bytes with and without it; `--verify` re-reads the top-k arrays and names damage."""
    from tests.cache_compare import read_cache_arrays

    with_topk, without = read_cache_arrays(topk_cache), read_cache_arrays(baseline_cache)
    for store, arrays in without.items():
        for name, values in arrays.items():
            np.testing.assert_array_equal(with_topk[store][name], values, err_msg=f"{store}/{name}")
    summary = json.loads(run_dflash("inspect", "--cache", str(topk_cache), "--verify", "--json", check=True).stdout)
    tokens, supervised = summary["tokens"], summary["loss_tokens"]
    feature_row = 2 * 5 * 576  # bf16 features of 5 layers
    assert summary["bytes_per_token"] == feature_row
    assert summary["topk_bytes_per_supervised_token"] == TOPK * (2 + 2)  # uint16 ids + float16 log-probs
    assert summary["topk_bytes"] == supervised * TOPK * 4  # every conversation's first token is a template token
    assert summary["bytes_per_token_with_topk"] == round(feature_row + supervised * TOPK * 4 / tokens, 1)
    text = run_dflash("inspect", "--cache", str(topk_cache), check=True).stdout
    assert f"{feature_row}.0 without the target top-k" in text and "k = 8: 32 bytes per supervised token" in text
    assert summary["verify"]["ok"]


def test_the_training_loader_reads_the_topk_only_for_an_objective_that_uses_it(topk_cache: Path) -> None:
    """The loader of `dflash train --loss kl|mix` yields the stored top-k beside the features; that of `--loss ce`
    (read_topk=False) leaves the arrays unread and yields the same batches without them."""
    from dflash.stage2_train.cache_index import CacheIndex
    from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch
    from dflash.stage2_train.packed_batches import CacheBatches

    index = CacheIndex.from_cache(topk_cache, 0.0, 0)
    plan = plan_epoch(index, 0, 0, 2048, 1, AnchorRule(None, 8, 16))[:3]
    options = {"epoch": 0, "seed": 0, "rule": AnchorRule(None, 8, 16), "bucket_multiple": 8}
    for position in range(len(plan)):
        with_topk = CacheBatches(topk_cache, plan, **options).batch(position)
        without = CacheBatches(topk_cache, plan, **options, read_topk=False).batch(position)
        assert with_topk["topk_ids"].shape[1] == TOPK and int(with_topk["topk_ids"].count_nonzero()) > 0
        assert set(with_topk) - set(without) == {"topk_ids", "topk_logprobs"}
        for key, value in without.items():
            assert torch.equal(value, with_topk[key]) if torch.is_tensor(value) else value == with_topk[key], key


def _unsorted_topk_row(topk_cache: Path, cache: Path) -> None:
    """A copy of the cache whose shard 1 has a top-k row out of order, with valid checksums (zarr rewrote it)."""
    import shutil

    import zarr

    shutil.copytree(topk_cache, cache)
    logprobs = zarr.open_group(str(cf.shard_path(cache, 1)), mode="r+")[cf.TOPK_LOGPROBS]
    logprobs[3] = np.asarray(logprobs[3])[::-1]


def test_verify_names_a_damaged_topk_array(topk_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _unsorted_topk_row(topk_cache, cache)
    result = run_dflash("inspect", "--cache", str(cache), "--verify")
    assert result.returncode == 1
    assert "DAMAGED shard 1" in result.stdout and "not sorted" in result.stdout
    assert "DAMAGED shard 0" not in result.stdout and "DAMAGED shard 2" not in result.stdout
    assert f"dflash extract --repair --out {cache}" in result.stdout


@pytest.mark.slow
def test_repair_redoes_a_damaged_topk_shard_with_the_recorded_k(topk_cache: Path, tmp_path: Path) -> None:
    """`extract --repair` redoes the damaged shard with the recorded --store-target-topk, back to the original."""
    import zarr

    cache = tmp_path / "cache"
    _unsorted_topk_row(topk_cache, cache)
    repair = run_dflash("extract", "--repair", "--out", str(cache))
    assert repair.returncode == 0 and "repairing shards [1]" in repair.stderr, repair.stderr[-2000:]
    assert run_dflash("inspect", "--cache", str(cache), "--verify").returncode == 0
    for shard in range(3):
        repaired = zarr.open_group(str(cf.shard_path(cache, shard)), mode="r")
        original = zarr.open_group(str(cf.shard_path(topk_cache, shard)), mode="r")
        for name in (cf.TOPK_IDS, cf.TOPK_LOGPROBS, cf.TOPK_OFFSETS):
            np.testing.assert_array_equal(repaired[name][:], original[name][:], err_msg=f"shard {shard}: {name}")


def test_store_target_topk_outside_the_vocabulary_is_refused(chat_jsonl: Path, tmp_path: Path) -> None:
    result = run_dflash("extract", "--data", str(chat_jsonl), "--out", str(tmp_path / "c"), "--max-samples", "1",
                        "--store-target-topk", "49153")
    assert result.returncode == 2
    assert "--store-target-topk 49153: choose K between 1 and the target's vocabulary size (49152)" in result.stderr


def test_extractor_skips_the_layers_above_the_last_capture_only_without_topk(smollm2: torch.nn.Module,
                                                                             tmp_path: Path) -> None:
    """The early exit stays for caches that do not ask for the top-k."""
    from dflash.stage1_extract.worker import WorkerConfig

    def extractor(topk: dict | None) -> ShardExtractor:
        config = WorkerConfig(cache_dir=tmp_path, load_path=resolve_target(None).load_path, layer_ids=[1, 8],
                              max_length=64, overlength="truncate", batch_tokens=64, stop_token_ids=[2],
                              log_file=tmp_path / "log", topk=topk)
        return ShardExtractor(config, torch.device("cpu"), report=lambda *a: None, model=smollm2,
                              tokenizer=object())

    plain = extractor(None)
    with_topk = extractor(cf.TopKFormat.for_vocab(4, 49152).record())
    try:
        assert plain.capture._stop_at == 8 and plain.topk_head is None
        assert with_topk.capture._stop_at is None and with_topk.topk_head.k == 4
    finally:
        plain.capture.remove()
        with_topk.capture.remove()
