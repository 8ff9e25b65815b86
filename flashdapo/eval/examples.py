"""A few math problems in the DAPO format, for `flashdapo generate --examples`: a look at a model's answers
without a data file. Each is posed with the DAPO prompt template (the training data's) and has an integer
answer the "Answer:" verifier checks; the arithmetic behind each answer is in its comment."""

from __future__ import annotations

from ..data import DAPO_TEMPLATE, Record

EXAMPLES: tuple[tuple[str, str], ...] = (
    # 1 + 2 + 3 + 4 + 6 + 9 + 12 + 18 + 36
    ("What is the sum of all positive divisors of 36?", "91"),
    # 33 multiples of 3 below 100, 19 of 5, 6 of 15 counted twice: 33 + 19 - 6
    ("How many positive integers less than 100 are divisible by 3 or by 5?", "46"),
    # 2^3 = 8 = 1 (mod 7), and 100 = 3 * 33 + 1
    ("Find the remainder when $2^{100}$ is divided by 7.", "2"),
    # the numbers are 16 and 9
    ("The sum of two numbers is 25 and their difference is 7. What is their product?", "144"),
    # the pair as one block, in 2 orders: 4! * 2
    ("In how many ways can 5 different books be put in a row on a shelf if two particular books must stand "
     "next to each other?", "48"),
)
"""(problem, answer) pairs."""

DATA_SOURCE = "examples"


def example_rows() -> list[dict]:
    """The examples as rows of the DAPO-Math-17k schema (as a .jsonl or .parquet for --data would hold
    them)."""
    return [{
        "data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=p)}],
        "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule"}
    } for p, a in EXAMPLES]


def example_records() -> list[Record]:
    """The examples as dataset records (one user message each, the DAPO template around the problem)."""
    return [Record(row["prompt"], row["reward_model"]["ground_truth"], f"examples:{i}", DATA_SOURCE)
            for i, row in enumerate(example_rows())]
