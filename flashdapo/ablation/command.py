"""`flashdapo ablate [--out DIR] [--seeds S] [--quick] [--panels P ...] [--ladder [--arms A ...]] [TRAIN
OPTIONS]`: the options of AblateOptions, then any `flashdapo train` option (--preset, --config, --SECTION.FIELD VALUE) for the base config of the arms."""

from __future__ import annotations

import tyro

from ..config import PRESETS, Config, starting_point
from .options import DEFAULT_ABLATION_PRESET, AblateOptions
from .panel_runner import run_panels
from .records import ArmRun, PanelRun
from .runner import run_ablation


def parse_ablate_args(argv: list[str]) -> tuple[AblateOptions, Config]:
    """Split argv into the ablation's own options and the base training config (preset default 'scratchpad')."""
    opts, config, _ = parse_ablate_command(argv)
    return opts, config


SWITCHES = ("--quick", "--ladder")
"""Options that may stand alone (`--quick` = `--quick True`); every other boolean takes its value, as in
`flashdapo train`."""


def bare_switches(argv: list[str]) -> list[str]:
    """argv with a value after each SWITCHES option given without one."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in SWITCHES and following.lower() not in ("true", "false"):
            out.append("True")
    return out


def parse_ablate_command(argv: list[str]) -> tuple[AblateOptions, Config, Config]:
    """(options, the base training config, its starting point: the preset and config file before the command
    line's fields)."""
    base, rest, start = starting_point(bare_switches(argv), DEFAULT_ABLATION_PRESET)
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
