"""`flashdapo eval` (command.py: sampling.py, results.py, store.py) and `flashdapo generate` (generate.py,
examples.py): a saved model's pass@k and answers, through the rollout engines; imports models/ and rollout/,
never trainer/."""
