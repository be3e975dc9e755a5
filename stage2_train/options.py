"""The options of `dflash train` and their defaults, in one place (the CLI shows these defaults; nothing here
imports torch, so `dflash train --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_BLOCK_SIZE = 16
# Anchors (blocks) per sequence and epoch: every anchor candidate of a sequence, up to DEFAULT_MAX_ANCHORS. Chosen by
# the recipe bench over three seeds (600 steps, SmolLM2 on ~770-token conversations): 64 a sequence led the previous
# default, 1/6 of the candidates capped at 512 (the reference's 512 in 3,072-token sequences, about one per 6
# positions), by +0.082 +- 0.029 test tau paired by seed, at every seed (docs/benchmarks.md, "Anchors per sequence on
# the packed layout"). A density below 1 draws that fraction of the candidates instead, still capped.
DEFAULT_MAX_ANCHORS = 64
DEFAULT_ANCHOR_DENSITY = 1.0
# The length and the optimiser's recipe: what every recipe bench trained with (--lr 1e-3, 49,152 tokens a step), and
# 16 epochs, measured on 15,340 regenerated conversations on an H100: 9,000 steps (~16.5 epochs) gave 1.30x the
# whole-test-split tau of 3,000 (~5.5 epochs), the best of the run at its end (flat over its last 1,500 steps); on a
# quarter of that data the drafter was flat over its last ~7 of ~22 epochs (docs/benchmarks.md, "Nine thousand steps
# on the four-times data"). Much larger data needs fewer passes (the reference recipe: 6 epochs of 800K samples).
# Before: 1 epoch, 6e-4 and 8,192 tokens, which no GPU run compared with these. --lr 2e-3 over the same 9,000 steps
# reached the same test tau (4.295 against 4.318 +- 0.07; ahead at step 1,500, level from 3,000: "The learning rate
# at the default length").
DEFAULT_EPOCHS = 16
DEFAULT_LR = 1e-3
DEFAULT_BATCH_TOKENS = 49152
DEFAULT_KL_WEIGHT = 0.5  # --kl-weight: the KL term's share of `--loss mix` (the cross-entropy has the rest)
ARCHITECTURES = ("dflash", "dflash2")  # --architecture: the drafter DFlash, or DFlash 2 (modeling_dflash.py)
SELECTOR_MISSING = ("inject", "drop")  # --selector-missing (loss.selector_loss)
# --architecture: DFlash stays the default for now. DFlash 2 led at equal steps on an H100 and an H200 (test tau
# 1.24x and 1.17x after 300 and 250 steps, ahead per GPU-second too), but only early in training, and its step
# is 1.27-1.36x DFlash's (docs/benchmarks.md); `--fsdp` does not take it yet.
DEFAULT_ARCHITECTURE = "dflash"
# Runs of at least this many steps train on the fast path (flex attention, compiled) by default on CUDA: the
# break-even measured in whole runs, ~850 steps, rounded up (fast_path.py, where the rule and the figures live).
COMPILE_MIN_STEPS = 1000
DEFAULT_SELECTOR_WEIGHT = 1.0  # --selector-weight: DFlash 2's selector loss beside the block loss (as peers weigh it)
# --selector-missing: positions whose true token is not among the candidates leave the selector loss. Measured on
# an H100 at 300 equal steps: test tau 1.441 +- 0.018 (drop) vs 1.379 +- 0.017 (inject), and a 7 % faster step
# (benchmarks/results/h100_dflash2_drop_and_fast_eval_2026-12-05).
DEFAULT_SELECTOR_MISSING = "drop"


@dataclass
class TrainOptions:
    cache: Path
    out: Path = Path("dflash_run")
    epochs: int = DEFAULT_EPOCHS
    max_steps: int | None = None
    draft_layers: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    sliding_window: int | None = None
    mask_token_id: int | None = None
    loss: str = "ce"
    kl_weight: float = DEFAULT_KL_WEIGHT
    architecture: str = DEFAULT_ARCHITECTURE
    selector_weight: float = DEFAULT_SELECTOR_WEIGHT
    selector_missing: str = DEFAULT_SELECTOR_MISSING
    lr: float = DEFAULT_LR
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    grad_accum: int = 1
    max_anchors: int = DEFAULT_MAX_ANCHORS
    anchor_density: float | None = DEFAULT_ANCHOR_DENSITY
    gamma: float | None = None
    eval_fraction: float = 0.05  # the validation split: periodic evaluation and the choice of export_best/
    test_fraction: float = 0.05  # the test split: the chosen drafter, evaluated once at the end
    train_fraction: float = 1.0  # of the rest, the part trained on (cache_index.py: a data-size question on one cache)
    eval_every: int = 200
    eval_untrained: bool = True  # also evaluate before the first step (the untrained drafter's tau)
    eval_sequences: int | None = None  # validation sequences per evaluation (None: the whole split)
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    resume: bool = False
    overwrite: bool = False
    init_from: Path | None = None
    seed: int = 0
    attention: str = "auto"
    compile: bool | None = None  # None: chosen by the device and the run's length (fast_path.py)
    fsdp: bool = False
    mixed_precision: str = "auto"
    num_workers: int | None = None  # None: chosen by the device and its CPUs (fast_path.loader_workers)
    memory_limit: float | None = None  # GiB a micro-batch step may use in all (default: what the device has free)
    log_every: int = 10
    verbose: bool = False

    @property
    def trains_selector(self) -> bool:
        """DFlash 2: the drafter has a path selector, trained by the selector loss beside the block loss."""
        return self.architecture == "dflash2"
