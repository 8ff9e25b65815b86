"""`flashdapo train`: the DAPO loop. The only module that knows every stage.

One step (docs/architecture.md, "One training step"), each stage timed:

    collect        the collector (collect/collector.py) returns this rank's kept groups, dealt into
                   mini-batches. Co-located: weight_sync (engine.wake on the current weights), gen and
                   reward rounds or a stream, dynamic sampling's filter (collect/rounds.py, streaming.py).
                   Split placement: wait_batch, the rollout side's batch (split/trainer_side.py)
    old_log_prob   log-probs of the kept responses under the policy before updating (update.py)
    adv            the TrainBatch, built once: advantages, overlong loss mask, rollout-correction
                   weights                                                           (batch.py)
    update_actor   mini-batches x micro-batches, global token-mean, clip, AdamW      (update.py)
    after_update   split placement: weight_push of the new weights to the rollout side

then validation, metrics, plot and checkpoint on their intervals, and an HF export at the end. The steps of
profile.steps run under the profiler (flashdapo/profiling/), each stage a named range.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ..algorithm import rollout_correction
from ..distributed.heartbeat import heartbeat
from ..distributed.interrupt import StopOnInterrupt
from ..eval.results import summarize
from ..eval.sampling import EvalSampling, Shard, sample_prompts
from ..profiling import StageTimer
from ..seeds import derive_seed
from .batch import build_train_batch
from .observe.correction import rollout_correction_metrics
from .observe.dumps import dump_train_rollouts, dump_validation, dumping
from .observe.logprob_check import exact_check, logprob_agreement, should_check_logprobs
from .observe.probe import probe_due, probe_metrics
from .observe.step_metrics import split_metrics, step_metrics  # noqa: F401  (split_metrics: read by tests)
from .observe.truncation import TruncationWatch
from .setup import Run, setup_run
from .split.rollout_side import run_rollout_side
from .state.adapter_export import export_adapted
from .state.checkpoint import latest_checkpoint, save_checkpoint
from .state.export import export_hf
from .update import NonFiniteError, UpdateResult, compute_old_logprobs, old_logprobs, update_actor


def train(cfg) -> Run | None:
    """Run DAPO as configured; returns the finished Run (its history, paths) for tests and notebooks (None on
    split placement's rollout ranks: they only generate, docs/split.md). Ctrl-C stops after the running step
    and its checkpoint, raising Interrupted (interrupt.py)."""
    if _rollout_rank(cfg):
        run_rollout_side(cfg)  # generates and sends every batch; the trainer side is the run
        return None
    with StopOnInterrupt(lambda: latest_checkpoint(Path(cfg.logging.run_dir))) as stop:
        run = setup_run(cfg, stop.check)  # a stop asked for during setup raises at its next stage
        stop.is_main = run.env.is_main
        stop.lost = run.failfast.end_if_lost  # torchrun's SIGTERM after a rank died: no checkpoint promised
        try:
            stopped_at = train_steps(run, stop)
            if stopped_at is None and cfg.checkpoint.export_hf and run.needs_export():
                stop.phase = "the export"
                for line in export_final(run):
                    run.log(line)
            if stopped_at is None:
                stop.check()
        except BaseException as err:
            run.close(err)
            raise
        run.close(None)
    if stopped_at is not None:
        raise stop.stopped(stopped_at)
    return run


def export_final(run: Run) -> list[str]:
    """Write the final policy's export (every rank together); the lines saying what was written."""
    cfg = run.cfg
    if run.weights.layout is not None:
        return export_adapted(run.weights, run.export_config(), run.tokenizer, run.run_dir, run.env.is_main,
                              run.final_step, cfg.model.path, cfg.checkpoint.export_merged)
    export_hf(run.weights.export(), run.export_config(), run.tokenizer, run.run_dir / "export",
              run.env.is_main, step=run.final_step)
    return [f"exported the final policy to {run.run_dir / 'export'}"]


def train_steps(run: Run, stop: StopOnInterrupt) -> int | None:
    """The steps from the start (or the resumed step) to trainer.total_steps, with validation, metrics, plot
    and checkpoints on their intervals; returns the step it stopped after on Ctrl-C (checkpoint saved), else
    None."""
    cfg = run.cfg
    truncation = TruncationWatch(run.tokenizer, cfg.model.path, cfg.rollout.max_response_length)
    # split placement: the rollout side starts generating batch start+1 now
    run.collector.begin(run.start_step)
    if run.start_step == 0 and cfg.trainer.val_before_train:
        stop.phase = "the validation before step 1"
        run.logger.log(
            {"step": 0, **validate(run, 0, keep_awake=cfg.trainer.total_steps > 0), **probe(run, 0)})
        stop.check()
    for step in range(run.start_step + 1, cfg.trainer.total_steps + 1):
        stop.phase = f"step {step}"
        metrics = train_step(run, step)
        warning = truncation.check(step, metrics)  # once: every response truncated, none reached a stop token
        if warning:
            run.log(warning)
        last = step == cfg.trainer.total_steps
        validating = last or (cfg.trainer.val_every and step % cfg.trainer.val_every == 0)
        if validating:
            metrics.update(validate(run, step, keep_awake=not last))
        metrics.update(probe(run, step))
        run.logger.log(metrics)
        if run.env.is_main and cfg.logging.plot and validating:  # a plot costs ~0.2 s: not every step
            run.logger.plot(run.run_dir / "training_dynamics.png", f"flashdapo: {run.run_dir.name}")
        saving = last or (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0)
        stopping = stop.agreed()  # every rank, every step: all stop after the same step
        # a signal from here on (this step's save included) is taken after the next step
        if not (stopping or last):
            stop.phase = f"step {step + 1}"
        if saving or stopping:
            save_checkpoint(run.run_dir, run.env, run.policy, run.optimizer, run.trainer_state(step),
                            cfg.checkpoint.keep_last, run.rank_state())
        if stopping:
            # split placement: the rollout side ends with it
            if run.env.bridges is not None and run.env.is_main:
                run.env.bridges.announce_stop(stop.signum)
            return step
    return None


def train_step(run: Run, step: int) -> dict[str, float]:
    """One DAPO step, stage by stage (docs/architecture.md, "One training step"); returns its metrics (already
    reduced over ranks)."""
    cfg, env = run.cfg, run.env
    timer = StageTimer(env.device)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    profiling = run.profiler.step(step) if run.profiler is not None else nullcontext()  # profile.steps
    beating = heartbeat(step, timer, cfg.logging.heartbeat_s, env.is_main and cfg.logging.progress)
    with profiling, timer("step"), beating:
        dump = dumping(cfg.logging.dump_rollouts_every, step)
        # weight sync, gen, reward, filter
        collected = run.collector.collect(step, timer, keep_generated=dump)
        with timer("old_log_prob"):
            old = old_logprobs(run.policy, collected.groups, cfg, run.pad_id, env.device)
            exact = exact_on_policy_check(run, step, collected.groups)
        with timer("adv"):
            batch = build_train_batch(collected.mini_batches, old, cfg.algorithm, rollout_correction(cfg))
        # Only recomputed old log-probs are the trainer's own: on-policy steps and old_logprobs=rollout skip
        # it (trainer.batch_invariant recomputes them on the check's schedule: `exact`).
        recomputed = batch.old_logprobs is not None and cfg.algorithm.old_logprobs == "recompute"
        rollout_check = {**logprob_agreement(step, batch, cfg.rollout, warn=env.is_main),
                         **rollout_correction_metrics(batch)} if recomputed else exact
        lr = run.scheduler.get_last_lr()[0]
        with timer("update_actor"):
            update = update_actor(run.policy, run.optimizer, batch, cfg, env, run.pad_id)
            if update.taken:  # the LR schedule counts training steps that took an optimizer step
                run.scheduler.step()
                run.weights.advance()
        stop_after_skips(run, step, update)
        run.collector.after_update(step, timer)  # split placement: the weight push
    if dump:
        dump_train_rollouts(run.run_dir, step, collected.generated, batch, run.tokenizer, env,
                            past_target=run.collector.past_target)
    collector_metrics = run.collector.metrics(step, batch, timer)
    # checkpointed: resumes continue it
    run.totals.add(collected.generated_samples, collected.generated_tokens)
    return {
        **step_metrics(step, batch, collected, update, timer, env, cfg.rollout.n), "actor/lr": lr,
        **rollout_check,
        **collector_metrics, "train/generated_samples_cum": float(run.totals.generated_samples),
        "train/generated_tokens_cum": float(run.totals.generated_tokens)
    }


def exact_on_policy_check(run: Run, step: int, groups) -> dict[str, float]:
    """trainer.batch_invariant with algorithm.old_logprobs=rollout: on the log-prob check's schedule the old
    log-probs are recomputed and must be the engine's bits (observe/logprob_check.py exact_check: the run
    stops at the first differing token); between checks nothing runs. {} otherwise."""
    cfg = run.cfg
    if not (cfg.trainer.batch_invariant and cfg.algorithm.old_logprobs == "rollout") or \
            not should_check_logprobs(step, cfg.rollout.logprob_check_every, 1) or \
            any(g.sampler_logprobs is None for g in groups):
        return {}
    recomputed = compute_old_logprobs(run.policy, groups, cfg, run.pad_id, run.env.device)
    return exact_check(step, groups, recomputed, cfg.rollout)


def _rollout_rank(cfg) -> bool:
    """Whether this process is one of split placement's rollout ranks (the last rollout.rollout_ranks)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return cfg.rollout.placement == "split" and int(os.environ.get("RANK",
                                                                   0)) >= world - cfg.rollout.rollout_ranks


def stop_after_skips(run: Run, step: int, update: UpdateResult) -> None:
    """Count optimizer steps skipped in a row for a non-finite loss or gradient norm (across training steps);
    at trainer.max_skipped_steps stop the run, naming the step and the newest good checkpoint."""
    for skipped in update.nonfinite:
        run.skipped_in_a_row = run.skipped_in_a_row + 1 if skipped else 0
    limit = run.cfg.trainer.max_skipped_steps
    if run.skipped_in_a_row >= limit:
        raise NonFiniteError(
            f"step {step}: {run.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
            "norm and "
            f"were skipped (trainer.max_skipped_steps={limit}); the weights are unchanged since the last "
            "good step. "
            f"Newest good checkpoint: {latest_checkpoint(run.run_dir) or 'none'}. Check the rewards, "
            "rollout.temperature and optim.lr, then resume with --checkpoint.resume auto")


def probe(run: Run, step: int) -> dict[str, float]:
    """probe/* of the weights after `step` when logging.probe_every says so (probe.py), else {}."""
    if run.probe is None or not probe_due(run.cfg.logging.probe_every, step):
        return {}
    start = time.perf_counter()
    out = probe_metrics(run.policy, run.probe, run.cfg.trainer.micro_batch_tokens, run.pad_id, run.env.device)
    return {**out, "timing_s/probe": time.perf_counter() - start}


def validate(run: Run, step: int, keep_awake: bool = False) -> dict[str, float]:
    """mean@k / pass@k / maj@k per data source and pooled on the validation prompts (k = rollout.val_n,
    top_p = rollout.val_top_p); each rank samples its share in one generate call. `keep_awake`: a training
    step follows on the same weights; the engine may stay awake (vLLM does) so that step pushes nothing."""
    if not run.val_prompts:
        return {}
    rc, env = run.cfg.rollout, run.env
    start = time.perf_counter()
    run.weights.wake(run.engine)
    # Round 0 of the step: training's generation rounds count from 1, so the streams never coincide.
    sampling = EvalSampling(k=rc.val_n, temperature=rc.val_temperature, top_p=rc.val_top_p,
                            max_new_tokens=rc.max_response_length,
                            seed=derive_seed(run.cfg.trainer.seed, step,
                                             0), prompts_per_call=-(-len(run.val_prompts) // env.world_size))
    results = sample_prompts(run.engine, run.val_prompts, run.tokenizer, run.verifier, sampling,
                             Shard(env.rank, env.world_size))
    run.engine.sleep(keep_awake)
    if dumping(run.cfg.logging.dump_rollouts_every, step):
        dump_validation(run.run_dir, step, results, env.is_main)
    return {**summarize(results).metrics("val"), "timing_s/val": time.perf_counter() - start}
