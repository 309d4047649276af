"""The clone batch: K blocks of one logical tensor, stored as one physical tensor.

Block layout (stated once, enforced here): a :class:`CloneTensor` of logical shape ``L``
is stored as a tensor of physical shape ``(K, *L)``. Block 0 is the primal ``a``; block
``j >= 1`` is ``a + s_j * t_j`` where ``t_j`` is the j-th tangent carried through the
network and ``s_j`` its scale (difference form, docs/design.md §1). Every consumer of the
tensor sees the *logical* shape ``L`` (``x.shape``, ``x.size()``, ``len(x)``, ``x.dim()``),
exactly as in a plain forward of the primal alone, so user code that builds shapes,
masks or constants from its inputs behaves as it does without jvpreg. This is what
makes the engine safe for parameters and constants: only tensors that descend from
the clone input are ``CloneTensor`` objects, whatever their shape.

Every torch function that receives a ``CloneTensor`` is routed through the dispatcher of
the running clone forward's session (:mod:`jvpreg.clone.core.session`;
:func:`jvpreg.clone.eager.dispatch.dispatch`), which picks, in this order: a registered rule (nonlinear ops,
state computed from block 0), a fast path (affine and shape ops), or the exact
fallback (``torch.func.jvp`` of that one op at block 0). Inside handlers the
subclass' torch-function is disabled, so a ``CloneTensor`` behaves as its
physical ``(K, *L)`` tensor there.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch._C import DisableTorchFunctionSubclass
from jvpreg.clone.core.errors import CaptureError
from jvpreg.clone.core.session import current


class CloneTensor(torch.Tensor):
    """K blocks (primal + tangents) of one logical tensor; see the module docstring.

    Do not build one by hand: use :func:`jvpreg.clone.pack` or :func:`jvpreg.jvp`.
    The attribute ``_jvp_state`` marks tensors whose blocks are all equal (masks,
    indices, constants derived from the primal); their tangent is zero.
    """

    _jvp_state: bool = False
    _jvp_owns: bool = False  # the first clone over all of its storage's base (see wrap): not a view, to autograd
    _jvp_routed: bool = False  # output of a custom autograd.Function routed by jvpreg.clone.eager.functions

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        session = current()
        if session is None:
            if func in METADATA:  # the physical batch's, as autograd saw it inside a rule
                with DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            if torch._guards.TracingContext.try_get() is not None:  # Dynamo wrapping a clone batch as a graph input
                raise RuntimeError(
                    "jvpreg clone mode: a clone batch (from jvpreg.clone.pack or call) crossed into a torch.compile-d "
                    "graph, which cannot hold one. Keep pack, call and unpack together in one function decorated "
                    "with @torch.compiler.disable, or use jvpreg.jvp / the penalties, which run between the graphs.")
            raise RuntimeError(
                f"jvpreg clone mode: {getattr(func, '__name__', func)} was called on a clone batch outside a clone "
                "forward. Run the forward with jvpreg.clone.call(model, clones) (or jvpreg.jvp), which also "
                "routes custom autograd.Functions; read its output with jvpreg.clone.unpack.")
        return session.dispatch(func, args, kwargs or {})

    def as_subclass(self, cls):
        # While a capture traces the clone forward (jvpreg.clone.program.capture), the physical tensor is
        # the tracked one: ``as_subclass`` itself is invisible to the tracer.
        if cls is torch.Tensor:
            session = current()
            if session is not None and session.tracer is not None:
                return tracked_phys(self)
        return torch.Tensor.as_subclass(self, cls)

    def __repr__(self, *, tensor_contents=None):  # pragma: no cover - cosmetic
        with DisableTorchFunctionSubclass():
            k = self.shape[0]
            return f"CloneTensor(blocks={k}, logical_shape={tuple(self.shape[1:])}, primal=\n{self[0]!r})"


# Libraries that pick an array backend from the array's class module (opt_einsum's and autoray's ``infer_backend``:
# ``x.__class__.__module__.split('.')[0]``, reached by tensorly's opt_einsum plugin in neuraloperator's FNO) must
# see a clone batch as torch's own tensor: under "jvpreg" they fall back to numpy, which cannot hold it. The class
# stays importable as jvpreg.clone.core.tensor.CloneTensor; a clone batch never outlives its forward, so nothing pickles
# it by this name.
CloneTensor.__module__ = "torch"

#: getters of metadata (shape, dtype, ...) answered outside a clone forward too, for the physical batch: a clone that
#: autograd saved inside a rule (subclass dispatch off) reads so there, and torch.utils.checkpoint compares those reads
#: with the same reads after its recomputation (a table, filled by :mod:`jvpreg.clone.rules.shape`)
METADATA: set = set()


def compiling() -> bool:
    """True while :mod:`jvpreg.clone.program.capture` records a program for ``engine="compiled"``: a rule may pick the
    formulation Inductor fuses best over the one with the fewest ops."""
    session = current()
    return session is not None and session.tracer is not None and session.compiling


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def any_autocast() -> bool:
    """Whether autocast is on for some device type (one call; ``True`` on a torch without that query)."""
    return _ANY_AUTOCAST()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False for a device type autocast does not know (``meta``)."""
    if not _ANY_AUTOCAST():  # one call in the usual case
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # a device type without autocast, or an older torch signature
        return False


def capturing() -> bool:
    """True while :mod:`jvpreg.clone.program.capture` records a clone forward (a value read by Python would raise)."""
    session = current()
    return session is not None and session.tracer is not None


def track(clone: CloneTensor, phys: torch.Tensor) -> CloneTensor:
    """While capturing: make the tracer see ``clone`` as the tracked physical tensor ``phys``."""
    session = current()
    tracer = None if session is None else session.tracer
    if tracer is not None:
        from torch.fx.experimental import proxy_tensor

        clone._jvp_phys = phys
        proxy_tensor.set_proxy_slot(clone, tracer, proxy_tensor.get_proxy_slot(phys, tracer))
    return clone


def tracked_phys(clone: CloneTensor) -> torch.Tensor:
    """While capturing: the tracked physical tensor that stands for ``clone`` (:func:`track`); a clone whose metadata
    changed since, or that was made outside the capture, cannot be recorded (:class:`CaptureError`)."""
    phys = getattr(clone, "_jvp_phys", None)
    with DisableTorchFunctionSubclass():
        same = phys is not None and phys.shape == clone.shape and phys.stride() == clone.stride()
    if not same:

        raise CaptureError("a clone tensor changed its metadata in place (or was created outside the capture)")
    return phys


def is_clone(x: Any) -> bool:
    """True for a :class:`CloneTensor`."""
    return type(x) is CloneTensor


def is_state(x: Any) -> bool:
    """True for a clone whose blocks are all equal (zero tangent)."""
    return type(x) is CloneTensor and x._jvp_state


def primal_block(t: Any) -> Any:
    """Block 0 of a clone; anything else unchanged."""
    return t[0] if type(t) is CloneTensor else t


def kept_primal(t: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """Block 0 of a physical ``(K, ...)`` tensor, for a rule whose ops keep it for backward: a copy under
    autograd (a view would keep every block alive until backward, where the tangent blocks are read only
    once, for ``d_j``), the view otherwise. One block held per rule instead of ``K``. ``memory_format``: the
    copy's layout (``torch.contiguous_format`` for a rule whose products would each copy a permuted view)."""
    a = t[0]
    return a.clone(memory_format=memory_format) if torch.is_grad_enabled() and a.requires_grad else a


def varies(t: Any) -> bool:
    """``t`` is a clone that carries tangents (not a constant, not state)."""
    return type(t) is CloneTensor and not t._jvp_state


def block_delta(z: torch.Tensor, a: torch.Tensor, *, nonfinite: bool = True) -> torch.Tensor:
    """``z - a``: tangent blocks ``z`` minus the primal ``a``, with the non-finite convention.

    Non-finite primal entries: the difference form cannot carry a tangent on them. An entry that
    holds the same infinity in a block and in the primal (a ``-inf`` mask, a ``masked_fill`` with
    ``-inf``: constants shared by every block) has difference 0, not ``inf - inf = NaN``; every
    other difference is the plain one (a NaN primal keeps NaN tangents: never a wrong finite value).
    Equal *finite* entries are not touched, so gradients through ``z - a`` stay exact.
    ``nonfinite=False``: the plain ``z - a``, for rules whose output is NaN wherever an entry of the primal is
    infinite whatever its tangent (a normalisation: the entry is in its row's statistics).

    With gradients disabled, every equal entry is filled (``z == a`` alone: an equal finite entry's difference is 0
    anyway, ``-0.0 - 0.0 = -0.0`` becoming ``0.0``): two kernels fewer, equal values. The choice follows grad mode
    only, which a captured program is guarded on; not whether ``z`` or ``a`` requires grad: a program recorded while
    the parameters did not would replay the fill's zero gradient at equal entries once they do.
    """
    d = z - a
    if not nonfinite:
        return d
    if torch.is_grad_enabled():
        return d.masked_fill(torch.isnan(d) & (z == a), 0)
    return d.masked_fill(z == a, 0)


def each_block(fn: Callable[[torch.Tensor], torch.Tensor], d: torch.Tensor) -> torch.Tensor:
    """``[fn(d_1); ...; fn(d_{K-1})]`` for a kernel that needs its argument shaped like the primal (a backward
    kernel taking the tangent as its ``grad``); one call, no stack, for the usual single tangent."""
    if d.shape[0] == 1:
        return fn(d[0]).unsqueeze(0)
    return torch.stack([fn(b) for b in d.unbind(0)])


def delta_blocks(t: Any, *, nonfinite: bool = True) -> torch.Tensor | None:
    """``block_j - block_0`` for j >= 1 of a varying clone (:func:`block_delta`); ``None`` for constants
    and state."""
    return block_delta(t[1:], t[0], nonfinite=nonfinite) if varies(t) else None


def wrap(phys: torch.Tensor, state: bool = False) -> CloneTensor:
    """View a physical ``(K, *L)`` tensor as a :class:`CloneTensor`."""
    session = current()
    tracer = None if session is None else session.tracer
    if type(phys) is CloneTensor:
        with DisableTorchFunctionSubclass():
            out = torch.Tensor.as_subclass(phys, CloneTensor)
            claim(out, phys)
            if tracer is not None:
                phys = tracked_phys(phys)
    else:
        out = phys.as_subclass(CloneTensor)
        claim(out, phys)
    if state:
        out._jvp_state = True
    if tracer is not None:
        track(out, phys)
    return out


def claim(out: CloneTensor, phys: torch.Tensor) -> None:
    """``out`` owns the base of ``phys``'s storage if it covers all of it and no clone owned it before.

    A clone is an autograd alias of its physical batch, so autograd takes every clone for a view. The owner stands
    for the op's own result, a tensor of its own (``._base`` is ``None``; its gradient hooks go on the base, where
    they survive an in-place update: :mod:`jvpreg.clone.rules.shape`); a later clone over the same base (a view op
    on the owner, ``x.view(-1)``) is a view of it, as the plain op's result is. Called with the subclass' torch
    function off."""
    base = phys._base
    if base is None:
        base = phys
    if "_jvp_owned" not in base.__dict__ and covers(phys, base):
        base._jvp_owned = True
        out._jvp_owns = True


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage; 0 for a tensor without one (a ``torch.func`` transform's wrapper)."""
    try:
        return t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return 0


def covers(x: torch.Tensor, base: torch.Tensor) -> bool:
    """``x`` aliases every element of ``base``, each once, in order: the same layout, or both contiguous from the
    same start (a batch a rule computed in another shape and reshaped). A view without storage (under a
    ``torch.func`` transform) covers nothing."""
    if x is base:
        return True
    try:
        if x.data_ptr() != base.data_ptr() or x.numel() != base.numel():
            return False
    except RuntimeError:
        return False
    if x.shape == base.shape and x.stride() == base.stride():
        return True
    return x.is_contiguous() and base.is_contiguous()


def raw(x: torch.Tensor) -> torch.Tensor:
    """The physical ``(K, *L)`` tensor of a clone as a plain tensor (a view, no copy); a plain tensor itself
    (a new alias of it would be invisible to a capture's tracer, so recorded as a constant)."""
    if type(x) is torch.Tensor:
        return x
    with DisableTorchFunctionSubclass():
        return x.as_subclass(torch.Tensor)


def tile(t: torch.Tensor, k: int) -> torch.Tensor:
    """Physical ``(k, *t.shape)`` tensor repeating ``t`` in every block (materialized)."""
    return t.unsqueeze(0).expand(k, *t.shape).clone()


def stack_blocks(first: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Physical ``[first; rest]`` (``rest``: ``(K-1, *L)``) whose blocks keep ``first``'s memory layout.

    ``torch.cat`` of ``first[None]`` would make every block contiguous: a channels-last primal (what a plain
    forward has after a channels-last convolution) would turn contiguous, and the next kernels (BatchNorm's
    statistics, convolutions) would take another code path than in the plain forward and differ in the last
    bits. The cat runs in ``first``'s physical dim order instead (free permutes, one copy as before).
    """
    if first.dim() < 2 or first.is_contiguous():
        return torch.cat([first.unsqueeze(0), rest])
    order = sorted(range(first.dim()), key=lambda d: -first.stride(d))
    inv = sorted(range(first.dim()), key=lambda i: order[i])
    out = torch.cat([first.permute(order).unsqueeze(0), rest.permute(0, *[d + 1 for d in order])])
    return out.permute(0, *[i + 1 for i in inv])


def wrap_tree(out: Any, wrap_fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``wrap_fn`` to every tensor leaf of a (possibly nested) output."""
    if isinstance(out, torch.Tensor):
        return wrap_fn(out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple (torch.return_types)
        return type(out)(*(wrap_tree(o, wrap_fn) for o in out))
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_tree(o, wrap_fn) for o in out)
    if isinstance(out, dict):
        return {k: wrap_tree(v, wrap_fn) for k, v in out.items()}
    return out


def iter_clones(tree: Any) -> Iterable[CloneTensor]:
    """Every :class:`CloneTensor` inside nested lists/tuples/dicts."""
    if type(tree) is CloneTensor:
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from iter_clones(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from iter_clones(t)


def any_clone(args: tuple, kwargs: dict | None = None) -> bool:
    """Fast check (one level of lists/tuples) for a clone among arguments."""
    for a in args:
        t = type(a)
        if t is CloneTensor:
            return True
        if t is list or t is tuple:
            for b in a:
                if type(b) is CloneTensor:
                    return True
    if kwargs:
        return any_clone(tuple(kwargs.values()))
    return False


def neg_dim(dim: int, ndim: int) -> int:
    """Express a logical dim as a negative index, valid for block 0, tangents and phys alike."""
    if ndim == 0:
        if dim in (0, -1):
            return -1
        raise IndexError(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim - ndim if dim >= 0 else dim


def phys_dim(dim: int, ndim: int) -> int:
    """Physical (non-negative) dim of a ``(K, *L)`` tensor for logical dim ``dim``."""
    if ndim == 0:
        return 1
    return (dim % ndim) + 1 if -ndim <= dim < ndim else _bad_dim(dim, ndim)


def _bad_dim(dim: int, ndim: int) -> int:
    raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
