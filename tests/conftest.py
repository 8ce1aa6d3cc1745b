"""Test-session setup: on a machine without a GPU the Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (it is read when kernels are
decorated), so it is set here, before test modules are collected. backend="auto" never picks the
interpreter: tests that exercise the kernels on the CPU ask for backend="triton".
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
