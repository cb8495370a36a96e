VENV := .venv
PY := $(VENV)/bin/python
# The GPU suite runs on any python with torch (CUDA), diffusers, transformers, accelerate,
# safetensors, psutil and pytest: `make test-gpu PYTHON_GPU=python3` leaves the venv out.
PYTHON_GPU ?= $(PY)
# Where the tests marked gpu live; only these files are collected, so the CPU suite's own
# test dependencies (hypothesis, peft) need not be installed there.
GPU_TESTS := tests/gpu tests/loading/test_cuda.py tests/loading/test_fp8_cuda.py tests/fp8/test_quantized.py
STAMP := $(VENV)/.installed

.PHONY: setup run test test-ui test-gpu soak lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ondeck generate --policy release

test: $(STAMP)
	$(PY) -m pytest -q
	# The loading tests again on the portable read path (no os.preadv, no reading processes).
	ONDECK_READ_PATH=portable $(PY) -m pytest -q tests/loading

# The page of `ondeck serve` in a real browser: Debian's chromium, driven by Playwright.
test-ui: $(STAMP)
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)
	$(PY) -m pip install -q -e '.[ui]'
	$(PY) -m pytest -q tests/serve/test_page.py

test-gpu: $(if $(filter $(PY),$(PYTHON_GPU)),$(STAMP))
	$(PYTHON_GPU) -m pytest -q -m gpu $(GPU_TESTS)

soak: $(STAMP)
	$(PY) -m pytest -q -s -m soak tests/reliability --hypothesis-show-statistics
	$(PY) -m pytest -q -s -m soak tests/serve/test_soak.py

lint: $(STAMP)
	$(VENV)/bin/ruff check ondeck tests benchmarks
	$(VENV)/bin/ruff format --check ondeck tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format ondeck tests benchmarks
	$(VENV)/bin/ruff check --fix ondeck tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
