"""A PEFT LoRA adapter directory over a base model directory, as a LoRA run exports it, and the merged model.

B is drawn non-zero (peft's init_lora_weights=False) and scaled up, so the adapted policy samples other tokens
than the base: an evaluation that ignored the adapter would be caught.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_adapter(base: Path, root: Path, rank: int = 8, alpha: float = 32.0, seed: int = 0,
                 norms: bool = False) -> tuple[Path, Path]:
    """(`root`/adapter, `root`/merged): a LoRA adapter of `rank` over every linear layer of `base`'s decoder
    blocks, naming `base` in adapter_config.json, with the base's tokenizer files beside it; and the merged
    model (peft's merge_and_unload, saved by transformers) with them too. `norms`: every norm trained whole
    too (modules_to_save, as lora.train_norms "all" exports them), moved off the base's values."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    saved = [name for name, m in model.named_modules() if "Norm" in type(m).__name__] if norms else None
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS), init_lora_weights=False,
                        modules_to_save=saved, base_model_name_or_path=str(base.resolve()), task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if ".modules_to_save." in name:
                    param.mul_(1 + torch.rand_like(param))
    adapter, merged = root / "adapter", root / "merged"
    adapted.save_pretrained(str(adapter))
    (adapter / "README.md").unlink(missing_ok=True)
    adapted.merge_and_unload().save_pretrained(str(merged))
    for name in TOKENIZER_FILES:
        for out in (adapter, merged):
            if (base / name).is_file():
                shutil.copy(base / name, out / name)
    if (base / "generation_config.json").is_file():
        shutil.copy(base / "generation_config.json", merged / "generation_config.json")
    return adapter, merged
