#!/usr/bin/env bash
# Packed vs padded anchors and the recipe ablation, side by side on one GPU, in one device session (issues "stage 2
# on real data" and "a better drafter than the reference recipe"). Run from the repository root after
# `gpu_pipeline.sh setup model` (see its header for the carried folders; .carry_old/ holds commit ed327ed's
# shared/ stage1_extract/ stage2_train/, the padded code before packing, copied to $OLD_CODE in call 1).
#
# 1. one fp8 cache of the carried conversations with the target's top-32 next tokens
# 2. RUNS drafters trained side by side for the same wall time (TRAIN_END, epoch seconds, or TRAIN_SECONDS), each
#    with the same sequences per step (49,152 packed context + block tokens hold about the 30 sequences that 16,384
#    padded context tokens held), every validation evaluation over the whole split (the padded code's held-out
#    split is the same samples: split_key < eval_fraction):
#      padded   ed327ed's code, 64 anchors per sequence, padded (the fifth session's layout), cross-entropy
#      ce       packed, default density, cross-entropy (the reference recipe on the new layout)
#      d2       packed, density 1/2 (the default-density choice)
#      kl, mix  packed, distillation from the stored top-32 (--loss kl / mix, weight 0.5)
#    (the runs `init` and `mixinit`, layers from the target's, went with `--init-from-target` on 2026-12-07: it
#    trained worse, docs/benchmarks.md)
#    Runs side by side share the GPU by time slices, so equal wall time is about equal GPU time; tokens/s are
#    those of a shared GPU. On a machine of several GPUs (an x8 kind, where lent) each run trains on its own GPU
#    (gpu_pipeline.sh's GPUS / GPU_OFFSET: padded on GPU 0, the others from GPU 1): equal GPU time exactly, and
#    the tokens/s of a whole GPU. A step that runs out of memory beside the others is retried in smaller
#    micro-batches by `dflash train` itself (the padded code of ed327ed has no such retry).
# 3. live tau of every run's export_best on MT-Bench and HumanEval (EVAL_SAMPLES prompts, EVAL_TOKENS new tokens)
#    by speculative decoding alone (EVAL_FLAGS)
# Everything small goes to $OUT; `tar czf` it from the polling calls.
#
# The calls (2026-12-05; the tree is ~10 MB and a call carries at most 64 MiB, so the GGUF travels split at 55 MB):
#   here:    FIRST_TURNS=10 bash benchmarks/gpu_carry.sh; mkdir -p .carry_old && git archive ed327ed shared \
#            stage1_extract stage2_train | tar -x -C .carry_old   (/.carry_old/ in .git/info/exclude)
#   call 1:  carry .carry_a .carry_old: mkdir -p /tmp/dflash_work /tmp/gpu_out && cp .carry_a/gguf.aa /tmp/dflash_work/
#            && cp -r .carry_old /tmp/old_code
#   call 2:  carry .whl .carry_b: T0=$(date +%s); export OUT2=$OUT OUT=/tmp/gpu_out; python3 -m pip install ... --target
#            /tmp/site .whl/*.whl; cp -r . /tmp/repo && cd /tmp/repo && bash benchmarks/gpu_pipeline.sh model &&
#            (TRAIN_END=$((T0 + LEFT - 430)) setsid nohup bash benchmarks/gpu_ablation.sh >/tmp/gpu_out/ablation.log
#            2>&1 </dev/null &); sleep 400; tar czf $OUT2/state.tgz -C /tmp/gpu_out --exclude=keep .
#   then:    poll (sleep, tar) until ablation_stages.tsv says "ablation done"; the last call also copies keep/.
# Issue each call right after the previous one returns: the machine goes back 30 s after a call, with everything
# on it (this is how the 2026-12-05 attempt lost its runs).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
WORK=${WORK:-/tmp/dflash_work}
OLD_CODE=${OLD_CODE:-/tmp/old_code}
TRAIN_SECONDS=${TRAIN_SECONDS:-840}
EVAL_SAMPLES=${EVAL_SAMPLES:-20}
EVAL_TOKENS=${EVAL_TOKENS:-512}
EVAL_SECONDS=${EVAL_SECONDS:-300}  # each eval process is stopped after this (then only its eval.log's prompt lines)
# tau alone, one CPU thread per process (14 of them share 16 cores): plain and prompt-lookup decoding of SmolLM2 run
# at ~25-30 tok/s here (h200_headline_anchors), two thirds of an evaluation's time
EVAL_FLAGS=${EVAL_FLAGS:---no-baselines --threads 1}
RUNS=${RUNS:-padded ce d2 kl mix}
export OUT WORK DTYPES=fp8 VERIFY=0 GEN_SECONDS=0 TRAIN_MARGIN=${TRAIN_MARGIN:-200}
mkdir -p "$OUT" "$WORK/import/dflash"
for package in shared stage1_extract stage2_train; do ln -sfn "$PWD/$package" "$WORK/import/dflash/$package"; done
export PYTHONPATH=/tmp/site:$WORK/import:$PWD PYTHONUNBUFFERED=1 DFLASH_HOME=${DFLASH_HOME:-/tmp/dflash_home}
stage() { printf '%s\t%s\n' "$(date +%s)" "$*" | tee -a "$OUT/ablation_stages.tsv"; }

stage start
EXTRACT_FLAGS="--store-target-topk 32" bash benchmarks/gpu_pipeline.sh generate extract
[ -f "$WORK/cache_fp8/manifest.json" ] || { stage "no cache: stop"; exit 1; }
du -sb "$WORK/cache_fp8" "$WORK/cache_fp8/target" >"$OUT/cache_bytes.txt"
python3 -m dflash.shared.cli inspect --cache "$WORK/cache_fp8" --json >"$OUT/inspect_fp8.json" 2>"$OUT/inspect_fp8.err"
stage extracted
[ -n "${TRAIN_END:-}" ] && TRAIN_SECONDS=$((TRAIN_END - $(date +%s)))
common=${COMMON:-"--batch-tokens=49152,--eval-every=300,--checkpoint-every=100000,--num-workers=2"}
padded_flags=${PADDED_FLAGS:-"--batch-tokens 16384 --eval-every 300 --eval-sequences 1000 --checkpoint-every 100000 --num-workers 2"}
variants=""
for run in $RUNS; do
    case $run in
    ce) variants+=" ce:1e-3:$common,--loss=ce" ;;
    d2) variants+=" d2:1e-3:$common,--anchor-density=0.5" ;;
    kl) variants+=" kl:1e-3:$common,--loss=kl" ;;
    mix) variants+=" mix:1e-3:$common,--loss=mix" ;;
    esac
done
# Both pipelines calibrate (60 steps) at the same moment, then train for what is left of TRAIN_SECONDS.
end=$(($(date +%s) + TRAIN_SECONDS))
if [[ " $RUNS " == *" padded "* ]]; then
    # python3 -P: without it `-m` puts the working directory (this tree, whose shared/ is the new code) first
    mkdir -p /tmp/old_work "$OUT/padded" && ln -sfn "$WORK/cache_fp8" /tmp/old_work/cache_fp8
    # ed327ed's CLI has no --overwrite (its runs start in fresh folders here): a wrapper drops it
    printf '#!/usr/bin/env bash\nargs=()\nfor a in "$@"; do [ "$a" = --overwrite ] || args+=("$a"); done\n%s\n' \
        "PYTHONPATH=/tmp/site:$OLD_CODE exec python3 -P -m shared.cli \"\${args[@]}\"" >/tmp/old_work/dflash
    chmod +x /tmp/old_work/dflash
    (WORK=/tmp/old_work OUT=$OUT/padded TRAIN_END=$end DF=/tmp/old_work/dflash GPU_OFFSET=0 \
        TRAIN_FLAGS="--attention sdpa --max-anchors 64 $padded_flags" \
        VARIANTS="a64:1e-3:--seed=0" bash benchmarks/gpu_pipeline.sh train >"$OUT/padded.out" 2>&1) &
fi
# On a machine of several GPUs each run trains on its own (gpu_pipeline.sh: GPUS, GPU_OFFSET): padded on GPU 0.
packed_offset=$([[ " $RUNS " == *" padded "* ]] && echo 1 || echo 0)
(TRAIN_END=$end TRAIN_FLAGS="" VARIANTS="$variants" GPU_OFFSET=$packed_offset bash benchmarks/gpu_pipeline.sh train \
    >"$OUT/packed.out" 2>&1) &
wait
stage trained
[ -d /tmp/old_work/run_fp8_a64 ] && ln -sfn /tmp/old_work/run_fp8_a64 "$WORK/run_fp8_padded"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
i=0
for run in "$WORK"/run_fp8_*; do
    name=${run##*/run_fp8_}
    draft=$run/export_best
    [ -f "$draft/config.json" ] || draft=$run/export
    for data in mtbench humaneval; do
        i=$((i + 1))
        CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout -s TERM "$EVAL_SECONDS" python3 -m dflash.shared.cli eval --draft "$draft" --data "$data" \
            --max-samples "$EVAL_SAMPLES" --max-new-tokens "$EVAL_TOKENS" --out "$OUT/eval_${name}_$data" $EVAL_FLAGS \
            >"$OUT/eval_${name}_$data.out" 2>&1 &
    done
done
wait
stage evaluated
# The best run by validation tau: its export_best, weights in 15 MB parts, to start the next session's runs.
KEEP=$OUT/keep bash benchmarks/gpu_pipeline.sh keep >>"$OUT/ablation.out" 2>&1
stage "ablation done"
