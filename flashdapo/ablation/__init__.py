"""`flashdapo ablate`: the mechanism panels (arms.py; run by panel_runner.py, judged by stats.py, reported by
panel_report.py) and the paper's cumulative ladder (--ladder; runner.py, report.py), on base models from
base.py; options in options.py, the command in command.py. docs/ablation.md."""
