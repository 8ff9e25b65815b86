"""The GPUs `flashdapo plan` and the kernel model know: memory, bf16 dense and fp32 peaks, HBM bandwidth.

Each figure is the vendor datasheet's (docs/plan.md names the documents). Memory is the datasheet's
capacity read as GiB (what torch reports as total is within ~2% of it).
Sustained rates are not datasheet figures: the kernel model scales an H200's measured fractions
(`flashdapo.kernels.cost.Rates.scaled`), the plan's step time takes a stated MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .cost import Rates


@dataclass(frozen=True)
class GPU:
    """One GPU model's datasheet figures."""

    key: str
    """The name `--gpu` takes."""
    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16 tensor-core peak (the datasheet's sparse figure is twice this)."""
    hbm_tbps: float
    fp32_tflops: float
    """Non-tensor-core fp32 peak (the kernel model's fp32 GEMMs, no TF32)."""
    source: str
    match: tuple[str, ...]
    """Substrings of torch.cuda.get_device_name() that name this GPU."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def kernel_rates(self) -> Rates:
        """The LM-head kernel model's rates on this GPU (an H200's sustained fractions of its peaks)."""
        return Rates.scaled(self.bf16_tflops, self.hbm_tbps, self.fp32_tflops)


GPUS: dict[str, GPU] = {
    "h20": GPU("h20", "H20", 96, 148, 4.0, 44, "NVIDIA H20 datasheet", ("H20", )),
    "h100": GPU("h100", "H100 SXM", 80, 989, 3.35, 67, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
                ("H100", )),
    "h200": GPU("h200", "H200", 141, 989, 4.8, 67, "NVIDIA H200 Tensor Core GPU datasheet (SXM)", ("H200", )),
    "a100": GPU("a100", "A100 80GB", 80, 312, 2.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)",
                ("A100", )),
}
"""Known GPUs by `--gpu` name."""


def gpu_named(key: str) -> GPU:
    """The GPU called `key` (case-insensitive); unknown names list the known ones."""
    gpu = GPUS.get(key.lower())
    if gpu is None:
        raise ConfigError(f"--gpu: unknown GPU {key!r}; known: {', '.join(sorted(GPUS))}")
    return gpu


def gpu_of_device(device_name: str) -> GPU | None:
    """The known GPU a CUDA device name (torch.cuda.get_device_name) belongs to, None if unknown. H200 is
    tried before H20, whose name is a prefix of it."""
    for gpu in sorted(GPUS.values(), key=lambda g: -max(len(m) for m in g.match)):
        if any(m in device_name for m in gpu.match):
            return gpu
    return None


__all__ = ["GPU", "GPUS", "gpu_named", "gpu_of_device"]
