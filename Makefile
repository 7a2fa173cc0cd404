# Every target bootstraps the virtual environment in .venv on first use, with what it
# needs: `make serve` the server alone (.[server]), the others the server, PostgreSQL's
# driver and the tools (.[dev]). A stamp per extra: `make serve` then `make test` installs
# what the first left out; each is made again when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVER := $(VENV)/.installed-server
DEV    := $(VENV)/.installed-dev
# PostgreSQL for the conformance suite; override for another server. In CI the
# PostgreSQL tests are required, locally they skip with a reason when it is down.
export LEASEKEEPER_TEST_POSTGRES_URL ?= postgresql://postgres@127.0.0.1:5432/test

.PHONY: serve test check lint typecheck docs unasync pytest dist bench soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(SERVER): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[server]'
	touch $@

# .[dev] holds .[server]: its stamp stands for both.
$(DEV): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@ $(SERVER)

serve: $(SERVER)  ## run the server on the embedded SQLite store (./leasekeeper.db)
	$(BIN)/leasekeeper serve

test: check docs unasync pytest  ## the whole suite: lint, types, the docs build, the generated sync client, tests

check: lint typecheck

LINTED := src tests examples scripts $(wildcard bench)

lint: $(DEV)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

typecheck: $(DEV)
	$(BIN)/mypy

# Not --quiet: mkdocs then drops the warnings before --strict counts them, and passes.
docs: $(DEV)  ## the documentation site in site/; a warning (a broken link, a page outside the nav) fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

unasync: $(DEV)  ## fails when client/_sync.py is not what scripts/unasync.py writes
	$(BIN)/python scripts/unasync.py --check

pytest: $(DEV)
	$(BIN)/pytest -q -p no:cacheprovider

# What would be published: the sdist and the wheel built from it, in dist/, checked by
# twine (tests/test_install.py checks the same in a temporary directory).
dist: $(DEV)
	rm -rf dist
	$(BIN)/python -m build
	$(BIN)/twine check --strict dist/*

bench: $(DEV)  ## benchmarks (minutes); never part of `make test`
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench

soak: $(DEV)  ## long fault and contention runs (minutes)
	LEASEKEEPER_SOAK=1 $(BIN)/pytest -q -p no:cacheprovider -m soak -s tests

clean:
	rm -rf $(VENV) site dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
