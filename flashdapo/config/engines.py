"""What each rollout engine is, stated once: every caller asks its spec, never its name.

The engines themselves live in rollout/ (rollout.build_engine builds one); this table is data only, so that
the config's checks, the algorithm's defaults, `flashdapo plan` and the start-up checks can read it without
importing an engine (vLLM's import alone takes seconds and needs vLLM installed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """The facts about one rollout engine that code outside rollout/ depends on."""

    name: str
    off_policy: bool
    """Its sampling distribution is computed by other kernels than the trainer's forward (bf16 drift, another
    attention): the trained tokens are slightly off the trainer's policy, so algorithm.rollout_correction=auto
    turns the truncated correction on and the push check compares the two."""
    own_weights: bool
    """It holds its own copy of the weights (pushed after every update; `flashdapo plan` counts its memory and
    KV cache). False: it samples from the policy module itself."""
    needs_checkpoint: bool
    """It loads the model from model.path (it cannot sample the in-memory toy model)."""
    tensor_parallel: bool
    """rollout.tensor_parallel_size applies (an engine spans that many ranks)."""
    package: str | None
    """The Python package it needs installed (None: torch alone)."""
    temperature_range: tuple[float, float] | None
    """The sampling temperatures it accepts (None: any positive one)."""
    prompts_per_call: int
    """eval / generate: prompts per generate call by default (an engine that batches well takes many)."""
    refuses_long_context: bool
    """It refuses a context longer than the model's max_position_embeddings (the torch engine samples on)."""
    model_registry: str | None = None
    """`module:attribute` of the registry of model architectures it builds (config.json `architectures`),
    imported only when this engine is asked for: preflight refuses an architecture outside it before the
    engine starts. None: any architecture flashdapo trains."""
    records_routes: bool = False
    """It can record the experts it routed every token to (algorithm.routing_replay=r3) in `generate`."""
    streams_routes: bool = False
    """It can also record them in a stream (rollout.streaming)."""
    uniform_window_architectures: tuple[str, ...] = ()
    """Architectures it builds with one attention kind for every layer: a config whose layer_types mix sliding
    and full attention is refused at start-up (rollout/engine_models.py check_layer_windows states the
    engine's condition)."""


ENGINES: dict[str, EngineSpec] = {
    "torch": EngineSpec("torch", off_policy=False, own_weights=False, needs_checkpoint=False,
                        tensor_parallel=False, package=None, temperature_range=None, prompts_per_call=1,
                        refuses_long_context=False, records_routes=True, streams_routes=True),
    # vLLM 0.33's SamplingParams (sampling_params.py `_verify_args`, `__post_init__`) rejects temperatures
    # above 2 and raises those below 0.01 to 0.01, where the trainer would still divide by the smaller value.
    "vllm": EngineSpec(
        "vllm",
        off_policy=True,
        own_weights=True,
        needs_checkpoint=True,
        tensor_parallel=True,
        package="vllm",
        temperature_range=(0.01, 2.0),
        prompts_per_call=64,
        refuses_long_context=True,
        records_routes=True,
        model_registry="vllm.model_executor.models.registry:ModelRegistry",
        # vLLM 0.32's Qwen2Model (model_executor/models/qwen2.py), which Qwen3Model extends,
        # asserts max_window_layers == num_hidden_layers whenever layer_types holds more than
        # one kind.
        uniform_window_architectures=("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2Model", "Qwen3Model")),
}
"""Every engine rollout.engine may name (config/sampling.py's Literal lists the same keys; a test checks)."""


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine `name` (a KeyError names the known ones)."""
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINES)}") from None


__all__ = ["ENGINES", "EngineSpec", "engine_spec"]
