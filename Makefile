# The tests run from a local virtual environment (.venv) built from requirements-test.txt; the
# demo from a smaller one (.venv-demo) built from requirements-demo.txt at the same versions.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo
DEMO_VENV := .venv-demo
CONSTRAINTS := build/constraints.txt
GPU_CHECK := build/gpu-check

.PHONY: venv test lint demo bench gpu-check docs docs-serve clean

$(VENV)/.installed: requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-test.txt
	touch $@

venv: $(VENV)/.installed

## The whole test suite (README: what it covers): every option combination checked through its
## files' variants, a pairwise cover rendered whole, hook errors, the rendered projects' own
## suites (2-process gloo training included) and the launchers on real engines. The long tests
## are collected first and --no-loadscope-reorder keeps that order, so both workers end together.
## The slowest tests are listed at the end: the suite has a time budget (README).
test: venv
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=25

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Render the default project, install it and train it with 2 processes on CPU through its
## launcher, then launch it again to show that it resumes from its checkpoint; say what next.
## Its environment holds what the demo needs only, not the test stack.
demo: $(DEMO_VENV)/.installed
	rm -rf $(DEMO)
	$(DEMO_VENV)/bin/cookiecutter --no-input . --output-dir $(DEMO)
	$(DEMO_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e $(DEMO)/ddp-project
	cd $(DEMO)/ddp-project && PYTHON=$(CURDIR)/$(DEMO_VENV)/bin/python NPROC_PER_NODE=2 \
		OMP_NUM_THREADS=1 launch/torchrun.sh train.max_steps=60
	cd $(DEMO)/ddp-project && PYTHON=$(CURDIR)/$(DEMO_VENV)/bin/python NPROC_PER_NODE=2 \
		OMP_NUM_THREADS=1 launch/torchrun.sh train.max_steps=100
	@echo
	@echo "The demo project is $(DEMO)/ddp-project, installed in $(DEMO_VENV). Next, there:"
	@echo "  source $(CURDIR)/$(DEMO_VENV)/bin/activate"
	@echo "  1. your data, model and loss go in src/ddp_project/task.py;"
	@echo "     pip install -e '.[dev]' && make test   checks them (tests/task: 1 and 2 ranks, resume)"
	@echo "  2. launch/torchrun.sh --doctor            can this machine (each node) train?"
	@echo "  3. on a cluster: NNODES=2 RDZV_ENDPOINT=node01:29500 launch/torchrun.sh on each node,"
	@echo "     or sbatch launch/slurm/train.sbatch    (README: On a cluster)"
	@echo "A project of your own: cruft create (README: Generate a project)."

# --no-compile: compiling every module of torch at install takes longer than the few the demo
# imports take to compile when first imported.
$(DEMO_VENV)/.installed: requirements-demo.txt $(CONSTRAINTS)
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet --no-compile -r requirements-demo.txt \
		-c $(CONSTRAINTS)
	touch $@

# The demo's and the benchmarks' environments take the test environment's versions; pip takes
# no extras in a constraints file: the test pins without them.
$(CONSTRAINTS): requirements-test.txt
	mkdir -p $(@D)
	sed 's/\[[^]]*\]//' requirements-test.txt > $@

## Render the default project and time its Trainer against a plain DDP loop and Lightning on 2
## CPU processes, its launch and its all-reduce; writes docs/benchmarks.md. Not part of `test`.
bench: $(VENV)/.bench-installed
	OMP_NUM_THREADS=1 $(BIN)/python bench/run.py $(BENCH_ARGS)

## On a GPU machine: render a `gpt` project and run its `make gpu-check` (the GPU tests, a
## bitwise resume on CUDA, bf16 and fp16 steps, the gpt example at GPT-2 124M's shape eager and
## compiled, the checkpoint stall, the doctor): within 8 minutes on one GPU, it prints the
## table for the "GPU check" section of docs/benchmarks.md. .venv's torch must be a CUDA build
## (PyPI's on Linux is); without a GPU it says so and exits 2. Not part of `test`.
gpu-check: venv
	rm -rf $(GPU_CHECK)
	$(BIN)/cookiecutter --no-input . --output-dir $(GPU_CHECK) example=gpt
	cd $(GPU_CHECK)/ddp-project && PYTHONPATH=src $(CURDIR)/$(BIN)/python benchmarks/gpu_check.py

$(VENV)/.bench-installed: requirements-bench.txt $(VENV)/.installed $(CONSTRAINTS)
	$(BIN)/python -m pip install --quiet -r requirements-bench.txt -c $(CONSTRAINTS)
	touch $@

## Regenerate docs/options.md from cookiecutter.json, then build the site into site/ (strict:
## a broken link fails). docs-serve rebuilds and serves it at http://127.0.0.1:8000 while you edit.
docs: venv
	$(BIN)/python docs/generate_options.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) $(DEMO_VENV) build site
