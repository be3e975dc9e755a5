"""benchmarks/gpu_pipeline.sh's stage logic (train, eval, keep), run for real with a stub in place of `dflash`.

The script only runs on the lent GPU, where a mistake costs a whole device session; its bash is tested here: runs
per VARIANTS entry with their own flags and their own step counts, the best run chosen by its best evaluation, and
that run's best export evaluated and kept in parts that join back to the same bytes.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, make_conversations

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
           "EXTRACT_FLAGS": "--store-target-topk 32 --max-length 1024"}
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "extract"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    extracts = [json.loads(line) for line in calls_file.read_text().splitlines()]
    assert [c[c.index("--feature-dtype") + 1] for c in extracts] == ["bf16", "fp8"]
    for call in extracts:
        assert call[-4:] == ["--store-target-topk", "32", "--max-length", "1024"]


# Generation over several calls and sessions (issue 29: four times the data): `turns`, `generate` (its dflash
# generate a stub that answers the first two conversations it is given and is then killed mid-chunk, as the time
# limit does) and `pack`, with benchmarks/generation_sessions.py doing the work.
GENERATE_STUB = r'''
import gzip, json, os, sys
from pathlib import Path
from dflash.shared.output_dirs import foreign_entries
from dflash.stage1_extract.generate_parts import OUTPUT_ENTRIES, PARTS_DIR
args = sys.argv[1:]
out, data = Path(args[args.index("--out") + 1]), args[args.index("--data") + 1]
ids = [json.loads(line)["id"] for line in gzip.open(data, "rt", encoding="utf-8")]
with open(os.environ["STUB_CALLS"], "a") as calls:
    calls.write(json.dumps({"args": args, "ids": ids, "foreign": foreign_entries(out, OUTPUT_ENTRIES)}) + "\n")
parts = out / PARTS_DIR
parts.mkdir(parents=True, exist_ok=True)
done = {json.loads(line)["id"] for part in parts.glob("*.part") for line in open(part) if line.endswith("\n")}
todo = [i for i in ids if i not in done]
def record(key):
    return {"id": key, "messages": [{"role": "user", "content": f"question {key}"},
                                    {"role": "assistant", "content": f"new answer {key}\nline two"}],
            "dflash": {"generated_tokens": 7, "finish_reason": "stop"}}
with open(parts / f"worker-{len(done)}.jsonl.part", "w") as part:
    part.write(json.dumps(record(todo[0])) + "\n" + json.dumps({"id": todo[1], "skipped": "too_long"}) + "\n")
    part.write(json.dumps(record(todo[2]))[:40])  # killed while appending its next chunk: a torn last line
sys.exit(143)
'''


def conversation(key: str, answer: str) -> dict:
    return {"id": key, "messages": [{"role": "user", "content": f"question {key}"},
                                    {"role": "assistant", "content": answer}]}


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)


def read_jsonl(path: Path) -> list[dict]:
    text = (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")).read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def python3_on_path(tmp_path: Path) -> str:
    """A PATH whose `python3` (as gpu_pipeline.sh calls it) is this interpreter, with the project's libraries."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_generation_sessions_add_up_without_regenerating_or_losing_a_conversation(tmp_path: Path) -> None:
    carried = [conversation(f"c{i}", f"carried answer {i}") for i in range(3)]
    turns = [conversation(f"c{i}", f"ShareGPT answer {i}") for i in range(3)]
    turns[1:1] = [conversation(f"n{i}", f"ShareGPT answer n{i}") for i in range(8)]  # the carried ones among them
    write_jsonl_gz(tmp_path / "carried.jsonl.gz", carried)
    write_jsonl_gz(tmp_path / "turns.jsonl.gz", turns)
    (tmp_path / "stub.py").write_text(GENERATE_STUB)
    work, out, polled = tmp_path / "work", tmp_path / "out", tmp_path / "polled"
    polled.mkdir()
    env = {**os.environ, "STUB_CALLS": str(tmp_path / "calls.jsonl"), "DF": f"{shlex.quote(sys.executable)} "
           f"{tmp_path / 'stub.py'}", "OUT": str(out), "WORK": str(work), "CARRIED": str(tmp_path / "carried.jsonl.gz"),
           "TURNS": str(tmp_path / "turns.jsonl.gz"), "SAMPLES": "all", "OUT2": str(polled),
           "PATH": python3_on_path(tmp_path)}

    def stages(*names: str) -> None:
        result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", *names], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]

    new_ids = [f"n{i}" for i in range(8)]
    stages("turns", "pack")  # a poll before the generate has written anything: the carried ones
    assert [r["id"] for r in read_jsonl(work / "sharegpt.jsonl.gz")] == new_ids  # carried ones left out
    assert read_jsonl(polled / "generated.jsonl.gz") == carried
    stages("generate", "generate")  # killed twice by its time limit, the second time resuming
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["ids"] for c in calls] == [new_ids, new_ids] and all(c["foreign"] == [] for c in calls)
    assert "--max-samples" not in calls[0]["args"]
    # The first run finished n0, skipped n1 and was killed writing n2 (a torn line: not kept); the rerun resumed at
    # n2: finished n2, skipped n3, killed writing n4. Only whole records are kept, skipped ones left out.
    expected = carried + [{**conversation(f"n{i}", f"new answer n{i}\nline two"),
                           "dflash": {"generated_tokens": 7, "finish_reason": "stop"}} for i in (0, 2)]
    assert read_jsonl(work / "gen" / "finished.jsonl") == expected
    assert read_jsonl(out / "generated.jsonl.gz") == expected
    timings = (out / "timings.tsv").read_text()
    assert "generated\t2 conversations\t14 new tokens\t2 skipped\t{'stop': 2}" in timings
    assert timings.endswith("generate stage done\n")
    # A poll while a worker appends its next chunk (a torn line) and with a record of a carried id: the carried one
    # wins, and the poll waits for the stage no longer than it has taken.
    with open(work / "gen" / "parts" / "worker-9.jsonl.part", "w") as part:
        part.write(json.dumps({**conversation("c1", "again"), "dflash": {"generated_tokens": 3,
                                                                          "finish_reason": "length"}}) + "\n")
        part.write('{"id": "n6", "messages": [{"role": "us')
    env["WAIT"] = "600"
    stages("pack")
    assert read_jsonl(polled / "generated.jsonl.gz") == expected
    assert (polled / "timings.tsv").read_text() == timings
    # The next session: the merged file is the carried one, and only what it lacks is left to generate (the skipped
    # ones again: skipping costs the workers nothing).
    env["CARRIED"] = str(out / "generated.jsonl.gz")
    stages("turns")
    assert [r["id"] for r in read_jsonl(work / "sharegpt.jsonl.gz")] == [i for i in new_ids if i not in ("n0", "n2")]


# A stand-in for `dflash generate` in the batching A/B: answers the first --max-samples (or all) of its --data with
# 10 new tokens each, the padded path (--static-cache) two seconds slower, and records its arguments.
AB_STUB = r'''
import gzip, json, os, sys, time
from pathlib import Path
from dflash.stage1_extract.generate_parts import PARTS_DIR
args = sys.argv[1:]
out, data = Path(args[args.index("--out") + 1]), args[args.index("--data") + 1]
ids = [json.loads(line)["id"] for line in gzip.open(data, "rt", encoding="utf-8")]
ids = ids[:int(args[args.index("--max-samples") + 1])] if "--max-samples" in args else ids
with open(os.environ["STUB_CALLS"], "a") as calls:
    calls.write(json.dumps({"args": args, "ids": ids}) + "\n")
if "--static-cache" in args:
    time.sleep(2)
(out / PARTS_DIR).mkdir(parents=True, exist_ok=True)
if out.name.startswith("genab_") and os.environ.get("STUB_AB_NOTHING"):
    sys.exit(143)  # killed by its time limit before its first chunk
with open(out / PARTS_DIR / "worker-0.jsonl.part", "w") as part:
    for key in ids:
        part.write(json.dumps({"id": key, "messages": [{"role": "user", "content": f"question {key}"},
                                                       {"role": "assistant", "content": f"{out.name} {key}"}],
                               "dflash": {"generated_tokens": 10, "finish_reason": "stop"}}) + "\n")
'''


def test_the_batching_ab_keeps_the_faster_paths_answers_and_generate_goes_on_with_its_flags(tmp_path: Path) -> None:
    """`genab`: both batching paths on the same first AB_SAMPLES pending turns, one after the other; the faster by
    new tokens per second (here continuous batching) is written for `generate`, which uses its flags over the
    turns the A/B left; the faster's answers join the carried ones (none generated twice, the slower's dropped)."""
    carried = [conversation("c0", "carried answer")]
    turns = [conversation(key, f"ShareGPT answer {key}") for key in ("c0", *(f"n{i}" for i in range(6)))]
    write_jsonl_gz(tmp_path / "carried.jsonl.gz", carried)
    write_jsonl_gz(tmp_path / "turns.jsonl.gz", turns)
    (tmp_path / "stub.py").write_text(AB_STUB)
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "STUB_CALLS": str(tmp_path / "calls.jsonl"), "DF": f"{shlex.quote(sys.executable)} "
           f"{tmp_path / 'stub.py'}", "OUT": str(out), "WORK": str(work), "CARRIED": str(tmp_path / "carried.jsonl.gz"),
           "TURNS": str(tmp_path / "turns.jsonl.gz"), "SAMPLES": "all", "AB_SAMPLES": "2",
           "PATH": python3_on_path(tmp_path)}
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "turns", "genab", "generate"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    static, continuous, generate = calls
    assert static["ids"] == continuous["ids"] == ["n0", "n1"] and generate["ids"] == ["n2", "n3", "n4", "n5"]
    assert "--static-cache" in static["args"] and "--continuous-batching" in continuous["args"]
    assert "--continuous-batching" in generate["args"] and "--max-samples" not in generate["args"]
    timings = (out / "timings.tsv").read_text()
    assert "genab\tstatic\t20 new tokens\t" in timings and "genab\tcontinuous\t20 new tokens\t" in timings
    assert "genab\tthe faster: continuous (" in timings
    answers = {r["id"]: r["messages"][-1]["content"] for r in read_jsonl(out / "generated.jsonl.gz")}
    assert answers == {"c0": "carried answer", "n0": "genab_continuous n0", "n1": "genab_continuous n1",
                       **{f"n{i}": f"gen n{i}" for i in range(2, 6)}}
    assert "generate stage done" in timings

    # Call 3's command again on the same machine (a generate restarted): genab keeps its choice and its answers, and
    # the turns left are the same, so generate resumes on the same data.
    pending = read_jsonl(work / "sharegpt.jsonl.gz")
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "turns", "genab", "generate"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 4 and calls[3]["ids"] == generate["ids"] and "--continuous-batching" in calls[3]["args"]
    assert read_jsonl(work / "sharegpt.jsonl.gz") == pending
    assert "genab\tdone before: --workers-per-gpu 1" in (out / "timings.tsv").read_text()
    assert {r["id"]: r["messages"][-1]["content"] for r in read_jsonl(out / "generated.jsonl.gz")} == answers

    # Neither path finishing a chunk in its time (a fresh machine): generate still runs, with GEN_FLAGS, over all.
    env.update(WORK=str(tmp_path / "work2"), OUT=str(tmp_path / "out2"), STUB_AB_NOTHING="1",
               STUB_CALLS=str(tmp_path / "calls2.jsonl"))
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "turns", "genab", "generate"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    *_, generate = [json.loads(line) for line in (tmp_path / "calls2.jsonl").read_text().splitlines()]
    assert generate["ids"] == [f"n{i}" for i in range(6)] and "--static-cache" in generate["args"]
    timings = (tmp_path / "out2" / "timings.tsv").read_text()
    assert "genab\tneither path generated anything" in timings and timings.endswith("generate stage done\n")


def test_first_turns_hold_every_conversation_that_has_an_answer(tmp_path: Path) -> None:
    """gpu_carry.sh's first turns (benchmarks/generation_sessions.py first-turns): every conversation with an
    assistant turn after a user turn, cut after that answer; of all the dataset's conversations, or of its first N
    (as `dflash generate --max-samples N` counts them)."""
    from dflash.stage1_extract.conversations import load_conversations

    records = make_conversations(12)
    records[3]["messages"] = records[3]["messages"][:1]  # a question alone
    records[7]["messages"] = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    for limit, count in (("all", 10), ("8", 7)):  # conv-3 is not loaded (no answer); conv-7 is, and left out
        out = tmp_path / f"turns_{limit}.jsonl.gz"
        result = subprocess.run([sys.executable, "benchmarks/generation_sessions.py", "first-turns", "--max", limit,
                                 "--data", str(data), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        loaded = {c.sample_id for c in load_conversations(str(data), max_samples=None if limit == "all" else 8)
                  .conversations}
        expected = [r for i, r in enumerate(records) if r["id"] in loaded and i not in (3, 7)]
        assert len(expected) == count
        turns = read_jsonl(out)
        assert [t["id"] for t in turns] == [r["id"] for r in expected]
        for turn, record in zip(turns, expected):
            first_answer = [m["role"] for m in record["messages"]].index("assistant") + 1
            assert turn["messages"] == record["messages"][:first_answer]


def test_a_damaged_carried_file_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    """The carried file is ours and whole: a torn line there (unlike in a running generate's part file) is damage."""
    turns = [conversation(f"n{i}", "answer") for i in range(3)]
    write_jsonl_gz(tmp_path / "turns.jsonl.gz", turns)
    with gzip.open(tmp_path / "carried.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(conversation("n0", "carried")) + "\n" + '{"id": "n1", "mess')
    result = subprocess.run([sys.executable, "benchmarks/generation_sessions.py", "pending", "--turns",
                             str(tmp_path / "turns.jsonl.gz"), "--carried", str(tmp_path / "carried.jsonl.gz")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and f"{tmp_path / 'carried.jsonl.gz'}: line 2 " in result.stderr
    assert read_jsonl(tmp_path / "turns.jsonl.gz") == turns


def test_gputests_runs_the_tests_marked_gpu_and_only_those(tmp_path: Path) -> None:
    """`gpu_pipeline.sh gputests` collects every test marked `gpu` (here, without a GPU, each skipped by the marker)
    and no other, and leaves its report and JUnit file in $OUT."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "PYTEST"))}
    env.update({"OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PATH": python3_on_path(tmp_path),
                "PYTEST_ADDOPTS": f"--basetemp={tmp_path / 'basetemp'}",
                "CUDA_VISIBLE_DEVICES": ""})  # (on a GPU machine too: the marked tests skip, as asserted)
    result = subprocess.run(["bash", "benchmarks/gpu_pipeline.sh", "gputests"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    import xml.etree.ElementTree as ElementTree

    cases = ElementTree.parse(tmp_path / "out" / "gpu_tests.xml").getroot().iter("testcase")
    skipped = {case.get("name"): [s.get("message") for s in case.iter("skipped")] for case in cases}
    assert {"test_cuda_graph_path_equals_the_dynamic_path[dflash-llama]",
            "test_cuda_graphs_of_the_compiled_target_equal_the_dynamic_path[gemma3_text]",
            "test_features_copied_aside_train_as_those_copied_on_the_compute_stream"} <= set(skipped)
    assert all(messages == ["needs a CUDA device"] for messages in skipped.values()), skipped
    assert not any(name.startswith("test_variants_train") for name in skipped)  # unmarked tests are left out
    assert "gpu_tests\t" in (tmp_path / "out" / "timings.tsv").read_text()


def test_the_carried_default_is_a_committed_file_of_generated_conversations() -> None:
    """CARRIED's default names the newest committed generation (a stale path would regenerate everything on the GPU)."""
    import re

    script = (REPO / "benchmarks" / "gpu_pipeline.sh").read_text()
    default = re.search(r"^CARRIED=\$\{CARRIED:-([^}]+)\}", script, re.MULTILINE)
    assert default, "gpu_pipeline.sh sets no CARRIED default"
    records = [json.loads(line) for line in gzip.open(REPO / default.group(1), "rt")]
    assert len(records) == len({r["id"] for r in records}) > 10_000
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in records)
