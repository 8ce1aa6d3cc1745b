"""A detector of the host work in a forward: position work over the sequence, host reads of device tensors.

On a GPU, torch ops on host tensors past torch's parallel grain (32K elements) wait for threads, and a busy
host makes each such op 100x slower; every read of a device tensor on the host (``.item()``, ``.tolist()``,
``bool(t)``) waits for the GPU. Work of either kind repeated by every layer multiplies by the layer count
(DEVELOPERS.md, "A busy host"). ``HostWork`` runs a forward on the CPU as if its model were on a device and
records, while entered:

- ``host``: aten ops on host tensors with an integer or bool tensor of at least ``GRAIN`` elements that derives
  from positions alone (not from q, k, v or scores: those are the estimate's math), views and allocations aside;
  and copies of such host tensors to the device;
- ``device``: the same ops on device tensors (kernel launches on a GPU, no host work over the positions);
- ``reads``: values of device tensors read on the host (``item``, ``tolist``, ``bool``, ``int``, ``float``,
  ``numpy``, a copy to the host): each waits for the GPU.

Which tensors are the device's: the model's (every tensor that exists before recording) and whatever is made
from them or on their device; a factory without a device, ``.cpu()`` and ``.to("cpu")`` make host tensors. To tell
them apart on the CPU, ``t.device`` reads ``cpu:0`` for a device tensor and ``cpu`` for a host one, so code that
compares devices sees what it would on a GPU. Each event carries the layer whose ``Attention.attend`` it ran in
(None: outside every layer) and its call site (the innermost frame in ``mtraining``). ``stub_kernels`` replaces
the attention computations (the sparse backend's forward and the dense blocks' per-block ops, cuDNN's stand-in)
by outputs of the right shape, so a forward at 64K positions runs in seconds and records only the work around
the kernels.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GRAIN = 32768  # torch's parallel grain (at::internal::GRAIN_SIZE): larger CPU ops go to the thread pool
PACKAGE = str(Path(__file__).resolve().parents[1] / "mtraining")
DEVICE = torch.device("cpu", 0)  # what a device tensor's .device reads while recording
HOST = torch.device("cpu")
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
_FACTORIES = {"arange", "zeros", "ones", "full", "empty", "tensor", "randint", "rand", "randn", "linspace", "eye"}
_LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like", "as_tensor"}
_NEW = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
_FREE = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default"}


@dataclass(frozen=True)
class Event:
    """One recorded op: ``kind`` ("host", "device" or "reads"), the op, the layer it ran in and its call site."""

    kind: str
    op: str
    layer: int | None
    site: str


def _site_and_layer() -> tuple[str, int | None]:
    """The innermost ``mtraining`` frame (file:line function) and the ``layer`` of an enclosing ``attend``."""
    frame, site, layer = sys._getframe(2), None, None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE):
            if site is None:
                site = f"mtraining{code.co_filename[len(PACKAGE) :]}:{frame.f_lineno} {code.co_name}"
            if code.co_name == "attend" and code.co_filename.endswith("models/attention.py"):
                layer = frame.f_locals.get("layer")
                break
        frame = frame.f_back
    return site or "(outside mtraining)", layer


def _host(t: torch.Tensor) -> bool:
    return getattr(t, "_hw_host", False)


def _data(t: torch.Tensor) -> bool:
    """Derived from floating values (q, k, v, scores), not from positions alone."""
    return t.is_floating_point() or t.is_complex() or getattr(t, "_hw_data", False)


def _tag(t: torch.Tensor, host: bool, data: bool | None = None) -> torch.Tensor:
    t._hw_host = host
    if data is not None:
        t._hw_data = data
    return t


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _target(value, default: bool) -> bool:
    """Whether a device argument (a device, a string, a tensor, or None: ``default``) names the host."""
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        return _host(value)
    return torch.device(value) == HOST


class HostWork:
    """The events recorded while entered (module docstring)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.factory_host = True  # the side a factory being called makes its tensors on
        self.moving = False  # inside a copy between host and device (recorded as one event)

    def record(self, kind: str, op: str) -> None:
        site, layer = _site_and_layer()
        self.events.append(Event(kind, op, layer, site))

    @contextlib.contextmanager
    def recording(self) -> Iterator[HostWork]:
        with _Functions(self), _Ops(self):
            yield self

    def count(self, kind: str) -> int:
        """Events of ``kind``."""
        return sum(e.kind == kind for e in self.events)

    def sites(self, kind: str) -> dict[str, collections.Counter]:
        """Per call site and op, the count of ``kind`` events per layer ("call": outside every layer)."""
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in self.events:
            if e.kind == kind:
                out[f"{e.site} [{e.op}]"]["call" if e.layer is None else e.layer] += 1
        return dict(out)


class _Functions(TorchFunctionMode):
    """Which side each tensor lives on (factories, copies, ``.device``), and the reads of device tensors."""

    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "__get__" and first is not None and getattr(func, "__self__", None) is torch.Tensor.device:
            return HOST if _host(first) else DEVICE
        if first is not None and name in _READS:
            if not _host(first):
                self.work.record("reads", name)
            return func(*args, **kwargs)
        if first is not None and name in ("to", "cpu", "cuda"):
            return self._move(func, name, first, args, kwargs)
        if name in _FACTORIES or name in _LIKE or name in _NEW:
            inherit = first is not None and (name in _LIKE or name in _NEW)
            host = _target(kwargs.get("device"), _host(first) if inherit else True)
            saved, self.work.factory_host = self.work.factory_host, host
            try:
                out = func(*args, **kwargs)
            finally:
                self.work.factory_host = saved
            for t in _tensors(out):
                _tag(t, host)
            return out
        return func(*args, **kwargs)

    def _move(self, func, name: str, t: torch.Tensor, args: tuple, kwargs: dict):
        """``to``/``cpu``/``cuda``: a copy between host and device is a read (to the host) or host work (to the
        device, at least ``GRAIN`` elements)."""
        if name == "cpu":
            host = True
        elif name == "cuda":
            host = False
        else:
            named = [a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))]
            host = _target(kwargs.get("device", named[0] if named else None), _host(t))
        saved, self.work.moving = self.work.moving, host != _host(t)
        try:
            out = func(*args, **kwargs)
        finally:
            self.work.moving = saved
        if host == _host(t):
            return out
        if host:
            self.work.record("reads", name)
        elif t.numel() >= GRAIN and not _data(t):
            self.work.record("host", f"{name} (to the device)")
        if out is t:
            out = t.clone()
        return _tag(out, host, _data(t))


class _Ops(TorchDispatchMode):
    """Each aten op's outputs take their side and origin from the inputs; position work over ``GRAIN`` recorded."""

    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _tensors((args, kwargs))
        shaped = [t for t in inputs if t.dim() > 0] or inputs  # host scalars mix with device tensors
        host = all(_host(t) for t in shaped) if shaped else self.work.factory_host
        data = any(_data(t) for t in inputs)
        outputs = _tensors(out)
        for t in outputs:
            if not any(t is i for i in inputs):  # in place: the tensor keeps its side
                _tag(t, host, data or _data(t))
        name = str(func)
        if self.work.moving or func.is_view or name in _FREE or data:
            return out
        if any(not (t.is_floating_point() or t.is_complex()) and t.numel() >= GRAIN for t in inputs + outputs):
            self.work.record("host" if host else "device", name)
        return out


@contextlib.contextmanager
def stub_kernels() -> Iterator[None]:
    """Attention's computations replaced by zeros (out) and zeros (lse) of the right shapes: the sparse backend's
    forward and, under the "reference" dense setting, the dense blocks' per-block forward (cuDNN's stand-in)."""
    from mtraining.ops import reference
    from mtraining.ops.dense import blocks, select

    def forward(chunk, q, k, v, out_dtype, merge_into=None):
        b, sq, hq, d = q.shape
        return q.new_zeros(b, sq, hq, d, dtype=out_dtype), q.new_zeros(b, hq, sq, dtype=torch.float32)

    def block_forward(q, k, v, causal, scale):
        return forward(None, q, k, v, q.dtype)

    saved = reference.forward, select.REFERENCE
    reference.forward = forward
    select.REFERENCE = blocks.BlockOps("stub", block_forward, select.REFERENCE.backward)
    try:
        with select.dense_backend("reference"):
            yield
    finally:
        reference.forward, select.REFERENCE = saved
