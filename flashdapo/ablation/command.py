"""`flashdapo ablate [--out DIR] [--seeds S] [--quick] [--panels P ...] [--ladder [--arms A ...]] [TRAIN
OPTIONS]`: the options of AblateOptions, then any `flashdapo train` option (--preset, --config,
--SECTION.FIELD VALUE) for the base config of the arms."""

from __future__ import annotations

from pathlib import Path

from ..config import PRESETS, Config, ConfigError, starting_point
from .options import DEFAULT_ABLATION_PRESET, AblateOptions
from .panel_runner import run_panels
from .records import ArmRun, PanelRun
from .runner import run_ablation

SWITCHES = ("--quick", "--ladder")
"""Options that may stand alone (`--quick` = `--quick true`); every other boolean takes its value, as in
`flashdapo train`."""


def parse_ablate_args(argv: list[str]) -> tuple[AblateOptions, Config]:
    """Split argv into the ablation's own options and the base training config (preset default
    'scratchpad')."""
    opts, config, _ = parse_ablate_command(argv)
    return opts, config


def parse_ablate_command(argv: list[str]) -> tuple[AblateOptions, Config, Config]:
    """(options, the base training config, its starting point: the preset and config file before the command
    line's fields). Both are read by the parser of every command (config/cli.py): AblateOptions first, the
    arguments it does not know then as `flashdapo train`'s."""
    from ..config.cli import parse  # the command line alone needs tyro

    base, rest, start = starting_point(argv, DEFAULT_ABLATION_PRESET)
    description = (f"{AblateOptions.__doc__}\n\nBase config: {start} (presets: {', '.join(PRESETS)}). Every "
                   "`flashdapo train --help` field is accepted after these options.")
    opts, unknown = parse(AblateOptions, rest, prog="flashdapo ablate", description=description,
                          known_only=True, switches=SWITCHES)
    config = parse(Config, unknown, prog="flashdapo ablate", default=base)
    return opts, config, base


def check_choices(opts: AblateOptions, argv: list[str]) -> None:
    """Refuse an option the chosen mode would ignore: --arms (the ladder's rungs) without --ladder, --panels
    with --ladder or --quick (which choose the runs themselves), --quick with --ladder (the ladder has no
    short variant); and an --out that is a file (the runs are written under a directory)."""
    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in argv)

    if given("--arms") and not opts.ladder:
        raise ConfigError(
            "ablate.arms: --arms chooses the rungs of the ladder and needs --ladder; the panels are "
            "chosen with --panels NAME ...")
    if given("--panels") and (opts.ladder or opts.quick):
        mode = "--ladder runs the ladder's rungs (choose them with --arms)" if opts.ladder else \
            "--quick runs its own panels and arms"
        raise ConfigError(
            f"ablate.panels: --panels chooses the mechanism panels, but {mode}; drop one of them")
    if opts.ladder and opts.quick:
        raise ConfigError(
            "ablate.quick: --quick runs the short panels and --ladder the whole ladder (it has no short "
            "variant: fewer rungs with --arms, fewer seeds with --seeds); drop one of them")
    if Path(opts.out).exists() and not Path(opts.out).is_dir():
        raise ConfigError(
            f"ablate.out: {opts.out} is a file; the ablation writes its runs and report under a "
            "directory: name a directory (new or one of an earlier ablation to reuse its runs)")


def ablate_main(argv: list[str]) -> list[ArmRun] | list[PanelRun]:
    """`flashdapo ablate`: parse, then run the panels (panel_runner.run_panels) or, with --ladder, the ladder
    (runner.run_ablation)."""
    opts, config, start = parse_ablate_command(argv)
    check_choices(opts, argv)
    log = lambda m: print(f"flashdapo: {m}", flush=True)  # noqa: E731
    return run_ablation(config, opts, log=log) if opts.ladder else run_panels(
        config, opts, log=log, start=start)
