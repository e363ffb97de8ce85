# Two commands from nothing: `make demo` and `make test`.  Both install into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ACCEL := $(VENV)/.accel-installed
# torch is pinned for development: an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test bench clean browser

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

# The optional compiled hot path (torchlens[fast]): built here so that the tests run both paths.  Without
# build isolation, so that its C++ gradient hooks build against the torch installed above.
$(ACCEL): $(STAMP) accel/setup.py accel/pyproject.toml $(wildcard accel/src/torchlens_accel/*)
	$(BIN)/python -m pip install -q "setuptools>=77"
	$(BIN)/python -m pip install -q --no-build-isolation ./accel
	touch $(ACCEL)

demo: $(STAMP)
	$(BIN)/python -m torchlens demo

# The browser tests drive Debian's chromium; install it only when it is missing (needs root).
browser:
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

# The suite runs twice: with the compiled hot path (whose tests fail rather than skip if it is not built),
# then on the pure-Python path alone, less the tests marked path_independent (spawned ranks meeting, waiting
# and resuming, and the tests that never trace, such as the import layering: what they check no capture
# path decides, and the distributed ones are the slowest tests there are) and those marked picks_its_path
# (every trace in them sets its own path, both paths side by side or a child process's: the second run
# would repeat the first, path for path).  Each run spreads its tests over one worker process per core
# (pytest-xdist); TESTFLAGS= runs them in this process.
# One torch thread per process: workers each running a thread per core would contend for the cores (on two
# cores the real-model tests took 70 s spread over two workers with two threads each, 24 s with one).
TESTFLAGS ?= -n auto --dist worksteal
TESTENV := OMP_NUM_THREADS=1
test: $(ACCEL) browser
	$(TESTENV) TORCHLENS_REQUIRE_ACCEL=1 $(BIN)/python -m pytest tests $(TESTFLAGS)
	$(TESTENV) TORCHLENS_ACCEL=0 $(BIN)/python -m pytest tests -m "not path_independent and not picks_its_path" $(TESTFLAGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/trace_overhead.py

clean:
	rm -rf $(VENV) build accel/build *.egg-info src/*.egg-info accel/src/*.egg-info
