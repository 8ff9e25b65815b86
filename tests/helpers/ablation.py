"""A CI-sized base for `flashdapo ablate` runs."""

TINY_BASE = {
    "model": {"toy": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "intermediate_size": 64, "sft_steps": 4, "sft_batch": 8}},
    "data": {"scratchpad": {"num_train": 40, "num_val": 4, "max_digits": 2}},
    "rollout": {"n": 4, "val_n": 2, "max_response_length": 24},
    "algorithm": {"overlong_buffer_len": 8},
    "trainer": {"total_steps": 2, "train_batch": 4, "gen_batch": 8, "mini_batch": 2, "val_every": 1},
    "checkpoint": {"save_every": 0},
}
"""Fields over the scratchpad preset: a 1-layer toy model briefly warmed up, 2 steps of 4 groups of 4."""
