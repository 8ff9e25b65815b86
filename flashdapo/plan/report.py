"""The plan as text: the launch, the model, the checks, the per-GPU memory table and the step time. Every
figure that is not an exact count is labelled `modelled`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, engine_spec
from .all_to_all import links_of
from .checks import CheckReport
from .fit import GIB, SEARCH_LIMIT, MemoryPlan
from .memory import rollout_ranks_per_node
from .model import ModelShape
from .step_time import StepTime, Workload, push_bytes


@dataclass(frozen=True)
class PlanInputs:
    """What the report describes besides the plan's figures."""

    cfg: Config
    start: str
    nodes: int
    gpus_per_node: int
    origin: str
    alternative: MemoryPlan
    """The same launch with trainer.fsdp_cpu_offload flipped (not checked for fit)."""


def _g(value: float) -> str:
    return f"{value / GIB:8.2f}"


def _row(label: str, value: float, basis: str, other: float | None = None) -> str:
    alt = _g(other) if other is not None else "       -"
    return f"  {label:<52}{_g(value)}  {alt}   {basis}"


def render(inputs: PlanInputs, shape: ModelShape, checks: CheckReport, plan: MemoryPlan, time: StepTime,
           work: Workload) -> list[str]:
    """The plan's lines."""
    cfg, tc, rc = inputs.cfg, inputs.cfg.trainer, inputs.cfg.rollout
    world = inputs.nodes * inputs.gpus_per_node
    sp, slots = tc.sequence_parallel, world // tc.sequence_parallel
    lines = [
        f"flashdapo plan: {inputs.start} on {inputs.nodes} node(s) x {inputs.gpus_per_node} {plan.gpu.name} "
        "= "
        f"{world} ranks ({plan.gpu.memory_gib:g} GiB, {plan.gpu.bf16_tflops:g} TFLOP/s bf16 dense, "
        f"{plan.gpu.hbm_tbps:g} TB/s: {plan.gpu.source})",
        f"model: {shape.name} from {inputs.origin}: {shape.base_parameters:,} parameters in "
        f"{sum(not t.adapter for t in shape.tensors)} "
        f"tensors (exact, built on the meta device); {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads / {shape.kv_heads} KV heads, vocabulary {shape.vocab:,}"
        f"{', tied head' if shape.tied else ''}"
    ]
    if shape.moe is not None:
        lines.append(_moe_line(shape))
    if shape.lora:
        lines.append(_lora_line(shape, cfg))
    lines += [f"layout: {slots} data-parallel slot(s) x sequence_parallel {sp}; FSDP2 over all {world} ranks"
              + _expert_layout(shape, tc.expert_parallel, world)
              + (f"; {world // rc.tensor_parallel_size} vLLM engine(s) of tensor_parallel_size "
                 f"{rc.tensor_parallel_size}" if engine_spec(rc.engine).tensor_parallel else
                 f"; {rc.engine} rollout engine"),
              "checks passed: " + "; ".join(checks.passed)]
    if checks.not_checked:
        lines.append("not checked here: " + "; ".join(checks.not_checked))
    lines += [f"note: {n}" for n in checks.notes]
    lines += _memory(inputs, plan, cfg)
    lines += _time(plan, time, work, cfg)
    if plan.engine is not None:
        lines.append(_push(shape, cfg))
    return lines


def _moe_line(shape: ModelShape) -> str:
    """The experts: how many, top-k, and the parameters a token runs through (exact counts)."""
    m = shape.moe
    shared = f", shared experts of width {m.shared_intermediate}" if m.shared_intermediate else ""
    return (
        f"experts: {m.num_experts} routed experts of width {m.moe_intermediate} in {m.moe_layers} of "
        f"{shape.layers} layers, top {m.top_k}{shared}; {shape.active_parameters:,} active parameters per "
        f"token of {shape.parameters:,} ({shape.expert_parameters:,} in routed experts; exact: FLOPs use "
        "the active, memory the total)")


def _lora_line(shape: ModelShape, cfg: Config) -> str:
    """The adapters: rank, modules, and trainable against total parameters (exact counts)."""
    adapted = sorted({t.name.split(".lora_A.")[0].rsplit(".", 1)[-1] for t in shape.tensors
                      if ".lora_A." in t.name})
    linears = sum(".lora_A." in t.name for t in shape.tensors)
    norms = sum(t.whole for t in shape.tensors)
    whole = f" and {norms} norms trained whole (lora.train_norms {cfg.lora.train_norms})" if norms else ""
    return (
        f"lora: rank {shape.lora_rank}, alpha {cfg.lora.alpha:g}, {' '.join(adapted)} in every decoder block "
        f"({linears} adapted linears{whole}); {shape.trainable_parameters:,} trainable of "
        f"{shape.parameters:,} parameters ({shape.trainable_parameters / shape.parameters:.2%}; exact: "
        "A [r, in] and B [out, r] per adapted linear); the base frozen in the compute dtype")


def _expert_layout(shape: ModelShape, expert_parallel: int, world: int) -> str:
    """The layout line's expert-parallel part ('' for a dense model at expert_parallel 1)."""
    if shape.moe is None or expert_parallel == 1:
        if shape.moe is None:
            return ""
        return "; trainer.expert_parallel 1: every rank gathers all of a block's experts"
    return (
        f"; expert_parallel {expert_parallel}: {shape.moe.num_experts // expert_parallel} experts of each "
        f"MoE layer per rank, sharded by FSDP2 over the {world // expert_parallel} ranks holding the same "
        "ones"
    )


def _memory(inputs: PlanInputs, plan: MemoryPlan, cfg: Config) -> list[str]:
    s, t, alt = plan.state, plan.transients, inputs.alternative
    on = cfg.trainer.fsdp_cpu_offload
    head = "offload on " if not on else "offload off"
    lines = ["", f"memory per GPU, GiB (rank 0; largest micro-batch {plan.tokens} tokens per rank; "
                 f"trainer.fsdp_cpu_offload={str(on).lower()}; last column: {head.strip()})",
             f"  {'':<52}{'value':>8}  {head:>8}   basis"]
    gpu_state = (lambda v: 0 if on else v)
    alt_state = (lambda v: v if on else 0)
    where = (lambda v: f"exact; {v / GIB:.2f} GiB per rank in host memory") if on else (lambda v: "exact")
    base = f"frozen base, {'bf16' if plan.setup.compute_bytes == 2 else 'fp32'} shards"
    params = [_row(base, gpu_state(s.frozen), where(s.frozen), alt_state(s.frozen)),
              _row("adapters, fp32 shards", gpu_state(s.trainable_params), where(s.trainable_params),
                   alt_state(s.trainable_params))] if s.frozen else [
        _row("parameters, fp32 shards", gpu_state(s.params), where(s.params), alt_state(s.params))]
    what = "adapter " if s.frozen else ""
    lines += params + [
        _row(f"{what}gradients, fp32 shards", gpu_state(s.grads), where(s.grads), alt_state(s.grads)),
        _row(f"{what}AdamW moments, fp32", gpu_state(s.moments), where(s.moments), alt_state(s.moments)),
        _row("gathered parameters (root + blocks, compute dtype)", t.gathered, "modelled",
             alt.transients.gathered),
        _row("activations kept" + (" (checkpointed inputs)" if plan.setup.checkpointing else ""),
             t.kept_activations, "modelled", alt.transients.kept_activations),
        _row("one block's recompute and backward", t.recompute, "modelled", alt.transients.recompute),
        _row(f"LM-head kernel, {plan.setup.lm_head} (chosen for this GPU)", t.lm_head,
             "modelled (kernels/cost.py)", alt.transients.lm_head),
        _row("gradient reduction buffers", t.layer_reduce, "modelled", alt.transients.layer_reduce),
        _row("optimizer step temporaries", t.optimizer_step, "modelled", alt.transients.optimizer_step),
        _row("trainer peak in training (+ CUDA context)", plan.train_peak, "modelled", alt.train_peak)
    ]
    e = plan.engine
    if e is not None:
        level = "level 2: weights discarded" if e.sleep_level == 2 else "level 1: weights on host"
        tp = cfg.rollout.tensor_parallel_size
        lines += [
            _row(f"vLLM base + adapter slot, bf16 / tensor_parallel {tp}" if s.frozen else
                 f"vLLM weights, bf16 / tensor_parallel_size {tp}", e.weights, "modelled"),
            _row("vLLM activations and runtime", e.activations + e.runtime, "modelled"),
            _row(f"vLLM KV cache at gpu_memory_utilization {cfg.rollout.gpu_memory_utilization}", e.kv_cache,
                 f"modelled: {e.sequences} requests of {e.max_model_len} tokens"),
            _row(f"vLLM asleep in training ({level})", e.asleep, "modelled")
        ]
    lines += [
        _row("total in generation (trainer resident + vLLM)", plan.generation_total, "modelled",
             alt.generation_total),
        _row("total in training (trainer peak + vLLM asleep)", plan.training_total, "modelled",
             alt.training_total),
        _row(f"GPU memory ({plan.gpu.name})", plan.gpu.memory_bytes, "datasheet"),
        f"  biggest trainer.micro_batch_tokens that fits: {_tokens(plan.best_tokens)} (modelled; configured "
        f"{cfg.trainer.micro_batch_tokens})" +
        f"; with offload {'off' if on else 'on'}: {_tokens(alt.best_tokens)}"
    ]
    if (on or s.frozen) and e is not None and e.sleep_level == 1:
        lines.append(f"  host memory per node for vLLM's sleeping weights: "
                     f"{e.weights * inputs.gpus_per_node / GIB:.1f} GiB (modelled)")
    if on:
        lines.append(f"  host memory per node for the offloaded state: "
                     f"{s.total * inputs.gpus_per_node / GIB:.1f} GiB (exact)")
    if plan.staged:
        lines.append(_staged(inputs, plan, cfg))
    return lines


def _staged(inputs: PlanInputs, plan: MemoryPlan, cfg: Config) -> str:
    """Split placement's staged weights in host memory, per rollout rank and per node, and whether checked."""
    rc, b = cfg.rollout, plan.setup.compute_bytes
    ranks = rollout_ranks_per_node(rc.rollout_ranks, inputs.gpus_per_node)
    host = plan.host_memory
    verdict = (f"within a node's {host / GIB:.1f} GiB" if host else
               "a node's host memory is not in the GPU table (kernels/gpus.py): not checked")
    return (
        f"  host memory for split placement's staged weights: {plan.staged / GIB:.1f} GiB per rollout rank "
        f"({rc.max_lag + 1} versions x {plan.staged // (b * (rc.max_lag + 1)):,} parameters x {b} bytes), "
        f"{plan.staged * ranks / GIB:.1f} GiB per node ({ranks} rollout rank(s)) (exact); {verdict}")


def _tokens(count: int) -> str:
    return f"{count} or more" if count >= SEARCH_LIMIT else str(count)


def _update_basis(cfg: Config, lora: bool) -> str:
    """The update row's FLOPs per parameter and token (LoRA: the frozen base's linears skip dW)."""
    ckpt = cfg.model.gradient_checkpointing
    if lora:
        return (f"{6 if ckpt else 4} FLOPs per frozen base parameter and token (no weight gradient), "
                f"{8 if ckpt else 6} per adapter parameter, attention")
    return f"{8 if ckpt else 6} FLOPs per parameter and token, attention"


def _push(shape: ModelShape, cfg: Config) -> str:
    """The bytes of one weight push to the engine (exact; its time is not modelled)."""
    what = (f"the adapters and trained norms alone, gathered in fp32 (sync WeightSource.adapters), held by "
            f"vLLM in bf16 ({2 * shape.trainable_parameters / 1e9:,.2f} GB); the frozen base is never pushed"
            if shape.lora
            else f"every parameter, {'fp32' if cfg.model.dtype == 'float32' else 'bf16'}")
    return (f"  weight push to vLLM, per step: {push_bytes(shape, cfg) / 1e9:,.2f} GB (exact: {what}; "
            "its time is not modelled)")


def _time(plan: MemoryPlan, time: StepTime, work: Workload, cfg: Config) -> list[str]:
    tc, rc, gpu = cfg.trainer, cfg.rollout, plan.gpu
    rows = [
        (f"generation, one round of {tc.gen_batch} prompts x {rc.n}", time.generation,
         f"decode roofline at {gpu.hbm_tbps:g} TB/s: {time.decode_steps} steps, {time.concurrent} sequences "
         "at once per engine"),
        ("old log-probs", time.old_logprobs, "skipped: on-policy" if time.old_logprobs == 0 else "forward"),
        (f"update, {tc.ppo_epochs} epoch(s)", time.update, _update_basis(cfg, plan.state.frozen > 0)),
        (f"LM-head kernel, {plan.setup.lm_head}", time.lm_head, f"kernels/cost.py at {gpu.name} rates")
    ]
    if tc.expert_parallel > 1:
        links = links_of(gpu)
        rows.append(
            (f"expert all-to-all, expert_parallel {tc.expert_parallel}", time.all_to_all,
             f"{time.all_to_all_bytes / 1e9:.1f} GB leave each rank (dispatch + combine; forward, "
             f"backward{', recompute' if cfg.model.gradient_checkpointing else ''}"
             f"{', old log-probs' if time.old_logprobs else ''}) at {links.nvlink_gbps:g} GB/s NVLink, "
             f"{links.network_gbps:g} GB/s off-node"))
    rows.append(("total", time.total, "without the weight push, FSDP2 and Ulysses communication and extra "
                 "dynamic-sampling rounds"))
    return ["", f"step time, modelled (assumed: mean response {work.mean_response} tokens, uniform on [0, 2 "
                "x mean], "
                f"longest {rc.max_response_length}; mean prompt {work.mean_prompt}; MFU {work.mfu:.0%} of "
                f"{gpu.bf16_tflops:g} TFLOP/s)"] + \
        [f"  {label:<52}{seconds:8.1f} s   modelled: {basis}" for label, seconds, basis in rows]


__all__ = ["PlanInputs", "render"]
