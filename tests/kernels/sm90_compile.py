"""Compile every Triton kernel of flashdapo.kernels for sm_90 at its shipped launch config, no GPU needed.

Run as a script (TRITON_INTERPRET must be unset, so the kernels are real JIT functions): prints one JSON
line per compiled variant with ptxas's register, spill and shared-memory figures. Used by
test_sm90_compile.py.
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


def variants():
    """(kernel name, jit function, signature, constexprs) of every shipped variant."""
    c = triton_tiles.GPU_CONFIG
    block = {"BLOCK_R": c.block_r, "BLOCK_V": c.block_v}
    stats_sig = {"z_ptr": "*fp32", "y_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32",
                 "zy_ptr": "*fp32", "n": "i32", "bv": "i32", "temperature": "fp32"}
    for first in (True, False):
        for ent in (True, False):
            yield (f"_stats_kernel first={first} entropy={ent}", triton_tiles._stats_kernel, stats_sig,
                   {"FIRST": first, "WITH_ENT": ent, **block})
    for dtype, ptr in PTR.items():
        grad_sig = {"z_ptr": "*fp32", "dz_ptr": ptr, "y_ptr": "*i64", "g_ptr": "*fp32", "ge_ptr": "*fp32",
                    "m_ptr": "*fp32", "log_s_ptr": "*fp32", "ent_ptr": "*fp32", "n": "i32", "bv": "i32",
                    "temperature": "fp32"}
        for has_ge in (True, False):
            yield (f"_grad_kernel dz={dtype} entropy_grad={has_ge}", triton_tiles._grad_kernel, grad_sig,
                   {"HAS_GE": has_ge, **block})


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
    covered = {fn.__name__ for _, fn, _, _ in variants()}
    if shipped != covered:
        print(f"kernels without a compile variant here: {sorted(shipped - covered)}", file=sys.stderr)
        return 3
    for name, fn, sig, constexprs in variants():
        signature = {**sig, **{k: "constexpr" for k in constexprs}}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                                options={"num_warps": num_warps})
        report = {"kernel": name, "shared_bytes": kernel.metadata.shared, **ptxas_report(kernel.asm["ptx"])}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
