"""Routing of every torch function that touches a clone batch.

Order of resolution for ``func(*args, **kwargs)`` with at least one clone argument:

1. a registered handler (rules, fast paths; :mod:`jvpreg.clone.core.registry`);
2. in-place ops without a handler: the out-of-place op, then a copy back into the target;
3. all clone arguments are *state* (equal blocks): evaluate on block 0 and repeat;
4. the exact fallback: ``out_0 = func(block 0)`` and, for each tangent block j,
   ``out_j = out_0 + jvp(func)(block 0; block j - block 0)`` with ``torch.func.jvp`` —
   the linearisation of that one op at the primal, which is what every rule computes
   (along the block difference rescaled by a power of two to the primal's size: :func:`_unit_scale`).
   Non-float outputs (masks, indices) are state and are repeated from block 0.
   An op without a forward-mode formula (``cdist``, ``pdist``, ``index_reduce``, ...), or with one torch gets
   wrong (``scatter_reduce(..., "prod")``: :data:`_WRONG_FORWARD_AD`), is linearised in reverse mode instead,
   ``J d = d/dv <J^T v, d>`` (:func:`_reverse_mode_jvp`). An op without any derivative raises
   :class:`UnsupportedOpError`, which names the op and how to register a rule. Never a silently wrong result.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
import warnings
from typing import Any, Callable

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.autograd.function import BackwardCFunction
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from jvpreg.clone.core.errors import CaptureError, JVPFallbackWarning, UnsupportedOpError
from jvpreg.clone.eager.made_tensors import blocks_of, fill_or_refuse, ORIGINAL_OF
from jvpreg.clone.core.registry import (COMPLEX_AFFINE, COMPLEX_AFFINE_MODULES, COMPLEX_EXACT, HANDLERS, REENTRANT,
    op_name, bind_arguments)
from jvpreg.clone.core.session import current
from jvpreg.clone.core.tensor import (CloneTensor, block_delta, capturing, is_clone, stack_blocks, tile, wrap,
    wrap_tree)
from jvpreg.clone.eager.writes import detached_target, write_back


_FALLBACK = {"mode": "jvp"}  # the user's setting: set_fallback, fallback_mode, get_fallback
#: the names of the ops whose fallback warning was given: each is said once per process (clear it to hear them again)
WARNED_FALLBACKS: set = set()
# the lists record_fallbacks collects into, innermost last, scoped by their blocks (they span several clone forwards)
_RECORDS: contextvars.ContextVar = contextvars.ContextVar("jvpreg_fallback_records", default=())


@contextlib.contextmanager
def record_fallbacks():
    """Collect the names of the ops that run through the exact fallback inside the block (yields a list)."""
    seen: list = []
    token = _RECORDS.set(_RECORDS.get() + (seen,))
    try:
        yield seen
    finally:
        _RECORDS.reset(token)


def set_fallback(mode: str) -> None:
    """Choose what ops without a rule do: ``"jvp"`` (exact fallback, default) or ``"error"``."""
    if mode not in ("jvp", "error"):
        raise ValueError(f"set_fallback(mode): expected 'jvp' or 'error', got {mode!r}")
    _FALLBACK["mode"] = mode


def get_fallback() -> str:
    """What ops without a rule do now (:func:`set_fallback`): ``"jvp"`` or ``"error"``."""
    return _FALLBACK["mode"]


@contextlib.contextmanager
def fallback_mode(mode: str):
    """Context manager form of :func:`set_fallback`."""
    old = _FALLBACK["mode"]
    set_fallback(mode)
    try:
        yield
    finally:
        _FALLBACK["mode"] = old


def _how_to_register(func: Callable, name: str) -> str:
    if isinstance(getattr(func, "hint", None), str):  # a TorchScript call (jvpreg.clone.eager.torchscript)
        return func.hint
    function_cls = getattr(func, "function_cls", None)
    if function_cls is not None:  # a custom autograd.Function
        return (
            f"Give {function_cls.__qualname__} `setup_context` and `jvp` staticmethods (torch.func support). Or "
            f"Register a clone rule for it: `@jvpreg.clone.register_function_rule({function_cls.__qualname__})` "
            "on a function `(args, kwargs)` "
            "that returns the clone output; see jvpreg/clone/rules/normalization.py (SyncBatchNorm) for an example."
        )
    return (
        f"Register a clone rule for it: `@jvpreg.clone.register_rule({name})` on a function that "
        "takes the op's arguments (clone arguments arrive as (K, *shape) tensors: block 0 is the "
        "primal, blocks 1.. the tangents) and returns the (K, *out_shape) output; see "
        "jvpreg/clone/rules/ for examples."
    )


def _is_getter(func: Callable) -> bool:
    self_obj = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and type(self_obj).__name__ == "getset_descriptor"


def check_not_custom_output(values: Any) -> None:
    """Raise if a clone argument came out of a custom ``autograd.Function`` that bypassed the engine.

    A reference to ``Fn.apply`` taken before the clone forward began (``f = Fn.apply`` at import)
    calls torch's own ``apply``: the forward still runs op by op through the rules, but ``Fn.backward``
    would differentiate the physical batch as if blocks were samples: wrong gradients."""
    if not torch.is_grad_enabled():
        return
    with DisableTorchFunctionSubclass():
        for v in values:
            if isinstance(v, (list, tuple)):
                check_not_custom_output(v)
            elif type(v) is CloneTensor and isinstance(v.grad_fn, BackwardCFunction) and not v._jvp_routed:
                cls = v.grad_fn._forward_cls
                name = f"{cls.__module__}.{cls.__qualname__}"
                raise UnsupportedOpError(
                    f"jvpreg clone mode: the custom autograd.Function {name} ran on a clone batch through a "
                    f"reference to `{cls.__qualname__}.apply` taken before the clone forward began (for example "
                    f"`f = {cls.__qualname__}.apply` at import time); its backward would treat tangent blocks as "
                    f"samples (wrong gradients). Call `{cls.__qualname__}.apply(...)` where it is used, so that "
                    "jvpreg can route it (a registered rule or the exact fallback).")


def _check_transform_level(func: Callable) -> None:
    """Raise where a clone batch reaches an op inside a ``torch.func`` transform entered during the clone forward: it
    got there by a closure (a transform's arguments are routed: :mod:`jvpreg.clone.eager.nested_transforms`), and functorch
    would treat its blocks as samples (``vmap(lambda w: tanh(x @ w))(W)``: a wrong JVP)."""
    top = torch._C._functorch.peek_interpreter_stack()
    if top is not None and top.level() > current().transform_level:
        raise UnsupportedOpError(
            f"jvpreg clone mode: {op_name(func)} ran on a clone batch inside a torch.func transform (vmap, grad, ...) "
            "that captured it by closure, not as an argument: functorch would treat its blocks as samples (a wrong "
            "JVP). Pass the tensor as an argument of the transformed function (torch.vmap and torch.func.grad "
            "calls with clone arguments are linearised exactly), or move the transform out of the forward.")


def dispatch(func: Callable, args: tuple, kwargs: dict) -> Any:
    func = ORIGINAL_OF.get(func, func)  # a factory that notes what it makes: its rules are the plain one's
    check_not_custom_output(args)
    _check_transform_level(func)
    if kwargs and "out" in kwargs:
        if kwargs["out"] is not None:
            raise UnsupportedOpError(
                f"jvpreg clone mode: {op_name(func)}(..., out=...) is not supported; use the out-of-place form "
                "(a batch tensor cannot be written into a preallocated `out`)."
            )
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}  # `out=None` is the out-of-place call
    if kwargs:
        args, kwargs = bind_arguments(func, args, kwargs)
    a0 = args[0] if args else None
    if type(a0) is CloneTensor and _inplace_name(func) is None:
        with DisableTorchFunctionSubclass():
            if a0.numel() == 0:  # an empty batch input: the op is constant in it (zero tangent)
                return _empty_input(func, args, kwargs)
    handler = HANDLERS.get(func)
    if handler is not None:
        if func in REENTRANT:  # a decomposition: its ops come back here one by one
            return handler(func, args, kwargs)
        with DisableTorchFunctionSubclass():
            if not _complex_clone_in(args, kwargs) or complex_exact(func, handler, args, kwargs):
                return handler(func, args, kwargs)
            # a rule written for real tensors on a complex clone: the exact fallback (torch.func.jvp, holomorphic
            # where the op is); an in-place op through its out-of-place form
            if _inplace_name(func) is None:
                return fallback(func, args, kwargs)
        return generic_inplace(func, args, kwargs)
    body = decomposition(func)
    if body is not None:  # a Python-level torch op: run its body op by op on the clone batch
        return body(*args, **kwargs)
    if _inplace_name(func) is not None:  # the out-of-place op is dispatched as a call of its own
        return generic_inplace(func, args, kwargs)
    with DisableTorchFunctionSubclass():
        if _is_getter(func):  # attributes not listed elsewhere (is_nested, ...): the primal's answer
            out = func(args[0][0])
            if isinstance(out, torch.Tensor):  # a tensor-valued attribute: its tangent is unknown here
                name = op_name(func)
                raise UnsupportedOpError(
                    f"jvpreg clone mode has no rule for the tensor attribute {name}. Register one with "
                    f"`jvpreg.clone.register_handler({name.split(' ')[0]}.__get__)`; see jvpreg/clone/rules/shape.py "
                    "(`.real`, `.H`) for examples.")
            return out
        return generic(func, args, kwargs)


def _complex_clone_in(args: tuple, kwargs: dict) -> bool:
    """Whether a clone argument (or a member of a list argument: ``torch.cat``) is complex; torch-function off."""
    for a in args:
        if type(a) is CloneTensor:
            if a.is_complex():
                return True
        elif type(a) in (list, tuple):
            for t in a:
                if type(t) is CloneTensor and t.is_complex():
                    return True
    return any(type(v) is CloneTensor and v.is_complex() for v in kwargs.values()) if kwargs else False


def _varying_complex(args: tuple, kwargs: dict) -> tuple:
    """``(number of clone arguments with tangents, whether one of them is complex)``, over the arguments and the
    members of list arguments; torch-function off."""
    n, cplx = 0, False
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is CloneTensor and not t._jvp_state:
                if t.is_complex():
                    n, cplx = n + 1, True
                elif t.is_floating_point():
                    n += 1
    return n, cplx


def complex_exact(func: Callable, handler: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``handler`` is exact on these arguments. Rules linearise real functions (tanh through its backward
    kernel, products of "floating" operands): on a complex intermediate (an FFT, ``view_as_complex``) they would
    give wrong tangents, so a complex clone with tangents takes the exact fallback unless the op is linear in every
    argument or written for complex (:data:`registry.COMPLEX_EXACT`), or its handler is affine in its one varying
    argument (:data:`registry.COMPLEX_AFFINE`, :data:`registry.COMPLEX_AFFINE_MODULES`)."""
    if func in COMPLEX_EXACT or handler is state_eval:  # state ops: piecewise constant, evaluated on the primal
        return True
    n, cplx = _varying_complex(args, kwargs)
    if not cplx:
        return True
    return n == 1 and (func in COMPLEX_AFFINE or getattr(handler, "__module__", None) in COMPLEX_AFFINE_MODULES)


def _empty_input(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` whose first (batch) argument has no elements: nothing of the output can depend on it, so
    the op runs once on the primal blocks and every block repeats it (zero tangent); other varying
    clone arguments (a weight) still get their exact tangents through the fallback."""
    flat, spec, idx = flat_clones(args, kwargs)
    if all(flat[i]._jvp_state or flat[i].numel() == 0 or not _is_float(flat[i]) for i in idx):
        return state_eval(func, args, kwargs)
    handler = HANDLERS.get(func)
    return handler(func, args, kwargs) if handler is not None and func not in REENTRANT else fallback(func, args, kwargs)


def without_torch_function_guard(fn: Callable) -> Callable:
    """A copy of a Python op whose ``has_torch_function`` guard is off, so its body runs op by op."""
    g = dict(fn.__globals__)
    for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
        g[name] = lambda *a, **k: False
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


_DECOMPOSED: dict = {}


def decomposition(func: Callable) -> Callable | None:
    """For a Python function of ``torch.nn.functional`` guarded by ``has_torch_function`` (softsign,
    normalize, local_response_norm, losses...), a copy with the guard off, so that its body runs op
    by op through the clone rules; ``None`` for anything else."""
    try:
        return _DECOMPOSED[func]
    except (KeyError, TypeError):
        pass
    body = None
    code = getattr(func, "__code__", None)
    if (code is not None and getattr(func, "__module__", None) in ("torch.nn.functional", "torch.functional")
            and any(n.startswith("has_torch_function") for n in code.co_names)):
        body = without_torch_function_guard(func)
    try:
        _DECOMPOSED[func] = body
    except TypeError:
        pass
    return body


def flat_clones(args: tuple, kwargs: dict) -> tuple:
    """``(flat, spec, idx)``: the leaves of ``(args, kwargs)``, their pytree spec, and the positions of the clone
    batches among them."""
    flat, spec = tree_flatten((args, kwargs))
    idx = [i for i, v in enumerate(flat) if type(v) is CloneTensor]
    return flat, spec, idx


def _inplace_name(func: Callable) -> str | None:
    name = getattr(func, "__name__", "")
    if name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__invert__", "__iter__"):
        return name[3:-2]  # __iadd__ -> add
    if name.endswith("_") and not name.startswith("_") and not name.endswith("__"):
        return name[:-1]
    return None


def generic_inplace(func: Callable, args: tuple, kwargs: dict) -> Any:
    """An in-place op without a handler: its out-of-place op (dispatched as a call of its own, so rules
    written with torch-function on work too), written back into the target."""

    oop = getattr(torch.Tensor, _inplace_name(func), None) or getattr(torch, _inplace_name(func), None)
    if oop is None:
        raise UnsupportedOpError(
            f"jvpreg clone mode: no out-of-place form of in-place op {op_name(func)}. "
            f"{_how_to_register(func, op_name(func))}")
    target = args[0]
    if not is_clone(target):
        out = into_plain_target(func, args, kwargs)
        if out is not NOT_STATE:
            return out
    return write_back(func, target, dispatch(oop, detached_target(args, kwargs), kwargs))


def generic(func: Callable, args: tuple, kwargs: dict) -> Any:
    flat, spec, idx = flat_clones(args, kwargs)
    if all(flat[i]._jvp_state for i in idx):
        return state_eval(func, args, kwargs)
    return fallback(func, args, kwargs)


def block0_args(flat: list, spec, idx: list) -> tuple:
    f0 = list(flat)
    for i in idx:
        f0[i] = flat[i][0]
    return tree_unflatten(f0, spec)


def state_eval(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Evaluate on block 0 and repeat the result in every block (zero tangent)."""
    flat, spec, idx = flat_clones(args, kwargs)
    k = flat[idx[0]].shape[0]
    a_args, a_kwargs = block0_args(flat, spec, idx)
    out = func(*a_args, **a_kwargs)
    return wrap_tree(out, lambda t: wrap(tile(t, k), state=True))


def state_write(func: Callable, args: tuple, kwargs: dict) -> Any:
    """An in-place op into a plain tensor (a buffer, a statistic) whose clone operands are all state (the same in every
    block: detached batch data, a statistic of it): the op on the primal blocks, written as a plain forward writes it
    (``self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))``); :data:`NOT_STATE` where a clone operand carries a
    tangent, which a plain tensor cannot hold."""
    flat, spec, idx = flat_clones(args, kwargs)
    if not all(flat[i]._jvp_state for i in idx):
        return NOT_STATE
    a_args, a_kwargs = block0_args(flat, spec, idx)
    return func(*a_args, **a_kwargs)


NOT_STATE = object()


def into_plain_target(func: Callable, args: tuple, kwargs: dict) -> Any:
    """An in-place op whose target ``args[0]`` is a plain tensor: :func:`state_write`'s result where every clone
    operand is state; else :data:`NOT_STATE`, once the target is known to be a tensor the forward made from sizes and
    may fill with batch data (:func:`~jvpreg.clone.eager.made_tensors.fill_or_refuse`, a clear error otherwise): the
    caller then writes the blocks back."""
    out = state_write(func, args, kwargs)
    if out is NOT_STATE:
        fill_or_refuse(args[0], blocks_of(args[1:], kwargs),
                       f"jvpreg clone mode: in-place {op_name(func)} would write batch data into a tensor created "
                       "outside the batch. Create it from the batch (torch.zeros_like(h), h.new_zeros(...)) or use the "
                       "out-of-place op.")
    return out


def per_block(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Apply an op that is affine in its clone arguments to every block (``torch.vmap``). A mask or index that is a
    clone (state: the same in every block) enters as its primal block, unbatched: ops whose output shape depends
    on a mask's values (``masked_select``) cannot be vmapped over it, and need not be."""
    flat, spec, idx = flat_clones(args, kwargs)
    state = all(flat[i]._jvp_state for i in idx)
    fixed = [i for i in idx if flat[i]._jvp_state and not _is_float(flat[i])]
    if fixed and len(fixed) < len(idx):
        flat = list(flat)
        for i in fixed:
            flat[i] = flat[i].as_subclass(torch.Tensor)[0]
        idx = [i for i in idx if i not in fixed]

    def g(*cs):
        f2 = list(flat)
        for i, c in zip(idx, cs):
            f2[i] = c
        a2, k2 = tree_unflatten(f2, spec)
        return func(*a2, **k2)

    phys = [flat[i].as_subclass(torch.Tensor) for i in idx]
    if capturing():  # a capture records plain ops: one call per block
        outs = [g(*(p[j] for p in phys)) for j in range(phys[0].shape[0])]
        out = tree_map(lambda *ts: torch.stack(ts) if isinstance(ts[0], torch.Tensor) else ts[0], *outs)
        return wrap_tree(out, lambda t: wrap(t, state=state))
    out = torch.vmap(g, in_dims=0, randomness="same")(*phys)
    return wrap_tree(out, lambda t: wrap(t, state=state))


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def rng_state(device: torch.device) -> tuple:
    """The random number generators' state a call on ``device`` draws from: the CPU's, and the device's on CUDA."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, cuda


def set_rng_state(state: tuple, device: torch.device) -> None:
    """Put back the state :func:`rng_state` read."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _forward_ad_checked(g: Callable, primals: tuple, tangents: tuple, name: str):
    """Forward-mode AD of a registered operator, refusing outputs that carry no tangent at all: a
    custom op without an autograd formula would otherwise look like a constant (zero JVP)."""
    from torch.autograd import forward_ad as fwAD

    with fwAD.dual_level():
        fl, out = g(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))
        unpacked = [fwAD.unpack_dual(f) for f in fl]
        if any(u.tangent is None for u in unpacked):
            raise UnsupportedOpError(
                f"jvpreg clone mode: {name} has no forward-mode derivative (no autograd formula is registered "
                "for it), so its JVP is unknown."
            )
        t_fl = tuple(u.tangent for u in unpacked)
        out = tree_map(lambda l: fwAD.unpack_dual(l).primal if isinstance(l, torch.Tensor) else l, out)
    return t_fl, out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Expanded (stride-0) views cannot become dual tensors: materialise them."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def _unit_scale(primals: tuple, tangents: tuple) -> torch.Tensor:
    """``c = 2^round(log2(||x|| / ||d||))`` (1 where either norm is 0 or not finite), a 0-d tensor: the fallback
    differentiates along ``c d`` and divides by ``c`` (exact: powers of two), so ``torch.func.jvp`` sees a tangent of the
    primal's size, not the clone block's ``s u`` (``s`` ~ 2^40 rms(x) / rms(u)). Linear in exact arithmetic, some
    forward-mode formulas are not in floating point: ``matrix_exp``'s (the exponential of ``[[X, D], [0, X]]``, whose
    scaling-and-squaring follows ``||D||``) loses float32's precision along ``s u``, not along ``c d``."""
    with torch.no_grad():
        def norm(ts):
            sq = [torch.linalg.vector_norm(t.detach().abs() if t.is_complex() else t.detach(), dtype=torch.float64)
                  ** 2 for t in ts if t.numel()]
            return torch.stack(sq).sum().sqrt() if sq else torch.ones((), dtype=torch.float64)

        r = norm(primals) / norm(tangents)
        ok = torch.isfinite(r) & (r > 0)
        return torch.where(ok, torch.exp2(torch.round(torch.log2(torch.where(ok, r, 1.0)))), 1.0)


def _no_forward_ad(err: Exception) -> bool:
    """``err`` says torch has no forward-mode formula for an op (its own message, or
    :func:`_forward_ad_checked`'s): where the reverse-mode fallback applies."""
    msg = str(err)
    return (isinstance(err, NotImplementedError) and "forward AD" in msg) or "no forward-mode derivative" in msg


def _reverse_mode_jvp(g: Callable, primals: tuple, tangents: tuple, name: str):
    """``(J d, out)`` by two reverse passes, ``J d = d/dv <J^T v, d>`` (exact at any ``v``: ``J^T v`` is linear in
    ``v``), for ops with a backward formula and no (or a wrong) forward-mode one. Differentiable once more where
    the op's backward is (a penalty's gradient differentiates the op's double backward)."""
    create = torch.is_grad_enabled() and any(p.requires_grad for p in primals)
    if any(p.is_complex() for p in primals):
        raise UnsupportedOpError(f"jvpreg clone mode: {name} has no forward-mode derivative, and the reverse-mode "
                                 "fallback takes real inputs only")
    with torch.enable_grad():
        xs = tuple(p if create and p.requires_grad else p.detach().requires_grad_() for p in primals)
        fl, out = g(*xs)
        if any(f.is_complex() for f in fl):
            raise UnsupportedOpError(f"jvpreg clone mode: {name} has no forward-mode derivative, and the "
                                     "reverse-mode fallback takes real outputs only")
        live = [f for f in fl if f.requires_grad]
        if len(live) < len(fl):  # an input requires grad, so an output that does not has no derivative
            raise UnsupportedOpError(f"jvpreg clone mode: {name} has no derivative (no autograd formula is "
                                     "registered for it), so its JVP is unknown.")
        # J^T v is linear in v, so d/dv <J^T v, d> is the same at every v: a random v, so that a backward that is
        # not differentiable shows (a J^T v without a graph that is not 0), where at v = 0 it would pass as J = 0
        gen = torch.Generator(device=live[0].device if live else "cpu").manual_seed(0)
        vs = [torch.randn(f.shape, generator=gen, dtype=f.dtype, device=f.device).requires_grad_() for f in live]
        gx = torch.autograd.grad(live, xs, vs, create_graph=True, allow_unused=True) if live else [None] * len(xs)
        if any(gi is not None and not gi.requires_grad and bool(gi.any()) for gi in gx):
            raise UnsupportedOpError(f"jvpreg clone mode: {name} has no forward-mode derivative, and its backward "
                                     "is not differentiable, so the reverse-mode fallback cannot take its JVP.")
        inner = [(gi * d).sum() for gi, d in zip(gx, tangents) if gi is not None and gi.requires_grad]
        jd = (torch.autograd.grad(sum(inner), vs, create_graph=create, allow_unused=True) if inner
              else [None] * len(vs))
    by_output = dict(zip(map(id, live), jd))
    t_fl = tuple(torch.zeros_like(f) if by_output.get(id(f)) is None else by_output[id(f)] for f in fl)
    if not create:
        t_fl = tuple(t.detach() for t in t_fl)
        out = tree_map(lambda l: l.detach() if isinstance(l, torch.Tensor) else l, out)
    return t_fl, out


# Ops whose forward-mode formula torch gets wrong (torch's OpInfo database marks them unsupported): the fallback
# takes them in reverse mode. ``(op name, predicate on (args, kwargs))``.
_WRONG_FORWARD_AD = {
    "scatter_reduce": lambda args, kwargs: (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod",
}


def _forward_ad_is_wrong(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Linearise ``func`` in reverse mode: an op of :data:`_WRONG_FORWARD_AD`, or a custom operator (a
    ``torch.library`` op outside aten): torch gives those no forward-mode formula, and for some (torch's own
    chunked ``linear_cross_entropy`` operator) ``torch.func.jvp`` returns a zero tangent instead of an error; and a
    callable marked ``reverse_mode`` (TorchScript: :mod:`jvpreg.clone.eager.torchscript`)."""
    if getattr(func, "reverse_mode", False):
        return True
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace not in ("aten", "prims")
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.split("::")[0] not in ("aten", "prims")
    name = getattr(func, "__name__", "").rstrip("_")
    check = _WRONG_FORWARD_AD.get(name)
    return check is not None and check(args, kwargs)


_FORWARD_AD_LOADED = [False]


def _load_forward_ad() -> None:
    """Load torch's forward-AD decompositions once, with the ``torch.jit.script`` deprecation warning that torch
    raises while loading them silenced (a DeprecationWarning on torch 2.11, a FutureWarning on 2.15): under
    ``-W error`` (pytest's ``filterwarnings = error``) that warning of torch's own would fail every fallback."""
    if _FORWARD_AD_LOADED[0]:
        return
    from torch.autograd import forward_ad as fwAD

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")  # Future- or DeprecationWarning
        with fwAD.dual_level():
            fwAD.make_dual(torch.zeros(1), torch.zeros(1))
    _FORWARD_AD_LOADED[0] = True


def fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Exact per-op linearisation at block 0 with ``torch.func.jvp``, or in reverse mode (two backward passes)
    where torch has no forward-mode formula for the op or a wrong one (see module docstring)."""
    flat, spec, idx = flat_clones(args, kwargs)
    name = op_name(func)
    k = flat[idx[0]].shape[0]
    diff = [i for i in idx if _is_float(flat[i]) and not flat[i]._jvp_state]
    f0 = list(flat)
    for i in idx:
        f0[i] = flat[i][0]

    if not diff:
        return state_eval(func, args, kwargs)
    if capturing():
        raise CaptureError(f"{name} has no clone rule and its exact per-op fallback (torch.func.jvp) runs "
                           "eagerly only")
    for seen in _RECORDS.get():
        seen.append(name)
    if _FALLBACK["mode"] == "error":
        raise UnsupportedOpError(
            f"jvpreg clone mode has no rule for {name} and the fallback is disabled "
            f"(jvpreg.clone.set_fallback('error')). {_how_to_register(func, name)}"
        )

    def g(*xs):
        f2 = list(f0)
        for i, x in zip(diff, xs):
            f2[i] = x
        a2, k2 = tree_unflatten(f2, spec)
        out = func(*a2, **k2)
        leaves, _ = tree_flatten(out)
        fl = tuple(l for l in leaves if _is_float(l))
        if not fl:  # no differentiable output: return a dummy so torch.func.jvp accepts it
            fl = (xs[0].sum() * 0,)
        return fl, out

    _load_forward_ad()
    primals = tuple(_dense(flat[i][0]) for i in diff)
    device = primals[0].device
    rng = rng_state(device) if k > 2 else None
    reverse = _forward_ad_is_wrong(func, args, kwargs)
    tangent_outs = []
    out0 = None

    def linearise(tangents):
        if reverse:
            return _reverse_mode_jvp(g, primals, tangents, name)
        if isinstance(func, torch._ops.OpOverload) or isinstance(func, torch._ops.OpOverloadPacket):
            return _forward_ad_checked(g, primals, tangents, name)
        _, t_fl, out = torch.func.jvp(g, primals, tangents, has_aux=True)
        return t_fl, out

    try:
        for j in range(1, k):
            tangents = tuple(_dense(block_delta(flat[i][j], flat[i][0])) for i in diff)
            c = _unit_scale(primals, tangents)
            tangents = tuple(t * c for t in tangents)
            if rng is not None:
                set_rng_state(rng, device)
            try:
                t_fl, out = linearise(tangents)
            except Exception as err:  # no forward-mode formula: the same derivative in reverse mode
                if reverse or not _no_forward_ad(err):
                    raise
                reverse = True
                if rng is not None:
                    set_rng_state(rng, device)
                t_fl, out = linearise(tangents)
            if out0 is None:
                out0 = out
            tangent_outs.append(tuple(t / c for t in t_fl))
    except UnsupportedOpError as err:
        raise UnsupportedOpError(f"{err} {_how_to_register(func, name)}") from err
    except Exception as err:  # the op refuses dual tensors, or has no derivative at all
        how = "torch.func.jvp of that op, or reverse mode where it has no forward-mode formula"
        raise UnsupportedOpError(
            f"jvpreg clone mode has no rule for {name}, and its exact fallback ({how}) failed: "
            f"{type(err).__name__}: {err}. {_how_to_register(func, name)}"
        ) from err

    leaves, ospec = tree_flatten(out0)
    if not any(isinstance(l, torch.Tensor) for l in leaves):
        return out0  # a query (shape, dtype, item...) answered on the primal block
    if any(isinstance(l, torch.Tensor) and l.layout != torch.strided for l in leaves):
        raise UnsupportedOpError(f"jvpreg clone mode: {name} returns a sparse tensor, which cannot hold the stacked "
                                 "blocks of a clone batch; keep the forward dense (or densify before the call).")
    if name not in WARNED_FALLBACKS and _FALLBACK["mode"] == "jvp" and any(_is_float(l) for l in leaves):
        WARNED_FALLBACKS.add(name)
        warnings.warn(
            f"jvpreg: no clone rule for {name}; using the exact "
            f"{'reverse-mode (two backward passes)' if reverse else 'torch.func.jvp'} fallback, which is "
            f"slower. {_how_to_register(func, name)}",
            JVPFallbackWarning,
            stacklevel=4,
        )
    new_leaves = []
    pos = 0
    for leaf in leaves:
        if _is_float(leaf):
            tail = torch.stack([leaf + t[pos] for t in tangent_outs])
            pos += 1
            new_leaves.append(wrap(stack_blocks(leaf, tail)))
        elif isinstance(leaf, torch.Tensor):
            new_leaves.append(wrap(tile(leaf, k), state=True))
        else:
            new_leaves.append(leaf)
    return tree_unflatten(new_leaves, ospec)
