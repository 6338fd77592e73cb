# Two entry points for a fresh machine:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Three pytest-xdist workers on CI's 2 cores: tests wait on servers, process starts and sleeps, and a third worker
# fills those waits (measured: the suite's pytest time 869 s with two, 786, 789, 879 and 806 s with three, the cores 97%
# busy over a run with three; four was not measured).
TEST_WORKERS ?= 3
STAMP   := $(VENV)/.installed
PIP     := $(BIN)/python -m pip install -q -c constraints-cpu.txt
export OMP_NUM_THREADS ?= 2

.PHONY: install demo serve test lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned to the CPU build, so nothing resolves a CUDA torch.
	$(PIP) "torch==2.13.0+cpu"
	$(PIP) -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/slime-server demo

serve: install
	$(BIN)/slime-server serve --model tiny

# `make test ISA=avx2` (or generic): the suite with every process capped at that instruction set (gemv.c's build,
# oneDNN, ATen, MKL: rollout/gemv.isa_env), as a CPU without AVX-512 runs it.
# PYTHONDONTWRITEBYTECODE is emptied for the suite (an image may set it): its few hundred processes (engines, ranks,
# CLIs, workers) then read this package's compiled modules and pytest's rewritten tests instead of compiling them
# again each (measured: ~0.35 CPU-s per process importing the server, ~3 s per worker's collection).
ISA ?=
test: install
	$(BIN)/python -m ruff check slime_server tools tests
	$(if $(ISA),env $$($(BIN)/python -m slime_server.rollout.gemv --env $(ISA))) PYTHONDONTWRITEBYTECODE= \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/python tools/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
