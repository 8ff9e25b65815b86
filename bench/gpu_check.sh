#!/usr/bin/env bash
# The GPU checks (docs/gpu.md), in one go (~8-12 minutes on one H200):
#   1. environment report        2. pytest -m cuda
#   3. kernel benchmark table, bf16 forward + backward at the Qwen2.5 0.5B / 7B / 32B shapes: naive,
#      the triton driver (all rows, half the rows, fused sweep), F.linear_cross_entropy and Liger's
#      fused GRPO loss, with the bf16 matmul ceiling of the same run and the modelled time beside each
#   4. a short training run of the toy preset on the GPU (tokens/s, time per stage)
# Logs and results go to $OUT (default bench/results/gpu-check-<date>); a short table is printed last.
# Each step has a time budget and failing steps are reported, not fatal.
#
#   bash bench/gpu_check.sh            # on a GPU machine
#   bash bench/gpu_check.sh --dry-run  # anywhere: same plumbing, CPU stand-ins for the CUDA-only steps
set -u -o pipefail

cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
OUT=${OUT:-bench/results/gpu-check-$(date +%Y-%m-%d)}
# Wheels carried from bench/fetch_gpu_wheels.sh (tyro for the CLI, liger-kernel for the kernel table):
# install them for this run only.
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import tyro, liger_kernel" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
SUMMARY="$OUT/gpu_check_summary.md"
: >"$SUMMARY"
ROWS=()

row() { ROWS+=("| $1 | $2 | $3 | $4 |"); }
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

# --------------------------------------------------------------------------------------------- 1. env
t0=$SECONDS
{
  echo "## Environment"
  echo '```'
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import importlib, importlib.util, platform
import torch
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}  "
      f"gpu {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "transformers", "numpy", "pytest", "pytest_benchmark", "safetensors", "matplotlib",
             "liger_kernel", "vllm", "flash_attn", "math_verify"):
    if importlib.util.find_spec(name) is None:
        print(f"{name:17s} missing (optional steps that need it skip)")
        continue
    try:
        module = importlib.import_module(name)
        print(f"{name:17s} {getattr(module, '__version__', 'importable')}")
    except Exception as err:  # an installed package that fails to import is worth a line, not a crash
        print(f"{name:17s} present but import fails: {type(err).__name__}: {str(err)[:100]}")
print("F.linear_cross_entropy:", hasattr(torch.nn.functional, "linear_cross_entropy"))
EOF
  echo '```'
} >>"$SUMMARY" 2>&1
env_status=$([[ $? -eq 0 ]] && echo ok || echo failed)
row "environment" "$env_status" $((SECONDS - t0)) "in gpu_check_summary.md"
if [[ $DRY -eq 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device visible: use --dry-run on machines without a GPU"
  exit 2
fi

# --------------------------------------------------------------------------------------------- 2. tests
t0=$SECONDS
log "pytest -m cuda"
# --continue-on-collection-errors: a test module whose optional imports (pyarrow, tyro) are missing on the
# GPU image must not stop the CUDA tests of the others.
timeout 240 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors tests \
  >"$OUT/pytest_cuda.log" 2>&1
rc=$?
result=$(grep -E "passed|failed|skipped|error|no tests ran" "$OUT/pytest_cuda.log" | tail -1)
status=$([[ $rc -eq 0 || $rc -eq 5 ]] && echo ok || echo "failed (rc $rc)")
[[ $rc -eq 124 ]] && status="timeout (240 s)"
row "pytest -m cuda" "$status" $((SECONDS - t0)) "${result:-see pytest_cuda.log}"

# --------------------------------------------------------------------------------------------- 3. bench
t0=$SECONDS
if [[ $DRY -eq 1 ]]; then
  bench_args=(--device cpu --shapes smoke --providers naive,torch,torch-fused,liger-dapo --timeout 120)
else
  bench_args=(--device cuda --providers naive,triton,triton-50%,triton-fused,torch-lce,liger-dapo --timeout 100)
fi
log "python -m bench.bench_kernels ${bench_args[*]}"
timeout 420 "$PY" -m bench.bench_kernels "${bench_args[@]}" --out "$OUT" >"$OUT/bench.log" 2>&1
rc=$?
table=$(grep -o "written to .*" "$OUT/bench.log" | sed 's/written to //')
status=$([[ $rc -eq 0 ]] && echo ok || echo "failed (rc $rc)")
[[ $rc -eq 124 ]] && status="timeout (420 s)"
row "kernel bench" "$status" $((SECONDS - t0)) "${table:-see bench.log}"
[[ -n "$table" ]] && cat "$table" >>"$SUMMARY"

# --------------------------------------------------------------------------------------------- 4. train
t0=$SECONDS
device=$([[ $DRY -eq 1 ]] && echo cpu || echo cuda)
train_args=(train --preset toy --trainer.device "$device" --logging.run-dir "$OUT/run" --trainer.total-steps 3
            --trainer.val-before-train False --trainer.val-every 0 --checkpoint.export-hf False --logging.plot False)
[[ $DRY -eq 1 ]] && train_args+=(--model.toy.sft-steps 2)  # CPU stand-in: plumbing only
log "flashdapo ${train_args[*]}"
timeout 120 "$PY" -m flashdapo "${train_args[@]}" >"$OUT/train.log" 2>&1
rc=$?
if [[ $rc -eq 0 && -f "$OUT/run/metrics.jsonl" ]]; then
  train_note=$("$PY" - "$OUT/run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in rows if "timing_s/step" in r] or rows
last = steps[-1] if steps else {}
stages = ", ".join(f"{k.split('/')[-1]} {v:.2f}s" for k, v in last.items() if k.startswith("timing_s/"))
tput = last.get("perf/throughput")
print(f"{len(steps)} steps; tokens/s/device {tput:.0f}; {stages}" if tput is not None else f"{len(steps)} steps; {stages}")
EOF
)
  row "toy training ($device)" ok $((SECONDS - t0)) "${train_note:-metrics.jsonl unreadable}"
else
  why=$([[ $rc -eq 124 ]] && echo "timeout (120 s)" || echo "skipped: rc $rc")
  row "toy training ($device)" "$why" $((SECONDS - t0)) "$(tail -1 "$OUT/train.log" | cut -c1-100)"
fi

# --------------------------------------------------------------------------------------------- table
{
  echo
  echo "## Summary ($(date -u +%Y-%m-%dT%H:%MZ), dry run: $DRY)"
  echo
  echo "| step | status | seconds | result |"
  echo "|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
} | tee -a "$SUMMARY"
echo "logs and results: $OUT"
