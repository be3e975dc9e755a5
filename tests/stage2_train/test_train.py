"""Stage 2 end to end: the real `dflash train` CLI on a cache extracted from the embedded SmolLM2 target."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.shared import cache_format as cf
from dflash.shared.errors import UserError
from dflash.shared.run_files import RunFiles
from dflash.stage2_train.acceptance import offline_acceptance
from dflash.stage2_train.cache_index import CacheIndex
from dflash.stage2_train.epoch_plan import AnchorRule, plan_epoch
from dflash.stage2_train.eval_set import eval_sequences
from dflash.stage2_train.options import DEFAULT_ANCHOR_DENSITY, TrainOptions
from dflash.stage2_train.run_setup import cosine_with_warmup
from dflash.stage2_train.draft_attention import training_drafter
from dflash.stage2_train.draft_config import DFlashConfig
from dflash.stage2_train.export import load_draft
from dflash.stage2_train.target_parts import load_target_parts, resolve_mask_token
from tests.conftest import REPO, assert_same_training, run_dflash, step_records
from tests.stage2_train.conftest import SPLIT, TEST_ANCHOR_DENSITY, TRAIN_ARGS, final_losses

REFERENCE_LAYER_KEYS = [
    "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight",
]
def test_mask_token_for_smollm2_is_an_unused_special_token(train_cache: Path) -> None:
    parts = load_target_parts(train_cache)
    assert parts.vocab_size == 49152 and parts.hidden_size == 576
    assert resolve_mask_token(parts) == 16  # <empty_output>: special, unused by template, bos/eos/pad
    assert resolve_mask_token(parts, explicit=7) == 7
    assert resolve_mask_token(parts, previous=9) == 9
    with pytest.raises(UserError):
        resolve_mask_token(parts, explicit=49152)


def test_train_learns_beats_untrained_and_exports_the_reference_format(train_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--epochs", "6", "--lr", "4e-3",
                        "--eval-every", "0", "--checkpoint-every", "0", *TRAIN_ARGS, "--max-anchors", "12")
    assert result.returncode == 0, result.stderr[-3000:]
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    for key in ("block_size", "num_target_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_hidden_layers", "rope_theta", "rms_norm_eps", "layer_types"):
        assert key in config, key
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27], "embed_scale": 1.0,
                                       "target_model_type": "llama", "block_size": 16}
    assert config["num_hidden_layers"] == len(config["layer_types"]) == 1 and config["num_target_layers"] == 30
    weights = load_file(str(export / "model.safetensors"))
    expected = sorted([f"layers.0.{k}" for k in REFERENCE_LAYER_KEYS] + ["fc.weight", "hidden_norm.weight",
                                                                        "norm.weight"])
    assert sorted(weights) == expected
    assert weights["fc.weight"].shape == (576, 5 * 576)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)

    # Reload: the exported folder gives exactly the logits of the trained weights (as stored, bf16).
    reloaded = load_draft(export).eval()
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    trained = training_drafter(DFlashConfig.from_dict(json.loads((run / "draft_config.json").read_text()))).eval()
    trained.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in
                             load_file(str(checkpoint / "model.safetensors")).items()})
    generator = torch.Generator().manual_seed(0)
    noise, context = torch.randn(1, 16, 576, generator=generator), torch.randn(1, 40, 5 * 576, generator=generator)
    positions = torch.arange(40, 56)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(noise, context, positions), trained(noise, context, positions))

    # Learning: held-out offline acceptance beats the untrained drafter of the same configuration.
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained_tau = [m for m in metrics if "eval/tau_walk" in m][-1]["eval/tau_walk"]
    parts = load_target_parts(train_cache)
    untrained = training_drafter(DFlashConfig.from_dict(json.loads((run / "draft_config.json").read_text())))
    index = CacheIndex.from_cache(train_cache, SPLIT[0], 0)
    with torch.no_grad():
        untrained_tau = offline_acceptance(untrained, parts.embed_tokens.float(), parts.lm_head.float(),
                                           eval_sequences(index, 6), 16, 16)["tau_walk"]
    losses = final_losses(run)
    assert losses[max(losses)] < 0.6 * losses[1]
    assert untrained_tau < 1.1
    # 6 epochs (30 steps) give ~1.2 on this machine (12 epochs: ~1.34, at twice the suite's longest test); the
    # walk's standard error over these sequences is ~0.01, so +0.15 is learning, not noise.
    assert trained_tau > untrained_tau + 0.15, (trained_tau, untrained_tau)
    assert (run / "training.png").is_file() and list((run / "tensorboard").iterdir())

    # The chosen drafter (export_best/: with --eval-every 0, the end's) on the whole test split, once: what
    # offline_acceptance gives for that export over the test split's sequences, with its standard error.
    three_way = CacheIndex.from_cache(train_cache, *SPLIT[:1], 0, test_fraction=SPLIT[1])
    test = json.loads((run / "test_results.json").read_text())
    with torch.no_grad():
        reference = offline_acceptance(load_draft(run / "export_best"), parts.embed_tokens.float(),
                                       parts.lm_head.float(), eval_sequences(three_way, None, "test"), 16, 16)
    assert test["sequences"] == len(three_way.test) == 4 and test["drafter"] == "export_best"
    assert test["tau_walk"] == reference["tau_walk"] and test["tau_walk_stderr"] == reference["tau_walk_stderr"]
    assert test["step"] == max(losses) and test["tau_walk_ci95"] == pytest.approx(
        [test["tau_walk"] - 1.96 * test["tau_walk_stderr"], test["tau_walk"] + 1.96 * test["tau_walk_stderr"]])
    assert f"test split, 4 sequences never used for training or selection: tau {test['tau_walk']:.3f}" in (
        result.stderr.strip().splitlines()[-1])

    # Live speculative decoding on test-split sequences, next to the offline walk over them (CLI). One thread: the
    # many small ops of decoding slow down ~4x when torch's 2 threads share the 2 cores with another test process
    # (measured: 125 s with the default threads, 35 s with --threads 1, beside another test run).
    result = run_dflash("eval", "--draft", str(export), "--data", "heldout", "--max-samples", "3",
                        "--max-new-tokens", "24", "--threads", "1", "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    heldout = json.loads((tmp_path / "eval" / "eval.json").read_text())["datasets"]["heldout"]
    assert heldout["prompts"] == 3 and heldout["offline"]["sequences"] == 3 and heldout["split"] == "test"
    assert [s["id"] for s in heldout["samples"]] == [s["sample_id"] for s in eval_sequences(three_way, 3, "test")]
    # 3 test sequences cut to 24 tokens: 1.27 measured on one machine, 1.18 on another (the same commit), so the
    # bound is their standard error's, not a fixed margin (learning itself is asserted above, on the validation split)
    offline = heldout["offline"]
    assert offline["tau_walk"] > untrained_tau + 2 * offline["tau_walk_stderr"], (offline, untrained_tau)
    assert heldout["tau"] > 1.0 and heldout["greedy_identical"] + heldout["tie_divergences"] == 3
    assert "offline walk tau" in (tmp_path / "eval" / "eval.md").read_text()
    # The export carries the cache's record of its rendering, and eval renders as extract did: no parity finding.
    parity = json.loads((tmp_path / "eval" / "eval.json").read_text())["parity"]
    assert parity["cache"] == cf.read_manifest(train_cache)[cf.RENDERING_KEY] and parity["mismatches"] == 0
    assert parity["summary"].startswith("prompts are rendered as the training cache's"), parity["summary"]
    training = json.loads((tmp_path / "eval" / "eval.json").read_text())["training"]
    assert training["trained_tau_walk"] == trained_tau and training["untrained_tau_walk"] is None  # --eval-every 0
    assert training["test"]["tau_walk"] == test["tau_walk"]
    # Clear refusals at the CLI: a folder without an export, an unknown dataset, a target of another size.
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other-target"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    for args, message in ((["--draft", str(tmp_path)], "no exported drafter"),
                          (["--draft", str(export), "--data", "nope"], "unknown dataset"),
                          (["--draft", str(export), "--model", str(other)], "hidden size 576 != the target's 64")):
        refused = run_dflash("eval", *args, "--out", str(tmp_path / "e2"), "--max-samples", "1")
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, (
            args, refused.stderr[-2000:])


def test_two_processes_give_the_same_update_as_one_with_accumulation(train_cache: Path, tmp_path: Path) -> None:
    runs = {}
    for name, args in {"ddp2": ("--processes", "2", "--grad-accum", "1"),
                       "single": ("--processes", "1", "--grad-accum", "2")}.items():
        runs[name] = tmp_path / name
        result = run_dflash("train", "--cache", str(train_cache), "--out", str(runs[name]), "--max-steps", "2",
                            "--eval-every", "0", "--checkpoint-every", "0", "--num-workers", "0", *TRAIN_ARGS[:6],
                            "--batch-tokens", "8192", "--lr", "6e-4",
                            "--eval-fraction", "0.15", "--eval-sequences", "1", "--mixed-precision", "no", *args)
        assert result.returncode == 0, result.stderr[-3000:]
    weights = [load_file(str(sorted((runs[n] / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
               for n in ("ddp2", "single")]
    # Equal up to float summation order (all-reduce vs accumulation): ~1e-6 after two Adam steps of lr 6e-4,
    # while a wrong loss normalisation or a missed micro-batch moves weights by the order of lr.
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-4, atol=1e-5, msg=key)
    assert final_losses(runs["ddp2"]) == pytest.approx(final_losses(runs["single"]), rel=1e-5)


def test_resume_keeps_the_runs_own_length_schedule_and_step_size(train_cache: Path, tmp_path: Path) -> None:
    """`--resume` without the run's recipe flags goes on with those it recorded (defaults change between versions:
    another step size would be refused, another length would stretch the schedule); a flag given is kept."""
    i = TRAIN_ARGS.index("--batch-tokens")
    other = (*TRAIN_ARGS[:i], *TRAIN_ARGS[i + 2:], "--eval-every", "0", "--checkpoint-every", "1")
    recipe = ("--lr", "3e-3", "--warmup", "0.5", "--batch-tokens", "2304")
    run = tmp_path / "run"
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--max-steps", "2", *recipe,
                      *other).returncode == 0
    resumed = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", *other)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--resume: the run's own --max-steps 2, --lr 0.003, --warmup 0.5, --batch-tokens 2304 (not given" \
        in resumed.stderr  # the recipe flags that differ from the defaults (--epochs, --clip ... do not)
    recipe_of = lambda options: tuple(options[k] for k in ("epochs", "max_steps", "lr", "warmup", "weight_decay",  # noqa: E731
                                                           "clip", "batch_tokens", "grad_accum"))
    assert recipe_of(json.loads(RunFiles(run).options.read_text())) == (16, 2, 3e-3, 0.5, 0.0, 1.0, 2304, 1)
    # The run's rate lives in its optimizer state, which the resume restores: another --lr is refused, not ignored.
    refused = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", "--lr", "1e-3", *other)
    assert refused.returncode == 2 and "trains at --lr 0.003, which its optimizer state holds" in refused.stderr
    # --max-steps given: the run goes on to step 4 with its own warm-up and step size, its schedule now over 4
    # steps (the trainer's own schedule function gives the rate step 3 records: the one after its update).
    longer = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", "--max-steps", "4", *other)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "--resume: the run's own --lr 0.003, --warmup 0.5, --batch-tokens 2304 (not given" in longer.stderr
    step3 = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("step") == 3 and "loss" in r]
    assert step3 and step3[-1]["lr"] == pytest.approx(3e-3 * cosine_with_warmup(4, 0.5)(3))  # the 4-step schedule
    assert recipe_of(json.loads(RunFiles(run).options.read_text())) == (16, 4, 3e-3, 0.5, 0.0, 1.0, 2304, 1)
    # --epochs given: the run's --max-steps goes with it (the length is one choice), so its epochs count.
    from dflash.stage2_train.cli import recorded_recipe

    assert recorded_recipe(run, {"epochs": 3})["max_steps"] is None


def test_killed_training_resumes_to_the_same_loss_curve(train_cache: Path, tmp_path: Path) -> None:
    args = ("--max-steps", "8", "--eval-every", "0", "--checkpoint-every", "3", "--lr", "3e-3", *TRAIN_ARGS)
    straight = tmp_path / "straight"
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(straight), *args).returncode == 0
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "dflash.shared.cli", "train", "--cache", str(train_cache), "--out",
                                str(killed), *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-00000003" / "complete").is_file():
        assert time.time() < deadline and process.poll() is None, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    resumed = run_dflash("train", "--cache", str(train_cache), "--out", str(killed), "--resume", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    # Resuming must replay exactly the same data, anchors and schedule; the losses agree up to float noise between
    # processes (~3e-5 after 8 steps), while a resume that drops the optimizer moments or the data position moves
    # them by far more than 1e-4 (checked by breaking each on purpose).
    assert sorted(step_records(killed)) == list(range(1, 9))
    assert_same_training(killed, straight, loss_rel=1e-4)


def test_train_fraction_trains_on_part_of_the_training_split_and_says_so(train_cache: Path, tmp_path: Path) -> None:
    """`dflash train --train-fraction 0.5`: the run's log names the training samples left out, its record keeps the
    fraction, and its held-out splits are those without it (it reports on the whole test split)."""
    run = tmp_path / "run"
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--max-steps", "1",
                        "--eval-every", "0", *TRAIN_ARGS, "--train-fraction", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    whole = CacheIndex.from_cache(train_cache, SPLIT[0], 0, SPLIT[1])
    half = CacheIndex.from_cache(train_cache, SPLIT[0], 0, SPLIT[1], train_fraction=0.5)
    assert 0 < len(half.train) < len(whole.train)
    assert f"{len(half.train)} train / {len(whole.eval)} validation / {len(whole.test)} test samples " \
        f"({len(whole.train) - len(half.train)} left out by --train-fraction 0.5)" in result.stderr
    assert json.loads((run / "train_options.json").read_text())["train_fraction"] == 0.5
    assert json.loads((run / "test_results.json").read_text())["sequences"] == len(whole.test)
    from dflash.stage2_train.run_setup import keep_recorded_plan

    recorded = dict(cache=train_cache, out=run, resume=True, max_anchors=24, anchor_density=TEST_ANCHOR_DENSITY,
                    test_fraction=SPLIT[1])  # the run's TRAIN_ARGS
    keep_recorded_plan(TrainOptions(**recorded, train_fraction=0.5), RunFiles(run))  # its own fraction: resumed
    with pytest.raises(UserError, match="--train-fraction: the run has 0.5, this command gives 1.0"):
        keep_recorded_plan(TrainOptions(**recorded), RunFiles(run))


def test_a_run_without_a_test_split_evaluates_its_validation_split_and_resumes_only_with_its_split(
        train_cache: Path, tmp_path: Path) -> None:
    """A run trained with --test-fraction 0 has one held-out split: `dflash eval --data heldout` takes its
    validation split. --resume refuses split flags other than the run's, and a run whose train_options.json does
    not record them, with one line (as does eval)."""
    from dflash.stage2_train.evaluate import heldout_prompts
    from dflash.stage2_train.run_setup import keep_recorded_plan

    run = tmp_path / "run"
    args = ("--max-steps", "1", "--eval-every", "0", *TRAIN_ARGS)
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(run), *args, "--test-fraction", "0").returncode == 0
    assert not (run / "test_results.json").exists()
    prompts, split = heldout_prompts(run / "export", 2, 8)
    validation = list(eval_sequences(CacheIndex.from_cache(train_cache, SPLIT[0], 0), 2))
    assert split == "validation" and [p.id for p in prompts] == [s["sample_id"] for s in validation]
    recorded = dict(cache=train_cache, out=run, resume=True, test_fraction=0.0, max_anchors=24,
                    anchor_density=TEST_ANCHOR_DENSITY)  # the run's TRAIN_ARGS
    keep_recorded_plan(TrainOptions(**recorded), RunFiles(run))  # its own flags: resumed
    with pytest.raises(UserError, match="split its cache or drew its anchors otherwise:\n  --eval-fraction: the run "
                                        "has 0.05, this command gives 0.2\nresume with the flags it was started with"):
        keep_recorded_plan(TrainOptions(**{**recorded, "eval_fraction": 0.2}), RunFiles(run))
    with pytest.raises(UserError, match="--train-fraction: the run has 1.0, this command gives 0.5\n"):
        keep_recorded_plan(TrainOptions(**{**recorded, "train_fraction": 0.5}), RunFiles(run))
    # the anchor defaults changed on 2026-12-06: a run started with other anchors is not resumed with today's
    with pytest.raises(UserError, match="drew its anchors otherwise:\n  --anchor-density: the run has "
                                        f"{TEST_ANCHOR_DENSITY}, this command gives 1.0\n  --max-anchors: the run has "
                                        "24, this command gives 64\n"):
        keep_recorded_plan(TrainOptions(cache=train_cache, out=run, resume=True, test_fraction=0.0), RunFiles(run))
    options = json.loads((run / "train_options.json").read_text())
    del options["test_fraction"]
    (run / "train_options.json").write_text(json.dumps(options))
    unrecorded = f"{run / 'train_options.json'} does not record test_fraction: this dflash cannot go on with or " \
        f"evaluate the run in {run}; train it afresh"
    with pytest.raises(UserError, match=re.escape(unrecorded)):
        keep_recorded_plan(TrainOptions(cache=train_cache, out=run, resume=True, test_fraction=0.0), RunFiles(run))
    with pytest.raises(UserError, match=re.escape(unrecorded)):
        heldout_prompts(run / "export", 2, 8)


def test_epochs_of_different_step_counts_train_to_the_end(train_cache: Path, tmp_path: Path) -> None:
    # Each epoch packs a new shuffle into micro-batches, so a later epoch can hold fewer micro-batches than the
    # first one: the largest token budget at which it does on this cache.
    index = CacheIndex.from_cache(train_cache, 0.05, 0, TrainOptions.test_fraction)
    budget, counts = next((b, c) for b in range(2048, 128, -16)
                          if (c := [len(plan_epoch(index, e, 0, b, 1, AnchorRule(DEFAULT_ANCHOR_DENSITY, 2, 16)))
                                    for e in range(3)])[1] < c[0])
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / "run"), "--epochs", "3",
                        "--batch-tokens", str(budget), "--max-anchors", "2", "--draft-layers", "1",
                        "--eval-every", "0", "--checkpoint-every", "0", "--num-workers", "0",
                        "--eval-fraction", "0.05", "--eval-sequences", "1", "--mixed-precision", "no")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(final_losses(tmp_path / "run")) == list(range(1, sum(counts) + 1))


def test_resume_into_a_run_of_another_drafter_is_refused(train_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("--max-steps", "1", "--eval-every", "0", "--checkpoint-every", "1", *TRAIN_ARGS)
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(run), *args).returncode == 0
    refused = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", *args,
                         "--block-size", "8")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "block_size: the run has 16, this cache and these flags give 8" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert json.loads((run / "draft_config.json").read_text())["block_size"] == 16  # the run is left as it was


def test_resume_with_another_epoch_plan_is_refused_and_the_same_plan_resumes(train_cache: Path,
                                                                             tmp_path: Path) -> None:
    """A saved data position holds only in the plan it was saved in: --resume with another --batch-tokens (or
    --grad-accum, processes, or more finished shards) is refused in one line naming what changed; with the same
    flags, and a longer --max-steps, it resumes."""
    run = tmp_path / "run"
    args = ("--eval-every", "0", "--checkpoint-every", "1", *TRAIN_ARGS)
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--max-steps", "1", *args).returncode == 0
    refused = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", "--max-steps", "2", *args,
                         "--batch-tokens", "768")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "were planned otherwise" in refused.stderr and "--batch-tokens: the run had 2,304, now 768" in refused.stderr
    assert "Traceback" not in refused.stderr
    resumed = run_dflash("train", "--cache", str(train_cache), "--out", str(run), "--resume", "--max-steps", "2", *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(final_losses(run)) == [1, 2]


def test_init_from_an_export_starts_from_its_weights_and_refuses_another_drafter(train_cache: Path,
                                                                                 tmp_path: Path) -> None:
    """--init-from EXPORT: the new run starts from the export's weights (with an lr too small to move them, its own
    export is the same bit for bit, and its step-0 evaluation equals the end of the first run's); an export of
    another drafter shape, or a folder that is no export, is refused by name. The first run also keeps the drafter
    of its best held-out evaluation after step 0 in export_best/, with that evaluation's step and tau."""
    args = ("--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "0", *TRAIN_ARGS)
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(first), *args, "--eval-every", "1",
                      "--lr", "3e-2").returncode == 0
    first_taus = {r["step"]: r["eval/tau_walk"] for r in map(json.loads, (first / "metrics.jsonl").read_text()
                                                             .splitlines()) if "eval/tau_walk" in r and r["step"]}
    best_step = max(first_taus, key=lambda step: (first_taus[step], -step))  # the first of equal ones
    best = json.loads((first / "export_best" / "best.json").read_text())
    assert best == {"step": best_step, "tau_walk": first_taus[best_step]} and sorted(first_taus) == [1, 2]
    best_weights, last_weights = (load_file(str(first / name / "model.safetensors")) for name in ("export_best",
                                                                                                   "export"))
    assert all(torch.equal(best_weights[k], last_weights[k]) for k in last_weights) == (best_step == 2)
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(second), *args, "--lr", "1e-30",
                        "--init-from", str(first / "export"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--init-from: starting from the weights of" in result.stderr
    exported = [load_file(str(run / "export" / "model.safetensors")) for run in (first, second)]
    assert sorted(exported[0]) == sorted(exported[1])
    for key in exported[0]:
        assert torch.equal(exported[0][key], exported[1][key]), key
    evaluations = [[r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                    if "eval/tau_walk" in r] for run in (first, second)]
    untrained_tau, first_tau, started_tau = (evaluations[0][0]["eval/tau_walk"], evaluations[0][-1]["eval/tau_walk"],
                                             evaluations[1][0]["eval/tau_walk"])
    assert started_tau == pytest.approx(first_tau, rel=0.02) and first_tau != untrained_tau
    for init, flags, message in (
        (first / "export", ("--block-size", "8"), "block_size: the export has 16, this cache and these flags give 8"),
        (first, (), "no config.json there"),  # the run folder, not its export
    ):
        refused = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / "refused"), *args,
                             *flags, "--init-from", str(init))
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert message in refused.stderr and "Traceback" not in refused.stderr


def test_compiled_layers_train_like_eager_ones(train_cache: Path, tmp_path: Path) -> None:
    """--compile: each decoder layer through torch.compile (inductor, also on CPU) trains on the same data to the
    same losses up to float noise, and the checkpoint and export keep the uncompiled weight names."""
    # No held-out split (faster): evaluations run uncompiled anyway (`uncompiled_sdpa`, test_loss_acceptance.py).
    args = ("--max-steps", "3", "--eval-every", "0", "--checkpoint-every", "0", *TRAIN_ARGS, "--eval-fraction", "0",
            "--num-workers", "0")
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert run_dflash("train", "--cache", str(train_cache), "--out", str(eager), *args).returncode == 0
    result = run_dflash("train", "--cache", str(train_cache), "--out", str(compiled), *args, "--compile")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compile: 1 decoder layers compile" in result.stderr
    graphs = re.search(r"compile: (\d+) graphs compiled", result.stderr)
    assert graphs and int(graphs.group(1)) >= 1, result.stderr[-2000:]  # the layers really went through dynamo
    assert "recompile limit was reached" not in result.stderr
    assert_same_training(compiled, eager, loss_rel=1e-4)
    weights = [load_file(str(run / "export" / "model.safetensors")) for run in (compiled, eager)]
    assert sorted(weights[0]) == sorted(weights[1])
    # Adam moves an element by about lr per step whatever the size of its gradient, so where the true gradient is ~0
    # float noise picks the sign and the two runs may differ there by 2 lr per step (seen in CI: a k_proj element).
    # So: nearly every element agrees to bf16 rounding, and none differs by more than Adam's bound on its updates,
    # lr * (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr per step, twice (once per run).
    max_move = 2 * 3.2 * sum(r["lr"] for r in step_records(eager).values())
    for key in weights[1]:
        got, want = weights[0][key].float(), weights[1][key].float()
        difference, rounding = (got - want).abs(), 2 ** -7 * want.abs() + 1e-5
        assert float((difference > rounding).float().mean()) < 1e-3, key
        assert bool((difference <= max_move + rounding).all()), (key, float(difference.max()), max_move)


def test_export_command_exports_the_latest_checkpoint_also_an_fsdp_one(train_cache: Path, tmp_path: Path) -> None:
    """`dflash export --run`: the latest complete checkpoint, written by DDP (model.safetensors) or by FSDP
    (Accelerate's full-state pytorch_model_fsdp.bin), becomes the same HF folder as the run's own export."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from safetensors.torch import save_file


    config = DFlashConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, block_size=16, num_target_layers=30,
                          dflash_config={"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27]})
    torch.manual_seed(3)
    states = {step: training_drafter(config).state_dict() for step in (1, 2)}
    for layout in ("ddp", "fsdp"):
        run = tmp_path / layout
        (run / "checkpoints").mkdir(parents=True)
        (RunFiles(run).draft_config).write_text(json.dumps(config.to_dict()))
        (RunFiles(run).cache_manifest).write_text((train_cache / cf.MANIFEST_FILE).read_text())
        for step, state in states.items():
            folder = run / "checkpoints" / f"step-{step:08d}"
            folder.mkdir()
            if layout == "ddp":
                save_file(state, str(folder / "model.safetensors"))
            else:
                torch.save(state, folder / f"{FSDP_MODEL_NAME}.bin")
            (folder / "complete").write_text(str(step))
        (run / "checkpoints" / "step-00000003").mkdir()  # an unfinished checkpoint (no `complete`) is passed over
        result = run_dflash("export", "--run", str(run))
        assert result.returncode == 0, result.stderr[-2000:]
        exported = load_file(str(run / "export" / "model.safetensors"))
        assert sorted(exported) == sorted(states[2])
        for key, value in states[2].items():
            assert torch.equal(exported[key], value.to(torch.bfloat16)), (layout, key)
        assert json.loads((run / "export" / "config.json").read_text())["dflash_config"] == config.to_dict()[
            "dflash_config"]
    empty = tmp_path / "empty"
    (empty / "checkpoints" / "step-00000001").mkdir(parents=True)
    (empty / "checkpoints" / "step-00000001" / "complete").write_text("1")
    RunFiles(empty).draft_config.write_text(json.dumps(config.to_dict()))
    refused = run_dflash("export", "--run", str(empty))
    assert refused.returncode == 2 and "holds neither model.safetensors" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fsdp_without_gpus_is_refused(train_cache: Path, tmp_path: Path) -> None:
    refused = run_dflash("train", "--cache", str(train_cache), "--out", str(tmp_path / "run"), "--fsdp",
                         "--max-steps", "1")
    assert refused.returncode == 2 and "--fsdp needs CUDA GPUs" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr


def test_train_refuses_a_damaged_cache_naming_the_shard(train_cache: Path, tmp_path: Path) -> None:
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    shutil.rmtree(cf.shard_path(cache, 1))
    result = run_dflash("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert result.returncode == 2
    assert "shard 1" in result.stderr and f"dflash extract --repair --out {cache}" in result.stderr
    assert "Traceback" not in result.stderr


def test_keep_checkpoints_deletes_all_but_the_newest(tmp_path: Path) -> None:
    from dflash.shared.run_files import RunFiles
    from dflash.stage2_train.checkpoints import prune_checkpoints

    files = RunFiles(tmp_path / "run")
    for step in (2, 4, 6, 8):
        files.checkpoint(step).mkdir(parents=True)
        (files.checkpoint(step) / "complete").write_text(str(step))
    files.checkpoint(5).mkdir()  # a save killed half-way, older than the newest complete one
    files.checkpoint(9).mkdir()  # a save in progress: newer, left alone
    deleted = prune_checkpoints(files, keep=2)
    assert sorted(p.name for p in deleted) == ["step-00000002", "step-00000004", "step-00000005"]
    assert sorted(p.name for p in files.checkpoints.iterdir()) == ["step-00000006", "step-00000008", "step-00000009"]
    assert prune_checkpoints(files, keep=0) == []  # 0 keeps every complete checkpoint


def test_overwrite_discards_a_run_of_an_earlier_version_with_its_retired_files(tmp_path: Path) -> None:
    """A run made before 2026-12-07 with --init-from-target (removed) holds target_init.json: it is still a run
    (not refused as a foreign folder), and --overwrite discards that file with the rest; the logs stay."""
    from dflash.stage2_train.run_setup import claim_run_dir

    run = tmp_path / "run"
    run.mkdir()
    for name in ("train_options.json", "target_init.json", "metrics.jsonl", "train.log"):
        (run / name).write_text("{}")
    with pytest.raises(UserError, match="already holds a training run"):
        claim_run_dir(TrainOptions(cache=tmp_path, out=run), RunFiles(run))
    lock = claim_run_dir(TrainOptions(cache=tmp_path, out=run, overwrite=True), RunFiles(run))
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == ["train.lock", "train.log"]
