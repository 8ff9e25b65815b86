"""The flashdapo command line: `flashdapo train | config | plan | eval | generate | ablate`.

`train` and `config` take `--preset NAME` and `--config FILE`, then overrides of any config field
(`--trainer.total-steps 10`); their flags and help come from `flashdapo.config`. Every command reads its
options with the one parser of config/cli.py (the same bool words, the same one-line refusals).
"""

from __future__ import annotations

import os
import sys

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning, so that a busy
# CPU does not stall every operator (flashdapo/tools/threads.py). A value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import __version__  # noqa: E402
from .config import DEFAULT_PRESET, PRESETS, ConfigError  # noqa: E402
from .config.cli import resolve_config  # noqa: E402
from .errors import DEBUG_ENV, debug_requested, user_error_line  # noqa: E402
from .tools.stack_dumps import stacks_on_sigusr1  # noqa: E402
from .tools.warning_lines import showing_warnings  # noqa: E402

USAGE = """usage: flashdapo {train,config,plan,eval,generate,ablate} [options]   (flashdapo --version)

  train    run DAPO            flashdapo train [--preset NAME] [--config FILE] [--SECTION.FIELD VALUE ...]
  config   print the resolved config (YAML; reusable with --config)
  plan     will a launch start and fit: flashdapo plan [--preset NAME] [--nodes N] [--gpus-per-node G]
           [--gpu h20] [train options]
  eval     evaluate a saved model: flashdapo eval --model DIR --data FILE [FILE ...] --out OUT [--k 32]
           [--config FILE]
  generate a saved model's answers: flashdapo generate --model DIR (--prompt TEXT ... | --data FILE
           [--limit N] | --examples) [--n 4] [--out FILE]
  ablate   the mechanism panels: flashdapo ablate [--out DIR] [--quick] [--panels NAME ...] [--seeds 5]
           [train options]; the paper's ladder: flashdapo ablate --ladder [--arms NAME ...]

presets: """ + ", ".join(PRESETS) + f" (default: {DEFAULT_PRESET})\n`flashdapo train --help` lists " \
    "every field; --debug (or FLASHDAPO_DEBUG=1) shows the traceback of an error."


def main(argv: list[str] | None = None) -> int:
    """Run a command; an error the user can fix prints one line (`flashdapo: error: ...`, status 1; config
    errors: status 2) unless `--debug` or FLASHDAPO_DEBUG=1 asks for the traceback (flashdapo/errors.py); a
    command line its parser cannot read, one line and SystemExit(2) (config/cli.py). flashdapo's warnings
    print one line each, `flashdapo: warning: ...` (flashdapo/tools/warning_lines.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"  # also read by failfast.py on every rank
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"flashdapo {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    # flashdapo's warnings as one line each (warning_lines.py); kill -USR1 prints the stacks (stack_dumps.py)
    with showing_warnings(), stacks_on_sigusr1():
        return _run_command(command, rest)


def _run_command(command: str, rest: list[str]) -> int:
    try:
        if command == "train":
            config = resolve_config(rest, "flashdapo train")
            from .trainer.loop import train

            train(config)
        elif command == "config":
            print(resolve_config(rest, "flashdapo config").to_yaml(), end="")
        elif command == "plan":
            from .plan.command import plan_main

            return plan_main(rest)
        elif command == "eval":
            from .eval.command import eval_main

            eval_main(rest)
        elif command == "generate":
            from .eval.generate import generate_main

            generate_main(rest)
        elif command == "ablate":
            from .ablation.command import ablate_main

            ablate_main(rest)
        else:
            print(f"flashdapo: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
            return 2
    except ConfigError as err:
        if debug_requested():
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank reads the same config: rank 0 reports it
            print(f"flashdapo: config error: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:
        line = user_error_line(err)
        if line is None or debug_requested():
            raise
        # Under torchrun an error every rank raises together is printed by rank 0 alone; a warning raised as
        # an error (-W error) by the rank that warned.
        if os.environ.get("RANK", "0") == "0" or not getattr(err, "every_rank", not isinstance(err, Warning)):
            print(line, file=sys.stderr, flush=True)
        return getattr(err, "exit_status", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
