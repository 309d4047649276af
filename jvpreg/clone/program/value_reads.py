"""Tensor values that Python reads while a capture traces a forward: answered with the real value, and remembered.

A clone forward recorded by :mod:`jvpreg.clone.program.capture` runs its Python once. Where that Python reads a
tensor's *value* (``if mask.all():``, ``n = lengths.max().item()``, ``x.tolist()``, ``x.numpy()``), the value steers
the recorded path or is baked into it as a constant: :class:`ValueReads` catches every such read, answers it, and
remembers the tensor and the value, which :mod:`jvpreg.clone.program.value_guard` re-checks before each replay.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode

from jvpreg.clone.core import tensor as _tensor

__all__ = ["READS", "ValueReads"]


#: Tensor methods that hand a tensor's value to Python (``tolist``, ``numpy``, ``__array__`` and ``__dlpack__`` read
#: memory directly, without an op the tracer would see: before these guards, a ``tolist()`` was silently baked in).
READS = ("item", "tolist", "numpy", "__array__", "__dlpack__", "__bool__", "__int__", "__float__", "__index__",
         "__complex__")


class ValueReads:
    """While active (one capture): every read of a traced tensor's value through :data:`READS` is answered with
    the real value and remembered as ``(tensor, value)``, the tensor being the plain traced one (the primal block,
    for a clone, which is what eager clone mode reads)."""

    def __init__(self, tracer: Any):
        self.tracer = tracer
        self.tensors: List[torch.Tensor] = []
        self.values: List[Any] = []
        self.names: List[str] = []
        self._ids: dict = {}

    @contextlib.contextmanager
    def active(self) -> Iterator["ValueReads"]:
        saved = {name: torch.Tensor.__dict__.get(name) for name in READS}
        originals = {name: getattr(torch.Tensor, name) for name in READS}
        try:
            for name in READS:
                setattr(torch.Tensor, name, self._reader(name, originals[name], originals["tolist"]))
            with _ScalarArguments(self):
                yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)

    def _traced(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The plain traced tensor whose value a read of ``t`` gives, or ``None`` if ``t`` is not traced."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot

        if type(t) is _tensor.CloneTensor:
            with DisableTorchFunctionSubclass():
                t = _tensor.tracked_phys(t).select(0, 0)
        elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None  # another subclass answers its own reads
        return t if get_proxy_slot(t, self.tracer, None) is not None else None

    def _reader(self, name: str, original: Callable, tolist: Callable) -> Callable:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        def read(t, *args, **kwargs):
            plain = self._traced(t) if isinstance(t, torch.Tensor) else None
            if plain is None:
                return original(t, *args, **kwargs)
            with disable_proxy_modes_tracing():
                value = original(plain, *args, **kwargs)
                if id(plain) not in self._ids:
                    self._ids[id(plain)] = len(self.tensors)
                    self.tensors.append(plain)
                    self.values.append(tolist(plain.detach()))
                    self.names.append(f"Tensor.{name}")
            return value

        read.__name__ = name
        return read


_C_FUNCTIONS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                types.MethodWrapperType)


class _ScalarArguments(TorchFunctionMode):
    """A one-element tensor passed where a number is expected (``torch.zeros(n, batch_sizes[0], h)`` in
    ``nn.LSTM`` on a packed sequence) is read inside the C++ call, where :class:`ValueReads` cannot answer: the
    tracer refuses it before the op runs. Such a call is made again with those tensors read first (and guarded):
    only a C function's (its arguments are parsed before it does anything); a Python function may have written
    something before the refused read, and runs once."""

    def __init__(self, reads: ValueReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if "tracing tensor" not in str(err) or not isinstance(func, _C_FUNCTIONS):
                raise
            first = err
        for skip_first in (True, False):  # a size argument, else also the first one (``torch.arange(n)``)
            converted = self._numbers(args[1:] if skip_first else args, kwargs)
            if converted is None:
                continue
            new_args, new_kwargs = converted
            try:
                return func(*((args[0],) if skip_first and args else ()), *new_args, **new_kwargs)
            except RuntimeError as err:
                if "tracing tensor" not in str(err):
                    raise
        raise first

    def _numbers(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        """``(args, kwargs)`` with every one-element traced tensor in them read as a Python number; ``None`` if
        there is none."""
        found = [False]

        def convert(v):
            if isinstance(v, (list, tuple)):
                return type(v)(convert(e) for e in v)
            if isinstance(v, torch.Tensor) and v.numel() == 1 and self.reads._traced(v) is not None:
                found[0] = True
                return v.item() if v.is_floating_point() or v.is_complex() else int(v)
            return v

        out = (tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()})
        return out if found[0] else None
