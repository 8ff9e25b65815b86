"""Where a mixture-of-experts model routes, as the family registry (models/hf.py) says, and which
router-loss coefficient a run uses.

A family with `routers` in its registry entry is a mixture-of-experts family: its decoder blocks' sparse MLPs
each have a top-k router whose forward returns the router logits first. transformers records those logits
when a forward is called with `output_router_logits=True`; the same switch in the model's config.json also
makes its ...ForCausalLM compute the load-balancing loss on every forward, which a forward over a KV cache
cannot do (the router logits cover the new tokens, the attention mask every cache slot: "The size of
tensor a (8) must match the size of tensor b (160)"). So every forward that is not the update's names the
switch explicitly (`router_logits_kwargs`), off.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import ConfigError
from ..hf import FAMILIES, Family


def family_entry(config) -> Family | None:
    """The registry entry of an HF config (object or config.json dict); None for an unregistered type."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return FAMILIES.get(model_type)


def routers(hf_model: nn.Module) -> list[nn.Module]:
    """The top-k routers of an HF causal LM, one per sparse block in layer order; [] for a dense model."""
    family = family_entry(hf_model.config)
    return [] if family is None or family.routers is None else family.routers(hf_model)


def loss_routers(hf_model: nn.Module) -> list[nn.Module]:
    """`routers` where the family balances them by transformers' load-balancing loss (softmax top-k routers:
    the router loss and expert load of balance.py apply); [] otherwise."""
    family = family_entry(hf_model.config)
    return routers(hf_model) if family is not None and family.router_loss else []


def is_moe(config) -> bool:
    """Whether an HF config (object or config.json dict) is of a registered mixture-of-experts family."""
    family = family_entry(config)
    return family is not None and family.routers is not None


class RouterLogits:
    """The router logits of one training forward, one [tokens, E] tensor per sparse layer: PolicyModel.forward
    fills it when given one. A holder rather than a list: FSDP2's root copies list arguments (moving them to
    the device), so a list filled inside the forward would not be the caller's."""

    def __init__(self) -> None:
        self.layers: tuple[torch.Tensor, ...] = ()
        self.chosen: tuple[torch.Tensor, ...] | None = None
        """Under routing replay, the experts each layer's router handed on ([tokens, k]: the engine's where
        recorded); None: the routers' own top-k of `layers`."""


def router_logits_kwargs(config, record: bool = False) -> dict[str, bool]:
    """The keyword a forward of an MoE model passes so that transformers records the router logits (`record`)
    or neither records them nor computes its own load-balancing loss, whatever config.json's
    `output_router_logits` says; {} for a dense model (its forward takes no such keyword)."""
    return {"output_router_logits": record} if is_moe(config) else {}


def check_router_aux_coef(override: float | None, config) -> None:
    """ConfigError for `model.router_aux_loss_coef` above 0 on a dense model (no router to balance) or on an
    MoE family whose routers no load-balancing loss balances (DeepSeek-V3's bias-corrected sigmoid routers):
    run before the launch (preflight.check_model_settings) and at start-up (models/parallelize.py)."""
    family = family_entry(config)
    if override and family is not None and family.routers is None:
        raise ConfigError(f"model.router_aux_loss_coef={override}: {family.model_type} is a dense model (no "
                          "mixture-of-experts router to balance); leave it unset or 0")
    if override and family is not None and family.routers is not None and not family.router_loss:
        raise ConfigError(
            f"model.router_aux_loss_coef={override}: {family.model_type}'s routers are not balanced by "
            f"a load-balancing loss (transformers has none for them); leave it unset or 0")


def router_aux_coef(override: float | None, config) -> float:
    """The load-balancing loss coefficient of a run: `model.router_aux_loss_coef` when set (0: off), else the
    model config's `router_aux_loss_coef` where its `output_router_logits` switch is on, else 0 (what a
    transformers ...ForCausalLM adds to its own training loss). Always 0 for a dense model; a ConfigError for
    a coefficient above 0 on a family whose routers no such loss balances (DeepSeek-V3)."""
    check_router_aux_coef(override, config)
    if not is_moe(config) or not family_entry(config).router_loss:
        return 0.0
    if override is not None:
        return float(override)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


__all__ = [
    "RouterLogits", "check_router_aux_coef", "is_moe", "loss_routers", "router_aux_coef",
    "router_logits_kwargs", "routers"
]
