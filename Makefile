# jaxsora — `make test` and `make demo` work on a fresh clone (CPU).
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test demo clean-venv lint

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch is installed first, pinned, so that pip takes the CPU wheel and nothing later pulls CUDA torch.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -c "import torch; assert '+cpu' in torch.__version__, 'a CUDA torch was installed: ' + torch.__version__"
	$(VPY) -m pip install -q -e '.[dev,torch]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

test: install
	$(VPY) -m pytest tests

lint: install
	$(VPY) -m ruff check jaxsora data_tools bench tests configs

demo: install
	@echo "make demo arrives with the training system (issue 6); it is not there yet." >&2; exit 1

clean-venv:
	rm -rf $(VENV)
