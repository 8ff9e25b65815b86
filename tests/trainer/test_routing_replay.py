"""Routing replay end to end on one process (trainer/update.py with models/moe/replay.py): a tiny Qwen3-MoE whose
routers are near ties, sampled by the torch engine from a stale copy of the weights (every weight 1e-3 off, as
split placement's lag leaves the rollout side), so that engine and trainer route some tokens differently. With
r3 every trained position's experts, in the old log-probs' pass and in the update's forwards, are the engine's
(checked by a hook after the replay's on every router), `moe/route_agreement` counts the trainer's own choices
that agreed, and the trainer's log-probs are closer to the engine's than without (measured here, both layouts
alike: mean |delta log-prob| 7.2e-3 with r3 against 9.4e-3 without, max 0.034 against 0.157; the rest is the
stale weights' own drift). Packed and padded micro-batches; an activation-checkpointed update (whose backward
recomputes the blocks) ends with the same weights as a plain one. Wall budget: 20 s."""

import copy

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from flashdapo.config import merge, toy
from flashdapo.distributed.mesh import init_distributed, shutdown
from flashdapo.models.moe import routers
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel
from flashdapo.rollout.base import SamplingParams
from flashdapo.rollout.torch_engine import TorchEngine
from flashdapo.trainer.batch import Group, build_train_batch
from flashdapo.trainer.observe.step_metrics import router_metrics
from flashdapo.trainer.update import compute_old_logprobs, update_actor
from tests.helpers.moe import one_thread, tiny_moe_config

N = 2


@pytest.fixture(scope="module")
def env():
    with one_thread():
        env = init_distributed("cpu")
        yield env
        shutdown()


@pytest.fixture(scope="module")
def sampled():
    """(trainer's weights, groups the engine sampled from its stale copy, with records and log-probs)."""
    torch.manual_seed(0)
    trainer = Qwen3MoeForCausalLM(tiny_moe_config(initializer_range=0.2)).double()
    with torch.no_grad():
        for router in routers(trainer):  # small router logits: near ties, which a small weight change flips
            router.weight.mul_(0.3)
    stale = copy.deepcopy(trainer)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-3)
    prompts = [torch.randint(3, 50, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (4,), generator=g)]
    with one_thread():
        out = TorchEngine(stale, eos_token_ids=[1], pad_token_id=0, max_batch=8, record_routes=True).generate(
            prompts, SamplingParams(n=N, max_new_tokens=10, seed=3))
    groups = []
    for p in range(len(prompts)):
        idx = (out.group_ids == p).nonzero().flatten().tolist()
        groups.append(Group(out.prompt_ids[idx[0]], [out.response_ids[i] for i in idx], torch.tensor([1.0, -1.0]),
                            torch.tensor([True, False]), torch.zeros(N, dtype=torch.bool),
                            sampler_logprobs=[out.logprobs[i] for i in idx], routes=[out.routes[i] for i in idx],
                            origin=(0, 0, p)))
    return trainer, groups


def _cfg(layout: str):
    return merge(toy(), {"rollout": {"n": N},
                         "trainer": {"train_batch": 4, "gen_batch": 4, "mini_batch": 2, "ppo_epochs": 1,
                                     "micro_batch_tokens": 40, "kernel_impl": "torch",
                                     "pack_sequences": layout == "packed"},
                         "optim": {"lr": 1e-3, "warmup_steps": 1}})


def _policy(trainer, env, cfg, mode: str) -> PolicyModel:
    return parallelize(PolicyModel(copy.deepcopy(trainer), "sdpa", "torch", 1.0), env, cfg.model,
                       cfg.trainer).with_route_replay(mode)


class RouteCheck:
    """After the replay's hook on every router: the experts it hands on equal the loaded record wherever one
    exists; counts the positions checked."""

    def __init__(self, policy: PolicyModel):
        self.policy, self.checked, self.differ = policy, 0, 0
        for layer, router in enumerate(routers(policy.hf)):
            router.register_forward_hook(lambda _m, _i, out, layer=layer: self.check(layer, out[2]))

    def check(self, layer: int, indices: torch.Tensor) -> None:
        layout = self.policy.route_replay.layout
        if layout is None:
            return
        has = layout[:, layer, 0] >= 0
        recorded = layout[has, layer].to(indices.dtype)
        self.differ += int((indices[has] != recorded).any(-1).sum())
        self.checked += int(has.sum())


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_r3_trains_on_the_engines_experts_and_closes_the_logprob_gap(env, sampled, layout):
    trainer, groups = sampled
    cfg = _cfg(layout)
    engine_logp = torch.cat([lp for g in groups for lp in g.sampler_logprobs])
    gaps = {}
    for mode in ("off", "r3"):
        with one_thread():
            policy = _policy(trainer, env, cfg, mode)
            check = RouteCheck(policy) if mode == "r3" else None
            old = compute_old_logprobs(policy, groups, cfg, pad_id=0, device=env.device)
            gap = (torch.cat(old) - engine_logp).abs()
            gaps[mode] = (gap.mean().item(), gap.max().item())
            if check is not None:
                fed = sum(len(g.prompt) + len(r) - 1 for g in groups for r in g.responses)
                assert check.checked == fed * 2 and check.differ == 0  # every position, both sparse layers
                batch = build_train_batch([groups[:2], groups[2:]], old, cfg.algorithm)
                result = update_actor(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), batch, cfg, env, 0)
                assert result.taken == 2
                assert check.checked == 2 * fed * 2 and check.differ == 0  # the update's forwards too
                matched, recorded = result.route_agreement
                # counted in the old log-probs' pass and the first mini-batch (before the first optimizer step)
                first = sum(len(g.prompt) + len(r) - 1 for g in groups[:2] for r in g.responses)
                assert recorded == (fed + first) * 2 and 0 < matched < recorded
                print(f"{layout}: route agreement {matched}/{recorded}, |delta logp| (mean, max) {gaps}")
                metrics = router_metrics(result)
                assert metrics["moe/route_agreement"] == pytest.approx(matched / recorded)
                assert policy.route_replay.layout is None  # unloaded: sampling routes for itself again
    assert gaps["r3"][0] < 0.85 * gaps["off"][0] and gaps["r3"][1] < 0.5 * gaps["off"][1], gaps


def test_an_activation_checkpointed_update_replays_the_same_routes_in_its_recompute(env, sampled):
    """Backward recomputes each block's forward: the routes loaded for the micro-batch must still be the
    replayed ones then, or the gradients would come from other experts than the forward's."""
    trainer, groups = sampled
    params = {}
    for checkpointing in (False, True):
        cfg = merge(_cfg("packed"), {"model": {"gradient_checkpointing": checkpointing}})
        with one_thread():
            policy = _policy(trainer, env, cfg, "r3")
            check = RouteCheck(policy)
            old = compute_old_logprobs(policy, groups, cfg, pad_id=0, device=env.device)
            batch = build_train_batch([groups[:2], groups[2:]], old, cfg.algorithm)
            update_actor(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), batch, cfg, env, 0)
            assert check.differ == 0
            # the checkpoint wrapper renames the blocks' parameters, never their order
            params[checkpointing] = [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                                     for p in policy.parameters()]
    assert len(params[False]) == len(params[True])
    for plain, recomputed in zip(params[False], params[True]):
        assert torch.equal(plain, recomputed)
