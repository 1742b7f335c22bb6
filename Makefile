# The two set-up commands: `make demo` and `make test`. Both create .venv, install torch first
# (a bare `torch` requirement would pull a multi-GB CUDA build on some machines), then beeswarm
# with its extras. The install is skipped while pyproject.toml is unchanged (stamp keyed on its hash).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
ARGS ?=
PYTEST_ARGS ?=

BUNDLE := dist/beeswarm/beeswarm

.PHONY: demo test test-fast check install bundle gpu-check

demo: $(STAMP)
	$(VENV)/bin/beeswarm demo $(ARGS)

# Lint, types (strict on the pure cores) and the import layers (arrows point down): pyproject.toml.
check: $(STAMP)
	$(VENV)/bin/ruff check beeswarm tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The bundle's smoke tests (tests/test_bundle.py) run the binary built here (rebuilt when sources
# change). Beside the rest of the suite run, one after the other, the build (~3-4 min, one process)
# and the network-namespace tests (~5 min, mostly waiting on routers' timers, relays and hole
# punches; their output follows the suite's); then the bundle's tests run.
test: $(STAMP) check
	@mkdir -p build
	@($(MAKE) --no-print-directory $(BUNDLE) > build/bundle.log 2>&1; echo $$? > build/bundle.rc; \
	  $(PY) -m pytest -m "netns or faults" --durations=10 --basetemp=build/netns-tmp $(PYTEST_ARGS) > build/netns.log 2>&1; \
	  echo $$? > build/netns.rc) & \
	{ $(PY) -m pytest -m "not netns and not faults" --durations=20 $(PYTEST_ARGS) --ignore=tests/test_bundle.py; \
	  echo $$? > build/suite.rc; } | tee build/suite.log; wait; \
	echo "--- the network-namespace and fault tests, run beside the suite (build/netns.log) ---"; cat build/netns.log; \
	if [ "$$(cat build/bundle.rc)" != 0 ]; then tail -40 build/bundle.log; echo "bundle build failed"; exit 1; fi; \
	{ BEESWARM_REQUIRE_BUNDLE=1 $(PY) -m pytest $(PYTEST_ARGS) tests/test_bundle.py; \
	  echo $$? > build/bundle-tests.rc; } | tee build/bundle-tests.log; \
	echo "--- what failed, from all three runs (their logs: build/) ---"; \
	grep -hE "^(FAILED|ERROR) " build/suite.log build/netns.log build/bundle-tests.log || echo "nothing"; \
	exit $$(( $$(cat build/suite.rc) || $$(cat build/bundle-tests.rc) || $$(cat build/netns.rc) ))

# The inner loop: the pure and in-process tests (no beeswarm processes, none of 3 s or more), under 2 minutes on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" --ignore=tests/test_bundle.py $(PYTEST_ARGS)

install: $(STAMP)

# Every path that needs CUDA, as one table (benchmarks/gpu_check.py; ARGS="--device cpu" runs it on the CPU).
gpu-check: $(STAMP)
	cd benchmarks && ../$(PY) gpu_check.py $(ARGS)

bundle: $(BUNDLE)

$(BUNDLE): $(STAMP) $(shell find beeswarm packaging -type f -not -name '*.pyc' -not -path '*/__pycache__/*')
	PY=$(PY) packaging/build.sh

$(STAMP): pyproject.toml
	@# libp2p builds fastecdsa from source: it needs libgmp's headers.
	@if command -v dpkg >/dev/null && ! dpkg -s libgmp-dev >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
		else echo "libgmp-dev is missing: install it as root (apt-get install libgmp-dev)"; exit 1; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libgmp-dev gcc; \
	fi
	@# The across-home-routers test bed (tests/netbed.py) builds namespaces with ip, tc, nft and sysctl;
	@# without them (or without root) its tests skip, naming what is missing, so this one is not fatal.
	@if command -v dpkg >/dev/null; then need=; \
		for p in iproute2 nftables procps; do dpkg -s $$p >/dev/null 2>&1 || need="$$need $$p"; done; \
		if [ -z "$$need" ]; then :; elif [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need; \
		else echo "netbed tests will skip: install$$need as root (apt-get install$$need)"; fi; \
	fi
	@# The web app's tests (tests/test_web.py) drive Debian's Chromium with Playwright; without it they skip, saying so.
	@if command -v dpkg >/dev/null && ! command -v chromium >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
		else echo "web app tests will skip: install chromium as root (apt-get install chromium)"; fi; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "beeswarm needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench,bundle]'
	rm -f $(VENV)/.installed-*
	touch $@
