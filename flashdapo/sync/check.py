"""The push check: after every weight push, the engine's log-probs of fixed tokens against the trainer's, so
that a run whose engine does not hold the policy stops at the push, not after steps of off-policy data.

`PushCheck` is the engine's `verify_push` (vLLM's; split placement's rollout side runs it on its own copy
too): the engine's log-probs of fixed tokens (`PROBE_SEQUENCES` sequences of `PROBE_LENGTH` tokens drawn once
from the tokenizer's ids, never the vocabulary's untrained padding, the same on every rank) against the
trainer's, both at temperature 1 from fp32 logits. Beyond the tolerance the run stops with one line naming the
parameter groups where the two forwards part, where the engine can record its groups' outputs
(`group_outputs`: vLLM's, sync/vllm.py): a stale or unloaded head, a layer left out of the push. Its cost (one
scoring request and one trainer forward over the probe) is logged with the first two pushes.

The push check's tolerance. fp32 weights: max |delta logp| <= 1e-3 (the two fp32 forwards agree to ~1e-6).
bf16 (fp16) weights: the two sides are two bf16 computations on the same weights, each off the exact result
by its own rounding, an error that grows with the model's width, depth and the tokens' positions (vLLM vs
HF differences of 0.1-0.3 on single tokens are reported for Qwen models, vllm#18352), so no fixed number
fits every model. The check measures it instead (`calibrate`, at the process's first bf16 push): the
trainer's log-probs of the probe in fp32 arithmetic on the same bf16-rounded weights (`reference_logprobs`:
the model's own forward, every family's details its own, one parameter group at a time from the full
tensors as the push streams them), and the trainer's own bf16 error against that, mean and max over the
probe. A correct push leaves vLLM about as far from the trainer as the trainer is from the exact result
(two independent errors of that size: ~1.4x; the two correlate, measured 1.1-1.2x); weights that are
wrong add their own error. The push passes when

    mean |logp_vllm - logp_trainer| <= MEAN_FACTOR x mean error + MEAN_FLOOR
    max  |logp_vllm - logp_trainer| <= MAX_FACTOR x max error + MAX_FLOOR

over the probe's tokens (the mean decides; the max, looser, catches damage confined to a few tokens).
Measured on CPU with vLLM's CPU build (docs/vllm.md, "The push check's tolerance"; Qwen2, Qwen3, Llama,
Mistral configs of hidden 512-1024): a correct push sits at 1.07-1.22x the trainer's mean error, a decoder
layer scaled by 1.01 at 2.39-2.92x, a layer holding another init at 106-142x, a stale tied head (HF double)
at 177-189x; one weight matrix off by 1% moves log-probs less than bf16 arithmetic does, and no log-prob
check that tolerates bf16 sees it.

LoRA (a policy carrying adapters, models/lora.py; the engine holds the base it loaded and the adapters it was
pushed, sync/vllm.py `push_adapters`): the engine scores the probe with the adapters (vLLM: its LoRA request)
and the trainer's reference is the adapted policy (its own forward; the calibration's fp32 reference runs the
plain model on base + alpha/r B A merged in fp32 from the base and adapters rounded to the engine's dtype).
A log-prob check cannot see an adapter whose last update moved log-probs less than its tolerance (B starts at
zero and moves by about the learning rate a step), so the check also compares a digest of the adapters the
engine was given at its last push (`adapter_digest`) with the trainer's current ones: a push that did not
reach the engine, or an engine woken on older adapters, fails whatever the size of the update.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..distributed.collectives import all_reduce
from ..errors import FlashdapoError
from ..models.hf import final_logit_softcap, group_modules
from ..models.lora import layout_of, merged_stream, peft_name, trained
from ..models.weights import hf_name, iter_full_state_dict

__all__ = [
    "MAX_FACTOR", "MAX_FLOOR", "MEAN_FACTOR", "MEAN_FLOOR", "PROBE_LENGTH", "PROBE_SEQUENCES",
    "PUSH_TOLERANCE", "Calibration", "PushCheck", "PushMismatchError", "adapter_digest", "probe_sequences",
    "reference_logprobs", "stream_of", "trainer_adapters"
]

PROBE_SEQUENCES, PROBE_LENGTH = 8, 32
"""The probe: 8 x 31 = 248 scored tokens, enough for a mean |delta logp| steady to a few percent; each
sequence, plus the one token vLLM samples after it, must fit max_model_len (data.max_prompt_length +
rollout.max_response_length >= 33)."""
PUSH_TOLERANCE = {torch.float32: 1e-3}
"""Largest |logp_engine - logp_trainer| over the probe a correct push shows when both compute in fp32
(measured on the toy: ~5e-7). Low-precision weights are checked against a measured tolerance (below)."""
MEAN_FACTOR, MAX_FACTOR = 2.0, 3.0
"""Multiples of the trainer's own bf16 error on the probe (mean, max) a push may show (module docstring)."""
MEAN_FLOOR = {torch.bfloat16: 5e-4, torch.float16: 1e-4}
MAX_FLOOR = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
"""Added to the measured tolerances: an error measured near 0 must not make the check fail on noise."""


def engine_name(engine: Any) -> str:
    """How messages name an engine: its `display_name` ('vLLM'), else its class name."""
    return getattr(engine, "display_name", type(engine).__name__)


class PushMismatchError(FlashdapoError):
    """The engine's log-probs after a weight push differ from the trainer's beyond the tolerance."""


def adapter_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of a stream of adapter tensors (names, dtypes, shapes and bytes, in stream order), read to its
    end: what an engine was given at its last push, and the trainer's current adapters, compared exactly."""
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def trainer_adapters(hf: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's adapters (and trained norms) as full fp32 tensors under their PEFT names
    (sync.WeightSource.adapters: the stream a LoRA push takes), every rank together."""
    for name, tensor in iter_full_state_dict(hf, only=trained(hf)):
        yield peft_name(name), tensor


def _merged_reference(hf: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]] | None:
    """An adapted policy's tensors as the plain model's, for the fp32 reference: each tensor rounded to
    `dtype` (what the engine holds: the base, and the adapters in vLLM's lora_dtype, the model's), then fp32;
    each adapted weight merged (W + alpha/r B A) in fp32, unrounded. None for a policy trained whole."""
    layout = layout_of(hf)
    if layout is None:
        return None

    def rounded() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_full_state_dict(hf):
            if tensor.is_floating_point():
                tensor = (tensor.to(dtype) if dtype is not None else tensor).float()
            yield name, tensor

    return merged_stream(rounded(), layout)


def probe_sequences(tokens: int) -> list[list[int]]:
    """The probe: PROBE_SEQUENCES sequences of PROBE_LENGTH ids below `tokens`, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, tokens, (PROBE_SEQUENCES, PROBE_LENGTH), generator=gen).tolist()


@dataclass(frozen=True)
class Calibration:
    """The trainer's own low-precision error on the probe (against fp32 arithmetic on the same weights), and
    the tolerances it gives (module docstring)."""

    dtype: torch.dtype
    mean: float
    max: float

    @property
    def mean_limit(self) -> float:
        return MEAN_FACTOR * self.mean + MEAN_FLOOR.get(self.dtype, MEAN_FLOOR[torch.bfloat16])

    @property
    def max_limit(self) -> float:
        return MAX_FACTOR * self.max + MAX_FLOOR.get(self.dtype, MAX_FLOOR[torch.bfloat16])

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.mean_limit:.3g} mean / {self.max_limit:.3g} max: {MEAN_FACTOR:g} / {MAX_FACTOR:g} x the "
            f"trainer's own {name} error on these tokens against fp32 arithmetic ({self.mean:.3g} mean, "
            f"{self.max:.3g} max)")


def _hf_class(hf: nn.Module) -> type:
    """The transformers class of `hf` (FSDP2's fully_shard swaps in a dynamic `FSDP<class>` subclass)."""
    return next(cls for cls in type(hf).__mro__ if not issubclass(cls, FSDPModule))


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule holding the parameter or buffer `name` of `module`, and its name there."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _reference_groups(inner: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each parameter group of an HF base model: each child holding parameters, a
    ModuleList's (the decoder layers') entries one by one, in module order."""
    groups: list[tuple[str, nn.Module]] = []
    for child_name, child in inner.named_children():
        parts = [(f"{child_name}.{i}", m) for i, m in enumerate(child)] if isinstance(child, nn.ModuleList) \
            else [(child_name, child)]
        groups += [(name, m) for name, m in parts if next(m.parameters(), None) is not None]
    return groups


def _release(module: nn.Module, _args: Any, _output: Any) -> None:
    """Forward hook: the group's fp32 tensors freed once its forward has run (None keeps its output)."""
    module.to("meta")


class _GroupStream:
    """The push's stream of full tensors, handed out one parameter group at a time as the forward asks for
    them. A group the stream reaches later than the forward needs it is read ahead (the tensors passed on the
    way are held until asked for); names it does not expect (persistent buffers: the live model gives those)
    are passed over; `drain` reads the rest, so that every rank consumes the whole stream (FSDP2 gathers)."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]], expected: dict[str, str]):
        self.stream, self.expected = stream, expected  # full name -> group
        self.missing = collections.Counter(expected.values())
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, group: str) -> dict[str, torch.Tensor]:
        """The full tensors of `group` (by full name), reading the stream as far as needed."""
        while self.missing[group]:
            try:
                name, tensor = next(self.stream)
            except StopIteration:
                absent = [
                    n for n, g in self.expected.items() if g == group and n not in self.held.get(group, {})
                ]
                raise RuntimeError(
                    f"the push check's fp32 reference: the weight stream ended without {absent[:3]} "
                    f"(parameter group {group!r})") from None
            owner = self.expected.get(name)
            if owner is not None and name not in self.held.get(owner, {}):
                self.held.setdefault(owner, {})[name] = tensor.detach()
                self.missing[owner] -= 1
        return self.held.pop(group, {})

    def drain(self) -> None:
        """Read the stream to its end."""
        for _ in self.stream:
            pass


class _StreamedModel:
    """The policy's base model (its own class and forward; eager attention and experts) built on the meta
    device, each parameter group given its full tensors in fp32 on `device` by a forward pre-hook and released
    to meta by a forward hook (`reference_logprobs`)."""

    def __init__(self, hf: nn.Module, device: torch.device, weight_dtype: torch.dtype | None,
                 tensors: Iterator[tuple[str, torch.Tensor]] | None):
        self.hf, self.device, self.weight_dtype = hf, device, weight_dtype
        config = copy.deepcopy(hf.config)
        config._attn_implementation = "eager"
        if hasattr(config, "_experts_implementation"):
            # the experts' plain loop: grouped kernels may refuse fp32
            config._experts_implementation = "eager"
        self.config = config
        with torch.device("meta"):
            skeleton = _hf_class(hf)(config)
        self.base = skeleton.base_model_prefix
        self.inner = skeleton.get_submodule(self.base)
        self.groups = _reference_groups(self.inner)
        names = [name for name, _ in skeleton.named_parameters()]  # the stream's order (tied parameters once)
        expected = {name: name.split(".")[0] for name in names if not name.startswith(f"{self.base}.")}
        self.head_group = next(iter(expected.values()), None)  # "lm_head"; None: tied to the input embedding
        for group, module in self.groups:
            expected |= {f"{self.base}.{group}.{name}": group for name, _ in module.named_parameters()}
        if len(expected) != len(names):
            stray = sorted(set(names) - set(expected))
            raise RuntimeError(f"the push check's fp32 reference: {type(skeleton).__name__}'s parameters "
                               f"{stray[:3]} belong to no parameter group")
        embedding = skeleton.get_input_embeddings()
        self.tied_group = next(
            (g for g, m in self.groups if m is embedding), None) if self.head_group is None else None
        self.early = self._early_groups(names, expected) if tensors is None else {}
        expected = {name: group for name, group in expected.items() if group not in self.early}
        self.source = _GroupStream(iter(tensors if tensors is not None else
                                        iter_full_state_dict(hf, dtype=weight_dtype)), expected)
        self.live_buffers = {hf_name(name): buffer for name, buffer in hf.named_buffers()}
        self.tied_head: torch.Tensor | None = None
        in_groups = tuple(f"{group}." for group, _ in self.groups)
        # buffers outside every group: rotary embeddings
        for module_name, module in self.inner.named_modules():
            if not f"{module_name}.".startswith(in_groups):
                self._give_buffers(module, module_name, recurse=False)
        for group, module in self.groups:
            module.register_forward_pre_hook(lambda m, _args, group=group: self._materialise(group, m))
            module.register_forward_hook(_release)

    def _early_groups(self, names: list[str], expected: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
        """The full tensors of the root-level groups (not the final norm) the stream reaches after the first
        decoder layer, which the forward runs before the layers (Gemma 4's per-layer inputs), gathered from
        the live model now (every rank does, in the same order)."""
        first: dict[str, int] = {}
        for position, name in enumerate(names):
            first.setdefault(expected[name], position)
        first_layer = min((first[g] for g, _ in self.groups if "." in g), default=len(names))
        early = {}
        for group, module in self.groups:
            if "." not in group and module is not getattr(self.inner, "norm",
                                                          None) and first[group] > first_layer:
                live = self.hf.get_submodule(f"{self.base}.{group}")
                early[group] = {f"{self.base}.{group}.{name}": tensor
                                for name, tensor in iter_full_state_dict(live, dtype=self.weight_dtype)}
        return early

    def _give_buffers(self, module: nn.Module, module_name: str, recurse: bool = True) -> None:
        """`module`'s buffers from the live model's (persistent ones rounded as the stream rounds them)."""
        for name, _ in list(module.named_buffers(recurse=recurse)):
            owner, leaf = _owner(module, name)
            full = f"{self.base}.{module_name}.{name}" if module_name else f"{self.base}.{name}"
            if full not in self.live_buffers:
                raise RuntimeError(
                    f"the push check's fp32 reference: {type(self.hf).__name__} has no buffer {full!r}")
            value = self.live_buffers[full]
            if leaf not in owner._non_persistent_buffers_set and value.is_floating_point(
            ) and self.weight_dtype:
                value = value.to(self.weight_dtype).float()
            owner._buffers[leaf] = value.to(self.device, copy=True)  # a dynamic RoPE rewrites its own

    def _materialise(self, group: str, module: nn.Module) -> None:
        """Forward pre-hook: `group`'s full tensors, fp32 on the device, into its meta module."""
        full = self.early.pop(group, None) or self.source.take(group)
        if not full:
            raise RuntimeError(
                f"the push check's fp32 reference: {_hf_class(self.hf).__name__}'s forward ran "
                f"parameter group {group!r} twice (its weights are released after its first run)")
        if group == self.tied_group:
            self.tied_head = full[f"{self.base}.{group}.weight"]  # the head's rows, as streamed
        for name, _ in list(module.named_parameters()):
            owner, leaf = _owner(module, name)
            value = full[f"{self.base}.{group}.{name}"].to(device=self.device, dtype=torch.float32)
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        self._give_buffers(module, group)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """The base model's last hidden states of `ids` [count, length] (its masks from an all-ones mask)."""
        out = self.inner(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return out[0].float()

    def head(self) -> dict[str, torch.Tensor]:
        """The LM head's tensors ('weight', maybe 'bias'), as streamed; the rest of the stream read."""
        if self.head_group is None:
            head = {"weight": self.tied_head} if self.tied_head is not None else {}
        else:
            head = {
                name.removeprefix(f"{self.head_group}."): t
                for name, t in self.source.take(self.head_group).items()
            }
        self.source.drain()
        if "weight" not in head:
            raise RuntimeError(f"the push check's fp32 reference found no LM head among "
                               f"{type(self.hf).__name__}'s tensors")
        return head


@torch.no_grad()
def reference_logprobs(hf: Any, sequences: list[list[int]], device: torch.device,
                       weight_dtype: torch.dtype | None,
                       tensors: Iterator[tuple[str, torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """log pi(token t | tokens < t) for t >= 1 of each sequence (all of one length), temperature 1, in fp32
    arithmetic on the policy's weights rounded to `weight_dtype` (what the engine holds).

    It runs the model's own forward (its class's base model, so that every family's embedding scale,
    per-layer-type RoPE and masks, attention caps and sinks, per-layer inputs, linear-attention and MoE layers
    are its own; eager attention and experts, the masks built from an all-ones attention mask) on a copy
    built on the meta device: each parameter group (the embedding, each decoder layer, the final norm, any
    other root-level module such as Gemma 4's per-layer input embedding) gets its full tensors from
    `iter_full_state_dict(hf, weight_dtype)` (or `tensors`), in fp32 on `device`, just before its forward and
    is released to meta right after it, so that memory holds one group at a time. A root-level group the
    stream reaches after the decoder layers although the forward runs it before them (Gemma 4's per-layer
    inputs) is gathered from the live model up front (from `tensors`: read ahead). Buffers come from the live
    model: RoPE frequencies and embedding scales as they are, persistent ones (Gemma 4's layer scalars,
    DeepSeek-V3's routing bias) rounded to `weight_dtype` as the stream rounds them. Then the head (lm_head or
    the tied embedding, in row blocks), the config's final-logit cap (`final_logit_softcap`) and the
    log-softmax, in fp32. Under FSDP2 every rank must call it together (the tensors are all-gathered)."""
    model = _StreamedModel(hf, device, weight_dtype, tensors)
    ids = torch.tensor(sequences, dtype=torch.long, device=device)
    count, length = ids.shape
    hidden = model.hidden_states(ids)[:, :-1].reshape(count * (length - 1), -1)
    head = model.head()
    logits = torch.cat(
        [hidden @ rows.to(device=device, dtype=torch.float32).T for rows in head["weight"].split(16384)], -1)
    if "bias" in head:
        logits = logits + head["bias"].to(device=device, dtype=torch.float32)
    cap = final_logit_softcap(model.config)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].reshape(-1, 1)).squeeze(1)
    return list(logp.float().cpu().split(length - 1))


def stream_of(name: str, output: Any) -> torch.Tensor:
    """The residual stream (or the normed / embedded states) a group's module returned, as [tokens, hidden]:
    a decoder layer of vLLM returns (hidden, residual) with the residual add deferred to the next layer's
    fused norm, so its stream is their sum, as HF's layer output is; other tuples hold the states first."""
    if isinstance(output, (tuple, list)):
        if name.startswith("layers.") and len(output) > 1 and isinstance(output[1], torch.Tensor):
            output = output[0] + output[1]
        else:
            output = output[0]
    return output.detach().float().reshape(-1, output.shape[-1]).cpu()


def _experts_note(config: Any) -> str:
    """For a mixture-of-experts model, how its experts show in the localisation (each one is compared only
    through its decoder layer's output, as the tokens routed to it shape that output)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not experts:
        return ""
    return (f" (a MoE layer's output holds its router and its {experts} experts: a wrong expert shows as its "
            "layer, where the probe's tokens are routed to it)")


class PushCheck:
    """`verify_push` for an engine holding its own copy of the weights: after each push, its log-probs of the
    fixed probe tokens (`engine.score`) against the policy's (every rank together: the policy forward may
    gather FSDP2 shards). Where an engine can also record its parameter groups' outputs
    (`engine.group_outputs`), a failed check names the groups where the two forwards part."""

    def __init__(self, policy: Any, device: torch.device, vocab_size: int, log=print, *,
                 tokenizer_size: int | None = None):
        """`vocab_size`: the model's rows; `tokenizer_size`: len(tokenizer), the ids the probe draws from
        (the rows past it are padding, never trained: their log-probs mean nothing); the smaller of the
        two."""
        tokens = vocab_size if tokenizer_size is None else min(vocab_size, tokenizer_size)
        self.probe = probe_sequences(tokens)
        self.policy, self.device, self.log = policy, device, log
        self.pushes, self.last_s, self.last_max, self.last_mean = 0, 0.0, 0.0, 0.0
        self.calibration: Calibration | None = None

    @torch.no_grad()
    def trainer_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """log pi(token t | tokens < t) for t >= 1 of each sequence, temperature 1, from the policy."""
        policy, temperature = self.policy, self.policy.temperature
        seqs = [torch.tensor(s, dtype=torch.long) for s in sequences]
        policy.temperature = 1.0  # the engine's prompt log-probs come from raw logits
        try:
            batch = policy.token_batch([s[:1] for s in seqs], [s[1:] for s in seqs], self.device)
            logp, _ = policy(batch)
        finally:
            policy.temperature = temperature
            if hasattr(policy, "reshard"):  # FSDP2 keeps the root unsharded after a forward without backward
                policy.reshard()
        return list(logp.float().cpu().split(batch.token_counts))

    def calibrate(self, dtype: torch.dtype | None, trainer: torch.Tensor,
                  engine: torch.Tensor) -> Calibration:
        """The trainer's error on the probe against fp32 arithmetic on the `dtype` weights (every rank
        together); logs it with the engine's own error against the same reference."""
        start = time.perf_counter()
        reference = torch.cat(reference_logprobs(self.policy.hf, self.probe, self.device, dtype,
                                                 _merged_reference(self.policy.hf, dtype)))
        mine, theirs = (trainer - reference).abs(), (engine - reference).abs()
        stats = all_reduce(torch.tensor([mine.mean().item(), mine.max().item(), theirs.mean().item(),
                                         theirs.max().item()], dtype=torch.float64), "max").tolist()
        calibration = Calibration(dtype or torch.bfloat16, stats[0], stats[1])
        self.log(
            f"push check calibrated on {mine.numel()} fixed tokens against fp32 arithmetic on the pushed "
            f"weights: the trainer's log-probs are off by {stats[0]:.3g} mean ({stats[1]:.3g} max), the "
            "engine's by "
            f"{stats[2]:.3g} mean ({stats[3]:.3g} max); tolerance for the engine vs the trainer "
            f"{calibration.describe()} (took {time.perf_counter() - start:.2f} s)")
        return calibration

    def __call__(self, engine: Any) -> None:
        start = time.perf_counter()
        engine_logp = torch.cat(engine.score(self.probe))
        trainer_logp = torch.cat(self.trainer_logprobs(self.probe))
        dtype = engine.weight_dtype
        low_precision = dtype != torch.float32
        if low_precision and self.calibration is None:
            self.calibration = self.calibrate(dtype, trainer_logp, engine_logp)
        diff = (engine_logp - trainer_logp).abs()
        stale = self._stale_adapters(engine)
        stats = all_reduce(torch.tensor([diff.max().item(), diff.mean().item(), float(stale is not None)],
                                        dtype=torch.float64), "max")
        worst, mean, any_stale = stats.tolist()
        self.pushes += 1
        self.last_s, self.last_max, self.last_mean = time.perf_counter() - start, worst, mean
        if low_precision:
            assert self.calibration is not None
            calibration = self.calibration
            passed = mean <= calibration.mean_limit and worst <= calibration.max_limit
            tolerance = f"{calibration.mean_limit:.3g} mean / {calibration.max_limit:.3g} max"
            why = calibration.describe()
        else:
            passed, tolerance = worst <= PUSH_TOLERANCE[
                torch.float32], f"{PUSH_TOLERANCE[torch.float32]:g} max"
            why = tolerance
        if any_stale:  # on any rank: every rank raises
            raise PushMismatchError(
                f"after weight push {self.pushes} {engine_name(engine)} holds other LoRA adapters than the "
                f"trainer's: {stale or 'so does another rank'} (its log-probs of {diff.numel()} fixed tokens "
                f"differ from the trainer's by {mean:.3g} mean, {worst:.3g} max). The adapters' push did not "
                "reach the engine: see docs/lora.md")
        if not passed:  # also NaN
            raise PushMismatchError(
                f"after weight push {self.pushes} {engine_name(engine)}'s log-probs of {diff.numel()} fixed "
                "tokens differ from "
                f"the trainer's by {mean:.3g} mean ({worst:.3g} max), beyond {why} for "
                f"{str(dtype).removeprefix('torch.')} weights; {self.localize(engine)}. The push "
                "left weights stale or unloaded (or the engine computes differently): see docs/vllm.md")
        if self.pushes <= 2:  # the first includes one-time costs (vLLM compiles its log-prob gather)
            self.log(
                f"weight push {self.pushes} checked: max |logp_vllm - logp_trainer| {worst:.2g}, mean "
                f"{mean:.2g} "
                f"over {diff.numel()} fixed tokens (tolerance {tolerance}); the check took {self.last_s:.3f} "
                "s"
            )

    def _stale_adapters(self, engine: Any) -> str | None:
        """For a policy with adapters and an engine that reports the digest of the adapters it was given
        (`adapter_digest`; vLLM's with LoRA), why it does not hold the trainer's current ones (None: it does,
        or there is nothing to compare). Every rank together (the adapters are all-gathered)."""
        if layout_of(self.policy.hf) is None or not hasattr(engine, "adapter_digest"):
            return None
        theirs = engine.adapter_digest
        mine = adapter_digest(trainer_adapters(self.policy.hf))
        if theirs is None:
            return "it was given none"
        if theirs != mine:
            return (f"the digest of those it was given at its last push ({theirs[:12]}) is not that of the "
                    f"trainer's current ones ({mine[:12]})")
        return None

    @torch.no_grad()
    def localize(self, engine: Any) -> str:
        """'parameter groups that differ most: ...' from both forwards over the first probe sequence."""
        sequence = self.probe[0]
        record = getattr(engine, "group_outputs", None)  # optional: an engine that cannot record has None
        if record is None:
            return f"{engine_name(engine)} records no parameter group's output, so the groups are not named"
        theirs = record(sequence, self.policy.config.model_type)
        mine: dict[str, torch.Tensor] = {}
        groups = group_modules(self.policy.hf, self.policy.config.model_type)
        handles = [module.register_forward_hook(lambda _m, _i, out, name=name: mine.__setitem__(
            name, stream_of(name, out))) for name, module in groups]
        try:
            engine_logp = engine.score([sequence])[0]
            trainer_logp = self.trainer_logprobs([sequence])[0]
        finally:
            for handle in handles:
                handle.remove()
        if not theirs:
            return (
                f"{engine_name(engine)}'s layer outputs could not be recorded (a compiled or graph-captured "
                "forward)")
        errors, previous = [], 0.0
        for name, _ in groups:
            if name not in theirs or name not in mine:
                continue
            ref, got = mine[name], theirs[name][: len(mine[name])]
            error = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            errors.append((error - previous, name, error))
            previous = max(previous, error)
        head = (engine_logp - trainer_logp).abs().max().item()
        errors.append((head if previous < 1e-2 else 0.0, "lm_head", head))
        worst = sorted(errors, reverse=True)[:3]
        named = ", ".join(f"{name} ({max(added, 0.0):.2g})" for added, name, _ in worst)
        return ("parameter groups that differ most (the relative error their output adds; the head: max "
                f"|delta logp|): {named}{_experts_note(self.policy.config)}")
