# Set-up and the two entry points of the README. Everything installs into .venv/ from the
# project's own files; re-running is cheap (the venv is rebuilt only when a requirements file or
# pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed
MLM_STAMP := $(VENV)/.installed-megatron-lm
# Megatron-LM's own training loop is tested against a checkout of the pinned release: MEGATRON_LM
# when set, otherwise the shared checkout beside this repository when it exists; without one the
# Megatron-LM tests skip and say why.
# A clone made elsewhere (e.g. in a temporary folder) also finds the checkout beside the local
# repository it was cloned from.
ORIGIN := $(shell git config --get remote.origin.url 2>/dev/null)
SHARED_CANDIDATES := $(abspath ../shared/megatron-lm/core_v0.16.1) \
	$(if $(filter /%,$(ORIGIN)),$(abspath $(ORIGIN)/../shared/megatron-lm/core_v0.16.1))
SHARED_MEGATRON_LM := $(firstword $(foreach d,$(SHARED_CANDIDATES),$(if $(wildcard $(d)/megatron/training),$(d))))
MEGATRON_LM ?= $(SHARED_MEGATRON_LM)

# The newest lane: Python 3.12 (python3.12 on PATH, or pyenv's), megatron-core 0.19.2 and the
# Megatron-LM checkout of its release, in .venv-newest/ (requirements/newest.txt).
PYTHON_NEWEST ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(if $(shell $(p) -c 'import sys; print(sys.version_info[:2] == (3, 12))' 2>/dev/null | grep True),$(p))))
VENV_NEWEST := .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed
MEGATRON_LM_NEWEST ?= $(patsubst %/core_v0.16.1,%/core_v0.19.0,$(SHARED_MEGATRON_LM))

.PHONY: venv demo docs test test-quick test-newest test-newest-ci lint bench clean slurm-deps slurm-test megatron-lm-test

venv: $(STAMP)

$(STAMP): requirements/cpu.txt requirements/test.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 needed, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements/test.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The main job: tiny GPT on 2 CPU processes with LowDiff, SIGKILL of a rank, recovery, finish.
demo: $(STAMP)
	bash examples/gpt/demo.sh

# What Megatron-LM's megatron.training imports beyond the CPU stack (requirements/megatron-lm.txt).
$(MLM_STAMP): $(STAMP) requirements/megatron-lm.txt
	$(VENV)/bin/python -m pip install --quiet -r requirements/megatron-lm.txt
	@touch $(MLM_STAMP)

# The docs (docs/, Sphinx + MyST; the flag and command-line pages generated from the code), with
# warnings as errors, into docs/_build/html.
docs: $(STAMP)
	$(VENV)/bin/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

# The test suite (what .ci/run runs), Megatron-LM's training loop included when a checkout is found;
# the lint, the import contracts and the docs first.
test: $(STAMP) $(if $(MEGATRON_LM),$(MLM_STAMP))
	$(VENV)/bin/ruff check megatron_diffckpt examples tests benchmarks docs
	$(VENV)/bin/lint-imports --no-logo
	$(MAKE) --no-print-directory docs
	MEGATRON_LM="$(MEGATRON_LM)" $(VENV)/bin/python -m pytest --durations=20 tests

# The whole suite against megatron-core 0.19.2 on Python 3.12 (its own venv and pins).
$(STAMP_NEWEST): requirements/newest.txt pyproject.toml
	@test -n "$(PYTHON_NEWEST)" || { echo "the newest lane needs Python 3.12: set PYTHON_NEWEST" >&2; exit 2; }
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install --quiet -r requirements/newest.txt
	$(VENV_NEWEST)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP_NEWEST)

test-newest: $(STAMP_NEWEST)
	DIFFCKPT_PINS=requirements/newest.txt MEGATRON_LM="$(MEGATRON_LM_NEWEST)" \
		$(VENV_NEWEST)/bin/python -m pytest --durations=20 tests

# CI's second lane (.ci/run, after `make test`): of the newest lane, the drift checks, Megatron-LM's
# training loop and the keeper tests that depend on the release or on torch's CUDA build (the
# memory bound of a keeper, the shared-memory sweep): about 8 minutes, plus the venv.
NEWEST_CI_TESTS := tests/test_drift.py tests/test_patches.py tests/test_megatron_lm.py \
	tests/test_keeper_base.py::test_a_base_past_a_gib_goes_around_the_ring_without_entering_a_keepers_heap \
	tests/test_keeper.py::test_a_keeper_removes_the_shared_memory_folders_of_keepers_that_died
test-newest-ci: $(STAMP_NEWEST)
	@test -d "$(MEGATRON_LM_NEWEST)/megatron/training" || { echo "the newest lane needs the Megatron-LM checkout core_v0.19.0 (MEGATRON_LM_NEWEST)" >&2; exit 2; }
	DIFFCKPT_PINS=requirements/newest.txt MEGATRON_LM="$(MEGATRON_LM_NEWEST)" \
		$(VENV_NEWEST)/bin/python -m pytest --durations=10 $(NEWEST_CI_TESTS)

# The inner loop: the tests that start no training processes (about three minutes), against the
# same Megatron-LM checkout as `make test` (its `--help` test starts no training).
test-quick: $(STAMP) $(if $(MEGATRON_LM),$(MLM_STAMP))
	$(VENV)/bin/ruff check megatron_diffckpt examples tests benchmarks docs
	$(VENV)/bin/lint-imports --no-logo
	MEGATRON_LM="$(MEGATRON_LM)" $(VENV)/bin/python -m pytest -q -m "not distributed" tests

# The benchmarks (about 2 hours on 2 cores); results in benchmarks/results/.
bench: $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -r requirements/bench.txt
	$(VENV)/bin/python benchmarks/lowdiff_overhead.py
	$(VENV)/bin/python benchmarks/lowdiff_plus_overhead.py
	$(VENV)/bin/python benchmarks/autotune_failures.py

# A real single-node Slurm (Debian's slurm-wlm and munge, installed when missing; needs root):
# the launcher's requeue after a killed task, and its retry budget. make test runs these when
# Slurm is installed (.ci/run installs it first) and skips them otherwise.
slurm-deps:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }

slurm-test: $(STAMP) slurm-deps
	$(VENV)/bin/python -m pytest -q tests/test_slurm.py

# Megatron-LM's own pretrain_gpt.py (megatron.training) with differential checkpointing, on CPU,
# alone. Megatron-LM is not a package: a checkout of the installed megatron-core's release (the
# shared one by default, or e.g. a clone of NVIDIA/Megatron-LM at tag core_v0.16.1):
#   make megatron-lm-test MEGATRON_LM=../Megatron-LM
megatron-lm-test: $(MLM_STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "set MEGATRON_LM=<a Megatron-LM checkout>" >&2; exit 2; }
	MEGATRON_LM="$(abspath $(MEGATRON_LM))" $(VENV)/bin/python -m pytest -q tests/test_megatron_lm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_diffckpt examples tests benchmarks docs
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/ruff format --check megatron_diffckpt examples tests benchmarks docs

clean:
	rm -rf $(VENV) $(VENV_NEWEST) runs .pytest_cache docs/_build
