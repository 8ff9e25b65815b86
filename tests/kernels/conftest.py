"""Kernel tests: on a machine without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET,
set by tests/conftest.py before any test module is collected). With a GPU the compiled kernels are
tested instead.

Seeds: each test's seed is fixed by its node id, so a CI run is reproducible. FLASHDAPO_TEST_SEED=<int>
runs every test with that seed, FLASHDAPO_TEST_SEED=random with a fresh one each; a failing test prints
the seed that reproduces it.
"""

import os
import random
import zlib

import pytest
import torch


@pytest.fixture
def seed(request) -> int:
    """The test's seed (see the module docstring); also seeds torch's generator."""
    override = os.environ.get("FLASHDAPO_TEST_SEED")
    if override == "random":
        value = random.SystemRandom().randrange(2**31)
    elif override:
        value = int(override)
    else:
        value = zlib.crc32(request.node.nodeid.encode()) % (2**31)
    request.node.flashdapo_seed = value
    torch.manual_seed(value)
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "flashdapo_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"FLASHDAPO_TEST_SEED={seed} reproduces this failure"))
    return report


@pytest.fixture(autouse=True)
def _one_thread():
    """Kernel tests use tiny shapes: one intra-op thread avoids OpenMP barrier stalls on a shared CPU
    (each tiny matmul otherwise waits for a descheduled worker) and keeps BLAS rounding reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
