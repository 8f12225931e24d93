# jaxsora — `make test` and `make demo` work on a fresh clone (CPU).
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test demo clean-venv lint browser plan-gpu plan-tpu

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch is installed first, pinned, so that pip takes the CPU wheel and nothing later pulls CUDA torch.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -c "import torch; assert '+cpu' in torch.__version__, 'a CUDA torch was installed: ' + torch.__version__"
	$(VPY) -m pip install -q -e '.[dev,torch,app]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

# The compilers of `--target` (docs/install.md): each in a folder of its own that only a target command loads, from
# pyproject.toml's plan-gpu / plan-tpu pins. make install (and so CI) puts in the GPU compiler: the structural HLO
# tests compile the step for an H100 with it (tests/train/test_target_hlo.py).
PLAN_GPU := $(VENV)/jaxsora-plan-gpu
PLAN_TPU := $(VENV)/jaxsora-plan-tpu
PINS = $(VPY) -c "import sys, tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))"

$(PLAN_GPU)/.installed $(PLAN_TPU)/.installed: pyproject.toml | $(VPY)
	rm -rf $(@D) && mkdir -p $(@D)
	$(PINS) $(patsubst jaxsora-%,%,$(notdir $(@D))) > $(@D).txt
	$(VPY) -m pip install -q --no-deps --target $(@D) -r $(@D).txt
	touch $@

plan-gpu: $(PLAN_GPU)/.installed
plan-tpu: $(PLAN_TPU)/.installed

install: $(STAMP) $(PLAN_GPU)/.installed

# The suite on TEST_WORKERS processes (pytest-xdist), whole files per worker so that module fixtures (compiled
# steps, trained runs) are built once; files with `slow` tests are handed out first (tests/conftest.py).
# Three workers on a 2-core machine: part of the suite waits rather than computes (timeouts, processes
# starting), and a third worker fills those waits (docs/install.md, "Running the tests").
# Each worker holds a few GiB (8 fake devices, compiled steps): raise it on machines with the memory.
TEST_WORKERS ?= 3
test: install lint browser
	$(VPY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade, simplify; pyproject.toml): make test
# runs it first, so CI does too
lint: install
	$(VPY) -m ruff check jaxsora data_tools bench tests configs docs

# The app's browser test (tests/app/test_app_browser.py) drives Debian's Chromium and its driver: installed here when
# missing, as root with apt-get (CI: a fresh machine, where the test fails without them); elsewhere the test skips
# and says how to install them.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (the app's browser test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else \
		echo "no /usr/bin/chromium: the app's browser test will skip (apt-get install chromium chromium-driver)"; \
	fi

# The CPU demo: synthetic videos → train a small STDiT3 → checkpoint → sample an mp4 → export to PyTorch.
DEMO ?= outputs/demo
DEMO_SEEDS ?= 4
# glibc gives XLA:CPU's per-step scratch buffers transparent huge pages instead of ~4 KB page faults
# (docs/install.md)
demo: export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
demo: install
	@# a fresh demo each time: the trainer refuses to start a new run in a folder that holds one
	rm -rf $(DEMO)
	$(VPY) -m data_tools.synthetic --output $(DEMO)/data --preset demo
	$(VPY) -m data_tools.synthetic --output $(DEMO)/eval --preset demo --num-videos 12 --num-images 4 --seed 1
	$(VPY) -m jaxsora.train --config configs/demo.py --data-path $(DEMO)/data/meta.csv --run-dir $(DEMO) \
		--config.eval.table=$(DEMO)/eval/meta.csv
	$(VPY) -m jaxsora.serve --preset demo --runs $(DEMO) --prompt-path $(DEMO)/data/prompts.txt --once --no-wandb
	@# prompts.txt: the captions of the 12 (colour, shape, direction) combinations no training clip shows
	$(VPY) -m jaxsora.sample --ckpt-path $(DEMO)/checkpoints --ema --output $(DEMO)/samples \
		--prompt-path $(DEMO)/data/prompts.txt --num-sample $(DEMO_SEEDS) --no-progress
	$(VPY) -m jaxsora.convert to-torch $(DEMO)/checkpoints $(DEMO)/stdit3_demo_ema.safetensors --ema
	@echo
	@# judged by their pixels: the shape's colour, which way it moves, and which shape it is
	$(VPY) -m data_tools.judge $(DEMO)/samples --png $(DEMO)/samples.png --quiet
	@echo
	@echo "demo done:"
	@echo "  data         $(DEMO)/data (meta.csv, videos)"
	@echo "  training log $(DEMO)/metrics.jsonl, validation loss $(DEMO)/eval.jsonl"
	@echo "  per checkpoint $(DEMO)/samples/demo/<step>/ (the inference server)"
	@echo "  checkpoints  $(DEMO)/checkpoints"
	@echo "  samples      $(DEMO)/samples, every frame beside its prompt: $(DEMO)/samples.png"
	@echo "  PyTorch      $(DEMO)/stdit3_demo_ema.safetensors (Open-Sora STDiT3 state dict)"
	@echo
	@echo "try the model in the browser (http://127.0.0.1:7860, its held-out captions as examples):"
	@echo "  $(VPY) -m jaxsora.app $(DEMO) --prompt-path $(DEMO)/data/prompts.txt"

clean-venv:
	rm -rf $(VENV)
