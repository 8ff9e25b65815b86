"""`flashdapo plan`: will this launch start, and fit, before the nodes are allocated? On any machine, in
seconds: the model on the meta device, the launch's own checks, the memory per GPU and a modelled step.

  flashdapo plan [--preset NAME] [--config FILE] [--nodes N] [--gpus-per-node G] [--gpu h20]
                 [--model-config FILE | --model-shape NAME] [--mean-response-tokens N] [--mean-prompt-tokens N]
                 [--mfu F] [--SECTION.FIELD VALUE ...]

The config is resolved by the code `flashdapo train` uses (preset, file, then any train flag). Nodes and GPUs
per node default to the preset's first documented cluster (config.PRESET_CLUSTERS). Exit 0 with the table;
exit 1 with one line when the launch would be refused or does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config import DEFAULT_PRESET, PRESET_CLUSTERS, ConfigError
from ..config.presets import Cluster
from ..errors import FlashdapoError
from ..kernels.gpus import GPUS, gpu_named
from .checks import launch_checks
from .fit import memory_plan
from .model import build_meta_model, model_shape
from .report import PlanInputs, render
from .shapes import BUILTIN_SHAPES, model_source
from .step_time import Workload, step_time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashdapo plan", add_help=False)
    p.add_argument("--preset", default=None)
    p.add_argument("--nodes", type=int, default=None, help="nodes (torchrun --nnodes)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (torchrun --nproc-per-node)")
    p.add_argument("--gpu", default="h20", help=f"one of {', '.join(sorted(GPUS))} (default h20)")
    p.add_argument("--model-config", default=None, help="a config.json to plan for instead of model.path's")
    p.add_argument("--model-shape", default=None, help=f"a built-in shape: {', '.join(BUILTIN_SHAPES)}")
    p.add_argument("--mean-response-tokens", type=int, default=None,
                   help="assumed mean response length (default: a fifth of rollout.max_response_length)")
    p.add_argument("--mean-prompt-tokens", type=int, default=None,
                   help="assumed mean prompt length (default: a eighth of data.max_prompt_length)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization (default 0.4)")
    return p


def plan_main(argv: list[str]) -> int:
    """Run `flashdapo plan`; returns the exit status."""
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from ..__main__ import resolve_config

    args, rest = _parser().parse_known_args(argv)
    name = args.preset or DEFAULT_PRESET
    cfg = resolve_config(rest + ["--preset", name], "flashdapo plan")
    default = PRESET_CLUSTERS.get(name, (Cluster(1, 1),))[0]
    nodes, per_node = args.nodes or default.nodes, args.gpus_per_node or default.gpus_per_node
    try:
        gpu = gpu_named(args.gpu)
        source = model_source(cfg, args.model_config, args.model_shape)
        shape = model_shape(build_meta_model(source, cfg), _name(cfg, source))
        world = nodes * per_node
        checks = launch_checks(cfg, world, source, shape)
        plan = memory_plan(cfg, world, shape, gpu)
        flipped = dataclasses.replace(cfg, trainer=dataclasses.replace(
            cfg.trainer, fsdp_cpu_offload=not cfg.trainer.fsdp_cpu_offload))
        alternative = memory_plan(flipped, world, shape, gpu, check=False)
    except (ConfigError, FlashdapoError) as err:  # what the launch would refuse, or a phase that does not fit
        print(f"flashdapo plan: cannot launch: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    work = Workload(mean_response=args.mean_response_tokens or max(1, cfg.rollout.max_response_length // 5),
                    mean_prompt=args.mean_prompt_tokens or max(1, cfg.data.max_prompt_length // 8), mfu=args.mfu)
    time = step_time(shape, cfg, world, gpu, plan.engine, plan.setup.lm_head, work)
    start = f"preset '{name}'" + (f" + {_config_file(argv)}" if _config_file(argv) else "")
    inputs = PlanInputs(cfg=cfg, start=start, nodes=nodes, gpus_per_node=per_node, origin=source.origin,
                        alternative=alternative)
    print("\n".join(render(inputs, shape, checks, plan, time, work)))
    return 0


def _name(cfg, source) -> str:
    if source.toy:
        return "toy"
    return source.config.get("_name_or_path") or (cfg.model.path.rstrip("/").split("/")[-1] or "model")


def _config_file(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


__all__ = ["plan_main"]
