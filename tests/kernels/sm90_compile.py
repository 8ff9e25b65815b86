"""Compile every Triton kernel of flashdapo.kernels for sm_90 at its shipped launch config, no GPU needed.

Each variant is compiled twice: with the specialization the JIT applies at run time at the real shapes
(16-byte divisibility of the pointers and of n, bv) and without it on the integers (ragged shapes).
Run as a script (TRITON_INTERPRET must be unset, so the kernels are real JIT functions): prints one JSON
line per compiled variant with ptxas's registers, spills, shared memory, the widest global load/store
and the resident CTAs per SM. Used by test_sm90_compile.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashdapo.kernels import triton_tiles  # noqa: E402

PTXAS = get_ptxas(90).path  # the ptxas Triton itself assembles sm_90 code with
TARGET = GPUTarget("cuda", 90, 32)
PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
INLINED = {"_tanh_sech2"}  # @triton.jit helpers called from the kernels: compiled inside them, not launched


def variants():
    """(kernel name, jit function, signature, constexprs) of every shipped variant."""
    c = triton_tiles.GPU_CONFIG
    block = {"BLOCK_R": c.block_r, "BLOCK_V": c.block_v}
    stats_sig = {"z_ptr": "*fp32", "y_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32",
                 "zy_ptr": "*fp32", "n": "i32", "bv": "i32", "temperature": "fp32", "softcap": "fp32"}
    for cap in (False, True):  # the final-logit softcap (Gemma): tanh and sech^2 inlined per logit
        for first in (True, False):
            for ent in (True, False):
                yield (f"_stats_kernel first={first} entropy={ent} softcap={cap}", triton_tiles._stats_kernel,
                       stats_sig, {"FIRST": first, "WITH_ENT": ent, "SOFTCAP": cap, **block})
    for cap in (False, True):
        for dtype, ptr in PTR.items():
            grad_sig = {"z_ptr": "*fp32", "dz_ptr": ptr, "y_ptr": "*i64", "g_ptr": "*fp32", "ge_ptr": "*fp32",
                        "m_ptr": "*fp32", "log_s_ptr": "*fp32", "ent_ptr": "*fp32", "n": "i32", "bv": "i32",
                        "temperature": "fp32", "softcap": "fp32"}
            for has_ge in (True, False):
                yield (f"_grad_kernel dz={dtype} entropy_grad={has_ge} softcap={cap}", triton_tiles._grad_kernel,
                       grad_sig, {"HAS_GE": has_ge, "SOFTCAP": cap, **block})


def divisibility_attrs(signature: dict, specialized: bool) -> dict:
    """What the JIT attaches at run time: 16-byte divisibility on every pointer (torch allocations are
    aligned) and on integer arguments that are multiples of 16 (n and bv at every Qwen2.5 shape: 8192-row
    tiles, 4096-column chunks, last chunks of 512 / 384 columns). `specialized=False` is the ragged case
    (a prime V or an odd row count), which the JIT compiles without the hint on the integers."""
    attrs = {}
    for i, (name, ty) in enumerate(signature.items()):
        if ty.startswith("*") or (specialized and name in ("n", "bv")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def vector_widths(ptx: str) -> dict:
    """Widest global load and store in the PTX, in elements per instruction (1: scalar)."""
    def widest(op):
        found = re.findall(rf"{op}\.global(?:\.\w+)*?\.v(\d)", ptx)
        return max((int(v) for v in found), default=1 if re.search(rf"{op}\.global", ptx) else 0)

    return {"load_vector": widest("ld"), "store_vector": widest("st")}


def ctas_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Resident CTAs per Hopper SM: 64 Ki registers (allocated per warp in units of 256), 228 KB of shared
    memory (1 KB reserved per CTA), 2048 threads, 32 CTAs."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_shared = (228 * 1024) // (shared + 1024)
    return min(by_regs, by_shared, 2048 // (32 * num_warps), 32)


def ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and static shared memory of one kernel, as ptxas -v prints them."""
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(PTXAS), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {"arch": arch, "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_bytes": sum(spills)}


def main() -> int:
    num_warps = triton_tiles.GPU_CONFIG.num_warps
    shipped = {name for name, obj in vars(triton_tiles).items() if isinstance(obj, triton.runtime.JITFunction)}
    shipped -= INLINED
    covered = {fn.__name__ for _, fn, _, _ in variants()}
    if shipped != covered:
        print(f"kernels without a compile variant here: {sorted(shipped - covered)}", file=sys.stderr)
        return 3
    for name, fn, sig, constexprs in variants():
        signature = {**sig, **{k: "constexpr" for k in constexprs}}
        for specialized in (True, False):
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                            attrs=divisibility_attrs(signature, specialized))
            kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
            ptx = kernel.asm["ptx"]
            report = {"kernel": name, "specialized": specialized, "shared_bytes": kernel.metadata.shared,
                      **ptxas_report(ptx), **vector_widths(ptx)}
            report["ctas_per_sm"] = ctas_per_sm(report["registers"], report["shared_bytes"], num_warps)
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
