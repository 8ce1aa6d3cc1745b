"""Bytes held by Python objects' tensors, for the memory tests (tests/models, tests/train)."""

from __future__ import annotations

import torch


def tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes and containers."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (int, float, str, bool, type(None), torch.dtype, torch.device)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())
