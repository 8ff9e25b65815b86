"""Whole-suite setup. Without a GPU, Triton kernels run under its interpreter: TRITON_INTERPRET must be set
before flashdapo.kernels.triton_tiles is first imported, whichever test module gets there first (eval and
trainer tests reach the kernels too), so it is set here, before any test module is collected."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
