"""Setting up a run: process group, run directory, tokenizer, data, model (and the toy warm-up),
FSDP2, optimizer and schedule, rollout engine, metrics, and resuming from a checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import Config, compact_summary
from ..data import Prompt, PromptSampler
from ..distributed.collectives import all_gather_objects
from ..distributed.failfast import FailFast
from ..distributed.mesh import DistEnv, init_distributed
from ..distributed.roles import Liveness
from ..models.policy import PolicyModel
from ..plan.launch import check_launch_memory
from ..preflight import check_launch, resolve_auto
from ..profiling import StepProfiler
from ..profiling.step import check_profile_dir
from ..reward import RANDOM_VERIFIER, RandomReward, Verifier, get_verifier, judging_verifier
from ..rollout import RolloutEngine
from ..rollout.vllm_process import library_versions
from ..sync import WeightSource, policy_weights
from ..sync.check import PushCheck
from ..tasks import build_datasets
from ..tools.warning_lines import attach_run
from .builders import build_optimizer, build_policy, checked_tokenizer, parameter_counts, training_engine
from .collect.collector import Collector, RoundsCollector, Sampling, StreamingCollector
from .collect.streaming import StreamState, dropped_streams_line
from .observe.probe import ProbeSet, build_probe_set
from .observe.sinks import MetricsLogger, WandbRun
from .split.cut import cut_dir, require_part
from .split.trainer_side import SplitTrainer
from .state.checkpoint import RANK_STATE, TrainerState, load_rank_state
from .state.export import exported_step
from .state.resume import Resumed, apply_optim_config, describe_resume, load_resume, restore_sampler
from .state.run_settings import run_settings
from .state.rundir import RunDirClaim, new_run_id, record_start
from .state.startup import StartPlan, agree_on_start, set_collective_timeout


@dataclass
class RunTotals:
    """What the run has generated so far, over every step and rank (train/generated_*_cum)."""

    generated_samples: int = 0
    """Responses generated (finished), kept or not."""
    generated_tokens: int = 0
    """Response tokens sampled, kept or not."""

    def add(self, samples: int, tokens: int) -> None:
        self.generated_samples += samples
        self.generated_tokens += tokens


@dataclass
class Run:
    """Everything a running job holds; built by `setup_run`."""

    cfg: Config
    env: DistEnv
    run_dir: Path
    tokenizer: Any
    policy: PolicyModel
    weights: WeightSource
    """The policy's weights as engines wake on them and the export writes them, with their version (sync/)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: RolloutEngine
    verifier: Verifier
    """What judges validation's responses (training's reward is the collector's)."""
    sampler: PromptSampler
    val_prompts: list[Prompt]
    logger: MetricsLogger
    pad_id: int
    start_step: int
    failfast: FailFast
    run_id: str
    """This run's id, recorded in its checkpoints (resumed runs keep theirs); see rundir.py."""
    claim: RunDirClaim | None = None
    """Rank 0's lock on the run directory, released when the run ends."""
    skipped_in_a_row: int = 0
    """Optimizer steps skipped in a row for a non-finite loss or gradient norm (loop.stop_after_skips)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The settings that shape this run, recorded in its checkpoints (run_settings.py)."""
    resumed: Resumed | None = None
    """The checkpoint this process continued from, None for a fresh start."""
    profiler: StepProfiler | None = None
    """This rank's profiler of profile.steps; None when profiling is off here (no profiler object)."""
    probe: ProbeSet | None = None
    """The probe's fixed prompts and responses (None: logging.probe_every = 0)."""
    totals: RunTotals = field(default_factory=RunTotals)
    """Counts over the whole run (resumed runs continue them), saved with every checkpoint."""
    collector: Collector | None = None
    """Where each step's kept groups come from (collect/collector.py; split placement: its trainer side)."""
    liveness: Liveness | None = None
    """Split placement: this rank's liveness counter, read by the other side while it waits."""

    def close(self, error: BaseException | None) -> None:
        """Close the metric sinks and the directory lock; then, after an error, report it to the other ranks
        (failfast: ends this process when there are peers), else meet them and close the process group."""
        self.logger.close()
        if self.liveness is not None:
            self.liveness.close()
        if self.claim is not None:
            self.claim.release()
        self.failfast.end(error)

    @property
    def final_step(self) -> int:
        """The step the weights are at once the loop ends: trainer.total_steps, or a later resumed one."""
        return max(self.start_step, self.cfg.trainer.total_steps)

    def needs_export(self) -> bool:
        """Whether the final export is still to write: False when a resume had nothing to train and export/
        already holds this step's weights (kept, said in one line, not rewritten)."""
        export = self.run_dir / "export"
        if self.start_step < self.cfg.trainer.total_steps or exported_step(export) != self.start_step:
            return True
        self.log(f"the export in {export} already holds step {self.start_step}: kept, not rewritten")
        return False

    def log(self, message: str) -> None:
        if self.env.is_main:
            print(f"flashdapo: {message}", flush=True)

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's own state for the checkpoint: the collector's (streaming's carried work), if any."""
        return self.collector.rank_state()

    def trainer_state(self, step: int) -> TrainerState:
        return TrainerState(step=step, scheduler=self.scheduler.state_dict(),
                            sampler=self.sampler.state_dict(), run_id=self.run_id, settings=self.settings,
                            totals=dataclasses.asdict(self.totals))

    def export_config(self):
        """The policy's HF config, saying the dtype `weights.export()` writes (config.json matches the
        tensors)."""
        config = copy.deepcopy(self.policy.config)
        config.dtype = torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32
        return config


def setup_run(cfg: Config, checkpoint: Callable[[], None] = lambda: None) -> Run:
    """Build every piece of a run; resume from a checkpoint when configured. From the process group on, a
    failure on any rank ends every rank (`failfast.py`). `checkpoint()` runs between the stages: a safe
    point where a stop asked for meanwhile (Ctrl-C, SIGTERM: interrupt.py) raises."""
    check_launch(cfg)  # before the process group: a config this launch cannot run is one line
    # The start-up checks wait at most setup_timeout_s for the other ranks (startup.py), the rest longer.
    split = cfg.rollout.placement == "split"
    env = init_distributed(cfg.trainer.device, cfg.trainer.setup_timeout_s, cfg.trainer.sequence_parallel,
                           cfg.rollout.rollout_ranks if split else 0)
    failfast = (FailFast.connect(env.global_rank, env.global_world_size, role=f"trainer rank {env.rank}",
                                 watch_peers=True) if split  # a dead rollout rank fails no collective here
                else FailFast.connect(env.rank, env.world_size))
    failfast.watch()
    liveness = Liveness(env.bridges.store, env.global_rank) if split else None
    run_dir = Path(cfg.logging.run_dir)
    log = (lambda m: print(f"flashdapo: {m}", flush=True)) if env.is_main else (lambda _m: None)
    cfg = resolve_auto(cfg, env.device.type == "cuda", log)
    plan, run = None, None
    try:
        checkpoint()
        # On GPUs, what `flashdapo plan` would refuse for memory is refused here, before anything is built.
        check_launch_memory(cfg, env.world_size,
                            torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
                            int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
        plan = agree_on_start(cfg, env, run_dir, log)
        check_profile_dir(cfg.profile, run_dir, env.rank)  # before the model loads, not at the profiled step
        attach_run(run_dir / "warnings.log", env.rank, env.world_size, cfg.logging.warnings_as_errors)
        set_collective_timeout(cfg.trainer.collective_timeout_s)
        run = _build_run(cfg, env, failfast, run_dir, log, plan, checkpoint)
        run.liveness = liveness
        if env.is_main:  # only now: a rejected config or a failed resume leaves the directory's files alone
            record_start(run_dir, run.run_id, run.start_step, cfg.to_yaml(), run.resumed and run.resumed.path,
                         run.resumed.changes if run.resumed else [], fresh=not cfg.checkpoint.resume)
        checkpoint()
    except BaseException as err:
        if run is not None:
            run.logger.close()
        if plan is not None and plan.claim is not None:
            plan.claim.release()
        if liveness is not None:
            liveness.close()
        failfast.end(err)  # with peers: reports and ends this process (and, through the store, the others)
        raise
    run.claim = plan.claim
    return run


def _build_run(cfg: Config, env: DistEnv, failfast: FailFast, run_dir: Path, log, plan: StartPlan,
               checkpoint: Callable[[], None]) -> Run:
    for line in compact_summary(cfg):
        log(f"config {line}")
    tokenizer = checked_tokenizer(cfg, log)
    torch.manual_seed(cfg.trainer.seed + env.rank)
    train_set, val_set = build_datasets(cfg.data, tokenizer)
    log(f"train data: {train_set.report.summary()}")
    if val_set is not None:
        log(f"val data: {val_set.report.summary()}")
    for warning in train_set.report.warnings + (val_set.report.warnings if val_set is not None else []):
        log(f"warning: {warning}")
    checkpoint()
    policy = build_policy(cfg, env, tokenizer, bool(plan.candidates), log)
    optimizer, scheduler = build_optimizer(cfg, policy)
    sampler = PromptSampler(train_set, cfg.trainer.gen_batch, cfg.trainer.seed, cfg.data.shuffle, env.rank,
                            env.world_size)
    logger = MetricsLogger(run_dir, env.is_main, cfg.logging.tensorboard, cfg.logging.wandb,
                           cfg.logging.wandb_project, cfg.logging.progress, cfg.trainer.total_steps,
                           cfg.to_dict(), WandbRun.from_config(cfg.logging))
    start_step, run_id = 0, plan.dir_run_id or all_gather_objects(new_run_id())[0]
    settings = run_settings(cfg, policy.hf, tokenizer)
    checkpoint()
    # a split checkpoint resumes only with the rollout side's part of its cut (in the checkpoint's run dir)
    split_part = ((lambda state, path: require_part(cut_dir(path), state.step, path, state.run_id))
                  if cfg.rollout.placement == "split" else None)
    resumed = load_resume(plan.candidates, cfg, settings, env, policy, optimizer, log, also=split_part)
    if resumed is not None:
        scheduler.load_state_dict(resumed.state.scheduler)
        restore_sampler(sampler, resumed, log)
        lr = apply_optim_config(optimizer, scheduler, cfg.optim, cfg.peak_lr)
        start_step, run_id = resumed.state.step, resumed.state.run_id or run_id
        log(describe_resume(resumed, lr, cfg.checkpoint.allow_changes))
        if start_step >= cfg.trainer.total_steps:
            log(f"step {start_step} is {'past' if start_step > cfg.trainer.total_steps else 'at'} "
                f"trainer.total_steps={cfg.trainer.total_steps}: nothing to train (raise "
                "--trainer.total-steps to "
                "train on)")
    dropped = logger.truncate_after(start_step if resumed is not None else -1)
    if dropped:
        log(f"dropped {dropped} metrics records after step {max(start_step, 0)}: they are recomputed from "
            f"{'the checkpoint' if resumed is not None else 'the start (no checkpoint to resume from)'}")
    checkpoint()
    # Split placement's trainer side samples only to validate, with the torch engine on the policy itself (the
    # rollout side holds the run's engine: docs/split.md); co-located, the run's engine samples everything.
    sampler_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="torch")) \
        if cfg.rollout.placement == "split" else cfg
    engine = training_engine(sampler_cfg, env, policy, tokenizer, run_dir / f"vllm-error.rank{env.rank}.log",
                             log)
    log(f"world size {env.world_size} on {env.device}; {parameter_counts(policy)}; run dir {run_dir}; "
        f"{library_versions()}")
    run = Run(
        cfg=cfg, env=env, run_dir=run_dir, tokenizer=tokenizer, policy=policy,
        weights=policy_weights(policy.hf, cfg.model.dtype), optimizer=optimizer, scheduler=scheduler,
        engine=engine, verifier=get_verifier(judging_verifier(cfg.algorithm.verifier)), sampler=sampler,
        val_prompts=list(val_set.prompts) if val_set is not None else [], logger=logger,
        pad_id=tokenizer.pad_token_id, start_step=start_step, failfast=failfast, run_id=run_id,
        settings=settings, resumed=resumed, profiler=StepProfiler.configured(cfg.profile, run_dir, env.rank,
                                                                             env.device),
        totals=RunTotals(**resumed.state.totals) if resumed is not None else RunTotals(),
        probe=(build_probe_set(val_set.prompts if val_set is not None else train_set.prompts, tokenizer,
                               cfg.logging.probe_prompts) if cfg.logging.probe_every else None))
    run.collector = build_collector(run, log)
    return run


def build_collector(run: Run, log) -> Collector:
    """The run's collector, built once: split placement's trainer side (resumed, holding the batches its
    checkpoint's cut queued), or a co-located one sampling the policy's current weights."""
    cfg, env = run.cfg, run.env
    if cfg.rollout.placement == "split":
        split = SplitTrainer(
            env, cfg, run.policy,
            PushCheck(run.policy, env.device, run.policy.config.vocab_size, log,
                      tokenizer_size=len(run.tokenizer)))
        split.run_id = run.run_id
        if run.resumed is not None and run.start_step < cfg.trainer.total_steps:
            split.resume(cut_dir(run.resumed.path), run.start_step)  # its parts: the checkpoint's run dir's
        return split
    algo = cfg.algorithm
    random = RandomReward(algo.random_reward_p,
                          cfg.trainer.seed) if algo.verifier == RANDOM_VERIFIER else None
    sampling = Sampling(run.engine, run.weights, run.sampler,
                        run.tokenizer, lambda: random if random is not None else run.verifier, cfg, env)
    if cfg.rollout.streaming:
        return StreamingCollector(sampling, _resumed_stream(run.resumed, cfg, env, log))
    if run.resumed is not None and env.is_main and (line := dropped_streams_line(
            _stream_states(run.resumed.path))):
        log(line)
    return RoundsCollector(sampling)


def _stream_states(path: Path) -> list[dict[str, Any] | None]:
    """Every rank's streaming state saved with the checkpoint at `path` (whatever world size wrote it; none
    for a checkpoint without streaming). One that does not load is None: it could only be dropped anyway."""
    states: list[dict[str, Any] | None] = []
    for file in sorted(path.glob(f"{RANK_STATE}*.pt")):
        try:
            states.append(torch.load(file, map_location="cpu", weights_only=True))
        except Exception:  # noqa: BLE001 - unpickling refusals, truncated zips, I/O errors: nothing to count
            states.append(None)
    return states


def _resumed_stream(resumed: Resumed | None, cfg: Config, env: DistEnv, log) -> StreamState:
    """The streaming sampler's carried work from the checkpoint (this rank's); empty for a fresh start. A
    checkpoint written at another world size cannot give each rank its own: that work is dropped, said
    once."""
    if resumed is None or not cfg.rollout.streaming:
        return StreamState()
    plain = load_rank_state(resumed.path, env)
    if plain is None:
        log(f"{resumed.path.name}: no streaming state for this world size ({env.world_size} ranks): carried "
            "responses and groups kept past the last target, if any, are dropped")
        return StreamState()
    return StreamState.from_plain(plain)


__all__ = ["Run", "RunTotals", "setup_run"]
