"""Forward hooks that turn the next call of a module into the shared clone forward (no Lightning needed).

:class:`SharedForward` registers a forward pre-hook and a forward hook on a module once. While armed
with penalty terms, the *first* call of the module packs its input (and swaps the perturbed
parameters for clones) in the pre-hook via :func:`jvpreg.losses.prepare`, and the forward hook
unpacks the output via :meth:`jvpreg.losses.Plan.finish`, keeps the penalty values and returns the
plain ``f(x)`` to the caller, so the caller's code sees exactly what a plain forward returns. Later
calls in the same step, nested calls, and calls while disarmed pass through untouched. The Lightning
callbacks arm it around ``training_step``; the training benchmark uses it around a hand-written step.
"""
from __future__ import annotations

import functools

import inspect
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..clone import SharedCall
from ..losses import row_subset as _row_subset
from ..losses.base import Plan, Term, prepare, subset_rows

__all__ = ["SharedForward"]


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _names(mapping: Mapping, floats: bool = False) -> str:
    keys = [k for k, v in mapping.items() if not floats or _is_float(v)]
    return ", ".join(repr(k) for k in keys) or "none"


def _params(module: nn.Module) -> List[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return []


def _signature(module: nn.Module) -> str:
    try:
        return str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        return "(...)"


def _positional_index(module: nn.Module, name: str) -> Optional[int]:
    """Position of the forward argument ``name`` when it can be passed positionally, else ``None``."""
    pos = 0
    for p in _params(module):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name == name:
            return pos
        pos += 1
    return None


def _hooked_elsewhere(module: nn.Module) -> bool:
    """Whether a hook besides the :class:`SharedForward`'s own (one forward pre-hook, one forward hook) sees the
    calls of ``module``: another forward hook, a backward hook, or one of torch's global module hooks. Torch registers
    the global hooks with public functions (``torch.nn.modules.module.register_module_forward_hook``, ...) but lists
    them nowhere public: their dicts are read here, and only here."""
    m = torch_module
    return (len(module._forward_pre_hooks) != 1 or len(module._forward_hooks) != 1
            or bool(module._backward_hooks or module._backward_pre_hooks or m._global_forward_pre_hooks
                    or m._global_forward_hooks or m._global_backward_hooks or m._global_backward_pre_hooks))


def _float_names(args: tuple, kwargs: dict, module: nn.Module) -> str:
    """The forward arguments of this call that hold float tensors, by name."""
    names = [p.name for p in _params(module) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    found = [repr(n) for n, v in zip(names, args) if _is_float(v)]
    found += [repr(k) for k, v in kwargs.items() if _is_float(v)]
    return ", ".join(found) or "none: regularize a submodule that receives float features (module=...)"


class SharedForward:
    """Arms a module so that its next forward is the shared clone forward of some penalty terms.

    Args:
        module: the module whose forward receives the concatenated batch.
        input_index: position of the input in the module's positional arguments.
        input_key: name of the input when passed as a keyword argument, or key of the input inside
            a dict passed at ``input_index``.
        engine: how the cloned call runs (see :func:`jvpreg.jvp`): ``"auto"``/``"captured"`` replay
            a captured program, ``"compiled"`` runs it under ``torch.compile``, ``"eager"`` forces
            op-by-op clone mode. ``torch.compile``-d submodules (and modules compiled in place by
            ``module.compile()``) run their original code in the clone.

    With ``arm(..., row_subset=...)`` the armed call runs the module twice (:mod:`jvpreg.losses.row_subset`): as the
    clone forward of the subset, then plainly on the other rows; the caller receives one output.

    Example::

        >>> shared = SharedForward(model)
        >>> shared.arm([(JacobianFrobenius(), 0.01, 1.0)])
        >>> out = model(x)                      # plain f(x); the clone forward ran underneath
        >>> loss = F.cross_entropy(out, y) + shared.total()
        >>> shared.disarm()
    """

    _jvpreg_shared = True  # capture knows these hooks are the clone forward's own

    def __init__(self, module: nn.Module, *, input_index: int = 0, input_key: Optional[str] = None,
                 engine: str = "auto"):
        self.module = module
        self._call = SharedCall(module, engine, where="SharedForward(module)")
        self.input_index = input_index
        self.input_key = input_key
        self._terms: Optional[List[Term]] = None
        self._forward_called = None  # the context in which calling the module reaches the armed forward
        self._targets: Optional[List[Any]] = None
        self._plan: Optional[Plan] = None
        self._x: Optional[torch.Tensor] = None  # the input a packed call clones inside its program
        self._tan: Any = None  # that call's tangent output
        self._cm = None
        self._row_subset = None
        self._rows: Optional[Tuple[torch.Tensor, torch.Tensor, Any]] = None  # (subset S, others R, their arguments)
        self._depth = 0
        self._busy = False
        self.fired = False
        self.plan: Optional[Plan] = None
        self.values: Optional[List[torch.Tensor]] = None
        self.batch_size: Optional[int] = None
        self._handles = [
            module.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            module.register_forward_hook(self._post_hook),
        ]

    @property
    def engine(self) -> str:
        """The engine the cloned call runs on (``"auto"`` resolved for a compiled module)."""
        return self._call.engine

    # -- arming -----------------------------------------------------------------------------
    def arm(self, terms: Sequence[Term], targets: Optional[Sequence[Any]] = None, *, row_subset: Any = None) -> None:
        """Clone the next call of the module for ``terms`` (``(penalty, weight, batch_fraction)``), with tangents on
        a random ``row_subset`` of the rows (a fraction or a count, :mod:`jvpreg.losses.row_subset`; ``None``: all)."""
        self.disarm()
        self._row_subset = _row_subset.check_rows("SharedForward.arm(terms)", row_subset)
        self._terms = list(terms)
        self._targets = None if targets is None else list(targets)
        # the cloned call runs through the shared call (captured program, compiled submodules
        # uncompiled); ``forward`` is looked up before the pre-hook runs, so it is swapped here
        orig = self.module.forward
        self._own_forward = self.module.__dict__.get("forward")  # an instance-level forward set by the user
        self._orig_forward = orig
        fn = self._call.module.forward  # a compiled module clones its original code

        @functools.wraps(orig)  # keeps the forward's signature visible (input_key checks)
        def forward(*args, **kwargs):
            if self._plan is None or self._depth:
                return orig(*args, **kwargs)
            if self._plan.x_in is None:
                return self._packed_call(fn, args, kwargs)
            return self._call(args, kwargs, fn=fn)

        self.module.forward = forward
        self._forward_called = self._call.forward_called()
        self._forward_called.__enter__()

    def disarm(self) -> None:
        """Forget the armed terms and results; restore swapped parameters if a forward failed midway."""
        self._exit()
        if getattr(self, "_orig_forward", None) is not None:
            self.module.__dict__.pop("forward", None)
            if self._own_forward is not None:
                self.module.forward = self._own_forward
            self._orig_forward = self._own_forward = None
        called, self._forward_called = self._forward_called, None
        if called is not None:
            called.__exit__(None, None, None)
        self._terms = self._targets = self._plan = self.plan = self.values = self.batch_size = None
        self._x = self._tan = None
        self._rows = None
        self._depth = 0
        self.fired = False

    def remove(self) -> None:
        """Remove the hooks from the module."""
        self.disarm()
        for h in self._handles:
            h.remove()
        self._handles = []

    def total(self) -> torch.Tensor:
        """``sum_i w_i penalty_i`` of the last cloned call."""
        if self.values is None:
            raise RuntimeError(f"SharedForward: {type(self.module).__name__} was not called since arm().")
        return self.plan.total(self.values)

    # -- hooks ------------------------------------------------------------------------------
    def _exit(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def _locate(self, args: tuple, kwargs: dict) -> Tuple[Any, Any]:
        """``(x, put)`` where ``put(z)`` returns ``(args, kwargs)`` with the input replaced by ``z``."""
        key, idx = self.input_key, self.input_index
        forward = f"{type(self.module).__name__}.forward"
        if key is not None:
            if key in kwargs:
                return kwargs[key], lambda z: (args, {**kwargs, key: z})
            if idx < len(args) and isinstance(args[idx], Mapping):
                value = args[idx]
                if key not in value:
                    raise ValueError(f"JVPRegularizer: input_key={key!r} is not a key of the dict passed to {forward} "
                                     f"at input_index={idx}; its keys: {_names(value)}. Set input_key to one of them.")
                return value[key], lambda z: (args[:idx] + ({**value, key: z},) + args[idx + 1:], kwargs)
            pos = _positional_index(self.module, key)
            if pos is not None and pos < len(args):
                return args[pos], lambda z: (args[:pos] + (z,) + args[pos + 1:], kwargs)
            raise ValueError(f"JVPRegularizer: input_key={key!r} selects nothing in this call of {forward}"
                             f"{_signature(self.module)}: it received {len(args)} positional argument(s) and the "
                             f"keyword(s) {sorted(kwargs)}. Set input_key to the name of the float input "
                             f"argument (one of {_float_names(args, kwargs, self.module)}).")
        if idx < len(args):
            value = args[idx]
            if isinstance(value, Mapping):
                raise TypeError(f"JVPRegularizer: {forward} received a {type(value).__name__} at input_index={idx}; "
                                f"pass input_key=<the key of the input to regularize> (float tensors in it: "
                                f"{_names(value, floats=True)}).")
            return value, lambda z: (args[:idx] + (z,) + args[idx + 1:], kwargs)
        raise ValueError(f"JVPRegularizer: {forward} got {len(args)} positional "
                         f"argument(s) and keyword(s) {sorted(kwargs)}; input_index={idx} does not select the input. "
                         f"Set input_key to the keyword of the input (one of {_float_names(args, kwargs, self.module)})"
                         " or input_index to its position.")

    def _reject(self, x: Any, args: tuple, kwargs: dict) -> None:
        what = (f"input_key={self.input_key!r}" if self.input_key is not None else f"input_index={self.input_index}")
        got = (f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
               else f"a {type(x).__name__}")
        hint = ""
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            hint = (" Integer inputs (token ids, labels) have no JVP: feed embeddings instead (a Hugging Face "
                    "model takes inputs_embeds=model.get_input_embeddings()(input_ids); then input_key='inputs_embeds'"
                    "), or regularize a submodule that receives float features (module=...).")
        raise TypeError(f"JVPRegularizer: {what} selects {got} in the call of {type(self.module).__name__}.forward; "
                        "clone mode needs a floating-point tensor with a batch dim. Float inputs of this call: "
                        f"{_float_names(args, kwargs, self.module)}.{hint}")

    def _bypass(self, args: tuple, kwargs: dict) -> Any:
        self._busy = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._busy = False

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._busy:
            return None
        if self._plan is not None:  # a nested call inside the cloned one
            self._depth += 1
            return None
        if self._terms is None or self.fired:
            return None
        self.fired = True
        x, put = self._locate(args, kwargs)
        if not _is_float(x) or x.dim() == 0:
            self._reject(x, args, kwargs)
        targets, split = self._targets, False
        rows = subset_rows(self._terms, x, self._row_subset)
        if rows is not None:  # the subset as the clone forward's own primal, the other rows plainly after it
            s, r = rows
            batch = int(x.shape[0])
            self._rows = (s, r, _row_subset.split((args, kwargs), batch, r))
            args, kwargs, targets = _row_subset.split((args, kwargs, targets), batch, s)
            x, put = self._locate(args, kwargs)
            split = True

        def forward(z):
            a, k = put(z)
            return self._bypass(a, k)

        plan = prepare(module, x, self._terms, targets=targets, forward=forward,
                       pack=not self._packs_in_program(module, x, args, kwargs))
        self._plan = plan
        self.batch_size = int(x.shape[0]) if rows is None else int(rows[0].numel() + rows[1].numel())
        if plan.x_in is None:  # packed inside the program, from the arguments as they are
            self._x = x
            return (args, kwargs) if split else None
        self._cm = plan.enter(module, watch=False)  # the shared call watches what it runs eagerly
        return put(plan.x_in)

    def _packs_in_program(self, module: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """Whether this call packs its input inside the program (:meth:`jvpreg.clone.SharedCall.packs`); another
        hook on the module would see the plain arguments and output where it sees the clone batch otherwise (a
        backward hook wraps the arguments)."""
        return self._call.packs(args, kwargs, x, hooks_outside=_hooked_elsewhere(module))

    def _packed_call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """The armed call as one program ``(args, u, s) -> (f(x), J u, s)``; returns ``f(x)``, keeps ``J u``."""
        plan = self._plan
        out, self._tan, plan.scales = self._call.packed(args, kwargs, self._x, plan.u, plan.scales, fn=fn,
                                                        finite=plan.finite)
        return out

    def _post_hook(self, module: nn.Module, args: tuple, output: Any):
        if self._busy or self._plan is None:
            return None
        if self._depth:
            self._depth -= 1
            return None
        plan, self._plan = self._plan, None
        self._exit()
        if plan.x_in is None:
            tan, self._tan, self._x = self._tan, None, None
            out, values = plan.penalties(output, tan)
        else:
            out, values = plan.finish(output)
        self.plan, self.values = plan, values
        if self._rows is not None:
            (s, r, (a, k)), self._rows = self._rows, None
            out = _row_subset.merge(out, self._bypass(a, k) if r.numel() else None, s, r)
        return out
