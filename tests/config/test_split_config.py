"""Split placement's launch checks (rollout.placement=split): one line each, at the documented cluster sizes
(config only: no GPU, no process group), and the run settings that make a resume changing the placement, R or
k refuse."""

import pytest

from flashdapo.config import PRESET_CLUSTERS, Config, ConfigError, merge, preset
from flashdapo.preflight import check_layout
from flashdapo.trainer.state.run_settings import ResumeRefused, compare_settings


def _split(cfg: Config, r: int, k: int = 1, **rollout) -> Config:
    return merge(cfg, {"rollout": {"placement": "split", "rollout_ranks": r, "max_lag": k, **rollout}})


@pytest.mark.parametrize(("name", "cluster"), [(n, c) for n, clusters in PRESET_CLUSTERS.items() for c in clusters
                                               if c.world_size > 1],
                         ids=lambda v: v if isinstance(v, str) else f"{v.nodes}x{v.gpus_per_node}")
def test_split_checks_the_batches_over_the_trainer_ranks_at_each_documented_cluster(name, cluster):
    cfg = preset(name)
    world, sp = cluster.world_size, cfg.trainer.sequence_parallel
    # Give the engines whole nodes where there are several, else one rank; then T = world - R trains.
    r = cluster.gpus_per_node if cluster.nodes > 1 else cfg.rollout.tensor_parallel_size
    t = world - r
    if t <= 0:  # one engine takes every rank (half a node under the 32B LoRA preset): nothing left to train
        with pytest.raises(ConfigError, match=r"^rollout\.rollout_ranks: .* leaves no rank to train"):
            check_layout(_split(cfg, r), world)
        return
    slots = t // sp if t % sp == 0 else None
    fits = (slots is not None and cfg.trainer.train_batch % slots == 0 and cfg.trainer.mini_batch * cfg.rollout.n >= slots
            and cfg.trainer.gen_batch % (r // cfg.rollout.tensor_parallel_size) == 0 and t > 0)
    if fits:
        check_layout(_split(cfg, r), world)
    else:  # the trainer side cannot share the batches: refused in one line naming the field
        with pytest.raises(ConfigError, match=r"^trainer\.(sequence_parallel|train_batch|mini_batch|gen_batch): "):
            check_layout(_split(cfg, r), world)


def test_the_32b_recipe_splits_on_128_gpus_with_two_engine_nodes():
    cfg = merge(preset("qwen2.5-32b-dapo"), {"trainer": {"sequence_parallel": 8}})
    check_layout(_split(cfg, 16), 128 + 16)  # 128 trainer ranks as today, 16 generating
    with pytest.raises(ConfigError, match=r"trainer.train_batch: 512 prompts cannot be shared by 14 data-parallel "
                                          r"slots \(112 trainer ranks / sequence_parallel 8\)"):
        check_layout(_split(cfg, 16), 128)


def test_split_launch_checks_are_one_line_each():
    cfg = preset("toy")
    tb = cfg.trainer
    with pytest.raises(ConfigError, match="rollout.rollout_ranks: 2 of a launch of 2 ranks leaves no rank to train"):
        check_layout(_split(cfg, 2), 2)
    with pytest.raises(ConfigError, match="rollout.rollout_ranks: 3 is not a multiple of rollout.tensor_parallel_size 2"):
        check_layout(_split(preset("qwen2.5-7b-math"), 3, tensor_parallel_size=2), 8)
    odd = tb.gen_batch + 1
    with pytest.raises(ConfigError, match=rf"trainer.gen_batch: {odd} prompts cannot be shared by 2 engines"):
        check_layout(merge(_split(cfg, 2), {"trainer": {"gen_batch": odd, "train_batch": tb.train_batch}}), 4)
    with pytest.raises(ConfigError, match=r"trainer.train_batch: .* data-parallel slots \(3 trainer ranks\)"):
        check_layout(merge(_split(cfg, 1), {"trainer": {"train_batch": 4, "mini_batch": 4, "gen_batch": 8}}), 4)
    check_layout(_split(cfg, 1), 2)  # the documented `done` launch: 1 trainer + 1 engine rank


def test_split_needs_a_rollout_rank():
    with pytest.raises(ConfigError, match="rollout.rollout_ranks"):
        merge(Config(), {"rollout": {"placement": "split", "rollout_ranks": 0}})


def test_a_resume_changing_placement_ranks_or_lag_is_refused():
    from flashdapo.tasks import build_task_tokenizer
    from flashdapo.tasks.toy import build_toy_model
    from flashdapo.trainer.state.run_settings import run_settings

    cfg = Config()
    tok = build_task_tokenizer(cfg.data)
    model = build_toy_model(cfg.model, len(tok), 64, 0)
    co = run_settings(cfg, model, tok)
    one = run_settings(_split(cfg, 1, 1), model, tok)
    two = run_settings(_split(cfg, 1, 2), model, tok)
    assert co["rollout.placement"] == "colocated" and "rollout.max_lag" not in co
    with pytest.raises(ResumeRefused, match="rollout.placement colocated -> split"):
        compare_settings(co, one, [], "ckpt")
    with pytest.raises(ResumeRefused, match="rollout.max_lag 1 -> 2"):
        compare_settings(one, two, [], "ckpt")
    assert compare_settings(one, one, [], "ckpt") == []


def test_auto_correction_is_token_truncate_where_split_trains_older_tokens():
    from flashdapo.algorithm import rollout_correction

    def resolved(**rollout):
        ds = rollout.pop("ds", True)
        cfg = merge(Config(), {"rollout": rollout, "algorithm": {"dynamic_sampling": ds},
                               "trainer": {"gen_batch": 1536 if ds else 512}})
        return rollout_correction(cfg)

    assert resolved() == "none"  # co-located torch engine
    assert resolved(placement="split", rollout_ranks=1, max_lag=1, ds=False) == "token_truncate"
    assert resolved(placement="split", rollout_ranks=1, max_lag=0) == "none"  # k = 0 drops the surplus, as co-located
    assert resolved(placement="split", rollout_ranks=1, max_lag=0, ds=False) == "none"  # every token on-policy


def test_the_step_line_of_a_batch_of_rolled_over_groups():
    """Split placement: a batch made only of groups rolled over from the last one generated nothing, so it has
    no kept fraction or generation accuracy; its step line says '-', not a made-up number."""
    from flashdapo.trainer.observe.sinks import format_line

    m = {"step": 3, "train/num_gen_batches": 0.0, "perf/throughput": 100.0, "timing_s/step": 1.0,
         "timing_s/wait_batch": 0.1, "critic/score/mean": 0.5}
    line = format_line(m, 10)
    assert "kept - rounds 0" in line and "acc nan" in line
