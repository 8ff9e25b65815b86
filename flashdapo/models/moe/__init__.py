"""Mixture-of-experts models: which modules route (from the family registry, models/hf.py), the routers'
load-balancing loss per sequence, and the expert load (router.py, balance.py)."""

from .balance import Balance, load_balancing, token_sequences
from .router import (
    RouterLogits,
    check_router_aux_coef,
    is_moe,
    loss_routers,
    router_aux_coef,
    router_logits_kwargs,
    routers,
)

__all__ = [
    "Balance", "RouterLogits", "check_router_aux_coef", "is_moe", "load_balancing", "loss_routers",
    "router_aux_coef", "router_logits_kwargs", "routers", "token_sequences"
]
