"""Test-session setup and shared fixtures.

On a machine without a GPU the Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be
set before any kernel module is imported (it is read when kernels are decorated), so it is set here,
before test modules are collected. backend="auto" never picks the interpreter: tests that exercise
the kernels on the CPU ask for backend="triton".

GPU tests carry one marker, ``@pytest.mark.cuda`` (``cuda(gpus=2)`` for several GPUs): they are skipped
here on a machine with fewer GPUs, and ``pytest -m cuda`` selects them. A ``skipif`` about GPUs is refused.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse GPU skipif's (one convention: the cuda marker) and skip cuda tests without enough GPUs."""
    for item in items:
        for mark in item.iter_markers("skipif"):
            reason = mark.kwargs.get("reason", "")
            if "cuda" in reason.lower() or "gpu" in reason.lower():
                raise pytest.UsageError(
                    f"{item.nodeid}: skipif({reason!r}); mark GPU tests @pytest.mark.cuda (gpus=N for N GPUs) instead"
                )
        marker = item.get_closest_marker("cuda")
        gpus = marker.kwargs.get("gpus", 1) if marker is not None else 0
        if torch.cuda.device_count() < gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}"))
