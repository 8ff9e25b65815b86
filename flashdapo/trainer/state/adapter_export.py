"""The final export of a LoRA run: a PEFT adapter directory, and the merged model on request.

- `export/` is what `peft.PeftModel.from_pretrained(base, "export")` and vLLM's `LoRARequest` load:
  `adapter_config.json` (rank, alpha, the target modules, `base_model_name_or_path` naming the base) and
  `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`, fp32, as trained), with the
  tokenizer beside them. Written in `export.tmp/` and moved in as the full export is (export.py's manifest).
- The base it names is model.path. The toy's base exists only in memory (built and warmed up at start), so
  it is written once as an HF model directory in `export-base/` and named instead.
- `checkpoint.export_merged`: `export-merged/` is the plain HF checkpoint of the adapted policy (every adapted
  weight W + alpha/r B A, in float32 before the cast to the export dtype), loadable with no peft at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file

from ...distributed.collectives import barrier
from ...sync import WeightSource
from .export import export_hf, publish_export, source_of, write_tokenizer

ADAPTER_FILE = "adapter_model.safetensors"


def export_adapted(weights: WeightSource, hf_config, tokenizer, run_dir: Path, is_main: bool, step: int,
                   model_path: str, merged: bool) -> list[str]:
    """Write the LoRA run's exports (module docstring) on every rank together (each tensor is a gather);
    the lines saying what was written."""
    lines = []
    base = model_path
    if not model_path:
        base_dir = run_dir / "export-base"
        export_hf(weights.base(), hf_config, tokenizer, base_dir, is_main, step=0)
        base = str(base_dir.resolve())
        lines.append(f"wrote the toy's frozen base to {base_dir} (the adapter names it)")
    out_dir = run_dir / "export"
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tensors = {}
    for name, tensor in weights.adapters():  # every rank gathers; rank 0 alone keeps a host copy
        if is_main:
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        weights.layout.peft_config(base).save_pretrained(str(tmp))
        source = Path(model_path) if model_path else source_of(tokenizer)
        added = write_tokenizer(tmp, source, tokenizer)
        publish_export(tmp, out_dir, step, added)
    barrier()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    lines.append(f"exported the adapters ({len(tensors)} tensors, {size / 2**20:.2f} MiB; base {base}) to "
                 f"{out_dir}")
    if merged:
        merged_dir = run_dir / "export-merged"
        export_hf(weights.merged(), hf_config, tokenizer, merged_dir, is_main, step=step,
                  source_dir=model_path or None)
        lines.append(f"exported the merged policy to {merged_dir}")
    return lines


__all__ = ["ADAPTER_FILE", "export_adapted"]
