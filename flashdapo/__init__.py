"""flashdapo: a kernel-optimized trainer for DAPO reinforcement learning of reasoning LLMs."""

__version__ = "0.1.0"
