"""Kernel tests: on a machine without a GPU the Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before
flashdapo.kernels.triton_logprobs is first imported; flashdapo imports it lazily, so setting it while
this conftest loads is early enough. With a GPU the compiled kernels are tested instead.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed(request) -> int:
    """A per-test seed (stable across runs, different between tests); also seeds torch's generator."""
    value = zlib.crc32(request.node.nodeid.encode()) % (2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def _one_thread():
    """Kernel tests use tiny shapes: one intra-op thread avoids OpenMP barrier stalls on a shared CPU
    (each tiny matmul otherwise waits for a descheduled worker) and keeps BLAS rounding reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
