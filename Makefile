# The two commands a newcomer runs (see README): `make demo` and `make test`.
# Both create ./.venv on first use; nothing is installed outside it.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

# Parallel test processes (pytest-xdist). The unit tests are CPU-bound: one per core. The
# integration tests mostly wait on the daemons, ranks and browsers they start: more.
UNIT_WORKERS        ?= 2
INTEGRATION_WORKERS ?= 4
# The rig's scenarios mostly wait (detection timeouts, recoveries), each on a fleet of its
# own: two at once (docs/rig.md has the figures).
RIG_WORKERS         ?= 2

.PHONY: demo test test-fast test-unit test-rollout rig lint format install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,train]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The quick loop while developing: lint and the unit tests (a few minutes), no daemons.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest tests/unit -n $(UNIT_WORKERS)

# make test and make rig run a test that failed once more, and the summary names it
# ("RERUN"): a test that fails then passes is a race to fix, never a pass to forget. The
# plain pytest commands (and make test-fast) do not rerun.
RERUN   := --reruns 1 --reruns-delay 2 -rR

# Everything but the rig: lint; the unit tests beside the rollout tests (the unit tests
# leave half the two cores idle, waiting on sockets and subprocesses; the rollout tests run
# in one process: they share one converged tree, a session fixture), each one's output
# printed once it ends; then the integration tests and the rig's helpers (a file's tests in
# one worker: loadfile).
test: lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-rollout
	$(BIN)/pytest tests/integration tests/rig -n $(INTEGRATION_WORKERS) --dist loadfile $(RERUN)

test-unit: $(STAMP)
	$(BIN)/pytest tests/unit -n $(UNIT_WORKERS) $(RERUN)

test-rollout: $(STAMP)
	$(BIN)/pytest tests/rollout $(RERUN)

# The fault-injection rig: every fault once on a fleet of network namespaces (root only),
# RIG_WORKERS scenarios at a time, each handed to the next idle worker (--dist load).
rig: $(STAMP)
	$(BIN)/pytest tests/rig -m rig -n $(RIG_WORKERS) --dist load -p no:cacheprovider $(RERUN)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .phalanx-local
