# make demo  - a real multi-process weight transfer on this machine (no GPU needed)
# make test  - the test suite (GPU tests skip cleanly without CUDA)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.weightsync-installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench-cpu bench-depth bench-planner bench-faults bench-gpu clean venv

venv: $(STAMP)

# torch: keep one the interpreter already has (GPU machines); otherwise install the pinned CPU build.
$(STAMP): setup.cfg pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "[make] python3 already has torch: sharing it with the venv"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip install -q $(TORCH_SPEC); \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/weightsync demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench-cpu: $(STAMP)
	$(BIN)/python bench/transfer_cpu.py --pairs 9 --cases mix,small,one --json | tee docs/results/transfer_cpu.txt

bench-depth: $(STAMP)
	$(BIN)/python bench/pipeline_depth.py --out docs/results/pipeline_depth_cpu.json

# SIGKILL a random role 300 times, restart it; exits non-zero on a half-applied version, rollback or stall
bench-faults: $(STAMP)
	$(BIN)/python bench/faults.py --trials 300 --out docs/results/faults_cpu.json

bench-planner: $(STAMP)
	$(BIN)/python bench/planner_scale.py | tee docs/results/planner_scale.jsonl

# on a 2-GPU machine, from the project root (see docs/TRANSPORTS.md): wheels in .whl, scripts in .gpu
bench-gpu:
	bash -c 'source .gpu/env.sh .whl && bash bench/gpu_suite.sh bench/results'

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
