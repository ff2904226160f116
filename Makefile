# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvroute-installed

.PHONY: test demo lint typecheck unit venv clean conformance

# the compiled index core is built by the install: rebuild when its sources change
$(STAMP): pyproject.toml conformance/install_nixl.sh $(wildcard indexer/csrc/*.c indexer/csrc/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	bash conformance/install_nixl.sh $(VENV)  # NIXL for P/D: --no-deps, so not a pip extra
	@touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck unit

demo: $(STAMP)
	$(VENV)/bin/kvroute demo

conformance: $(STAMP)  ## real vLLM on the CPU: bash conformance/setup_vllm.sh first
	$(PY) -m conformance --target vllm --report out/conformance-vllm.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache indexer/_cindex*.so
