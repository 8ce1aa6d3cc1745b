"""Test-session setup and shared fixtures.

On a machine without a GPU the Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be
set before any kernel module is imported (it is read when kernels are decorated), so it is set here,
before test modules are collected. backend="auto" never picks the interpreter: tests that exercise
the kernels on the CPU ask for backend="triton".
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.distributed import ProcessPool  # noqa: E402  (after TRITON_INTERPRET)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One token cache for the session (tokenised text is shared between tests, never the user's cache)."""
    os.environ["MTRAINING_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture(scope="module")
def pool():
    """Four gloo worker processes shared by one test module (tests/distributed.py)."""
    p = ProcessPool()
    yield p
    p.close()
