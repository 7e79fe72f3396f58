# kiln — `make help` lists the targets.
# The interpreter .venv is made from (`make PYTHON=...` chooses another): the first python3.11 on
# PATH whose executable holds the interpreter itself, as distributions build it (PGO and LTO, no
# call through libpython3.11.so), else the first python3.11. A build linked to libpython
# (pyenv's default, first on this machine's PATH) ran kiln's Python 12-19% slower: a 3-step
# train.py 3.7 -> 3.0 CPU-s, 160 behaviour checks 52 -> 46 s (docs/development.md).
ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(shell for p in $$(which -a python3.11 2>/dev/null); do \
            ldd "$$p" 2>/dev/null | grep -q 'libc\.so' && ! ldd "$$p" | grep -q libpython && \
            { echo "$$p"; break; }; done),python3.11)
endif
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BYTECODE := $(VENV)/.compiled
ARGS   ?=
# pytest-xdist workers: three on the 2-core CI machine. Many tests wait (for a checkpoint to
# appear before a signal, a server to be ready, torchrun's rendezvous): with two workers eight
# such files used 101% of 200% CPU in 160 s, with three 147% in 124 s; the whole suite 190%.
# --dist loadscope keeps a test file on one worker, so its module fixtures (a trained run, a
# server) are built once rather than once per worker; under test-all, files without such
# fixtures and with many long cases are spread test by test, the longest first (tests/conftest.py).
JOBS   ?= 3

.DEFAULT_GOAL := help
.PHONY: help install train test test-all lint format sweep export serve bench matrix doctor lock clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-10s %s\n", $$1, $$2}'

# uv installs the lock in well under a minute (pip takes minutes); it is itself installed from
# the package index, and reads the machine's pip indexes. Plain pip is the fallback.
PIP_INDEXES := $(shell $(PYTHON) -m pip config get global.extra-index-url 2>/dev/null)
PIP_LINKS   := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_FLAGS    := $(foreach u,$(PIP_INDEXES),--extra-index-url $(u)) \
               $(foreach l,$(PIP_LINKS),--find-links $(l)) --index-strategy unsafe-best-match

UV_VERSION  := 0.13.9

# Re-runs only when the lock or the project metadata changes.
$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); python3.11 -m venv $(VENV); }
	($(PY) -m pip install --quiet uv==$(UV_VERSION) && \
	 $(VENV)/bin/uv pip install --quiet --python $(PY) $(UV_FLAGS) -r requirements.lock) || \
	 $(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Byte-compile the environment and kiln's src once. Python writes no .pyc where
# PYTHONDONTWRITEBYTECODE=1 is set (this machine, many Docker images), so every process compiled
# torch's 2,352 modules again: `import torch` 3.7 s -> 1.6 s, `train.py --help` 0.43 -> 0.29 s.
# One step for both install paths and for a .venv made before this step existed (uv's
# --compile-bytecode compiles only what that call installs). compileall exits 1 for files
# written for another Python (torch's py312_intrinsics.py), which 3.11 never imports: -qq and
# `|| true`; tests/test_startup.py checks that torch's modules have their bytecode. The
# packages' own test suites (pandas/tests, scipy's, sympy's ...: 3,800 of 23,000 files) are
# never imported: not compiled (-x): 86 -> 51 CPU-s, 50 -> 28 s of a fresh install. Nor is
# the Kubernetes API kserve's client brings (a fifth of the sources: its endpoints and models,
# sync and asyncio; the client imports the package roots only): alone 4.5 s, 7.7 CPU-s. Nor
# the code of transformers' 560 model families (1,459 modeling, tokenization and processing
# files, 15% of the sources; their configurations and the auto mappings stay): a run imports
# one family's, and compiles it in ~15 ms (modeling_bert.py: 14 ms).
COMPILE_SKIPS := /tests?/|/kubernetes/(aio|client/api|client/models)/|/transformers/models/(?!auto/)[^/]+/(modeling|modular|tokenization|image_processing|video_processing|feature_extraction|processing|convert)_
$(BYTECODE): $(STAMP)
	$(PY) -m compileall -qq -j 0 -x '$(COMPILE_SKIPS)' $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') src || true
	touch $(BYTECODE)

install: $(BYTECODE) ## build .venv from requirements.lock, byte-compiled (idempotent)

train: install ## train the default experiment (extra overrides: make train ARGS="model=resnet18")
	$(PY) train.py $(ARGS)

# Measured: docs/benchmarks.md, "How long things take". The commands tests start whose start is
# not what they check are forked from a Python that has imported torch, torchvision and Hydra
# (tests/preloaded_python.py): KILN_TESTS_FRESH_PYTHON=1 make test starts each one fresh.
TEST_TIME := about 7-11 min on 2 CPU cores (fresh clones 2026-12-07: 6 min 53 s - 10 min 38 s with the install, 376-549 s of pytest, by the hour's CPU speed)

test: lint ## ruff + the default test suite (everything but `slow`)
	@echo "make test: the default suite, $(TEST_TIME); one dot per test, the share done at each line's end"
	$(PY) -m pytest -m "not slow" -n $(JOBS) --dist loadscope $(ARGS)

test-all: lint ## ruff + every test, slow ones included
	$(PY) -m pytest -n $(JOBS) --dist loadscope $(ARGS)

lint: install ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

sweep: install ## a short multirun over num_workers x accumulation x precision; writes its summary
	$(PY) train.py -m data.num_workers=0,2 trainer.accumulate_grad_batches=1,4 \
		precision=fp32,amp trainer.max_epochs=1 $(ARGS)

bench: install ## engine vs a hand-written loop; kiln vs Lightning, quiet and beside a busy process; start-up vs Lightning and a plain loop, infer.py vs the server; text vs SVC and fastText, model=hf vs Hugging Face's Trainer; detection vs torchvision's reference loop
	$(PY) scripts/bench_engine.py $(ARGS)
	$(PY) scripts/bench_peers.py --contention 1 --rounds 3
	$(PY) scripts/bench_startup.py --out docs/figures/startup.json
	$(PY) scripts/loadtest.py && $(PY) scripts/loadtest_bombs.py --out docs/figures/serving_bombs.json
	$(PY) scripts/bench_infer.py --out docs/figures/infer_backends.json
	$(PY) scripts/bench_text.py --fasttext venv --contention 1
	$(PY) scripts/bench_image_folder.py --out docs/figures/image_folder.json
	$(PY) scripts/bench_detection.py --out docs/figures/detection.json

matrix: install ## every model x dataset x {single, DDP} x {amp off, on}, a few steps each
	$(PY) scripts/matrix.py $(ARGS)

doctor: install ## explain the Python / torch / CUDA / cuDNN / driver / ONNX Runtime stack
	$(PY) -m kiln.doctor

export: install ## export CKPT=<path to .pt> to ONNX with a parity check
	$(PY) infer.py mode=export ckpt=$(CKPT) $(ARGS)

serve: install ## serve CKPT=<path to .pt> over HTTP on 127.0.0.1
	$(PY) infer.py mode=serve ckpt=$(CKPT) $(ARGS)

lock: ## refresh requirements.lock from requirements.in (needs network to the package index)
	$(PY) -m pip install --quiet pip-tools
	$(VENV)/bin/pip-compile --quiet --strip-extras --no-emit-find-links --no-emit-index-url \
		-o requirements.lock requirements.in

clean: ## remove outputs, caches and the venv
	rm -rf outputs multirun .pytest_cache .ruff_cache wandb
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf $(VENV)
