# Two commands from nothing: `make demo` and `make test`.  Both install into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned for development: an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test bench clean browser

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m torchlens demo

# The browser tests drive Debian's chromium; install it only when it is missing (needs root).
browser:
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

test: $(STAMP) browser
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python benchmarks/trace_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
