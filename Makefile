# ptxgen: every target does its own set-up (a venv in .venv with the project and
# its test extras, ptxas from the nvidia-cuda-nvcc wheel).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# `make bench` compares against torch: on a GPU machine whose python has torch,
# use `make bench VENV_FLAGS=--system-site-packages` (or scripts/gpu_bench.sh).
VENV_FLAGS ?=

.PHONY: all setup test golden demo bench results llamacpp conformance clean mutate fuzz

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# the suite without the `slow` comparisons with a llama.cpp build (make conformance),
# on one pytest-xdist worker per core, each test file on one worker (its module
# fixtures built once); PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the hostile-input suite (tests/fuzz) with many examples per property test;
# `make test` runs it with a few (PTXGEN_FUZZ_EXAMPLES unset)
FUZZ_EXAMPLES ?= 20000
fuzz: $(STAMP)
	PTXGEN_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/fuzz \
		--hypothesis-show-statistics $(PYTEST_ARGS)

golden: $(STAMP)
	PTXGEN_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/test_golden.py
	@git --no-pager diff --stat -- tests/golden || true

demo: $(STAMP)
	$(PY) -m ptxgen demo

bench: $(STAMP)
	$(PY) -m benchmarks.bench_all bench-results $(BENCH_ARGS)

# docs/results.md from benchmarks/results/*.json; a `make bench` run joins them
# with `python scripts/results_table.py --add bench-results`
results:
	$(PYTHON) scripts/results_table.py

# llama.cpp (CPU) built once per machine outside the tree, in
# $${PTXGEN_CACHE_DIR:-~/.cache/ptxgen}/llama.cpp-<version>; the oracle of scripts/conformance.py.
llamacpp:
	bash scripts/llamacpp_build.sh

# ptxgen's reference decoder against llama.cpp (CPU build, cached outside the
# tree) on synthetic files of every supported convention (docs/conformance.md)
conformance: $(STAMP) llamacpp
	$(PY) -m pytest -m slow tests/test_conformance.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# mutation check (tests/mutants.toml): every mutant must be caught
mutate: $(STAMP)
	$(PY) scripts/mutate.py $(MUTATE_ARGS)
