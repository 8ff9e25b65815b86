"""`flashdapo plan`: every preset at each documented cluster prints its table (exit 0); a launch the
launch's own checks refuse, or one that does not fit, is one line (exit 1); the model is built exactly."""

import pytest

from flashdapo.__main__ import main
from flashdapo.config import PRESET_CLUSTERS, toy
from flashdapo.plan.model import build_meta_model, model_shape
from flashdapo.plan.shapes import BUILTIN_SHAPES, ModelSource, builtin_shape
from tests.helpers.data_files import train_file
from tests.helpers.model_dirs import model_dir

CASES = [(name, c) for name, clusters in PRESET_CLUSTERS.items() for c in clusters]


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["plan", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(("name", "cluster"), CASES, ids=[f"{n}-{c.nodes}x{c.gpus_per_node}" for n, c in CASES])
def test_every_preset_plans_at_each_documented_cluster(name, cluster, capsys):
    status, out, err = _plan(capsys, "--preset", name, "--nodes", str(cluster.nodes), "--gpus-per-node",
                             str(cluster.gpus_per_node))
    assert status == 0, err
    assert f"= {cluster.world_size} ranks" in out and "memory per GPU" in out and "step time, modelled" in out
    # every figure that is not an exact count says it is modelled
    for line in out.splitlines():
        if line.startswith("  ") and any(c.isdigit() for c in line) and not any(
                word in line for word in ("datasheet", "exact", "configured")):
            assert "modelled" in line, line


def test_the_defaults_are_the_presets_first_cluster_and_an_h20(capsys):
    status, out, _ = _plan(capsys, "--preset", "qwen2.5-32b-dapo")
    assert status == 0
    assert "16 node(s) x 8 H20 = 128 ranks" in out
    assert "32,763,876,352 parameters" in out and "sequence_parallel 8" in out


@pytest.mark.parametrize(("args", "expected"), [
    (["--preset", "qwen2.5-32b-dapo", "--nodes", "3"], "trainer.train_batch: 512 prompts cannot be shared by 3 "
                                                        "data-parallel slots"),
    (["--preset", "qwen2.5-32b-dapo", "--nodes", "1", "--trainer.fsdp-cpu-offload", "False"], "generation needs"),
    (["--preset", "qwen2.5-32b-dapo", "--rollout.gpu-memory-utilization", "0.2"], "not one request of 22528 tokens"),
    (["--preset", "qwen2.5-7b-math", "--trainer.micro-batch-tokens", "400000"], "the biggest that fits is"),
    (["--preset", "qwen2.5-32b-dapo", "--trainer.sequence-parallel", "16", "--nodes", "16"], "query heads"),
    (["--preset", "qwen2.5-32b-dapo", "--rollout.tensor-parallel-size", "16"], "does not divide the model's 40"),
    (["--preset", "qwen2.5-7b-math", "--gpu", "b200"], "unknown GPU 'b200'"),
    (["--preset", "qwen2.5-7b-math", "--model.path", "checkpoints/Unknown-9B"], "--model-config FILE"),
])
def test_a_launch_that_cannot_start_or_fit_is_one_line(args, expected, capsys):
    status, out, err = _plan(capsys, *args)
    assert status == 1 and out == ""
    assert err.startswith("flashdapo plan: cannot launch: ") and err.count("\n") == 1 and expected in err, err


def test_a_checkpoint_on_this_machine_is_checked_with_its_tokenizer(tmp_path, capsys):
    data = str(train_file(tmp_path / "train.jsonl"))
    good = str(model_dir(tmp_path / "good", positions=64))
    status, out, err = _plan(capsys, "--model.path", good, "--data.train-files", data, "--data.max-prompt-length",
                             "16", "--rollout.max-response-length", "16", "--nodes", "1", "--gpus-per-node", "1")
    assert status == 0, err
    assert "model directory and tokenizer (preflight.check_model)" in out and good in out
    short = str(model_dir(tmp_path / "short", positions=16))
    status, _, err = _plan(capsys, "--model.path", short, "--data.train-files", data, "--nodes", "1",
                           "--gpus-per-node", "1")
    assert status == 1 and "max_position_embeddings=16" in err


def test_a_config_file_and_a_model_config_are_read(tmp_path, capsys):
    assert main(["config", "--preset", "qwen2.5-7b-math", "--trainer.micro-batch-tokens", "8192"]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    config_json = tmp_path / "config.json"
    config_json.write_text(__import__("json").dumps(builtin_shape("Qwen2.5-1.5B")))
    status, out, err = _plan(capsys, "--config", str(path), "--model-config", str(config_json), "--nodes", "1",
                             "--gpus-per-node", "8")
    assert status == 0, err
    assert "1,543,714,304 parameters" in out and "configured 8192" in out and str(config_json) in out


# The checkpoints' own totals: model.safetensors.index.json total_size / 2 bytes (bf16) for 7B and 32B, the
# model card's count for the single-file 0.5B.
PUBLISHED = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-7B": 7_615_616_512, "Qwen2.5-32B": 32_763_876_352}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_built_in_shapes_have_the_checkpoints_parameter_counts(name):
    shape = model_shape(build_meta_model(ModelSource(builtin_shape(name), name), toy()), name)
    assert shape.parameters == PUBLISHED[name]
    assert set(BUILTIN_SHAPES) >= set(PUBLISHED)


def test_the_kernel_model_takes_the_users_gpu(capsys):
    from bench import kernel_model

    assert kernel_model.main(["--gpu", "h20"]) == 0
    h20 = capsys.readouterr().out
    assert "Modelled on an H20" in h20 and "GEMMs at 111 TFLOP/s" in h20  # 740/989 of 148
    assert kernel_model.main([]) == 0
    assert "GEMMs at 740 TFLOP/s" in capsys.readouterr().out
