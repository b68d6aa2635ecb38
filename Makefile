# Every target sets up what it needs first; `make install` is idempotent and fast once done.
PYTHON ?= python3
BUILD := $(CURDIR)/build
# One stamp per Python environment: installing into the system Python does not install into a venv.
STAMP := $(BUILD)/.installed-$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])")
EXTRAS ?= dev
export HF_LOWPREC_CACHE ?= $(BUILD)/cache
export HF_HOME ?= $(BUILD)/hf_home
export TORCH_EXTENSIONS_DIR ?= $(BUILD)/torch_extensions
# The compiled optimizer steps (hf_lowprec.optim.dispatch) are built once into this cache, one per
# CPU (its flags) and ATen capability: code Inductor generated for one ISA aborts a process run with
# another ("double free or corruption"), as when build/ moves to another machine or one command sets
# ATEN_CPU_CAPABILITY=avx2.
CPU_KEY := $(shell (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "$$ATEN_CPU_CAPABILITY") | cksum | cut -d' ' -f1)
export TORCHINDUCTOR_CACHE_DIR ?= $(BUILD)/inductor/cpu-$(CPU_KEY)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-ppo test-floors bench gpu-check device-bundle fidelity readme lint clean

$(STAMP): pyproject.toml
	@mkdir -p $(BUILD)
	@# A machine that already has torch (e.g. a CUDA build) keeps it; otherwise torch 2.13.0 from pip's index
	@# (the CPU wheel where the index serves it; PyPI's Linux wheel is the CUDA build).
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[$(EXTRAS)]"
	@# Build the native optimizer kernels now (a minute or two), not inside the first training step.
	@$(PYTHON) -c "from hf_lowprec.optim import native; r = native.native_unavailable(); print('native optimizer kernels:', r or 'built, ISA ' + native.isa())"
	@touch $(STAMP)

install: $(STAMP)

# The headline strategies on the embedded default, lost-arithmetic metrics on: a table, then plots in build/demo.
DEMO_STRATEGIES ?= bf16-mixed,bf16-pure,collage-plus,fp8-lm-o2
# On a CPU without AVX-512, torch's BF16 and FP16 matrix products are a scalar loop: the demo
# computes them as FP32 GEMMs of the exact upcasts, rounded once (hf_lowprec/cpu_gemm.py; `auto`
# changes nothing where AVX-512 is present). 419 s → 179 s on a 2-core AVX2 CPU (2026-12-05).
demo: export HF_LOWPREC_CPU_GEMM ?= auto
demo: install
	$(PYTHON) -m hf_lowprec compare --recipe pretrain_clm --strategies $(DEMO_STRATEGIES) --max_steps 150 --out $(BUILD)/demo

# Maintainer tools of the repository (not `hf-lowprec` subcommands: they write into the checkout).
# The README/docs tables that come from the code; tests/test_docs.py fails when they are stale.
readme: install
	$(PYTHON) scripts/readme_tables.py

# ruff (pinned in the dev extra): lint rules and formatting, both checked, nothing rewritten.
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# The suite runs on the current TRL line; the ppo-marked tests need TRL 1.12 (the last with
# PPOTrainer), which test-ppo puts in front of it on PYTHONPATH (same other packages).
PPO_SITE := $(BUILD)/ppo-site

# The suite pins one intra-op thread (tests/conftest.py) and runs on TEST_WORKERS processes
# (pytest-xdist; one per core: the two cores of the machines here), tests handed out as workers
# free up; the native kernels' tests run again at two threads, where their blocks are split
# over threads (results must not change).
TEST_WORKERS ?= 2
test: install
	@$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25 -m "not ppo" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing loudly" >&2; exit 1; fi; \
	if [ -z "$(PYTEST_ARGS)" ]; then OMP_NUM_THREADS=2 $(PYTHON) -m pytest -q tests/optim/test_native.py || rc=1; fi; \
	$(MAKE) --no-print-directory test-ppo; ppo=$$?; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$ppo

test-ppo: install
	@$(PYTHON) -c "import sys; sys.path.insert(0, '$(PPO_SITE)'); import trl.experimental.ppo" 2>/dev/null || \
		$(PYTHON) -m pip install --quiet --no-deps --target $(PPO_SITE) "trl>=1.12,<1.13"
	@PYTHONPATH=$(PPO_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -m ppo $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ] && [ -z "$(PYTEST_ARGS)" ]; then echo "no ppo tests collected: failing loudly" >&2; exit 1; fi; \
	if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

# The main suite on the oldest releases pyproject.toml allows (tests/floors.txt: transformers,
# accelerate, peft, TRL, DeepSpeed), in a venv of its own under build/ (made once). CI runs the
# newest; run this when a floor or an integration point changes (docs/gpu.md).
FLOORS_VENV := $(BUILD)/floors-venv
test-floors:
	@test -x $(FLOORS_VENV)/bin/python || $(PYTHON) -m venv $(FLOORS_VENV)
	@PIP_CONSTRAINT=$(CURDIR)/tests/floors.txt $(MAKE) --no-print-directory install PYTHON=$(FLOORS_VENV)/bin/python
	@# Again on every run: the install stamp watches pyproject.toml, not tests/floors.txt.
	@PIP_CONSTRAINT=$(CURDIR)/tests/floors.txt $(FLOORS_VENV)/bin/python -m pip install --quiet -e ".[dev]"
	@$(FLOORS_VENV)/bin/python -m pip freeze | grep -i -E "^(transformers|accelerate|peft|trl|deepspeed)=="
	@$(FLOORS_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not ppo" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing loudly" >&2; exit 1; fi; exit $$rc

bench: install
	$(PYTHON) bench/bench_native.py
	$(PYTHON) bench/bench_optim.py
	$(PYTHON) bench/bench_e2e.py
	$(PYTHON) bench/bench_gpu_ready.py
	$(PYTHON) bench/bench_ledger.py
	$(PYTHON) bench/bench_recipes.py

# Tests marked `cuda`, then a one-screen GPU bench (bench/gpu_check.py). Without a CUDA device:
# says so and exits 0, having installed and run nothing.
gpu-check:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		$(MAKE) --no-print-directory install && TORCHINDUCTOR_CACHE_DIR=$(BUILD)/inductor $(PYTHON) bench/gpu_check.py; \
	else echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False, or torch is missing): nothing run."; fi

# What the device check (scripts/device_check.sh, docs/gpu.md) installs on a GPU machine that
# reaches no package index: the wheels it lacks there (cp312, manylinux_2_28 x86_64) and this
# package's own, with bundle.json (the commit and a hash of every file that travels); prints the
# sizes (tree and bundle must stay under the device tool's 64 MiB). The machine already has
# torch 2.11, transformers, accelerate, peft, safetensors, tokenizers, numpy and pytest, within
# pyproject.toml's ranges; torchao (the float8 peer row) is the one missing wheel the check uses.
# Another one goes on the same pip download line (pure-Python py3-none-any wheels match it too).
DEVICE_BUNDLE := $(BUILD)/device-bundle
TORCHAO_VERSION ?= 0.18.0
device-bundle:
	@# Refuse first, naming what is heavy, when the tree alone could not travel (a venv not ignored, data).
	$(PYTHON) bench/device_check.py travel
	rm -rf $(DEVICE_BUNDLE) && mkdir -p $(DEVICE_BUNDLE)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d $(DEVICE_BUNDLE) "torchao==$(TORCHAO_VERSION)"
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(DEVICE_BUNDLE) .
	$(PYTHON) bench/device_check.py bundle $(DEVICE_BUNDLE)

# Collage training-fidelity comparison (docs/algorithms.md §2): beta2 = 0.999, cosine decay, thousands of steps.
fidelity: install
	OMP_NUM_THREADS=1 $(PYTHON) -m hf_lowprec.demo --steps 2000 --lr 1e-3 --threads 1 \
		--strategies bf16-pure,collage-light,collage-plus,bf16-fp32states,bf16-mixed,bf16-kahan,bf16-sr

clean:
	rm -rf $(BUILD)
