"""LM-head log-prob kernels, forward + backward, one harness for every provider.

Providers (each one step = forward, then backward into h and W), named from flashdapo.kernels' registry:
  naive          token_logprobs(impl="naive"): materialized fp32 logits (the baseline; tests' reference)
  <impl>         token_logprobs(impl=<impl>) for each chunked impl (torch; triton, compiled, CUDA only)
  <impl>-50%     the same with half the rows at zero upstream gradient (masked/clipped): skipped rows
  <impl>-fused   fused_token_loss(impl=<impl>): the gradient formed in the forward sweep (6NHV), with the
                 loss sum(g * logp) so that its upstream gradient is the same g as the others'
  gemm-floor     the fused sweep's three GEMMs alone (z = h W^T, dh += dz W, dW += dz^T h on its tiles, z
                 standing in for dz), no elementwise work: the floor of any exact 6 N H V design on this
                 BLAS, the baseline the fused sweep's overhead is read against
  torch-lce      torch.nn.functional.linear_cross_entropy (torch >= 2.13), chunked via
                 LinearCrossEntropyOptions(), reduction="sum": log-prob only, no temperature/entropy
  liger-dapo     Liger's LigerFusedLinearGRPOLoss(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28,
                 beta=0, compiled=False), 1024-token sequences; skipped when liger-kernel is absent
  liger-dapo-compiled  the same with compiled=True (Liger's default: torch.compile of its chunk step;
                 the warm-up step compiles)
Upstream gradients are random of both signs (all rows live unless stated). Time: median of `reps` steps
after one warm-up (CUDA events on GPU). TFLOP/s counts 8 N H V per step for every provider.
Peak extra memory: GPU, torch.cuda.max_memory_allocated during one step minus what was allocated before
it (inputs); CPU, the peak resident set (VmHWM, reset through /proc/self/clear_refs) during one step
minus the resident set before it, each provider in a fresh process so no allocator cache is reused.
Both include the gradients dh and dW the step produces. Beside the measured columns the table prints
each design's modelled H200 time at the Qwen2.5 shapes (bench/kernel_model.py: GEMM FLOPs at the GEMM
rate plus the bytes of the separate kernels), and a second table the FLOPs, exposed bytes, peak memory
and workspace behind them.

  python -m bench.bench_kernels [--device cpu|cuda] [--out DIR]   # table -> DIR/<date>-<machine>-<commit>.md
  python -m bench.bench_kernels --profile DIR                      # + a torch.profiler trace per provider
  pytest bench/bench_kernels.py                                    # the same steps under pytest-benchmark
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench.kernel_model` also under `pytest bench/bench_kernels.py`

from bench import kernel_model  # noqa: E402
from bench.kernel_model import SHAPES as MODEL_SHAPES  # noqa: E402
from bench.kernel_model import predict  # noqa: E402
from flashdapo.kernels import CHUNKED_IMPLS  # noqa: E402
from flashdapo.profiling import ranges  # noqa: E402
from flashdapo.profiling.ranges import traced  # noqa: E402

PROVIDERS = ["naive", *(f"{impl}{suffix}" for impl in CHUNKED_IMPLS for suffix in ("", "-50%", "-fused")),
             "gemm-floor", "torch-lce", "liger-dapo", "liger-dapo-compiled"]
# (label, N, H, V, dtype, reps)
CPU_SHAPES = [("CPU target, fp32", 8192, 256, 32768, "float32", 3)]
SMOKE_SHAPE = ("smoke", 512, 64, 2048, "float32", 2)  # plumbing check (`--shapes smoke`, any device)
GPU_SHAPES = [  # the model's shapes (bench/kernel_model.py); bench/gpu_check.py is the one-call GPU run
    ("Qwen2.5-0.5B", 16384, 896, 151936, "bfloat16", 5),
    ("Qwen2.5-7B", 16384, 3584, 152064, "bfloat16", 3),
    ("Qwen2.5-32B", 16384, 5120, 152064, "bfloat16", 3),
    ("Qwen2.5-32B-32k", 32768, 5120, 152064, "bfloat16", 2),
]


class Unavailable(Exception):
    """A provider that cannot run here (the reason goes into the table)."""


# ------------------------------------------------------------------------------ providers
def make_step(provider: str, h, w, y, g):
    """A closure running one forward + backward of `provider`; raises Unavailable with a reason. The call is
    `traced` as the trainer's LM-head call is: named lm_head.forward / lm_head.backward under --profile (and
    a direct call otherwise)."""
    from flashdapo.kernels import token_logprobs
    from flashdapo.kernels.fused import fused_token_loss

    impl, _, variant = provider.partition("-")
    if impl in ("naive", *CHUNKED_IMPLS) and variant in ("", "50%", "fused"):
        if impl == "triton" and h.device.type != "cuda":
            raise Unavailable("needs CUDA (interpreter only in tests)")
        if importlib.util.find_spec("triton") is None and impl == "triton":
            raise Unavailable("triton not installed")
        upstream = g.clone()
        if variant == "50%":
            upstream[torch.rand(len(g), device=g.device) < 0.5] = 0
        if variant == "fused":
            loss_fn = lambda lp, rows: (lp * upstream[rows]).sum()  # noqa: E731 - dL/dlogp = upstream
            return lambda: traced("lm_head", lambda h, w: fused_token_loss(h, w, y, loss_fn, impl=impl),
                                  (h, w))[0].backward()

        def step():
            logp = traced("lm_head", lambda h, w: token_logprobs(h, w, y, impl=impl), (h, w))
            logp.backward(upstream)

        return step
    if provider == "gemm-floor":
        return lambda: _named_call("lm_head.forward", _gemm_floor, h, w)
    if provider == "torch-lce":
        import torch.nn.functional as F

        if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy")
        options = torch.nn.LinearCrossEntropyOptions()
        return lambda: traced("lm_head", lambda h, w: F.linear_cross_entropy(h, w, y, reduction="sum",
                                                                               options=options), (h, w)).backward()
    if provider in ("liger-dapo", "liger-dapo-compiled"):
        return _liger_step(h, w, y, g, compiled=provider.endswith("-compiled"))
    raise ValueError(provider)


def _named_call(name: str, fn, *args):
    with ranges.named(name):
        return fn(*args)


def _gemm_floor(h, w):
    """The GEMMs of fused_token_loss at its own token chunks and vocabulary tiles, nothing else."""
    from flashdapo.kernels.fused import TILE_VOCAB, fused_chunk_tokens

    h, w = h.detach(), w.detach()
    rows, (n, vocab) = fused_chunk_tokens(len(h), len(w), h.device.type), (len(h), len(w))
    dh, dw = torch.zeros_like(h), torch.zeros_like(w)
    for r0 in range(0, n, rows):
        h_t = h[r0 : r0 + rows]
        tiles = [h_t @ w[v0 : v0 + TILE_VOCAB].T for v0 in range(0, vocab, TILE_VOCAB)]
        for z, v0 in zip(tiles, range(0, vocab, TILE_VOCAB)):
            dh[r0 : r0 + rows].addmm_(z, w[v0 : v0 + TILE_VOCAB])
            dw[v0 : v0 + TILE_VOCAB].addmm_(z.T, h_t)


def _liger_step(h, w, y, g, compiled=False):
    if importlib.util.find_spec("liger_kernel") is None:
        raise Unavailable("liger-kernel not installed")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seq = 1024 if len(y) % 1024 == 0 else len(y)
    try:
        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=compiled, loss_type="dapo",
                                           epsilon_low=0.2, epsilon_high=0.28)
    except TypeError as err:  # an older Liger without loss_type / epsilon_high
        raise Unavailable(f"this liger-kernel lacks the dapo loss ({err})") from err
    ids, mask = y.view(-1, seq), torch.ones(len(y) // seq, seq, device=y.device)
    adv = g.view(-1, seq)[:, 0].float()

    def step():
        out = traced("lm_head", lambda h, w: loss_fn(h.view(-1, seq, h.shape[1]), w, ids, mask, adv), (h, w))
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


# ------------------------------------------------------------------------------ measuring
def make_inputs(n, hdim, vocab, dtype, device, seed=0):
    """Fresh random inputs (never zeros): logits of std ~4, like a trained LM head."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hdim, device=device, generator=gen).to(dtype).requires_grad_(True)
    w = torch.randn(vocab, hdim, device=device, generator=gen).mul_(4 / hdim**0.5).to(dtype).requires_grad_(True)
    y = torch.randint(0, vocab, (n,), device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen)
    return h, w, y, g


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _one_step_peak_bytes(step, h, w, device) -> int:
    """Peak extra memory of one step (see the module docstring for what is counted)."""
    h.grad = w.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError as err:
        raise Unavailable(f"cannot reset the peak RSS here ({err})") from err
    base = _status_kb("VmRSS")
    step()
    return (_status_kb("VmHWM") - base) * 1024


def _median_ms(step, h, w, device, reps: int) -> float:
    times = []
    for _ in range(reps):
        h.grad = w.grad = None
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(provider, n, hdim, vocab, dtype, device, reps) -> dict:
    """One provider at one shape, in this process: {status, ms, tflops, peak_mb}."""
    device = torch.device(device)
    h, w, y, g = make_inputs(n, hdim, vocab, getattr(torch, dtype), device)
    try:
        step = make_step(provider, h, w, y, g)
        peak = _one_step_peak_bytes(step, h, w, device)  # also the warm-up (compiles, page faults)
        ms = _median_ms(step, h, w, device, reps)
    except Unavailable as why:
        return {"status": f"skipped: {why}"}
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    return {"status": "ok", "ms": ms, "tflops": 8 * n * hdim * vocab / (ms * 1e-3) / 1e12, "peak_mb": peak / 2**20}


def profile_provider(provider, n, hdim, vocab, dtype, device, trace: str) -> None:
    """One warm step of `provider` under torch.profiler, with the trainer's range names (the provider's name
    around the step, lm_head.forward and lm_head.backward inside), written to `trace` (Chrome trace JSON)."""
    from flashdapo.profiling import Recorder

    device = torch.device(device)
    h, w, y, g = make_inputs(n, hdim, vocab, getattr(torch, dtype), device)
    step = make_step(provider, h, w, y, g)
    step()  # warm-up: compiles, first-touch page faults
    h.grad = w.grad = None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                           if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof, ranges.recording(Recorder(device)):
        with ranges.named(provider):
            step()
    Path(trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(trace)


def trace_path(profile_dir: str, label: str, provider: str) -> Path:
    """PROFILE_DIR/<shape>/<provider>.pt.trace.json: `tensorboard --logdir PROFILE_DIR` (torch-tb-profiler)
    shows each shape as a run and each provider as a worker; chrome://tracing and Perfetto open any one."""
    shape = label.split(",")[0].strip().replace(" ", "-")
    return Path(profile_dir) / shape / f"{provider.replace('%', 'pct')}.pt.trace.json"


def matmul_ceiling_tflops(size: int = 8192, reps: int = 20) -> float:
    """Dense bf16 matmul TFLOP/s on this GPU now (random data): the roofline the kernels are held to."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        a @ b
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    return 2 * size**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------ table
def _run_child(provider, shape, device, timeout, profile_dir: str = "") -> dict:
    label, n, hdim, vocab, dtype, reps = shape
    spec = dict(provider=provider, n=n, hdim=hdim, vocab=vocab, dtype=dtype, device=device, reps=reps)
    if profile_dir:
        spec["trace"] = str(trace_path(profile_dir, label, provider))
    spec = json.dumps(spec)
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.bench_kernels", "--child", spec], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout ({timeout}s)"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"failed: {tail[:120]}"}


def machine_tag(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name().lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def write_result(text: str, out: str | Path, commit: str, name: str, device: str = "cpu") -> Path:
    """Print a benchmark's table and write it to OUT/<date>-<machine>-<commit>-<name>.md (the results' naming)."""
    print(text)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{datetime.date.today()}-{machine_tag(device)}-{commit}-{name}.md"
    path.write_text(text + "\n")
    print(f"written to {path}")
    return path


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "nogit"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _model_cells(provider: str) -> list[str]:
    """Modelled H200 ms of the provider's design per Qwen shape ('' where not modelled)."""
    costs = [predict(provider, shape) for shape in MODEL_SHAPES]
    return [f"{c.ms:.0f}" if c else "" for c in costs]


def model_table() -> list[str]:
    """The analytic table (bench/kernel_model.py): per modelled provider and shape, GEMM TFLOP, exposed
    GB, peak extra and workspace GB, H200 ms and the ratio to 8NHV at the ceiling."""
    return kernel_model.table()


def build_table(device: str, providers, shapes, timeout: int, commit: str, profile_dir: str = "") -> str:
    """Run every provider at every shape (fresh process each) and return the Markdown report."""
    ceiling = matmul_ceiling_tflops() if device == "cuda" else None
    where = f"matmul ceiling (bf16, 8192^3): {ceiling:.0f} TFLOP/s" if ceiling else (
        f"CPU threads: {torch.get_num_threads()}, load average at start: {os.getloadavg()[0]:.1f}")
    lines = [f"# Kernel benchmark: {machine_tag(device)}, commit {commit}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; {where}",
             "Step = forward + backward into h and W; TFLOP/s by 8NHV; peak = extra memory of one step "
             "(see bench/bench_kernels.py); H200 columns: modelled time of the same design at the Qwen2.5 "
             "shapes (bf16), not measured.", ""]
    model_head = " | ".join(f"H200 {s} ms (model)" for s in MODEL_SHAPES)
    for shape in shapes:
        label, n, hdim, vocab, dtype, reps = shape
        lines += [f"## {label}: N={n} H={hdim} V={vocab} {dtype}, median of {reps}", "",
                  f"| provider | time (ms) | vs naive | TFLOP/s | % ceiling | peak extra (MB) | vs naive | {model_head} |",
                  "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(MODEL_SHAPES)]
        results = {p: _run_child(p, shape, device, timeout, profile_dir) for p in providers}
        naive = results.get("naive", {})
        for p, r in results.items():
            model = " | ".join(_model_cells(p))
            if r.get("status") != "ok":
                lines.append(f"| {p} | {r.get('status')} | | | | | | {model} |")
                continue
            t_rel = f"{r['ms'] / naive['ms']:.2f}x" if naive.get("status") == "ok" else ""
            m_rel = f"{r['peak_mb'] / naive['peak_mb']:.3f}x" if naive.get("status") == "ok" else ""
            frac = f"{100 * r['tflops'] / ceiling:.0f}%" if ceiling else ""
            lines.append(f"| {p} | {r['ms']:.1f} | {t_rel} | {r['tflops']:.2f} | {frac} | {r['peak_mb']:.0f} | "
                         f"{m_rel} | {model} |")
        lines.append("")
    return "\n".join(lines + model_table()) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--shapes", default="all", help="comma-separated shape labels' first words, or 'all'")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per provider and shape")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="also write one torch.profiler trace per provider and shape, "
                             "DIR/<shape>/<provider>.pt.trace.json, with the trainer's range names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        trace = spec.pop("trace", "")
        result = measure(**spec)
        if trace and result["status"] == "ok":
            spec.pop("reps")
            profile_provider(**spec, trace=trace)
            result["trace"] = trace
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    shapes = (GPU_SHAPES if args.device == "cuda" else CPU_SHAPES) + [SMOKE_SHAPE]
    keep = args.shapes.split(",")
    shapes = [s for s in shapes if (args.shapes == "all" and s is not SMOKE_SHAPE) or s[0].split(",")[0] in keep]
    commit = git_commit()  # once: the tree may be committed to while the benchmark runs
    write_report(build_table(args.device, args.providers.split(","), shapes, args.timeout, commit, args.profile),
                 args.out, args.device, commit)
    if args.profile:
        print(f"traces (one per provider and shape) under {args.profile}/; `tensorboard --logdir {args.profile}` "
              "with torch-tb-profiler, or open one in https://ui.perfetto.dev")
    return 0


def write_report(report: str, out_dir: str, device: str, commit: str, suffix: str = "") -> Path:
    """Print `report` and write it to OUT_DIR/<date>-<machine>-<commit><suffix>.md (returned)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.date.today()}-{machine_tag(device)}-{commit}{suffix}.md"
    path.write_text(report)
    print(report + f"\nwritten to {path}")
    return path


# ------------------------------------------------------------------------------ pytest-benchmark
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", (GPU_SHAPES if _DEVICE == "cuda" else CPU_SHAPES) + [SMOKE_SHAPE],
                         ids=lambda s: s[0].split(",")[0].replace(" ", "-"))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_fwd_bwd(benchmark, provider, shape):
    """pytest-benchmark timing of one step (in-process; the table's memory figures come from main())."""
    label, n, hdim, vocab, dtype, reps = shape
    device = torch.device(_DEVICE)
    h, w, y, g = make_inputs(n, hdim, vocab, getattr(torch, dtype), device)
    try:
        step = make_step(provider, h, w, y, g)
    except Unavailable as why:
        pytest.skip(str(why))

    def run():
        h.grad = w.grad = None
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=reps, iterations=1, warmup_rounds=1)
    benchmark.extra_info["tflops"] = 8 * n * hdim * vocab / benchmark.stats.stats.median / 1e12


if __name__ == "__main__":
    sys.exit(main())
