# Every target sets up what it needs first; `make install` is idempotent and fast once done.
PYTHON ?= python3
BUILD := $(CURDIR)/build
STAMP := $(BUILD)/.installed
EXTRAS ?= dev
export HF_LOWPREC_CACHE ?= $(BUILD)/cache
export HF_HOME ?= $(BUILD)/hf_home
export TORCH_EXTENSIONS_DIR ?= $(BUILD)/torch_extensions
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test bench fidelity clean

$(STAMP): pyproject.toml
	@mkdir -p $(BUILD)
	@# A machine that already has torch (e.g. a CUDA build) keeps it; otherwise take the CPU wheel.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) -m hf_lowprec.demo

test: install
	@$(PYTHON) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing loudly" >&2; exit 1; fi; exit $$rc

bench: install
	$(PYTHON) bench/bench_optim.py

# Collage training-fidelity comparison (ALGORITHMS.md §2): beta2 = 0.999, cosine decay, thousands of steps.
fidelity: install
	OMP_NUM_THREADS=1 $(PYTHON) -m hf_lowprec.demo --steps 2000 --lr 1e-3 --threads 1 \
		--strategies bf16-pure,collage-light,collage-plus,bf16-fp32states,bf16-mixed,bf16-kahan,bf16-sr

clean:
	rm -rf $(BUILD)
