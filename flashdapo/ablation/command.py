"""`flashdapo ablate [--out DIR] [--seeds S] [--quick] [--panels P ...] [--ladder [--arms A ...]] [TRAIN
OPTIONS]`: the options of AblateOptions, then any `flashdapo train` option (--preset, --config, --SECTION.FIELD VALUE) for the base config of the arms."""

from __future__ import annotations

import tyro

from ..config import PRESETS, Config, starting_point
from .options import DEFAULT_ABLATION_PRESET, AblateOptions
from .panel_runner import PanelRun, run_panels
from .runner import ArmRun, run_ablation


def parse_ablate_args(argv: list[str]) -> tuple[AblateOptions, Config]:
    """Split argv into the ablation's own options and the base training config (preset default 'scratchpad')."""
    opts, config, _ = parse_ablate_command(argv)
    return opts, config


def parse_ablate_command(argv: list[str]) -> tuple[AblateOptions, Config, Config]:
    """(options, the base training config, its starting point: the preset and config file before the command
    line's fields)."""
    base, rest, start = starting_point(argv, DEFAULT_ABLATION_PRESET)
    description = (f"{AblateOptions.__doc__}\n\nBase config: {start} (presets: {', '.join(PRESETS)}). Every "
                   "`flashdapo train --help` field is accepted after these options.")
    opts, unknown = tyro.cli(AblateOptions, args=rest, prog="flashdapo ablate", description=description,
                             return_unknown_args=True, config=(tyro.conf.FlagConversionOff,))
    config = tyro.cli(Config, default=base, args=unknown, prog="flashdapo ablate",
                      config=(tyro.conf.FlagConversionOff,))
    return opts, config, base


def ablate_main(argv: list[str]) -> list[ArmRun] | list[PanelRun]:
    """`flashdapo ablate`: parse, then run the panels (panel_runner.run_panels) or, with --ladder, the ladder
    (runner.run_ablation)."""
    opts, config, start = parse_ablate_command(argv)
    log = lambda m: print(f"flashdapo: {m}", flush=True)  # noqa: E731
    return run_ablation(config, opts, log=log) if opts.ladder else run_panels(config, opts, log=log, start=start)
