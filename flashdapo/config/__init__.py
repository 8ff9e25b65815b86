"""The config tree (tree.py, its sections in inputs.py, sampling.py, training.py and profiling.py), its
declarative checks (checks.py), overrides and files (io.py), presets. The command line (cli.py, tyro) is
imported by the commands alone: importing the tree imports neither tyro nor yaml."""

from .checks import ConfigError, field_path
from .engines import ENGINES, EngineSpec, engine_spec
from .io import load_file, merge
from .presets import (
    DEFAULT_PRESET,
    PRESET_CLUSTERS,
    PRESETS,
    Cluster,
    compact_summary,
    differences,
    preset,
    starting_point,
    toy,
)
from .tree import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ProfileConfig,
    RolloutConfig,
    ScratchpadTaskConfig,
    ToyModelConfig,
    ToyTaskConfig,
    TrainerConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "ENGINES",
    "EngineSpec",
    "engine_spec",
    "PRESETS",
    "PRESET_CLUSTERS",
    "Cluster",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ProfileConfig",
    "RolloutConfig",
    "ScratchpadTaskConfig",
    "ToyModelConfig",
    "ToyTaskConfig",
    "TrainerConfig",
    "compact_summary",
    "differences",
    "field_path",
    "load_file",
    "merge",
    "preset",
    "starting_point",
    "toy",
]
