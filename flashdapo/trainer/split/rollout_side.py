"""The rollout side of split placement (rollout.placement=split): the last R ranks generate, never train.

Each rollout rank builds the policy's structure (no warm-up, no optimizer: its weights come from the trainer
side), a torch engine over it and the prompt sampler over the rollout side's ranks, then runs the strict
schedule (docs/split.md):

    for b in start+1 .. total_steps:
        w = max(start, b - 1 - k)      the schedule's weights: θ_w, no fresher, no older
        take θ_w from the stage (waiting for the trainer's push if it is not there yet), load it, push check
        collect batch b: streaming (rollout.streaming) or rounds, dynamic sampling as co-located, its
            informative groups past train_batch kept to open batch b+1
        send batch b (rollout rank 0's sender thread)

The seeds and the sampler are the co-located run's at the same batch (derive_seed(seed, b, ...), the sampler
over the rollout side's ranks), so at k = 0 with R = 1 every batch is the one a co-located single rank
generates, bitwise; the trainer side then trains it exactly as co-located.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...config import Config, engine_spec
from ...data import PromptSampler
from ...distributed.collectives import all_gather_objects, all_reduce
from ...distributed.failfast import FailFast
from ...distributed.mesh import DistEnv, init_distributed
from ...distributed.roles import Liveness
from ...preflight import check_launch, resolve_auto
from ...profiling import StageTimer
from ...reward import training_reward
from ...sync import WeightSource
from ...sync.broadcast import Stage, check_loaded, load_weights
from ...sync.check import PushCheck
from ...tasks import build_datasets
from ..batch import Group
from ..builders import build_policy, checked_tokenizer, training_engine
from ..collect.rounds import Collected, collect_groups
from ..collect.streaming import StreamState, StreamStats, dropped_streams_line, stream_groups
from .cut import parts_due, read_rank_state, write_part
from .schedule import START_KEY, last_pushed_step, weights_step
from .wire import BatchMessage, RolloutFigures, Sender, pack


class TrainerCut:
    """`deal` for the collectors on the rollout side: every kept group of the rollout side in canonical order,
    cut to train_batch (or, short, a multiple of the trainer's data-parallel slots), as one list; the
    trainer side deals it to its slots. `leftover`: this rank's kept groups past the cut."""

    def __init__(self, trainer_slots: int):
        self.slots = trainer_slots
        self.leftover: list[Group] = []

    def __call__(self, kept_per_round: list[list[Group]], cfg: Config, env: DistEnv,
                 with_leftover: bool = False):
        everyone = all_gather_objects(kept_per_round)
        ordered = sorted((g for rounds in everyone for rnd in rounds for g in rnd), key=lambda g: g.origin)
        usable = min(len(ordered), cfg.trainer.train_batch) // self.slots * self.slots
        cut = {g.origin for g in ordered[:usable]}
        self.leftover = [g for rnd in kept_per_round for g in rnd if g.origin not in cut]
        return ([ordered[:usable]], self.leftover) if with_leftover else [ordered[:usable]]


def run_rollout_side(cfg: Config) -> None:
    """A rollout rank's whole life: set up, generate every batch of the schedule, send it, end."""
    check_launch(cfg)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer side's: it stops, then the job ends
    signal.signal(signal.SIGTERM, _sigterm_notice)  # so is SIGTERM: this rank has no checkpoint of its own
    env = init_distributed(cfg.trainer.device, cfg.trainer.setup_timeout_s, 1, cfg.rollout.rollout_ranks)
    cfg = resolve_auto(cfg, env.device.type == "cuda")
    failfast = FailFast.connect(env.global_rank, env.global_world_size, role=f"rollout rank {env.rank}",
                                watch_peers=True)  # a dead trainer rank fails no collective here
    failfast.watch()
    signal.signal(signal.SIGTERM,
                  lambda signum, frame: failfast.end_if_lost() or _sigterm_notice(signum, frame))
    me = env.bridges.layout.describe(env.global_rank)
    live = Liveness(env.bridges.store, env.global_rank,
                    stop_line=f"flashdapo: {me} stops with the trainer side")
    try:
        _generate_all(cfg, env)
    except BaseException as err:
        # an error right after the trainer side's stop (its closed sockets) is that stop
        live.stop_if_announced()
        failfast.end(err)
        raise
    live.close()
    failfast.end(None)


def _sigterm_notice(signum, frame) -> None:
    """SIGTERM on a rollout rank: one notice, and generation goes on. The rollout side writes no checkpoint of
    its own (its parts are written at fixed boundaries): the run stops, with its checkpoint, when the trainer
    side is signalled (a scheduler signals every rank), and this rank then ends with it. Once fail-fast is up,
    a SIGTERM that follows another rank's failure or death (torchrun's, to the survivors) ends this rank
    first, in the line naming that rank (FailFast.end_if_lost): the trainer side will not stop in order."""
    line = (
        f"flashdapo: rank {os.environ.get('RANK', '?')} (a rollout rank) got {signal.Signals(signum).name}: "
        "the rollout side saves nothing and stops when the trainer side does; signal the trainer ranks (or "
        "Ctrl-C) to stop the run after its step, with a checkpoint\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass


@dataclass
class RolloutSide:
    """A rollout rank's pieces between batches: the policy copy and its engine, the sampler, the weights
    stage, the collectors' state (streaming's, or rounds' surplus groups)."""

    cfg: Config
    env: DistEnv
    tokenizer: Any
    sampler: PromptSampler
    policy: Any
    engine: Any
    stage: Stage
    stream: StreamState = field(default_factory=StreamState)
    carried: list[Group] = field(default_factory=list)
    loaded: int | None = None

    def __post_init__(self) -> None:
        algo = self.cfg.algorithm
        self.verifier = training_reward(algo.verifier, algo.random_reward_p, self.cfg.trainer.seed)
        self.check = PushCheck(self.policy, self.env.device, self.policy.config.vocab_size,
                               tokenizer_size=len(self.tokenizer))
        self.cut = TrainerCut(self.env.bridges.layout.trainers // self.cfg.trainer.sequence_parallel)

    def load(self, w: int) -> dict[str, float]:
        """θ_w into the policy copy (waiting for it if not staged yet), push-checked; what that took."""
        if self.loaded == w:
            return {"wait_weights_s": 0.0, "load_s": 0.0, "push_check_max": 0.0}
        staged, waited = self.stage.take(w)
        began = time.perf_counter()
        load_weights(self.policy, staged)
        worst = check_loaded(self.policy, staged, self.check, w)
        self.loaded = w
        return {"wait_weights_s": waited, "load_s": time.perf_counter() - began, "push_check_max": worst}

    def collect(self, b: int, w: int, timer: StageTimer) -> tuple[Collected, StreamStats | None, list[Group]]:
        """Batch b with θ_w: the collector's result, its stream figures, the groups cut for the trainer
        side."""
        cfg, env, version = self.cfg, self.env, w + 1  # streaming's numbering: θ_w is version w + 1
        # vLLM loads θ_w from the policy copy (its own push check against that copy); the torch engine samples
        # from the copy itself.
        self.engine.wake(WeightSource(self.policy.hf), w)
        args = (self.sampler, self.engine, self.tokenizer, self.verifier, cfg, env, timer)
        if cfg.rollout.streaming:
            collected, stats = stream_groups(b, self.stream, *args, version=version, deal=self.cut)
        else:
            collected, stats = collect_groups(b, *args, carried=self.carried, deal=self.cut), None
            # Dynamic sampling's surplus opens the next batch at k >= 1; at k = 0 it is dropped, as co-located
            # rounds drop it: k = 0 trains exactly the co-located run's groups, every token on-policy.
            rolls_over = cfg.algorithm.dynamic_sampling and cfg.rollout.max_lag > 0
            surplus = _tagged(self.cut.leftover, version) if rolls_over else []
            self.carried = _carried(surplus, env.rank)
        self.engine.sleep()
        return collected, stats, _tagged(collected.mini_batches[0], version)


def _generate_all(cfg: Config, env: DistEnv) -> None:
    bridges = env.bridges
    tokenizer = checked_tokenizer(cfg, lambda _m: None)
    train_set, _ = build_datasets(cfg.data, tokenizer)
    sampler = PromptSampler(train_set, cfg.trainer.gen_batch, cfg.trainer.seed, cfg.data.shuffle, env.rank,
                            env.world_size)
    policy = build_policy(cfg, env, tokenizer, True, lambda _m: None)  # the structure; weights are pushed
    engine = rollout_engine(cfg, env, policy, tokenizer)
    bridges.wait_key(START_KEY, [0], "the trainer side's start")
    plan = json.loads(bridges.get(START_KEY))
    start, total, k = int(plan["start"]), int(plan["total"]), cfg.rollout.max_lag
    run_dir = Path(cfg.logging.run_dir)
    first = int(plan["boundary"]) + 1  # resumed: the batches up to the cut's boundary are queued in it
    if first > total:
        return
    stage = Stage(bridges, last_version=last_pushed_step(total, k, start), first_version=start)
    stage.start()
    side = RolloutSide(cfg, env, tokenizer, sampler, policy, engine, stage)
    if plan["resume"]:
        # the checkpoint's run dir (resume PATH into a new one)
        cut_from = Path(plan.get("cut_dir") or run_dir)
        side.stream, side.carried = _restore(read_rank_state(cut_from, start, env.rank), sampler, cfg)
        if env.rank == 0 and not cfg.rollout.streaming and (line := dropped_streams_line(
                [read_rank_state(cut_from, start, r)["stream"] for r in range(env.world_size)])):
            print(f"flashdapo: {line}", flush=True)  # a cut written with streaming on: its streams go nowhere
    sender = Sender(bridges) if env.rank == 0 else None
    recent: dict[int, bytes] = {}
    for b in range(first, total + 1):
        began = time.perf_counter()
        w = weights_step(b, k, start)
        loading = side.load(w)
        timer = StageTimer(env.device)
        collected, stats, groups = side.collect(b, w, timer)
        figures = {
            "gen_s": timer.seconds.get("gen", 0.0), "reward_s": timer.seconds.get("reward", 0.0),
            **loading, "busy_s": time.perf_counter() - began - loading["wait_weights_s"],
            "staged_max": float(stage.max_staged)
        }
        figures = RolloutFigures(**dict(zip(figures, _rollout_max(list(figures.values())))))
        if sender is not None:
            summary = Collected.from_figures(collected.figures(), [])
            recent[b] = pack(BatchMessage(b, w, groups, summary, figures, stats))
            sender.put(b, recent[b])
            recent.pop(b - k, None)  # only the last k can be queued at a cut
        for c in parts_due(b, cfg, start):  # the boundary of a checkpoint's cut: this side's part of it
            queue = [recent[j] for j in range(c + 1, b + 1)] if env.rank == 0 else None
            write_part(run_dir, c, b, env.rank, _state(sampler, side.carried, side.stream, cfg), queue,
                       plan.get("run_id"))
    if sender is not None:
        sender.close()
    stage.join()


def rollout_engine(cfg: Config, env: DistEnv, policy, tokenizer):
    """The rollout side's engine over its partition: the torch engine on the policy copy, or vLLM (its
    external launcher sees the rollout side's default group: RANK and WORLD_SIZE become the partition's)."""
    if engine_spec(cfg.rollout.engine).own_weights:
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size))
    log = (lambda m: print(f"flashdapo: {m}", flush=True)) if env.rank == 0 else (lambda _m: None)
    return training_engine(cfg, env, policy, tokenizer,
                           Path(cfg.logging.run_dir) / f"vllm-error.rank{env.global_rank}.log", log)


def _state(sampler: PromptSampler, carried: list[Group], stream: StreamState, cfg: Config) -> dict:
    """This rank's state at a batch boundary (plain, for the cut): sampler position, surplus or stream."""
    return {"sampler": sampler.state_dict(), "carried": [g.to_plain() for g in carried],
            "stream": stream.to_plain() if cfg.rollout.streaming else None}


def _restore(state: dict, sampler: PromptSampler, cfg: Config) -> tuple[StreamState, list[Group]]:
    sampler.load_state_dict(state["sampler"])
    stream = StreamState.from_plain(state["stream"]) if cfg.rollout.streaming else StreamState()
    return stream, [Group.from_plain(g) for g in state["carried"]]


def _rollout_max(values: list[float]) -> list[float]:
    """The slowest rollout rank's figures (the side moves at its pace)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), "max").tolist()


def _carried(leftover: list[Group], rank: int) -> list[Group]:
    """This rank's groups past the cut, renamed to round 0 of the next batch (ahead of its fresh rounds), in
    order."""
    for i, g in enumerate(leftover):
        g.origin = (0, rank, i)
    return leftover


def _tagged(groups: list[Group], version: int) -> list[Group]:
    """Every response's per-token versions: the streaming collector records them; rounds sampled each group
    whole with one version (streaming's numbering: weights of step w are version w + 1)."""
    for g in groups:
        if g.versions is None:
            g.versions = [torch.full((len(r),), version, dtype=torch.long) for r in g.responses]
    return groups


__all__ = ["TrainerCut", "run_rollout_side"]
