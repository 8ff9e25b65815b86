"""The launch's own memory check: `flashdapo train` on GPUs refuses, in one line, a launch the planner's
memory model says cannot fit (the same model `flashdapo plan` prints, docs/plan.md), before anything is built.

Example: Qwen2.5-7B fully fine-tuned on one H200 needs its parameters, gradients, two AdamW moments and
AdamW's foreach temporary (5 x 28.4 GiB) over the GPU's 141 GiB: refused, naming trainer.fsdp_cpu_offload.
"""

from __future__ import annotations

from ..config import Config
from ..kernels.gpus import gpu_of_device
from .fit import memory_plan
from .model import build_meta_model, model_shape
from .shapes import model_source


def check_launch_memory(cfg: Config, world: int, device_name: str | None,
                        gpus_per_node: int = 0) -> str | None:
    """Raise PlanError (one line naming the phase and the field to change) when the launch of `cfg` over
    `world` GPUs named `device_name` (torch.cuda.get_device_name), `gpus_per_node` to a node (torchrun's
    LOCAL_WORLD_SIZE; 0: one node), cannot fit. Returns why nothing was checked (None when checked): no GPU,
    the built-in toy model, or a GPU the table does not know."""
    if device_name is None:
        return "no GPU"
    if not cfg.model.path:
        return "the built-in toy model"
    gpu = gpu_of_device(device_name)
    if gpu is None:
        return f"{device_name} is not in the GPU table (flashdapo/kernels/gpus.py)"
    source = model_source(cfg)
    shape = model_shape(build_meta_model(source, cfg), source.origin, cfg.lora)
    # raises PlanError when a phase does not fit
    memory_plan(cfg, world, shape, gpu, gpus_per_node=gpus_per_node)
    return None


__all__ = ["check_launch_memory"]
