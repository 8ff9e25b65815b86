"""The GPU check (docs/gpu.md): one Python process, one device call (~3-5 minutes on one H200).

Every result row goes to $OUT the moment it is measured (gpu_check.jsonl, one JSON object a line, and
gpu_check.md), so a timeout keeps what was done. Sections, each under the run's time budget (a section
that would start past it is reported as skipped; one that fails is reported and the run goes on):

1. environment: GPU, clocks (nvidia-smi), torch / triton / CUDA versions, optional packages;
2. GEMM ceilings at the exact shapes the designs run (triton.testing.do_bench, median), device copy
   bandwidth, and the cost model (bench/kernel_model.py) re-evaluated with those measured rates;
3. providers at Qwen2.5 7B and 32B (N=16384; 32B also 32768): generic (token_logprobs, triton), fused
   (fused_token_loss, triton), naive (7B only), Liger's fused linear cross-entropy and Apple's Cut
   Cross-Entropy when importable; forward and backward timed apart (CUDA events, one warm-up, median of
   5 and spread), peak extra memory and workspace (peak minus the gradients dh and dW);
4. a torch.profiler breakdown of one 7B step of generic and of fused: GEMM vs Triton vs other;
5. the toy training run (the README's demo, torch engine) for 40 steps on the GPU: s/step, validation;
6. `pytest -m cuda` on the test modules with CUDA cases only (not all of tests/ collected), run first (right
   after the environment) in a subprocess under their own budget (`--tests-budget-s`; no plugin the GPU image
   lacks), one row per test module: passed, failed, or not collected (and why: a module needing vLLM on an
   image without it); on a timeout, the module cut off and those never started are named (left out).

This file and everything it imports need only torch, triton, transformers, numpy, safetensors and pytest
(the GPU image has no tyro, vLLM, flash-attn or Liger); the toy run's subprocess also needs pyarrow and pyyaml.

  python bench/gpu_check.py [--out DIR] [--budget-s 290] [--tests-budget-s 120]
  python bench/gpu_check.py --dry-run   # CPU, tiny shapes, impl="torch": the same plumbing (in the tests)
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import kernel_model  # noqa: E402

# (label, N, H, V); naive only where its ~35 GB of fp32 logits and gradients fit next to the rest.
GPU_SHAPES = [("7B", 16384, 3584, 152064), ("32B", 16384, 5120, 152064), ("32B-32k", 32768, 5120, 152064)]
DRY_SHAPES = [("7B", 256, 32, 1000), ("32B", 128, 48, 1500)]
PROVIDERS = ("generic", "fused", "naive", "liger-flce", "cce", "generic-cap30", "fused-cap30")
"""LM-head providers timed; `-cap30`: flashdapo's own with Gemma's final-logit softcap of 30 (its tanh and
sech^2 work against the same provider uncapped)."""
GEMMA_CAP = 30.0
OPTIONAL = ("triton", "transformers", "liger_kernel", "cut_cross_entropy", "vllm", "flash_attn", "pytest")


class Report:
    """Rows to $OUT as they come: JSON lines, a Markdown table per section, and stdout."""

    def __init__(self, out: Path, deadline: float):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.deadline = out, deadline
        self.jsonl, self.md = out / "gpu_check.jsonl", out / "gpu_check.md"
        self.jsonl.write_text("")
        self.md.write_text(f"# GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str, columns: list[str]) -> None:
        self._columns = columns
        with self.md.open("a") as f:
            f.write(f"\n## {name}\n\n| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n")
        print(f"\n== {name}", flush=True)

    def row(self, section: str, **fields) -> None:
        fields = {"section": section, **fields}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(fields, default=str) + "\n")
        cells = [_fmt(fields.get(c, "")) for c in self._columns]
        with self.md.open("a") as f:
            f.write(f"| {' | '.join(cells)} |\n")
        print("  " + " | ".join(cells), flush=True)


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def run_section(report: Report, name: str, need_s: float, fn) -> None:
    """Run one section unless less than `need_s` of the budget is left; a failure is a row, not fatal."""
    if report.left() < need_s:
        report.row(name, status=f"skipped: {report.left():.0f} s of the budget left, needs ~{need_s:.0f}")
        return
    try:
        fn()
    except Exception as err:  # the run must go on and report; the error is the row
        report.row(name, status=f"failed: {type(err).__name__}: {str(err)[:300]}")


# ------------------------------------------------------------------------------ 1. environment
def environment(report: Report, device: str) -> None:
    report.section("environment", ["item", "value"])
    report.row("environment", item="python / torch / cuda", value=f"{platform.python_version()} / "
               f"{torch.__version__} / {torch.version.cuda}")
    report.row("environment", item="device", value=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    query = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,memory.total"
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        smi = f"nvidia-smi not available ({type(err).__name__})"
    report.row("environment", item=query, value=smi or "nvidia-smi printed nothing")
    if device == "cuda":
        from flashdapo.kernels import gemm

        acc = torch.zeros(64, 64, device="cuda")
        gemm.mm_acc_(acc, *(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
        report.row("environment", item="dh accumulated inside the GEMM (addmm out_dtype, fp32 self)",
                   value="no: mm + add_ (" + gemm._FP32_INPUT_REFUSED[0][:100] + ")" if gemm._FP32_INPUT_REFUSED else "yes")
    for name in OPTIONAL:
        if importlib.util.find_spec(name) is None:
            report.row("environment", item=name, value="missing (its rows skip)")
            continue
        try:
            version = getattr(importlib.import_module(name), "__version__", "importable")
        except Exception as err:  # installed but broken: worth a line
            version = f"import fails: {type(err).__name__}: {str(err)[:120]}"
        report.row("environment", item=name, value=version)


# ------------------------------------------------------------------------------ 2. GEMM ceilings
def _bench_ms(fn, device: str) -> float:
    """Median ms of fn: triton's do_bench on CUDA, a few timed calls on CPU (dry run)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_cases(n: int, h: int, v: int, device: str):
    """(name, flops, fn) of each GEMM form the drivers run at this shape, with their chunk sizes."""
    from flashdapo.kernels.chunked import CUDA_CHUNK_VOCAB, CUDA_TILE_ELEMS
    from flashdapo.kernels.fused import fused_chunk_tokens
    from flashdapo.kernels.gemm import mm_acc_, mm_f32, mm_into_

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    bv = min(v, CUDA_CHUNK_VOCAB)
    bn, c = min(n, CUDA_TILE_ELEMS // bv), fused_chunk_tokens(n, v, "cuda")
    r = lambda *s, dtype=dt: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    hh, w_c, dz = r(n, h), r(bv, h), r(n, bv)
    dw_c, dh, acc = torch.empty(bv, h, device=device, dtype=dt), r(n, h, dtype=torch.float32), r(bv, h, dtype=torch.float32)
    return [
        (f"z = h W_c^T [{bn}x{h}]x[{h}x{bv}] -> fp32", 2 * bn * h * bv, lambda: mm_f32(hh[:bn], w_c.T)),
        (f"dW_c = dz^T h [{bv}x{n}]x[{n}x{h}] -> 16-bit", 2 * bv * n * h, lambda: mm_into_(dw_c, dz.T, hh)),
        (f"dh += dz W_c [{n}x{bv}]x[{bv}x{h}] fp32 acc", 2 * n * bv * h, lambda: mm_acc_(dh, dz, w_c)),
        (f"fused dW += dz^T h_t [{bv}x{c}]x[{c}x{h}] fp32 acc", 2 * bv * c * h, lambda: mm_acc_(acc, dz[:c].T, hh[:c])),
    ]


def _square_gemm_ms(size: int, dtype, device: str) -> float:
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return _bench_ms(lambda: a @ b, device)


def _copy_ms(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _bench_ms(lambda: dst.copy_(src), device)


def gemm_ceilings(report: Report, device: str, shapes) -> dict:
    """Measured rates: {"ceiling": TFLOP/s on 8192^3, "copy_tbps", (shape, case index): TFLOP/s}."""
    report.section("GEMM ceilings and copy bandwidth (median)", ["shape", "case", "ms", "TFLOP/s", "TB/s"])
    rates, size = {}, 8192 if device == "cuda" else 256
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    ms = _square_gemm_ms(size, dt, device)
    rates["ceiling"] = 2 * size**3 / ms / 1e9
    report.row("gemm", shape="-", case=f"{size}^3 {dt}", ms=ms, **{"TFLOP/s": rates["ceiling"]})
    nbytes = 2**30 if device == "cuda" else 2**24
    ms = _copy_ms(nbytes, device)
    rates["copy_tbps"] = 2 * nbytes / ms / 1e9
    report.row("gemm", shape="-", case=f"device copy {nbytes >> 20} MiB", ms=ms, **{"TB/s": rates["copy_tbps"]})
    for label, n, h, v in shapes[:2]:
        for i, (name, flops, fn) in enumerate(gemm_cases(n, h, v, device)):
            ms = _bench_ms(fn, device)
            rates[(label, i)] = flops / ms / 1e9
            report.row("gemm", shape=label, case=name, ms=ms, **{"TFLOP/s": rates[(label, i)]})
        _free(device)
    return rates


def model_with_rates(report: Report, rates: dict, shapes) -> None:
    """The cost model again, with the GEMM rates (each design's own GEMM mix) and copy rate just measured."""
    report.section("model with the measured rates", ["shape", "provider", "GEMM TFLOP/s", "model ms",
                                                     "vs 8NHV at ceiling"])
    for label, n, h, v in shapes:
        key = label if (label, 0) in rates else "32B"
        if (key, 0) not in rates:
            continue
        r = [rates[(key, i)] for i in range(4)]
        # generic: z twice (forward, recompute), dW, dh: 4 + 2 + 2 NHV; fused: z, dh, fp32 dW: 2 + 2 + 2 NHV
        mixes = {"triton": (kernel_model.generic, 8 / (4 / r[0] + 2 / r[1] + 2 / r[2])),
                 "triton-fused": (kernel_model.fused, 6 / (2 / r[0] + 2 / r[2] + 2 / r[3]))}
        for p, (model, gemm) in mixes.items():
            measured = kernel_model.Rates(gemm, rates["copy_tbps"], kernel_model.RATES.fp32_tflops, rates["ceiling"])
            cost = model(n, h, v, rates=measured)
            report.row("model", shape=label, provider=p, **{"GEMM TFLOP/s": gemm, "model ms": cost.ms,
                       "vs 8NHV at ceiling": cost.ms / kernel_model.ideal_ms(n, h, v, measured)})


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ 3. providers
def make_provider(name: str, h, w, y, g, impl: str):
    """(forward, backward) closures of one provider, or a string saying why it cannot run here."""
    from flashdapo.kernels import fused_token_loss, token_logprobs

    cap = None
    if name.endswith("-cap30"):  # flashdapo's own provider with the final-logit softcap
        name, cap = name.removesuffix("-cap30"), GEMMA_CAP
        if name not in ("generic", "fused"):
            raise ValueError(f"{name}-cap30")
    if name == "generic":
        return (lambda: token_logprobs(h, w, y, impl=impl, softcap=cap)), (lambda logp: logp.backward(g))
    if name == "naive":
        return (lambda: token_logprobs(h, w, y, impl="naive")), (lambda logp: logp.backward(g))
    if name == "fused":  # the gradient is formed in the forward; backward hands it on
        loss_fn = lambda lp, rows: (lp * g[rows]).sum()  # noqa: E731 - dL/dlogp = g, as the others get
        return (lambda: fused_token_loss(h, w, y, loss_fn, impl=impl, softcap=cap)[0]), (lambda loss: loss.backward())
    if name == "liger-flce":
        if importlib.util.find_spec("liger_kernel") is None or not h.is_cuda:
            return "liger-kernel not installed" if h.is_cuda else "needs CUDA"
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        return (lambda: loss(w, h, y)), (lambda out: out.backward())
    if name == "cce":
        if importlib.util.find_spec("cut_cross_entropy") is None or not h.is_cuda:
            return "cut-cross-entropy not installed" if h.is_cuda else "needs CUDA"
        from cut_cross_entropy import linear_cross_entropy

        return (lambda: linear_cross_entropy(h, w, y, reduction="sum")), (lambda out: out.backward())
    raise ValueError(name)


def _step_ms(fwd, bwd, h, w, device: str) -> tuple[float, float]:
    h.grad = w.grad = None
    if device != "cuda":
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        bwd(out)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    events[0].record()
    out = fwd()
    events[1].record()
    bwd(out)
    events[2].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])


def _peak_extra(fwd, bwd, h, w, device: str) -> float | None:
    """Peak bytes allocated during one step beyond what was allocated before it (gradients included)."""
    if device != "cuda":
        return None
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bwd(fwd())
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure_provider(report: Report, name: str, shape, device: str, reps: int = 5) -> None:
    label, n, hdim, v = shape
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    impl = "triton" if device == "cuda" else "torch"
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hdim, device=device, generator=gen).to(dt).requires_grad_(True)
    w = (torch.randn(v, hdim, device=device, generator=gen) * (4 / hdim**0.5)).to(dt).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen)
    made = make_provider(name, h, w, y, g, impl)
    if isinstance(made, str):
        report.row("providers", shape=label, provider=name, status=f"skipped: {made}")
        return
    fwd, bwd = made
    try:
        _step_ms(fwd, bwd, h, w, device)  # warm-up: compiles, allocator
        peak = _peak_extra(fwd, bwd, h, w, device)
        times = [_step_ms(fwd, bwd, h, w, device) for _ in range(reps)]
    except torch.OutOfMemoryError:
        report.row("providers", shape=label, provider=name, status="OOM")
        return
    except Exception as err:  # one provider failing must not cost the others their rows
        report.row("providers", shape=label, provider=name, status=f"failed: {type(err).__name__}: {str(err)[:200]}")
        return
    finally:
        h.grad = w.grad = None
        _free(device)
    f_ms, b_ms = ([t[i] for t in times] for i in range(2))
    total = [a + b for a, b in times]
    grads = (h.numel() + w.numel()) * h.element_size()
    ideal = 8 * n * hdim * v / (statistics.median(total) * 1e-3) / 1e12
    report.row("providers", shape=label, provider=name, status="ok", **{
        "fwd ms": statistics.median(f_ms), "bwd ms": statistics.median(b_ms), "step ms": statistics.median(total),
        "spread ms": f"{min(total):.1f}-{max(total):.1f}", "8NHV TFLOP/s": ideal,
        "peak GB": "" if peak is None else peak / 1e9, "workspace GB": "" if peak is None else (peak - grads) / 1e9})


def providers(report: Report, device: str, shapes) -> None:
    report.section("providers: bf16 forward + backward into h and W, all rows live (median of 5)",
                   ["shape", "provider", "status", "fwd ms", "bwd ms", "step ms", "spread ms", "8NHV TFLOP/s",
                    "peak GB", "workspace GB"])
    for shape in shapes:
        for name in PROVIDERS:
            if name == "naive" and shape[0] != "7B":
                continue
            if report.left() < 25:
                report.row("providers", shape=shape[0], provider=name, status="skipped: budget")
                continue
            measure_provider(report, name, shape, device)


# ------------------------------------------------------------------------------ 4. profile
def _category(kernel: str) -> str:
    k = kernel.lower()
    if "_stats_kernel" in k or "_grad_kernel" in k:
        return "Triton (flashdapo passes)"
    if any(s in k for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul", "addmm", "aten::mm")):
        return "GEMM"
    return "other"


def profile_step(report: Report, device: str, shape) -> None:
    """One step of generic and of fused at `shape` under torch.profiler: device time per category."""
    from torch.profiler import ProfilerActivity, profile

    report.section(f"profile of one {shape[0]} step (device time; CPU ops in the dry run)",
                   ["provider", "category", "ms", "share", "top kernels"])
    label, n, hdim, v = shape
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    h = torch.randn(n, hdim, device=device).to(dt).requires_grad_(True)
    w = (torch.randn(v, hdim, device=device) * (4 / hdim**0.5)).to(dt).requires_grad_(True)
    y, g = torch.randint(0, v, (n,), device=device), torch.randn(n, device=device)
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    for name in ("generic", "fused"):
        fwd, bwd = make_provider(name, h, w, y, g, "triton" if device == "cuda" else "torch")
        _step_ms(fwd, bwd, h, w, device)
        with profile(activities=activities) as prof:
            _step_ms(fwd, bwd, h, w, device)
        per_kernel = {}
        for evt in prof.key_averages():
            us = (getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
                  if device == "cuda" else evt.self_cpu_time_total)
            if us > 0:
                per_kernel[evt.key] = per_kernel.get(evt.key, 0.0) + us / 1e3
        total = sum(per_kernel.values()) or 1.0
        for cat in ("GEMM", "Triton (flashdapo passes)", "other"):
            names = sorted((k for k in per_kernel if _category(k) == cat), key=per_kernel.get, reverse=True)
            ms = sum(per_kernel[k] for k in names)
            top = "; ".join(f"{k[:60]} {per_kernel[k]:.1f}" for k in names[:3])
            report.row("profile", provider=name, category=cat, ms=ms, share=f"{100 * ms / total:.0f}%",
                       **{"top kernels": top})
        h.grad = w.grad = None
    _free(device)


# ------------------------------------------------------------------------------ 5. the toy training run
TOY_RUN = """
import json, sys, time
from pathlib import Path
from flashdapo.config import merge, preset
from flashdapo.trainer.loop import train
steps, device, run_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
cfg = merge(preset("toy"), {"trainer": {"total_steps": steps, "device": device, "val_every": steps},
                            "checkpoint": {"save_every": 0, "export_hf": False},
                            "logging": {"run_dir": str(run_dir), "plot": False, "progress": False,
                                        "move_old_run": True}})
began = time.perf_counter()
train(cfg)
print(json.dumps({"wall_s": time.perf_counter() - began}))
"""


def toy_training(report: Report, device: str, dry: bool) -> None:
    """DAPO on the toy task (the README's demo, torch engine) on this device, in a subprocess: s/step and the
    last validation. Needs the trainer's own packages (pyarrow, pyyaml), not the command line's (tyro)."""
    report.section("train", ["status", "steps", "s/step", "val mean@k", "seconds"])
    steps = 2 if dry else 40
    run_dir = report.out / "toy-run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", TOY_RUN, str(steps), device, str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=max(10, int(report.left() - 40)))
    (report.out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        report.row("train", status=f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}",
                   steps=steps, seconds=round(time.monotonic() - t0))
        return
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in history if m.get("step", 0) > 0 and "timing_s/step" in m]
    val = next((m[k] for m in reversed(history) for k in m if k.startswith("val/") and "mean@" in k), "")
    report.row("train", status="ok", steps=len(trained), seconds=round(time.monotonic() - t0),
               **{"s/step": statistics.median(m["timing_s/step"] for m in trained), "val mean@k": val})


# ------------------------------------------------------------------------------ 6. tests
CUDA_MARK = "mark.cuda"
"""How a test module marks its own CUDA cases (a decorator, `pytestmark`, or a parametrize case's `marks=`)."""
MARKED_ON_A_GPU = ("from kernel_accuracy import", ("TRITON", "impl_params"))
"""The helper whose triton parameter carries the `cuda` mark on a GPU (tests/kernels/kernel_accuracy.py): the
kernel suite's modules that import it and its marked parameter (TRITON, TRITON_MARKS, impl_params) have CUDA
cases there."""


def cuda_test_modules(root: Path, gpu: bool = True) -> list[Path]:
    """The test modules under `root` (test_*.py) with `cuda`-marked cases: first those that mark cases
    themselves, then, on a GPU (`gpu`), those whose cases get the mark from the kernel suite's helper (on a CPU
    they carry none), each group in path order. What the tests section runs, instead of collecting all of
    tests/ only to deselect the rest."""
    texts = {path: path.read_text(errors="replace") for path in sorted(root.rglob("test_*.py"))}
    own = [path for path, text in texts.items() if CUDA_MARK in text]
    if not gpu:
        return own
    helper, names = MARKED_ON_A_GPU
    return own + [path for path, text in texts.items()
                  if path not in own and helper in text and any(name in text for name in names)]


def cuda_tests(report: Report, dry: bool, budget_s: float) -> None:
    """`pytest -m cuda` on the modules with CUDA cases (`cuda_test_modules`), under the section's own budget
    (`--tests-budget-s`), one row per module: passed / failed / skipped counts, or not collected and why (a
    module needing vLLM fails to collect on an image without it: that is said, not counted as a failure). On a
    timeout the log says which modules ran: the one cut off and those never started are named (left out)."""
    report.section("pytest -m cuda", ["module", "status", "passed", "failed", "skipped", "summary"])
    timeout = max(10, int(min(budget_s, report.left() - 10)))
    # dry run: tests/kernels alone, whose CUDA cases skip without a GPU
    modules = [str(m.relative_to(REPO)) for m in cuda_test_modules(REPO / "tests" / "kernels" if dry else
                                                                    REPO / "tests", gpu=not dry)]
    xml, log = report.out / "pytest_cuda.xml", report.out / "pytest_cuda.log"
    # Not -q: each module's line names it as it starts (unbuffered), which is what a timeout leaves to read.
    args = [sys.executable, "-m", "pytest", "-m", "cuda", "-rs", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", f"--junitxml={xml}", *modules]
    t0 = time.monotonic()
    try:
        with log.open("w") as f:
            rc = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    except subprocess.TimeoutExpired:
        started = started_modules(log.read_text(errors="replace") if log.exists() else "", modules)
        for module in modules:
            status = "ran" if module in started[:-1] else "cut off by the tests budget" if started and \
                module == started[-1] else "left out: the tests budget was spent first"
            report.row("tests", module=_dotted(module), status=status, summary="see pytest_cuda.log")
        left_out = [m for m in modules if m not in started[:-1]]
        report.row("tests", module="(all)", status=f"timeout ({timeout} s, --tests-budget-s)",
                   seconds=round(time.monotonic() - t0),
                   summary=f"left out (tests budget spent): {', '.join(left_out)}")
        return
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if any(k in ln for k in ("passed", "failed", "error", "skipped",
                                                                          "selected", "no tests"))),
                   "see pytest_cuda.log")
    found = per_module(xml) if xml.exists() else {}
    for module, counts in sorted(found.items()):
        report.row("tests", module=module, **counts)
    failed = [m for m, c in found.items() if c["status"] == "failed"]
    status = "ok" if not failed and rc in (0, 1, 5) else f"failed (rc {rc})" if not failed else "failed"
    report.row("tests", module="(all)", status=status, seconds=round(time.monotonic() - t0),
               summary=f"{summary.strip('= ')}; modules: {len(modules)}, left out: none")


def started_modules(log: str, modules: list[str]) -> list[str]:
    """The modules of `modules` whose progress line (`path ...`) pytest has written to `log`, in order."""
    heads = {line.split(" ", 1)[0] for line in log.splitlines()}
    return [m for m in modules if m in heads]


def _dotted(module: str) -> str:
    """tests/kernels/test_x.py -> tests.kernels.test_x, as the JUnit rows name modules."""
    return module.removesuffix(".py").replace("/", ".")


def per_module(xml: Path) -> dict[str, dict]:
    """{test module: {status, passed, failed, skipped, summary}} from pytest's JUnit XML. A module whose
    collection failed has one error case naming it: 'not collected' with the error's first line."""
    import xml.etree.ElementTree as ET

    out: dict[str, dict] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname = case.get("classname") or case.get("name") or "?"
        module = classname if not case.get("classname") else ".".join(
            p for p in classname.split(".") if not p[:1].isupper())
        row = out.setdefault(module, {"status": "passed", "passed": 0, "failed": 0, "skipped": 0, "summary": ""})
        error, failure, skipped = case.find("error"), case.find("failure"), case.find("skipped")
        if error is not None and "collection failure" in (error.get("message") or ""):
            first = (error.text or "").strip().splitlines()
            row.update(status="not collected", summary=(first[-1] if first else "")[:200])
        elif error is not None or failure is not None:
            row["failed"] += 1
            row["status"] = "failed"
        elif skipped is not None:
            row["skipped"] += 1
        else:
            row["passed"] += 1
    for row in out.values():  # every case skipped (no GPU, a missing package): say so, not "passed"
        if row["status"] == "passed" and not row["passed"] and row["skipped"]:
            row["status"] = "skipped"
    return out


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the plumbing, anywhere")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results" /
                                                                      f"gpu-check-{datetime.date.today()}"))
    parser.add_argument("--budget-s", type=float, default=290.0, help="the whole run's time budget")
    parser.add_argument("--tests-budget-s", type=float, default=120.0,
                        help="the CUDA test modules' own budget, out of the whole; they run first")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("flashdapo: error: no CUDA device visible; use --dry-run on a machine without a GPU", file=sys.stderr)
        return 2
    report = Report(Path(args.out), time.monotonic() + args.budget_s)
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    rates = {}
    run_section(report, "environment", 0, lambda: environment(report, device))
    # The CUDA tests first, under their own budget: last, they got what the benchmarks left (under a minute).
    run_section(report, "tests", 30, lambda: cuda_tests(report, args.dry_run, args.tests_budget_s))
    run_section(report, "gemm", 20, lambda: rates.update(gemm_ceilings(report, device, shapes)))
    run_section(report, "model", 0, lambda: model_with_rates(report, rates, shapes))
    run_section(report, "providers", 40, lambda: providers(report, device, shapes))
    run_section(report, "profile", 20, lambda: profile_step(report, device, shapes[0]))
    run_section(report, "train", 60, lambda: toy_training(report, device, args.dry_run))
    print(f"\nrows: {report.jsonl}\ntables: {report.md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
