#!/usr/bin/env bash
# The recipe bench (benchmarks/recipe_bench.py, issue 29) on the lent GPU: one fp8 cache of the committed
# regenerated conversations ($CARRIED of gpu_pipeline.sh: all 17,023 since 2026-12-06; the runs before used the
# 4,215 of CARRIED=benchmarks/results/h200_generate_static/generated.jsonl.gz) with the target's top-32 (so every
# question of the issue can use it), then the bench: each variant alone, one after
# another, at STEPS steps, validation every EVAL_EVERY steps over the whole split, the test split, and live tau
# (MT-Bench and HumanEval, 80 prompts x 512 new tokens) of the baseline and the best. Run from the repository root
# after `gpu_pipeline.sh setup model`; meant to be started detached, so that short calls can poll:
#
#   bash benchmarks/gpu_recipe_bench.sh            the cache (unless made already), then the bench, into $OUT/bench
#   bash benchmarks/gpu_recipe_bench.sh pack DIR   DIR/state.tgz: $OUT without checkpoints, weights and compile
#                                                  caches; prints the bench's table and the last lines of its log
#
# Settings (environment): VARIANTS ("NAME=FLAGS;NAME=FLAGS;...", the first the baseline; default: the issue's
# question d, the learning rate; questions a, the loss, and b, anchors per sequence, were answered on 2026-12-06, b
# over seeds 0-2: 64 a sequence is the default since; c, target-initialised layers, on 2026-12-07: they trained
# worse and the option is gone; and
#   b, anchors per sequence:       "density6=--anchor-density 0.16666666666666666 --max-anchors 512;fixed64=" (SEEDS=0,1,2)
# asks it again), the issue's other questions as variants:
#   d, learning rate:              "lr1e-3=;lr2e-3=--lr 2e-3;lr5e-4=--lr 5e-4" (epochs: STEPS, or VARIANT_STEPS)
#   the loss's second mix weight:  "ce=;mix25=--loss mix --kl-weight 0.25"
#   the data's size (one cache, the same held-out splits; `dflash train --train-fraction`): all conversations
#   against as many training sequences as the 4,215 before gave (0.25: 3,867 of the 15,340), e.g. at 3,000 steps
#   (~22 epochs of the small part):
#                                  "data1x=--train-fraction 0.25;data4x=" (extracting the 17,023: 184 s on an H100)
# STEPS (600), VARIANT_STEPS
# ("NAME=STEPS;NAME=STEPS": those variants train their own number of steps instead, each its own cosine schedule
# over its own length: recipe_bench.py --steps-of; the equal-time comparison below), EVAL_EVERY (200),
# TRAIN_FLAGS (every variant's flags), UNTIMED_STEPS (50), COMPILE_WARM_UP (N: each variant whose run compiles
# trains N untimed steps first, recipe_bench.py --warm-up-steps, so that no variant's training time holds the
# machine's first compilation: 91 s of the fast variant's 170 s on 2026-12-06; 3 covers the first shapes; ~40 s a
# variant), SEEDS ("0,1,2": every variant trained once per seed,
# runs NAME@sSEED, all variants at a seed before the next; the table adds each variant's mean over seeds and its
# difference to the baseline paired by seed; default: one run per variant at seed 0), LIVE_SAMPLES (80),
# LIVE_TOKENS (512), LIVE_FLAGS, and RESULTS_FROM: a folder of an earlier bench's results/*.json (carried in the
# tree, e.g. from a lost machine's state.tgz): they are copied into $OUT/bench/results first (and the live/ folder
# beside it, if there, into $OUT/bench/live: its eval.json files pair live tau by prompt), and the bench skips
# every run whose result is complete there.
# Why seeds: one recipe's test tau after 600 steps spread with a standard deviation of 0.033-0.066 over seeds 0-2,
# 2-5x one run's standard error over test sequences (2026-12-06, benchmarks/results/
# h100_anchor_seeds_and_specforge_2026-12-06): a difference between variants is the paired one over seeds.
# Each 600-step run took 168-318 s on the fast path on an H100 or H200 (measured 2026-12-06; 318 s: the first run,
# compiling cold), so
# variants x seeds runs of ~3-4 min each: 6 runs (3 variants x 2 seeds, or 2 x 3) 17-25 min, which with the start,
# the cache and live tau (~4-8 min) just fits one 30-minute session; 9 runs (3 x 3) need two (the second with
# RESULTS_FROM the first's results/: it trains only what is missing).
# Equal GPU time instead of equal steps (the product's claim is the better drafter per GPU-hour): give the faster
# variant the steps that take the baseline's training time, from s/step measured with each variant alone on the GPU
# (docs/benchmarks.md "The fast training path in whole runs": 0.196 s a step on the plain path, 0.083 on the fast
# path, H100, 600 steps), e.g. the default recipe on the plain path against the same recipe on the fast path at
# 600 x 0.196 / 0.083 = 1,420 steps (put a recipe change in the fast variant's flags too to ask for the best recipe
# per GPU-second; then the two changes are not told apart):
#   VARIANTS="plain=--attention sdpa --no-compile;fast=" STEPS=600 VARIANT_STEPS="fast=1420"
# The table's train s (every step's time, compilation included, evaluations not) and train s / baseline's columns
# then show how equal the times came out: measured, not assumed. The fast path's compilation counts (GPU time a user
# pays too) and the steady s/step leave it out: 94.9 s in the first 50 steps compiling cold, ~17 s from the bench's
# warm compile cache (H100, 2026-12-06, benchmarks/results/h100_fast_path_and_loss_2026-12-06); in the example the
# fast variant runs after the plain one, so on a fresh machine it compiles cold.
# Follow-ups on the same machine, each alone on the GPU after the bench, in this order (each optional):
#   EVAL_ALONE=1    `dflash eval` of the best variant's drafter with its baselines (plain greedy, prompt lookup) on
#                   MT-Bench and HumanEval, EVAL_ALONE_SAMPLES (20, issue 31's measure) x LIVE_TOKENS, alone: wall
#                   time per dataset, tokens/s, speedup (issue 31) -> $OUT/eval_alone
#   EVAL_DECODE=1   benchmarks/bench_eval_decode.py on that drafter: dynamic vs fast decode path, and the
#                   Qwen3-8B-shaped verify cost (EVAL_DECODE_FLAGS) -> $OUT/eval_decode
#   WARM_STEPS=N    a second bench ($OUT/bench_warm), N steps from the baseline's best drafter (--init-from): DFlash
#                   trained on vs DFlash 2 grown from it (issue 28's warm start), validation at step N/2 and N
#   TRAIN_PROFILE="ENTRY;ENTRY..."  benchmarks/bench_train.py on the bench's cache, once per entry, each at most
#                   TRAIN_PROFILE_TIMEOUT seconds (300). An entry is "[VAR=VALUE ...] TRAIN FLAGS [| BENCH FLAGS]":
#                   environment for it, `dflash train` flags added to TRAIN_FLAGS, bench_train.py's own flags added
#                   to TRAIN_PROFILE_FLAGS (default "--steps 20 --warmup 10 --profile 3"); e.g.
#                   "--architecture dflash | --exact-windows;TORCHINDUCTOR_SPLIT_REDUCTIONS=0 --compile"
#                   -> $OUT/train_profile
#
# The calls (one 30-minute device session; the machine goes back 30 s after a call returns, with everything on it,
# so issue each call right after the previous one returns):
#   here:    bash benchmarks/gpu_carry.sh   (once; .whl, .carry_a, .carry_b, .carry_d are ignored folders)
#   call 1:  carry .whl .carry_a:  export OUT2=$OUT OUT=/tmp/gpu_out; bash benchmarks/gpu_pipeline.sh setup
#   park:    carry .carry_d:  bash benchmarks/gpu_pipeline.sh park   (when gpu_carry.sh prints it: the tree holds
#            the generated conversations since 2026-12-06, too large for the GGUF in two calls)
#   call 2:  carry .carry_b:  export OUT2=$OUT OUT=/tmp/gpu_out; cp -r . /tmp/repo && cd /tmp/repo &&
#            bash benchmarks/gpu_pipeline.sh model &&
#            (setsid nohup bash benchmarks/gpu_recipe_bench.sh >/tmp/gpu_out/recipe_bench.out 2>&1 </dev/null &);
#            sleep 480; bash benchmarks/gpu_recipe_bench.sh pack $OUT2
#   then:    export OUT2=$OUT OUT=/tmp/gpu_out; cd /tmp/repo && sleep 560;
#            bash benchmarks/gpu_recipe_bench.sh pack $OUT2
#            (again until recipe_bench_stages.tsv ends with "follow-ups done"; the last call without the sleep)
# The table is in bench.md, every figure in bench.json; results/NAME.json is each variant's, complete as soon as
# it finished.
# Time, measured on an H100 on 2026-12-05 (benchmarks/results/h100_dflash2_drop_and_fast_eval_2026-12-05): the
# machine's start and call 1 ~130 s; `model` (GGUF conversion) ~60 s; the cache 77 s; per variant ~110-125 s of
# start-up, evaluations (the untrained one ~20-25 s), test split and export, plus 0.32 s per step (DFlash) or
# 0.40-0.43 s (DFlash 2) at --batch-tokens 49152: 206-228 s per variant at 300 steps; live tau (4 evaluations of
# 20 x 512 side by side) 130 s. Follow-ups: EVAL_ALONE 153 s, EVAL_DECODE 113 s, a train profile 40-55 s (85 s
# until --compile crashed), WARM_STEPS=150 about 4-5 min. So three variants x 300 steps with live tau take ~16 min
# of device time with the machine's start; one question a session, with room for one or two follow-ups. Since the grouped attention's windows are bucketed (second H100 session,
# benchmarks/results/h100_train_speed_and_warm_start_2026-12-05): the cache 55 s, a DFlash variant 128 s at 300
# steps (0.20 s a step), WARM_STEPS=150 217 s, a train profile 30-90 s (flex compiles ~60 s on its first shapes).
# On the fast path (third H100 session, 2026-12-06, 600 steps, validation every 200): the machine's start ~6 min
# (waiting for one), the GGUF conversion 32 s, the cache 56 s; the first variant 229 s (its ~100 s of cold
# compilation included), each later one 168 s (`--loss kl` / `mix`; 0.134 s a step), the plain path 195 s
# (0.196 s a step); live tau of one drafter on both datasets 66 s; a DFlash 2 --compile train profile 152 s. So
# the default 3 variants x 600 steps with live tau take ~14 min with the machine's start (when one comes at once).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
WORK=${WORK:-/tmp/dflash_work}
SITE=${SITE:-/tmp/site}
BENCH=$OUT/bench
if [ "${1:-}" = pack ]; then
    tar czf "$2/state.tgz" -C "$OUT" --exclude=checkpoints --exclude='*.safetensors' --exclude=tensorboard \
        --exclude=compile_cache --exclude=generated.jsonl.gz .
    [ -f "$BENCH/bench.md" ] && cat "$BENCH/bench.md"
    tail -n 5 "$BENCH/bench.log" "$OUT/recipe_bench_stages.tsv" 2>/dev/null
    exit 0
fi
VARIANTS=${VARIANTS:-"lr1e-3=;lr2e-3=--lr 2e-3;lr5e-4=--lr 5e-4"}
STEPS=${STEPS:-600}
EVAL_EVERY=${EVAL_EVERY:-200}
# The packed recipe of the 2026-12-05 H100 run (about 30 sequences a step), learning rate 1e-3 as every GPU run so far,
# on the fast path at any length: the variants share one compile cache, so only the first compiles cold (~100 s;
# later ones ~12 s: benchmarks/results/h100_fast_path_and_loss_2026-12-06). Put "--attention sdpa --no-compile" in a
# variant's flags for the plain path.
TRAIN_FLAGS=${TRAIN_FLAGS:-"--lr 1e-3 --batch-tokens 49152 --num-workers 6 --attention flex --compile"}
UNTIMED_STEPS=${UNTIMED_STEPS:-50}
LIVE_SAMPLES=${LIVE_SAMPLES:-80}
LIVE_TOKENS=${LIVE_TOKENS:-512}
LIVE_FLAGS=${LIVE_FLAGS:-"--no-baselines --threads 2"}
RESULTS_FROM=${RESULTS_FROM:-}
SEEDS=${SEEDS:-}
SEEDS=${SEEDS// /}
# With several seeds a variant's runs are NAME@sSEED; the follow-ups take the first seed's.
run_suffix=""
[[ "$SEEDS" == *,* ]] && run_suffix="@s${SEEDS%%,*}"
RECIPE_BENCH=${RECIPE_BENCH:-python3 benchmarks/recipe_bench.py}  # (a stub in a dry run of this script)
BENCH_TRAIN=${BENCH_TRAIN:-python3 benchmarks/bench_train.py}  # (likewise)
BENCH_EVAL_DECODE=${BENCH_EVAL_DECODE:-python3 benchmarks/bench_eval_decode.py}  # (likewise)
export OUT WORK SITE
mkdir -p "$OUT" "$WORK/import/dflash"
for package in shared stage1_extract stage2_train; do ln -sfn "$PWD/$package" "$WORK/import/dflash/$package"; done
export PYTHONPATH=$SITE:$WORK/import:$PWD PYTHONUNBUFFERED=1 DFLASH_HOME=${DFLASH_HOME:-/tmp/dflash_home}
stage() { printf '%s\t%s\n' "$(date +%s)" "$*" | tee -a "$OUT/recipe_bench_stages.tsv"; }

stage start
if [ ! -f "$WORK/cache_fp8/manifest.json" ]; then
    GEN_SECONDS=0 DTYPES=fp8 VERIFY=0 EXTRACT_FLAGS="--store-target-topk 32" \
        bash benchmarks/gpu_pipeline.sh generate extract
fi
[ -f "$WORK/cache_fp8/manifest.json" ] || { stage "no cache: stop"; exit 1; }
stage cache
if [ -n "$RESULTS_FROM" ]; then
    mkdir -p "$BENCH/results" && cp -n "$RESULTS_FROM"/*.json "$BENCH/results/"
    # and their live evaluations (a bench folder's live/ beside its results/), for the comparison paired by prompt
    [ -d "$RESULTS_FROM/../live" ] && mkdir -p "$BENCH/live" && cp -rn "$RESULTS_FROM/../live/." "$BENCH/live/"
fi
variant_args=()
IFS=';' read -ra entries <<<"$VARIANTS"
for entry in "${entries[@]}"; do
    read -r entry <<<"$entry"  # without the spaces around it
    [ -n "$entry" ] && variant_args+=(--variant "$entry")
done
IFS=';' read -ra entries <<<"${VARIANT_STEPS:-}"
for entry in "${entries[@]}"; do
    read -r entry <<<"$entry"
    [ -n "$entry" ] && variant_args+=(--steps-of "$entry")
done
# shellcheck disable=SC2086
$RECIPE_BENCH run --cache "$WORK/cache_fp8" --out "$BENCH" --steps "$STEPS" \
    --eval-every "$EVAL_EVERY" --untimed-steps "$UNTIMED_STEPS" --train-flags "$TRAIN_FLAGS" \
    --live-samples "$LIVE_SAMPLES" --live-new-tokens "$LIVE_TOKENS" --live-flags "$LIVE_FLAGS" "${variant_args[@]}" \
    ${SEEDS:+--seeds "$SEEDS"} ${COMPILE_WARM_UP:+--warm-up-steps "$COMPILE_WARM_UP"}
stage "recipe bench done (exit $?)"
best=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["best"] or "")' "$BENCH/bench.json" 2>/dev/null)
drafter=$BENCH/runs/$best$run_suffix/export_best
if [ ! -f "$drafter/config.json" ]; then  # the best was trained elsewhere (RESULTS_FROM): the best trained here
    # (at the first seed, as the best's own drafter above: runs of several seeds end in $run_suffix)
    drafter=$(python3 - "$BENCH" "$run_suffix" 2>/dev/null <<'PY'
import json, sys
from pathlib import Path
bench, suffix = Path(sys.argv[1]), sys.argv[2]
rows = json.loads((bench / "bench.json").read_text()).get("results", []) if (bench / "bench.json").is_file() else []
tau = {row["name"]: ((row.get("best_validation") or {}).get("tau") or 0.0) for row in rows if "name" in row}
here = sorted(path.parent for path in (bench / "runs").glob("*/export_best/config.json")
              if path.parent.parent.name in tau and path.parent.parent.name.endswith(suffix))
print(max(here, key=lambda path: tau[path.parent.name]) if here else "")
PY
)
    best=$(basename "$(dirname "$drafter")")
fi
baseline=$BENCH/runs/${variant_args[1]%%=*}$run_suffix/export_best
if [ "${EVAL_ALONE:-0}" = 1 ] && [ -f "$drafter/config.json" ]; then
    python3 -m dflash.shared.cli eval --draft "$drafter" --data mtbench,humaneval --max-samples "${EVAL_ALONE_SAMPLES:-20}" \
        --max-new-tokens "$LIVE_TOKENS" --out "$OUT/eval_alone" >"$OUT/eval_alone.out" 2>&1
    stage "eval alone of $best (exit $?)"
fi
if [ "${EVAL_DECODE:-0}" = 1 ] && [ -f "$drafter/config.json" ]; then
    # shellcheck disable=SC2086
    $BENCH_EVAL_DECODE --out "$OUT/eval_decode" --draft "$drafter" \
        ${EVAL_DECODE_FLAGS:---prompts 3 --new-tokens 256} >"$OUT/eval_decode.out" 2>&1
    stage "eval decode bench (exit $?)"
fi
if [ -n "${WARM_STEPS:-}" ] && [ -f "$baseline/config.json" ]; then
    $RECIPE_BENCH run --cache "$WORK/cache_fp8" --out "$OUT/bench_warm" --steps "$WARM_STEPS" \
        --eval-every $(( WARM_STEPS / 2 )) --untimed-steps "$UNTIMED_STEPS" --train-flags "$TRAIN_FLAGS" \
        --live-samples 0 --variant "trained_on=--init-from $baseline" \
        --variant "dflash2_grown=--architecture dflash2 --init-from $baseline"
    stage "warm-start bench (exit $?)"
fi
IFS=';' read -ra profiles <<<"${TRAIN_PROFILE:-}"
for entry in "${profiles[@]}"; do
    # "[VAR=VALUE ...] TRAIN FLAGS [| BENCH FLAGS]": environment, `dflash train` flags, bench_train.py's own flags
    read -r entry <<<"$entry"
    [ -n "$entry" ] || continue
    bench_flags=""
    [[ "$entry" == *"|"* ]] && bench_flags=${entry#*|} && entry=${entry%%|*}
    envs=()
    read -ra words <<<"$entry"
    while [ ${#words[@]} -gt 0 ] && [[ "${words[0]}" =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
    flags="${words[*]}"
    name=$(tr -c 'A-Za-z0-9_.-' _ <<<"${envs[*]} $flags $bench_flags" | sed 's/--//g; s/__*/_/g; s/^[_-]*//; s/[_-]*$//')
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout "${TRAIN_PROFILE_TIMEOUT:-300}" $BENCH_TRAIN --cache "$WORK/cache_fp8" \
        --train-flags "$TRAIN_FLAGS $flags" --name "$name" ${TRAIN_PROFILE_FLAGS:---steps 20 --warmup 10 --profile 3} \
        $bench_flags --out "$OUT/train_profile" >"$OUT/train_profile_$name.out" 2>&1
    stage "train profile $entry | $bench_flags (exit $?)"
done
stage "follow-ups done"
