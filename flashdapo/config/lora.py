"""Config section of LoRA adapters (`lora`): a frozen base with low-rank adapters trained in its place
(docs/lora.md). The root of the tree is tree.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from .checks import Check, Fraction, NonNegative, PositiveFloat, Section, at_most

NEVER_ADAPTED = ("embed_tokens", "lm_head", "embedding")
"""Modules no adapter goes on: the fused LM-head kernels read the head's weight itself, and the embedding's
lookup has no low-rank path in the kernels' contract (docs/lora.md)."""


def _module_names(names: list[str]) -> bool:
    return all(name and name.replace("_", "").isalnum() and name not in NEVER_ADAPTED for name in names)


@dataclass
class LoraConfig(Section):
    """LoRA: the base model frozen in its compute dtype, low-rank adapters (`W + alpha/rank * B A`) and the
    normalization weights trained in its place; only they are optimized, checkpointed and pushed to the
    rollout engine."""

    rank: Annotated[NonNegative, at_most(4096, "an adapter's rank beyond any layer's width")] = 0
    """Adapter rank r (0: off, the whole model trains)."""
    alpha: PositiveFloat = 32.0
    """Scale numerator: each adapter's update is alpha / rank * B A (B starts at zero, so step 0 is the
    base)."""
    dropout: Fraction = 0.0
    """Dropout on an adapter's input in the update's forwards only (sampling, the old log-probs and the push
    check run without it, as the importance ratio needs)."""
    target_modules: Annotated[list[str], Check(
        _module_names, f"linear module names such as q_proj (never {', '.join(NEVER_ADAPTED)})")] = \
        field(default_factory=list)
    """Names of the decoder's linear modules that take adapters (e.g. q_proj v_proj). Empty: every linear
    layer of the family's decoder blocks (models/hf.py `adapter_modules`; never the embeddings, the LM head,
    the routers or the fused routed experts)."""
    train_norms: Literal["all", "final", "none"] = "all"
    """Normalization weights trained beside the adapters, whole (a few thousand values per block): "all",
    "final" (the last norm before the LM head only) or "none" (the adapters alone). The LM head and the final
    norm fix the logits' scale; with both frozen the policy cannot become sharper than the base, measured on
    the toy (docs/lora.md). Pushed to vLLM as full tensors beside the adapters; exported in the adapter
    directory as PEFT's `modules_to_save`."""
    lr_scale: PositiveFloat = 2.0
    """optim.lr is multiplied by this when adapters train. Measured on the toy (docs/lora.md): 1-2x its full
    rate learns best, 5x and more collapse; large models are reported to want ~10x (the 32B LoRA preset)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0
