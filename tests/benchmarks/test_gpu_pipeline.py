"""benchmarks/gpu_pipeline.sh's stage logic (train, eval, keep), run for real with a stub in place of `dflash`.

The script only runs on the lent GPU, where a mistake costs a whole device session; its bash is tested here: runs
per VARIANTS entry with their own flags and their own step counts, the best run chosen by its best evaluation, and
that run's best export evaluated and kept in parts that join back to the same bytes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# A stand-in for `python3 -m dflash.shared.cli`: records its arguments; `extract` makes its cache folder and log;
# `train` writes the metrics a calibration or a run
# would (a rate of 10 steps/s with --max-anchors=64, else 2) and, for a real run, exports; the run named *a64 has
# its best held-out evaluation at its end, the others at step 500 (the first in glob order is not the best).
STUB = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["STUB_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\n")
def value(flag):
    return args[len(args) - 1 - args[::-1].index(flag) + 1] if flag in args else None
with open(os.environ["STUB_CALLS"] + ".gpus", "a") as gpus:
    gpus.write(json.dumps([Path(value("--out")).name, os.environ.get("CUDA_VISIBLE_DEVICES")]) + "\n")
if args[0] == "extract":
    Path(value("--out")).mkdir(parents=True)
    (Path(value("--out")) / "extract.log").write_text("extracted\n")
if args[0] == "train":
    out = Path(value("--out"))
    out.mkdir(parents=True)
    rate = 10.0 if "--max-anchors=64" in args else 2.0
    records = [{"step": s, "elapsed_s": s / rate, "loss": 1.0} for s in (20, 60)]
    if not out.name.startswith("calib_"):
        taus = {500: 2.2, 1000: 2.5} if out.name.endswith("a64") else {500: 3.0, 1000: 2.0}
        records += [{"step": 0, "eval/tau_walk": 1.0}] + [{"step": s, "eval/tau_walk": t} for s, t in taus.items()]
        best = max(taus, key=taus.get)
        for folder, tag in (("export", "last"), ("export_best", f"best-{best}")):
            (out / folder).mkdir()
            (out / folder / "config.json").write_text(json.dumps({"tag": tag}))
            (out / folder / "model.safetensors").write_bytes(tag.encode() * 4_000_000)  # 3 parts of 15 MB
        (out / "export_best" / "best.json").write_text(json.dumps({"step": best, "tau_walk": taus[best]}))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
'''


def test_variants_train_with_their_own_steps_and_the_best_export_is_evaluated_and_kept(tmp_path: Path) -> None:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    calls_file, out, work, keep = tmp_path / "calls.jsonl", tmp_path / "out", tmp_path / "work", tmp_path / "keep"
    env = {**os.environ, "STUB_CALLS": str(calls_file), "DF": f"{shlex.quote(sys.executable)} {stub}",
           "OUT": str(out), "WORK": str(work), "KEEP": str(keep), "DTYPES": "fp8", "TRAIN_SECONDS": "600",
           "EVAL_RUNS": "best", "VARIANTS": "a64:1e-3:--max-anchors=64,--eval-every=500 c16:6e-4:--max-anchors=16",
           "GPUS": "4", "GPU_OFFSET": "1"}
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "train", "eval", "keep"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    runs = {Path(c[c.index("--out") + 1]).name: c for c in calls if c[0] == "train"}
    assert sorted(runs) == ["calib_run_fp8_a64", "calib_run_fp8_c16", "run_fp8_a64", "run_fp8_c16"]
    # Each run its own flags and lr, and steps fitted to its own calibrated rate over TRAIN_SECONDS - 120 s.
    a64, c16 = runs["run_fp8_a64"], runs["run_fp8_c16"]
    assert "--max-anchors=64" in a64 and "--eval-every=500" in a64 and a64[a64.index("--lr") + 1] == "1e-3"
    assert "--max-anchors=16" in c16 and c16[c16.index("--lr") + 1] == "6e-4"
    assert a64[a64.index("--max-steps") + 1] == str(10 * 480) and c16[c16.index("--max-steps") + 1] == str(2 * 480)
    # c16 is the best run by its best evaluation (3.0 at step 500), though its last one (2.0) is below a64's 2.5.
    evals = [c for c in calls if c[0] == "eval"]
    assert sorted(c[c.index("--data") + 1] for c in evals) == ["heldout", "humaneval", "mtbench"]
    assert {c[c.index("--draft") + 1] for c in evals} == {str(work / "run_fp8_c16" / "export_best")}
    assert json.loads((keep / "config.json").read_text()) == {"tag": "best-500"}
    parts = sorted(keep.glob("model.safetensors.part*"))
    assert len(parts) == 3 and all(p.stat().st_size <= 15_000_000 for p in parts)  # 32 MB
    joined = b"".join(p.read_bytes() for p in parts)
    assert joined == (work / "run_fp8_c16" / "export_best" / "model.safetensors").read_bytes()
    assert "kept run_fp8_c16" in (out / "timings.tsv").read_text()
    # On a machine of 4 GPUs each process of a stage gets its own, from GPU_OFFSET on (calibration and training
    # keep each run on the same GPU).
    gpus = dict(json.loads(line) for line in Path(f"{calls_file}.gpus").read_text().splitlines())
    assert gpus == {"calib_run_fp8_a64": "1", "calib_run_fp8_c16": "2", "run_fp8_a64": "1", "run_fp8_c16": "2",
                    "eval_run_fp8_c16_mtbench": "2", "eval_run_fp8_c16_humaneval": "3",
                    "eval_run_fp8_c16_heldout": "0"}


def test_extract_flags_reach_every_extraction(tmp_path: Path) -> None:
    """EXTRACT_FLAGS (the distillation ablation's top-k and target layers) go to each dtype's `dflash extract`."""
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    calls_file = tmp_path / "calls.jsonl"
    env = {**os.environ, "STUB_CALLS": str(calls_file), "DF": f"{shlex.quote(sys.executable)} {stub}",
           "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "DTYPES": "bf16 fp8", "VERIFY": "0",
           "EXTRACT_FLAGS": "--store-target-topk 32 --export-layers last:5"}
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "extract"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    extracts = [json.loads(line) for line in calls_file.read_text().splitlines()]
    assert [c[c.index("--feature-dtype") + 1] for c in extracts] == ["bf16", "fp8"]
    for call in extracts:
        assert call[-4:] == ["--store-target-topk", "32", "--export-layers", "last:5"]
