"""`flashdapo ablate`: the paper's ablation ladder (arms.py), run on one base model (base.py) by runner.py,
reported by report.py; its options in options.py, the command in command.py. docs/ablation.md."""
