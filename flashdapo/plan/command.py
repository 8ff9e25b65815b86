"""`flashdapo plan`: will this launch start, and fit, before the nodes are allocated? On any machine, in
seconds: the model on the meta device, the launch's own checks, the memory per GPU and a modelled step.

  flashdapo plan [--preset NAME] [--config FILE] [--nodes N] [--gpus-per-node G] [--gpu h20]
                 [--model-config FILE | --model-shape NAME] [--mean-response-tokens N] [--mean-prompt-tokens
                 N] [--mfu F] [--SECTION.FIELD VALUE ...]

The config is resolved by the code `flashdapo train` uses (preset, file, then any train flag). Nodes and GPUs
per node not given are the preset's first documented cluster's (config.PRESET_CLUSTERS; the plan says so in a
note). Exit 0 with the table; exit 1 with one line when the launch would be refused or does not fit.
"""

# No `from __future__ import annotations`: PlanOptions' checks must be objects, not strings the parser
# evaluates in its own namespace (as in ablation/options.py).
import dataclasses
import sys
from dataclasses import dataclass
from typing import Annotated

from ..config import DEFAULT_PRESET, PRESET_CLUSTERS, Config, ConfigError
from ..config.checks import (
    IS_PATH,
    TOKENS_MAX,
    TOKENS_WHY,
    Check,
    Section,
    at_most,
    field_docs,
    ge,
    register_tree,
    within,
)
from ..config.presets import Cluster
from ..errors import FlashdapoError
from ..kernels.gpus import GPUS, gpu_named
from ..models.moe.expert_parallel import expert_modules
from .checks import launch_checks
from .fit import memory_plan
from .model import build_meta_model, model_shape
from .report import PlanInputs, render
from .shapes import BUILTIN_SHAPES, model_source
from .step_time import Workload, step_time

_CLUSTER_DEFAULT = ">= 1 (leave it out for the preset's first documented cluster)"


@dataclass
class PlanOptions(Section):
    """The launch `flashdapo plan` models; every other argument is a `flashdapo train` option."""

    preset: str = DEFAULT_PRESET
    """The preset to start from (then --config FILE, then any --SECTION.FIELD VALUE)."""
    nodes: Annotated[int | None, Check(lambda n: n >= 1, _CLUSTER_DEFAULT)] = None
    """Nodes (torchrun --nnodes); not given (None): the preset's first documented cluster's, which the plan
    notes."""
    gpus_per_node: Annotated[int | None, Check(lambda n: n >= 1, _CLUSTER_DEFAULT)] = None
    """GPUs per node (torchrun --nproc-per-node); not given (None): the preset's first documented cluster's,
    which the plan notes."""
    gpu: str = "h20"
    """The GPU, by its name in the GPU table (kernels/gpus.py)."""
    model_config: Annotated[str, IS_PATH] = ""
    """A config.json to plan for instead of model.path's."""
    model_shape: str = ""
    """A built-in shape (plan/shapes.py) to plan for instead of model.path's."""
    mean_response_tokens: Annotated[int, ge(0), at_most(TOKENS_MAX, TOKENS_WHY)] = 0
    """Assumed mean response length; 0: a fifth of rollout.max_response_length."""
    mean_prompt_tokens: Annotated[int, ge(0), at_most(TOKENS_MAX, TOKENS_WHY)] = 0
    """Assumed mean prompt length; 0: an eighth of data.max_prompt_length."""
    mfu: Annotated[float, within(0, 1, "(]")] = 0.4
    """Assumed model FLOPs utilization."""


register_tree(PlanOptions, "plan.")


def parse_plan_args(argv: list[str]) -> tuple[PlanOptions, Config]:
    """(the plan's own options, the config resolved as `flashdapo train` resolves it from the other
    arguments), both read by the parser of every command (config/cli.py)."""
    from ..config.cli import parse, resolve_config  # the command line alone needs tyro

    opts, rest = parse(PlanOptions, argv, prog="flashdapo plan", description=__doc__, known_only=True)
    return opts, resolve_config([*rest, "--preset", opts.preset], "flashdapo plan")


def plan_help() -> str:
    """What `flashdapo plan --help` prints: the command, then its own options (the others: `flashdapo train
    --help`)."""
    docs = field_docs(PlanOptions)
    known = {
        "gpu": f" Known: {', '.join(sorted(GPUS))}.", "model_shape": f" Known: {', '.join(BUILTIN_SHAPES)}."
    }
    lines = [f"  --{f.name.replace('_', '-')} (default {f.default!r}): {' '.join(docs[f.name].split())}"
             + known.get(f.name, "") for f in dataclasses.fields(PlanOptions)]
    return "\n".join([__doc__.rstrip(), "", "options:", *lines])


def plan_main(argv: list[str]) -> int:
    """Run `flashdapo plan`; returns the exit status."""
    if "-h" in argv or "--help" in argv:
        print(plan_help())
        return 0
    args, cfg = parse_plan_args(argv)
    name = args.preset
    default = PRESET_CLUSTERS.get(name, (Cluster(1, 1),))[0]
    nodes = default.nodes if args.nodes is None else args.nodes
    per_node = default.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    try:
        gpu = gpu_named(args.gpu)
        source = model_source(cfg, args.model_config or None, args.model_shape or None)
        model = _meta_model(source, cfg)
        shape = model_shape(model, _name(cfg, source), cfg.lora)
        world = nodes * per_node
        checks = launch_checks(cfg, world, source, shape, expert_modules(model))
        if shape.lora:
            checks.passed.append("lora.target_modules (models/lora.py adapter_layout)")
        checks.notes += _default_cluster_note(args, name, nodes, per_node)
        plan = memory_plan(cfg, world, shape, gpu)
        flipped = dataclasses.replace(cfg, trainer=dataclasses.replace(
            cfg.trainer, fsdp_cpu_offload=not cfg.trainer.fsdp_cpu_offload))
        alternative = memory_plan(flipped, world, shape, gpu, check=False)
    except (ConfigError, FlashdapoError) as err:  # what the launch would refuse, or a phase that does not fit
        print(f"flashdapo plan: cannot launch: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    work = Workload(mean_response=args.mean_response_tokens or max(1, cfg.rollout.max_response_length // 5),
                    mean_prompt=args.mean_prompt_tokens or max(1, cfg.data.max_prompt_length // 8),
                    mfu=args.mfu)
    time = step_time(shape, cfg, world, gpu, plan.engine, plan.setup.lm_head, work, per_node)
    start = f"preset '{name}'" + (f" + {_config_file(argv)}" if _config_file(argv) else "")
    inputs = PlanInputs(cfg=cfg, start=start, nodes=nodes, gpus_per_node=per_node, origin=source.origin,
                        alternative=alternative)
    print("\n".join(render(inputs, shape, checks, plan, time, work)))
    return 0


def _default_cluster_note(args: PlanOptions, preset: str, nodes: int, per_node: int) -> list[str]:
    """The note saying which of --nodes and --gpus-per-node were not given, and what the plan took."""
    missing = [flag for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node))
               if value is None]
    if not missing:
        return []
    return [
        f"{' and '.join(missing)} not given: {nodes} node(s) x {per_node} GPU(s), the first documented "
        "cluster "
        f"of preset '{preset}' (config/presets.py PRESET_CLUSTERS)"
    ]


def _meta_model(source, cfg):
    """The model on the meta device; a config.json transformers cannot build from is one line naming it (the
    checks of preflight.check_model_shape run first, so this is the backstop)."""
    try:
        return build_meta_model(source, cfg)
    except Exception as err:
        if source.toy:
            raise
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"{source.origin}: transformers cannot build the model from it: {first}") from err


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


__all__ = ["PlanOptions", "parse_plan_args", "plan_help", "plan_main"]
