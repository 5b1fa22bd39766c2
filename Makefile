# The two promises of the README: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo protos clean

# torch is pinned first: a plain `torch` requirement would pull the CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/muster --log-level warning demo --duration 45

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos protos/muster/v1/muster.proto

clean:
	rm -rf $(VENV) .muster
