VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test soak lint format clean

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

soak: $(STAMP)
	$(PY) -m pytest -q -s -m soak tests/reliability --hypothesis-show-statistics

lint: $(STAMP)
	$(VENV)/bin/ruff check ondeck tests benchmarks
	$(VENV)/bin/ruff format --check ondeck tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format ondeck tests benchmarks
	$(VENV)/bin/ruff check --fix ondeck tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
