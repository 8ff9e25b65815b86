"""The expert-parallel combine (flashdapo/models/moe/expert_parallel.py `combine`) adds each token's k expert
outputs without atomics (no index_add / scatter_add, which are atomic and so nondeterministic on CUDA): the
dispatch on a one-rank gloo group gives the same bits on two runs and HF's experts module's float64 output
to fp32 rounding, "no expert" slots included. EP = 2 against EP = 1: tests/models/moe/test_expert_parallel.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from flashdapo.models.moe.expert_parallel import combine, shard_experts
from tests.helpers.moe import tiny_moe_config


@pytest.fixture
def one_rank():
    """A one-rank gloo group (the test's own; none may be up already)."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def _refuse(*_args, **_kwargs):
    raise AssertionError("an atomic accumulation (index_add / scatter_add) in the expert combine")


ATOMIC = [(torch.Tensor, name) for name in ("index_add", "index_add_", "scatter_add", "scatter_add_")] + \
    [(torch, "index_add"), (torch, "scatter_add")]


def test_the_combine_is_deterministic_without_atomics_and_equals_float64(one_rank, monkeypatch):
    torch.manual_seed(0)
    reference = Qwen3MoeExperts(tiny_moe_config()).double()  # 4 experts, hidden 16
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(37)])
    index[3, 1] = index[10, 0] = 4  # HF's "no expert": adds nothing
    weights = torch.rand(37, 2, dtype=torch.float64, generator=g)
    expected = reference(hidden, index, weights)  # HF's own loop: index_add_ (outside the patch below)

    sharded = Qwen3MoeExperts(tiny_moe_config()).float()
    sharded.load_state_dict(reference.float().state_dict())
    shard_experts(sharded, one_rank)
    for owner, name in ATOMIC:
        monkeypatch.setattr(owner, name, _refuse)
    runs = []
    for _ in range(2):
        x, w = hidden.float().requires_grad_(), weights.float().requires_grad_()
        out = sharded(x, index, w)
        out.square().sum().backward()
        runs.append((out.detach(), x.grad, w.grad))
    monkeypatch.undo()
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    torch.testing.assert_close(runs[0][0].double(), expected, rtol=1e-5, atol=1e-5)


def test_combine_sums_each_tokens_slots_in_pair_order():
    g = torch.Generator().manual_seed(2)
    flat = torch.tensor([2, 0, 4, 1, 0, 3])  # 3 tokens x k = 2; 4: no expert
    order = torch.argsort(flat, stable=True)
    weights = torch.rand(3, 2, dtype=torch.float64, generator=g)
    outputs = torch.randn(6, 5, dtype=torch.float64, generator=g)  # per pair, in pair order
    returned = outputs.index_select(0, order[:5])  # what comes back: sorted by expert, "no expert" not sent
    got = combine(returned, weights, order, 5)
    used = (flat != 4).double().view(3, 2, 1)
    expected = (outputs.view(3, 2, 5) * weights[..., None] * used).sum(1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    empty = combine(torch.zeros(0, 5), torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 0)
    assert empty.shape == (0, 5)


def test_a_rank_without_tokens_runs_the_exchange(one_rank):
    experts = Qwen3MoeExperts(tiny_moe_config())
    shard_experts(experts, one_rank)
    hidden = torch.zeros(0, 16, requires_grad=True)
    out = experts(hidden, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 16) and experts.gate_up_proj.grad is not None


def test_the_exchange_is_an_autograd_function_around_all_to_all_single(one_rank, monkeypatch):
    """Not torch's functional all_to_all_single_autograd (its memory grew step on step under activation
    checkpointing in torchtitan, #1467); forward and backward through non-reentrant checkpointing equal the
    plain ones bit for bit. EP = 2 against EP = 1, with gradient checkpointing on: test_expert_parallel.py."""
    import torch.distributed._functional_collectives as functional
    from torch.utils.checkpoint import checkpoint

    from flashdapo.models.moe import expert_parallel

    monkeypatch.setattr(functional, "all_to_all_single_autograd", _refuse)
    monkeypatch.setattr(expert_parallel, "all_to_all_single_autograd", _refuse, raising=False)
    torch.manual_seed(3)
    experts = Qwen3MoeExperts(tiny_moe_config()).double()
    with torch.no_grad():
        for p in experts.parameters():  # the module alone leaves them uninitialised
            p.normal_(0, 0.3)
    shard_experts(experts, one_rank)
    g = torch.Generator().manual_seed(4)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, dtype=torch.float64, generator=g)
    results = []
    for checkpointed in (False, True):
        hidden = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5),
                             requires_grad=True)
        out = checkpoint(experts, hidden, index, weights, use_reentrant=False) if checkpointed else \
            experts(hidden, index, weights)
        out.square().sum().backward()
        results.append((out.detach(), hidden.grad, experts.gate_up_proj.grad.to_local().clone()))
        experts.zero_grad()
    for plain, checkpointed in zip(*results):
        assert plain.isfinite().all() and plain.abs().sum() > 0
        assert torch.equal(plain, checkpointed)
