"""The Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "tools" / "compile_kernels_sm90.py"
    cmd = [sys.executable, str(script), "--ptx-dir", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count(": ok") == 30  # 20 configurations without documents (4 sorted scorers), 10 with
    assert len(list(tmp_path.glob("*.ptx"))) == 30


def test_no_kernel_takes_over_30_parameters():
    """Kernels take their inputs as NamedTuples (a tensor with its strides, a walk whole), so that their argument
    lists stay short enough to read: no @triton.jit function of the package takes more than 30."""
    import importlib
    import pkgutil

    import triton

    import mtraining

    counts = {}
    for info in pkgutil.walk_packages(mtraining.__path__, "mtraining."):
        if not info.name.endswith(("kernels", "ce_kernel")):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            while isinstance(value, triton.runtime.Heuristics):
                value = value.fn
            kernel = isinstance(value, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction))
            if kernel and value.fn.__module__ == info.name:
                counts[f"{info.name}.{name}"] = len(value.arg_names)
    assert len(counts) >= 20, counts  # every kernel module was found
    assert max(counts.values()) <= 30, {name: n for name, n in counts.items() if n > 30}
