# rtop — two commands on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.rtop-installed
PYTHON ?= python3

.PHONY: test test-fast demo lint typecheck pytest fuzz bench reliability accuracy screenshots clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU wheel; anything else pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# (the second run imports neither framework that pyproject.toml tells mypy to skip)
# mypy's cache lives outside the checkout, one per run (their options differ): a fresh
# clone, as CI makes, is checked in seconds instead of a minute. The cache only saves
# work: mypy checks each file's hash against it and re-checks what changed.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/rtop/mypy
typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict --cache-dir $(MYPY_CACHE)/collectors collectors
	$(VENV)/bin/mypy --no-warn-unused-configs --cache-dir $(MYPY_CACHE)/rtop rtop

pytest: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The fast tier, while working: lint, types, and every test that starts no training job,
# no Ray, no fault scenario, no fuzzer, no browser, no fresh virtualenv and needs no root
# (tests/conftest.py).
FAST := not (job or ray or fault or fuzz or root or browser or install or slow)
test-fast: lint typecheck
	$(VENV)/bin/pytest -q -n 4 -m "$(FAST)" $(PYTEST_ARGS)

# The fuzzers of tests/test_fuzz.py (frame decoder, recording reader, the rank's side
# of the hub connection) at 1,000,000 cases per property (CI: 10,000 per target, shared
# among its properties): hours, not minutes. FUZZ_ARGS go to pytest, e.g. FUZZ_ARGS="-k
# decoder".
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(VENV)/bin/pytest -o timeout=0 -q \
		tests/test_fuzz.py $(FUZZ_ARGS)

# A real Ray Train job (3 CPU workers, a starved rank 1) under the live view; e.g.
# make demo DEMO_ARGS="--fault straggler"  or  DEMO_ARGS="--headless --duration 60"
demo: $(STAMP)
	$(VENV)/bin/rtop demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/collector_overhead.py

# The fault suite with its long variants (network cut, hub killed, viewer frozen, disk
# full, overload, ranks dying under control actions), the bad-input suite, and what rtop
# costs the job under faults, written to docs/reliability.md. Runs as root (network
# namespaces, tmpfs); e.g. RELIABILITY_ARGS="--rounds 3" or "--no-overhead".
reliability: $(STAMP)
	$(PY) benchmarks/reliability.py $(RELIABILITY_ARGS)

# How often the diagnosis is right: every fault scenario on simulated fleets (5 seeds at
# 64 and 1,024 ranks, 1 at 4,096) beside a naive baseline, written to docs/diagnosis.md;
# e.g. ACCURACY_ARGS="--quick" or "--jobs 4".
accuracy: $(STAMP)
	$(PY) benchmarks/diagnosis_accuracy.py $(ACCURACY_ARGS)

# The README's screenshots (screenshots/*.svg): the real UI on the recorded runs of
# tests/fixtures and on simulated fleets of 1,024 and 16,384 ranks (their recordings are
# cached under ~/.cache/rtop/screenshots; the first 16,384-rank one takes ~10 minutes).
# SCREENSHOTS="fleet-1024 help" makes only those.
screenshots: $(STAMP)
	$(PY) screenshots/make.py $(SCREENSHOTS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
