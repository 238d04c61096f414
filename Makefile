# One task runner for people and CI. `make test` sets everything up and runs every test;
# `make run` sets up and runs the main job (a short transfer benchmark).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Optional: a package index with CPU-only torch wheels (e.g. PyTorch's own CPU index), which keeps
# a fresh machine's download small where it can be reached. Plain PyPI works too.
TORCH_INDEX ?=
TORCH_SPEC ?= torch>=2.4
TRITON_SPEC ?= triton>=3.0
# The vLLM the plug-in's tests run against (tests/test_vllm*.py): its Python sources without its
# dependencies (they pin another torch, and its compiled ops need a GPU), then what importing its
# CPU offloading spec needs (most of vLLM's Python side), with vLLM 0.33's own version bounds.
# pip then reports vLLM's pins it leaves unmet (its torch, its compiled ops' dependencies) as
# "dependency conflicts": expected, and not an error.
VLLM_SPEC ?= vllm==0.33.0
VLLM_IMPORT_DEPS ?= msgspec regex "requests>=2.33.0" psutil "pyzmq>=25.0.0" \
  "transformers>=5.16.1,<5.21.0" cbor2 "aiohttp>=3.14.4" openai-harmony "openai>=2.25.0" \
  pybase64 cachetools cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18.0" \
  "xgrammar==0.2.8" "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0"

.PHONY: setup develop test test-rust test-python lint fmt run bench bench-rust wheel clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.9,<2" "numpy>=1.24" "pytest>=8" "hypothesis>=6.100" "ruff>=0.6" "mypy>=1.10" "matplotlib>=3.7"
	if [ -n "$(TORCH_INDEX)" ]; then \
	  $(PY) -m pip install -q --index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)" || $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	else $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q "$(TRITON_SPEC)"
	$(PY) -m pip install -q --no-deps "$(VLLM_SPEC)"
	$(PY) -m pip install -q $(VLLM_IMPORT_DEPS)
	touch $@

# Builds the extension (release) into the virtual environment.
develop: setup
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH maturin develop --release -q

test-rust:
	cargo test --all-targets

test-python: develop
	$(PY) -m pytest -q tests

# The test command: Rust tests, then Python tests against a fresh build.
test: setup test-rust test-python

# stubtest checks the hand-written python/blockswap/_core.pyi against the built extension;
# tests/typing/check_planted.py that `mypy --strict` reports each of the API mistakes planted in
# tests/typing/planted.py (a typo in an option, a spec of the wrong type), and nothing else.
lint: develop
	cargo fmt --check
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest blockswap._core --mypy-config-file pyproject.toml
	$(PY) tests/typing/check_planted.py

fmt: setup
	cargo fmt
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

# The main job: the benchmark suite's short version (GPU where there is one, host backend
# otherwise); results/<date>-<gpu or host>-quick/ gets its tables, JSON and plots.
run: develop
	$(PY) benches/suite.py --quick

# The full suite (a few minutes on a GPU): results/<date>-<gpu>/.
bench: develop
	$(PY) benches/suite.py

bench-rust:
	cargo bench --bench submit

# The release wheel for x86_64 Linux (see "Release artefacts" below): dist/*manylinux_2_17_x86_64.whl.
wheel: wheel-tools
	rm -f dist/blockswap-*_x86_64.whl
	PATH=$(abspath $(WHEEL_VENV))/bin:$$PATH maturin build $(WHEEL_FLAGS) --out dist

clean:
	cargo clean
	rm -rf $(VENV) dist

# Checks of the Rust core beyond `cargo test` (see docs/reliability.md).
.PHONY: loom miri fuzz-short fuzz-long stress-rust test-random

# Undefined-behaviour check of the host-only Rust tests under Miri (nightly and its miri component,
# installed when missing): the modules with unsafe code (slab pool, completion lane) and the engine
# tests over the host backend (the fault-injecting backend's after the modules, the engine's own
# in a run of their own, each run under MIRI_TIMEOUT), under Stacked Borrows, then the pool and
# lane under Tree Borrows.
# Property tests run 1-2 cases and loops are shortened there (Miri is ~1000x slower), and the
# engine tests build a small pool and small rings (`tests/common`); MIRI_TIMEOUT bounds each run
# (each took 290-332 s side by side on the 2-core development machine, the whole step 333 s).
# The engine tests run without isolation: proptest looks for its regression files.
MIRI_TIMEOUT ?= 1500
# The three runs are independent single-threaded interpreters: after one build they run side by
# side (each into its own log, printed in order), which halves the step on a 2-core machine.
miri:
	cargo +nightly miri --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal --component miri,rust-src
	cargo +nightly miri test --lib --test engine --test engine_blocks --test engine_faults --no-run
	.ci/parallel "$(MIRI_TIMEOUT)" \
	  "cargo +nightly miri test --lib -- pool:: completion:: transfer:: region:: && MIRIFLAGS=-Zmiri-disable-isolation cargo +nightly miri test --test engine_faults" \
	  "MIRIFLAGS=-Zmiri-disable-isolation cargo +nightly miri test --test engine --test engine_blocks" \
	  "MIRIFLAGS=-Zmiri-tree-borrows cargo +nightly miri test --lib -- pool:: completion::"

# The property tests with fresh random examples (CI runs them derandomised: the same examples
# each run). A failure prints the example and the seed to reproduce it.
test-random: develop
	HYPOTHESIS_PROFILE=random $(PY) -m pytest -q tests/test_reliability_properties.py -k property

# Model checking of the lock-free completion lane and slab pool with loom (about a minute).
# `--cfg loom` rebuilds every dependency, so it gets its own target directory.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=$${CARGO_TARGET_DIR:-target}/loom \
	  cargo test --profile loom --test loom -- --nocapture

# Coverage-guided fuzzing of descriptor validation, coalescing and block-table expansion
# (cargo-fuzz on a nightly toolchain, both installed when missing): FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 60
fuzz-short:
	fuzz/run.sh $(FUZZ_SECONDS)

# The long run: 20 minutes per target.
fuzz-long:
	fuzz/run.sh 1200

# A million random transfers through the engine on the host backend from several threads, every
# byte checked (STRESS_TRANSFERS to change the number). `cargo test` runs 20,000.
stress-rust:
	cargo test --release --test stress -- --ignored --nocapture

# ---- Release artefacts ------------------------------------------------------------------------
# The wheel is linked by zig (maturin's zig extra) against glibc 2.17's symbols and stripped: one
# manylinux_2_17 abi3 wheel for CPython 3.9+, about 0.5 MB. (A plain `maturin build` links
# against the build machine's glibc: manylinux_2_34 here, with a 5.5 MB extension carrying the
# release profile's debug info.) `--compatibility` makes maturin refuse a newer tag rather than
# quietly produce one. The tools live in a virtual environment of their own, without torch.
.PHONY: wheel-tools wheel-check wheel-aarch64 sdist msrv
WHEEL_VENV ?= .venv-wheel
SMOKE_VENV ?= .venv-smoke
WHEEL_FLAGS := --release --zig --strip --compatibility manylinux_2_17
MSRV := $(shell sed -n 's/^rust-version *= *"\(.*\)"/\1/p' Cargo.toml)

wheel-tools: $(WHEEL_VENV)/.setup-done

$(WHEEL_VENV)/.setup-done: Makefile
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install -q "maturin[zig]>=1.9,<2" "auditwheel>=6"
	touch $@

# Builds the wheel, checks its tag with auditwheel, installs it into a fresh virtual environment
# with numpy only and runs .ci/smoke_wheel.py there (see .ci/check-wheel).
wheel-check: wheel
	.ci/check-wheel dist/blockswap-*_x86_64.whl $(WHEEL_VENV)/bin/auditwheel $(SMOKE_VENV)

# The same wheel for aarch64 Linux, cross-built by zig (rustup adds the target's standard library;
# that needs rustup's download server). Its tag is checked; nothing here can run it.
wheel-aarch64: wheel-tools
	rustup target add aarch64-unknown-linux-gnu
	rm -f dist/blockswap-*_aarch64.whl
	PATH=$(abspath $(WHEEL_VENV))/bin:$$PATH maturin build $(WHEEL_FLAGS) \
	  --target aarch64-unknown-linux-gnu --out dist
	.ci/check-wheel dist/blockswap-*_aarch64.whl $(WHEEL_VENV)/bin/auditwheel

# The source distribution (no docs/results: pyproject.toml's maturin exclude).
sdist: wheel-tools
	PATH=$(abspath $(WHEEL_VENV))/bin:$$PATH maturin sdist --out dist

# The declared minimum Rust version (Cargo.toml's rust-version): no locked dependency may need a
# newer one (.ci/msrv.py), and the crate and its tests must build with it where rustup can
# install that toolchain (otherwise only the first check runs, and it says so).
msrv:
	$(PYTHON) .ci/msrv.py
	if rustup toolchain install $(MSRV) --profile minimal; then \
	  CARGO_TARGET_DIR=target/msrv cargo +$(MSRV) check --locked --all-targets --features python; \
	else echo "msrv: rustup could not install Rust $(MSRV): only the lockfile check ran"; fi

clean: clean-release
.PHONY: clean-release
clean-release:
	rm -rf $(WHEEL_VENV) $(SMOKE_VENV)
