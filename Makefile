# Set-up and entry points. `make demo` and `make test` work on a fresh machine, offline against
# the package registry: torch==2.13.0 (a local CPU wheel here) is installed first, so that no CUDA
# build is pulled by the packages that depend on torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nclip-installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/nclip train --preset tiny --out runs/tiny

test: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest --numprocesses auto --maxprocesses 4 --dist loadfile

bench: install
	$(BIN)/nclip bench --json bench.json

clean:
	rm -rf $(VENV) runs
