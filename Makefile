# Quick start: `make demo` trains the debug recipe on 2 CPU processes; `make test` runs the test suite.
# Both create .venv (Python 3.10+) with the CPU build of torch the first time.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
RECIPE ?= recipes/debug.yaml
OUT ?= runs/debug
# The CPU wheel of torch. Elsewhere than this project's machines add the CPU index, e.g.
#   make demo TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test lint clean wheels

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) tools/prepare_data.py --recipe $(RECIPE)
	$(VENV)/bin/fsdp-train --nproc_per_node=$(NPROC) --recipe $(RECIPE) \
		--train.out_dir $(OUT) --checkpoint.resume none
	$(PY) tools/plot.py $(OUT)
	@echo "Run written to $(OUT)/: config.yaml, metrics.jsonl, metrics.png, checkpoints/. A sample from it:"
	$(PY) tools/generate.py $(OUT) --prompt "ROMEO." --max_new_tokens 80

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 --dist worksteal

lint: $(VENV)/.installed
	$(PY) -m pip install -q ruff && $(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# For a GPU machine that has torch but no internet: the wheels of every other dependency, for its Python and
# platform, to copy over and install with `pip install --no-index --find-links wheels -e .` (README, "Many GPUs").
WHEELS_PYTHON ?= 3.11
WHEELS_PLATFORM ?= manylinux2014_x86_64
wheels:
	$(PYTHON) -m pip download -q -d wheels --only-binary=:all: --python-version $(WHEELS_PYTHON) \
		--platform $(WHEELS_PLATFORM) --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		"numpy>=1.24" "safetensors>=0.4" "sentencepiece>=0.2" "jsonargparse[signatures]>=4.35" "pyyaml>=6" \
		"tokenizers>=0.19" "protobuf>=3.20" "tqdm>=4.60" "pyarrow>=14" "jinja2>=3.1" "setuptools>=64" wheel
	@echo "wheels/ holds $$(ls wheels | wc -l) wheels for Python $(WHEELS_PYTHON) on $(WHEELS_PLATFORM)"

clean:
	rm -rf $(VENV) data runs
