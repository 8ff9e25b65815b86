"""MoE families in flashdapo's policy (float64): Qwen3-MoE and DeepSeek-V3 (multi-head latent attention, a
shared expert, grouped sigmoid routers) give transformers' own log-probs packed and padded; which router-loss
coefficient a run uses, and its refusal where the routers take none."""

import pytest
import torch

from flashdapo.config import ModelConfig, TrainerConfig
from flashdapo.distributed.mesh import DistEnv
from flashdapo.errors import ConfigError
from flashdapo.models.moe import (
    RouterLogits,
    is_moe,
    loss_routers,
    router_aux_coef,
    router_logits_kwargs,
    routers,
)
from flashdapo.models.packing import use_packed_attention
from flashdapo.models.parallelize import parallelize
from flashdapo.models.policy import PolicyModel, make_token_batch
from tests.helpers.moe import one_thread, tiny_deepseek, tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("build", [lambda: tiny_moe(output_router_logits=True), tiny_deepseek],
                         ids=["qwen3_moe", "deepseek_v3"])
def test_logprobs_packed_and_padded_equal_transformers_float64(build):
    """Qwen3-MoE with config.json's output_router_logits on: the policy's forwards name the switch themselves."""
    model = build()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 50, (n,), generator=g) for n in (5, 3, 9)]
    responses = [torch.randint(3, 50, (n,), generator=g) for n in (4, 7, 1)]
    reference = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]
            reference.append(torch.log_softmax(logits, -1).gather(1, r[:, None])[:, 0])
    reference = torch.cat(reference)
    for packed in (True, False):
        policy = PolicyModel(model, "sdpa", "torch", 1.0)
        policy.pack = packed
        if packed:
            use_packed_attention(model)
        routing = RouterLogits()
        logp, _ = policy(make_token_batch(prompts, responses, torch.device("cpu"), packed), routing=routing)
        assert len(routing.layers) == len(routers(model)) and routing.layers[0].shape[-1] == 4
        torch.testing.assert_close(logp.double(), reference, rtol=0, atol=1e-12)


def test_the_coefficient_the_override_then_the_model_configs_switch():
    on, off = tiny_moe(output_router_logits=True).config, tiny_moe().config
    assert router_aux_coef(None, on) == 0.01 and router_aux_coef(None, off) == 0.0
    assert router_aux_coef(0.0, on) == 0.0 and router_aux_coef(0.3, off) == 0.3
    dense = type("Config", (), {"model_type": "qwen3"})()
    assert not is_moe(dense) and router_aux_coef(None, dense) == 0.0 and router_aux_coef(0.0, dense) == 0.0
    with pytest.raises(ConfigError, match=r"^model.router_aux_loss_coef=0.3: qwen3 is a dense model"):
        router_aux_coef(0.3, dense)  # was accepted and ignored
    assert router_logits_kwargs(on) == {"output_router_logits": False} and router_logits_kwargs(dense) == {}


def test_deepseek_routers_take_no_router_loss_and_a_coefficient_is_refused_at_start():
    model = tiny_deepseek()
    assert len(routers(model)) == 1 and loss_routers(model) == []  # layer 0 dense; sigmoid routers: no loss
    assert router_aux_coef(None, model.config) == 0.0 and router_aux_coef(0.0, model.config) == 0.0
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)  # refused before use
    with pytest.raises(ConfigError, match=r"^model.router_aux_loss_coef=0.1: deepseek_v3's routers are not balanced "
                                          r"by a load-balancing loss"):
        parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, ModelConfig(router_aux_loss_coef=0.1),
                    TrainerConfig())
