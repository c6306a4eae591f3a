# The two commands a newcomer runs: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install the project on first use; torch is downloaded once into .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_PORT ?= 39292
TEST_KAFKA_DIR ?= $(HOME)/.cache/rollout-bus/make-test-broker
PYTEST_ARGS ?=
COMPOSE_TEST_RUNS ?= all

.PHONY: demo learn test venv lock lint bench clean chaos compose-check compose-test

venv: $(STAMP)

# Installs are reproducible: every package (test extras included) at the version and sha256 of requirements.lock,
# then the project itself without dependencies. `make lock` refreshes the lock from pyproject.toml.
LOCK := requirements.lock
PIP_VERSION := 26.3
UV_VERSION := 0.13.9
UV_VENV ?= $(HOME)/.cache/rollout-bus/uv-$(UV_VERSION)

$(STAMP): pyproject.toml setup.py $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "rollout-bus needs Python 3.11 or newer (found " + sys.version.split()[0] + ")")'
	@test -x $(BIN)/python || { echo "creating $(VENV) ..."; $(PYTHON) -m venv $(VENV); }
	@echo "installing the locked packages ($(LOCK)) and rollout-bus into $(VENV) (torch is large: the first time takes a few minutes) ..."
	$(BIN)/python -m pip install --progress-bar off -q 'pip==$(PIP_VERSION)'
	$(BIN)/python -m pip install --progress-bar off --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install --progress-bar off --no-deps --no-build-isolation -e .
	@touch $(STAMP)

lock:
	@test -x $(UV_VENV)/bin/uv || { $(PYTHON) -m venv $(UV_VENV) && $(UV_VENV)/bin/pip install -q 'uv==$(UV_VERSION)'; }
	$(UV_VENV)/bin/uv pip compile pyproject.toml --extra test --universal --python-version 3.11 --generate-hashes \
		--upgrade -o $(LOCK)

# `make demo` runs from the packaged prompt file (rollout_bus/demo/prompts.jsonl) with two generators sharing it, and
# prints the prompt ledger beside the batch table; DEMO_SOURCE= (empty) runs the seeded generator instead, which the
# seeded-only flags need, e.g. `make demo DEMO_SOURCE= DEMO_ARGS="--train --max-staleness 1"`.
DEMO_SOURCE ?= --from-prompts

demo: $(STAMP)
	$(BIN)/rollout-bus demo $(DEMO_SOURCE) $(DEMO_ARGS)

# The loop closed with a real policy, its calculator prompts on the bus (rollout.prompts) as a user's: two generators sample from it, `rollout-bus train` trains it on the shards and
# ships every version back; a reward table, learn.json and the plots; exit 1 unless the reward rose (about 2 minutes).
learn: $(STAMP)
	$(BIN)/rollout-bus demo --learn $(DEMO_SOURCE) $(DEMO_ARGS)

# The suite's broker is the project's own (rollout-bus kafka start), fresh every run, stopped also on failure.
# Debian's chromium is installed (as root, when missing) for the report's browser test. Then the alert rules
# through promtool (compose/prometheus/check-rules.sh), and the compose deployment on a real Docker engine (compose-test below: about 5 minutes with its images
# cached, 12 without; COMPOSE_TEST_RUNS=none skips it, saying so).
test: $(STAMP)
	@$(BIN)/rollout-bus kafka stop --port $(TEST_PORT) --data-dir $(TEST_KAFKA_DIR) >/dev/null 2>&1 || true
	@rm -rf $(TEST_KAFKA_DIR)
	$(BIN)/rollout-bus kafka start --port $(TEST_PORT) --data-dir $(TEST_KAFKA_DIR)
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || { \
	  echo "installing Debian's chromium for the report's browser test (tests/browser.py) ..."; \
	  { apt-get install -y -q --no-install-recommends chromium || { apt-get update -q && \
	    apt-get install -y -q --no-install-recommends chromium; }; } >/tmp/rollout-bus-apt-chromium.log 2>&1 || \
	  echo "chromium could not be installed (/tmp/rollout-bus-apt-chromium.log): the browser test is skipped"; }
	@command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || { \
	  echo "installing Debian's iptables for the packet-drop test (tests/integration/test_stream_packet_drop.py) ..."; \
	  { apt-get install -y -q --no-install-recommends iptables || { apt-get update -q && \
	    apt-get install -y -q --no-install-recommends iptables; }; } >/tmp/rollout-bus-apt-iptables.log 2>&1 || \
	  echo "iptables could not be installed (/tmp/rollout-bus-apt-iptables.log): the packet-drop test is skipped"; }
	@status=0; \
	ROLLOUT_BUS_TEST_BOOTSTRAP_SERVERS=127.0.0.1:$(TEST_PORT) $(BIN)/pytest -ra --durations=15 $(PYTEST_ARGS) || status=$$?; \
	$(BIN)/rollout-bus kafka stop --port $(TEST_PORT) --data-dir $(TEST_KAFKA_DIR); \
	compose/prometheus/check-rules.sh || status=$$?; \
	if [ "$(COMPOSE_TEST_RUNS)" = none ]; then echo "compose-test: skipped (COMPOSE_TEST_RUNS=none)"; \
	else compose/compose-test.sh $(COMPOSE_TEST_RUNS) || status=$$?; fi; \
	exit $$status

# Fault-injection drills of the whole pipeline on brokers of their own (a single node and a 3-node
# cluster, free ports in 31000-31999): the full table takes about 20 minutes; CHAOS_ARGS="--only NAME".
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos $(CHAOS_ARGS)

# The compose files checked by the real compose CLI: built once from the Go module proxy into the cache
# (compose/compose-plugin.sh, a few minutes), then `config -q` on the three layouts (the test that needs it runs).
COMPOSE_PROFILES_ALL := --profile observability --profile tools
compose-check: $(STAMP)
	@compose=$$(compose/compose-plugin.sh) && set -x && \
	$$compose -f compose/docker-compose.yml $(COMPOSE_PROFILES_ALL) config -q && \
	$$compose -f compose/docker-compose.yml -f compose/docker-compose.cluster.yml $(COMPOSE_PROFILES_ALL) config -q && \
	$$compose -f compose/docker-compose.yml -f compose/docker-compose.secure.yml $(COMPOSE_PROFILES_ALL) config -q
	$(BIN)/pytest -q -rs tests/unit/compose

lint: $(STAMP)
	$(BIN)/python -m tests.import_contracts

bench: $(STAMP)
	for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

# The compose deployment brought up for real: a private dockerd (root) unless one answers, local images
# (debootstrap, Python, Kafka, rollout-bus; cached), the single-broker stack with --scale stream=3 and the
# 3-broker stack with a broker killed mid-run, checked from outside the containers (compose/README.md).
# COMPOSE_TEST_RUNS=single|cluster|all (or none, in make test).
compose-test: $(STAMP)
	compose/compose-test.sh $(COMPOSE_TEST_RUNS)
