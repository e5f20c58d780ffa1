# Two commands from a fresh clone (the README's quick start): `make demo` and `make test`.
# Both create the environment in $(VENV) when it is missing, with the README's Install commands,
# then run the README's command. .ci/run is `make quality`, `make test`, then `make test-stacks`,
# so CI installs and tests the way a user does.
.PHONY: demo test test-fast quality setup test-stacks test-compat

VENV ?= .venv
CONSTRAINTS ?= constraints.txt
# Extra pip arguments for torch alone. The pin resolves to the CPU wheel where pip serves one
# (as here); on a machine with no GPU/NPU whose pip would fetch the multi-GB CUDA build, give
# PyTorch's CPU wheel index: make test TORCH_PIP_ARGS="--extra-index-url <that index>".
TORCH_PIP_ARGS ?=
# The torch pin of $(CONSTRAINTS), installed first and on its own; the extras to install.
TORCH_PIN = $(shell grep -E '^torch==' $(CONSTRAINTS))
# What $(CONSTRAINTS)'s installs need in their environment, from its `# pip-env: VAR=value` line
# (stacks/torch-2.15.txt: its torch is above the cap this machine's pip config puts on torch);
# empty for constraints.txt and the other stacks.
PIP_ENV = $(shell sed -n 's/^# pip-env: //p' $(CONSTRAINTS))
EXTRAS ?= recipes,test,bench,quality
# The other stacks CI tests (stacks/<name>.txt pins each): the compatibility suite (`-m compat`)
# runs in .venv-stacks/<name>, which `setup` builds from that file as it builds .venv.
STACKS ?= vllm-0.33 trl-vllm torch-2.15

# Every recipe runs inside the environment: `python`, `accelerate` and `pytest` are its own.
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
SHELL := /bin/bash

setup: $(VENV)/.installed

# Installed again when a pin, a range or an extra changes. torch first, on its own and pinned,
# so pip never resolves it to a CUDA build while it installs the rest.
$(VENV)/.installed: setup.cfg pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(PIP_ENV) python -m pip install $(TORCH_PIN) $(TORCH_PIP_ARGS)
	$(PIP_ENV) python -m pip install -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $@

# The GRPO recipe on its embedded default (2 processes, FSDP2 with deferral, 500 steps; 1 to 2
# minutes on 2 CPU cores, after the install), then its reward curve and one summary line (the
# accuracy reward's mean over the first and the last 100 steps).
demo: setup
	HF_HUB_OFFLINE=1 accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync
	python recipes/plot_rewards.py runs/grpo/trainer_state.json runs/grpo/reward_curve.png

test: setup
	HF_HUB_OFFLINE=1 python -m pytest -q

# The one-process tests only: the unit tests of each layer and the repository's own checks (README,
# docs, layering, CI), no multi-rank launch: 2.5 minutes on 2 CPU cores (measured: 617 passed,
# 3 skipped, 2m34s wall, with other jobs on the cores), against about 9 for `make test`.
test-fast: setup
	HF_HUB_OFFLINE=1 python -m pytest -q tests/unit tests/repo

# The compatibility suite on each of $(STACKS), each in its own venv (a make of its own, so that
# VIRTUAL_ENV and PATH are that venv's).
test-stacks:
	for stack in $(STACKS); do \
		$(MAKE) --no-print-directory test-compat VENV=.venv-stacks/$$stack CONSTRAINTS=stacks/$$stack.txt EXTRAS=recipes,test || exit 1; \
	done

test-compat: setup
	HF_HUB_OFFLINE=1 python -m pytest -q -m compat

# Lint, format and type checks (configured in pyproject.toml).
quality: setup
	ruff check .
	ruff format --check .
	mypy

# Before a release: each mutant in tools/mutants.py breaks the package in a copy of the repository,
# and the tests named with it must fail (`python tools/mutants.py --list` names them).
.PHONY: mutants
mutants: setup
	HF_HUB_OFFLINE=1 python tools/mutants.py
