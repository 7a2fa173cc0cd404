# Every target bootstraps its own virtual environment in .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# PostgreSQL for the conformance suite; override for another server. In CI the
# PostgreSQL tests are required, locally they skip with a reason when it is down.
export LEASEKEEPER_TEST_POSTGRES_URL ?= postgresql://postgres@127.0.0.1:5432/test

.PHONY: serve test check lint typecheck docs unasync pytest bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)  ## run the server on the embedded SQLite store (./leasekeeper.db)
	$(BIN)/leasekeeper serve

test: check docs unasync pytest  ## the whole suite: lint, types, the docs build, the generated sync client, tests

check: lint typecheck

LINTED := src tests examples scripts $(wildcard bench)

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

typecheck: $(STAMP)
	$(BIN)/mypy

# Not --quiet: mkdocs then drops the warnings before --strict counts them, and passes.
docs: $(STAMP)  ## the documentation site in site/; a warning (a broken link, a page outside the nav) fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

unasync: $(STAMP)  ## fails when client/_sync.py is not what scripts/unasync.py writes
	$(BIN)/python scripts/unasync.py --check

pytest: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider

bench: $(STAMP)  ## benchmarks (minutes); never part of `make test`
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench

soak: $(STAMP)  ## long fault and contention runs (minutes)
	LEASEKEEPER_SOAK=1 $(BIN)/pytest -q -p no:cacheprovider -m soak -s tests

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
