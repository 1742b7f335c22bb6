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

.PHONY: demo test install

demo: $(STAMP)
	$(VENV)/bin/beeswarm demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	@# libp2p builds fastecdsa from source: it needs libgmp's headers.
	@if command -v dpkg >/dev/null && ! dpkg -s libgmp-dev >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
		else echo "libgmp-dev is missing: install it as root (apt-get install libgmp-dev)"; exit 1; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libgmp-dev gcc; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "beeswarm needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	rm -f $(VENV)/.installed-*
	touch $@
