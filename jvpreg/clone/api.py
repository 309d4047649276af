"""Public entry points: ``jvp`` (drop-in for ``torch.func.jvp``), ``jvp_params``, ``pack``/``unpack``.

Scale choice (difference form, docs/design.md §1). Block j is ``x + s_j u_j`` with one power-of-two
scale per tangent, ``s_j = 2^round(log2(R * rms(x) / rms(u_j)))``, ``R = 2^40`` (``2^2`` when the
primals are float16 or float16 autocast is on, to stay clear of its 65504 range). Because every
rule is linear in ``z_j - a``, ``(y_j - y_0) / s_j`` equals ``J u_j`` up to rounding, whose relative
size is about ``eps * (1 + |y_0| / |s_j J u_j|)`` at each layer: a tangent block that dominates
its primal (large ``s_j``) keeps the float32 error near machine precision, also where the output
is dominated by a bias (Inception-v3's logits: |y_0| / |J u| ~ 3e3, 1e-4 error with R = 2^10) and where the
network barely depends on its input (timm's ConvMixer-768/32 at random init: |y_0| / |J u| ~ 1e11, float32 error
5.4e-2 with R = 2^20, 3.4e-4 with R = 2^40, where torch.func.jvp's own float32 error is 3.3e-4). Block values stay far
from float32's range (2^40 rms(x) ~ 1e12 rms(x) against 3e38), and a penalty's gradients through the blocks are
divided by ``s_j`` only to be multiplied back by values of size ``s_j``. Where ``x`` holds entries so close to the
end of its dtype's range that a block overflows (no scale gives the difference resolution there), the host raises
:class:`~jvpreg.clone.eager.dispatch.UnsupportedOpError` rather than return an infinite tangent (:func:`_check_blocks_fit`).
Nothing but rounding depends on ``R``: block values only pass through affine ops, and every
nonlinearity reads its state from the primal block. Powers of two make the
scaling itself exact. The scale is one number per tangent, not per sample: ops that mix samples
(train-mode BatchNorm, attention over the batch) would not commute with per-sample scales.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_map, tree_unflatten

from jvpreg.clone import callables
from jvpreg.clone.program import capture
from jvpreg.clone.eager import stored_clones
from jvpreg.clone.eager.compiled_code import between_graphs
from jvpreg.clone.eager.forward import active
from jvpreg.clone.eager.parameter_slots import swapped_tensors
from jvpreg.clone.core.device_paths import on_host
from jvpreg.clone.core.errors import BatchWriteError, UnsupportedOpError
from jvpreg.clone.eager.dispatch import check_not_custom_output, rng_state, set_rng_state
from jvpreg.clone.core.tensor import autocast_enabled, block_delta, capturing, is_clone, wrap

_R_DEFAULT = 2.0 ** 40
_R_HALF = 2.0 ** 2


def _ratio(dtype: torch.dtype, device_type: str) -> float:
    if dtype == torch.float16:
        return _R_HALF
    if not autocast_enabled(device_type):
        return _R_DEFAULT
    try:
        return _R_HALF if torch.get_autocast_dtype(device_type) == torch.float16 else _R_DEFAULT
    except (TypeError, RuntimeError, AttributeError):  # torch before 2.4
        return _R_DEFAULT


def choose_scales(pairs: Sequence[tuple], k: int, ratio: float | None = None) -> torch.Tensor:
    """Per-tangent power-of-two scales ``s_j`` (shape ``(k,)``) for ``(primal, tangents (k, ...))`` pairs."""
    return _choose_scales(pairs, k, ratio)[0]


def host_scales(ref: torch.Tensor) -> bool:
    """Whether the scales of a clone forward on ``ref``'s device are chosen by the host (on the CPU, where reading a
    norm costs nothing) or by kernels (:func:`device_scales`: on an accelerator a read would wait for the device)."""
    return on_host(ref)


_SHARED_SCALES: Dict[tuple, torch.Tensor] = {}  # read-only CPU scale tensors by value (jvp's program inputs)


def _choose_scales(pairs: Sequence[tuple], k: int, ratio: float | None = None, shared: bool = False) -> tuple:
    """:func:`choose_scales`, and ``True`` if every entry of the pairs is finite (``None``: not known, on a
    device; a float64 norm is finite only if every entry is, so on the CPU this comes free). ``shared``: the
    CPU tensor may be one shared by calls with the same scales (for a caller that never writes to it)."""
    ref = pairs[0][0]
    if host_scales(ref):  # rms(x) / rms(u_j) = ||x|| / ||u_j|| of the finite entries: Python scalars, no kernel
        ratio = _ratio(ref.dtype, "cpu") if ratio is None else ratio
        xs, us, finite = [], [[] for _ in range(k)], True
        for x, u in pairs:
            nx, fx = _finite_norms(x, 1)
            nu, fu = _finite_norms(u, k)
            xs.append(nx[0])
            for acc, n in zip(us, nu):
                acc.append(n)
            finite = finite and fx and fu
        nx = (xs[0] if len(xs) == 1 else math.hypot(*xs)) or 1.0  # hypot: no square to underflow or overflow
        top = _max_exponent(ref.dtype)
        s = tuple(_power_of_two(ratio, nx, n[0] if len(n) == 1 else math.hypot(*n), top) for n in us)
        _check_blocks_fit(pairs, xs, us, s)
        if not shared:
            return torch.tensor(s, dtype=torch.float64), finite
        t = _SHARED_SCALES.get(s)
        if t is None:
            if len(_SHARED_SCALES) > 256:
                _SHARED_SCALES.clear()
            t = _SHARED_SCALES[s] = torch.tensor(s, dtype=torch.float64)
        return t, finite
    ratio = _ratio(ref.dtype, ref.device.type) if ratio is None else ratio
    return device_scales(pairs, k, ratio), None


def _check_blocks_fit(pairs: Sequence[tuple], xs: Sequence[float], us: Sequence[Sequence[float]],
                      s: Sequence[float]) -> None:
    """Raise :class:`UnsupportedOpError` where a block ``x + s_j u_j`` overflows although ``x`` and ``u_j`` are finite
    (entries of ``x`` near the end of the dtype's range: the difference form has no resolution there, and an infinite
    block would give an infinite tangent where the JVP is finite). Free in the usual case: ``|x| + s_j |u_j|`` is
    bounded by the norms ``xs``, ``us`` (``s_j ||u_j|| ~ 2^40 ||x||``); checked entry by entry only where that bound
    passes half the range. On an accelerator nothing is read: such a block gives an infinite tangent there."""
    for i, (x, u) in enumerate(pairs):
        if not (x.is_floating_point() or x.is_complex()):
            continue
        big = torch.finfo(x.dtype).max
        if all(xs[i] + sj * n[i] < big / 2 for sj, n in zip(s, us)):
            continue
        x0, u0 = x.detach(), u.detach()
        sv = torch.tensor(s, dtype=torch.float64).to(x0.dtype).reshape(-1, *([1] * x0.dim()))
        over = ~torch.isfinite(x0.unsqueeze(0) + sv * u0) & torch.isfinite(x0).unsqueeze(0) & torch.isfinite(u0)
        if bool(over.any()):
            largest = float(x0.abs().nan_to_num(0.0, 0.0, 0.0).amax())
            raise UnsupportedOpError(
                f"jvpreg: the clone batch cannot hold this direction: x + s*u overflows {x0.dtype} where x and u are "
                f"finite (|x| up to {largest:.3g}, s = 2^{round(math.log2(max(s)))}; the largest {x0.dtype} is "
                f"{big:.3g}). The difference form has no resolution that close to the end of the range: rescale the "
                "input (divide it by a power of two), or use torch.func.jvp for this call.")


def device_scales(pairs: Sequence[tuple], k: int, ratio: float) -> torch.Tensor:
    """:func:`choose_scales` in kernels, with no host synchronisation (tensors on an accelerator).

    ``s_j = 2^clamp(round(log2(ratio) + log2 ||x|| - log2 ||u_j||))``, in as few kernels as the rules allow (each is
    a launch on a GPU, where a small model's JVP is launch-bound): 15 for one float32 pair, 28 before. The special
    cases are folded into ``nan_to_num`` of the logs instead of masks: ``||x|| = 0`` counts as 1 (``log2`` 0), an
    infinite ``||x||`` as a log above every exponent (the largest scale), and ``||u_j|| = 0`` or infinite makes the
    exponent infinite, which becomes 0 (``s_j = 1``). Same values as the host's choice, bit for bit (the same
    float64 operations in the same order)."""
    ref = pairs[0][0]
    with torch.no_grad():
        xs, us = [], []
        for x, u in pairs:
            xs.append(_device_norms(torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0, neginf=0.0).reshape(1, -1)))
            us.append(_device_norms(torch.nan_to_num(u.detach(), nan=0.0, posinf=0.0, neginf=0.0).reshape(k, -1)))
        nx = _scaled_norms(torch.stack(xs, 1))[0] if len(xs) > 1 else xs[0][0]
        nu = _scaled_norms(torch.stack(us, 1)) if len(us) > 1 else us[0]
        top = _max_exponent(ref.dtype)  # log2 of each factor: no quotient to overflow
        log_x = torch.nan_to_num(torch.log2(nx), neginf=0.0, posinf=_BEYOND_EXPONENTS) + math.log2(ratio)
        e = torch.nan_to_num(torch.round(log_x - torch.log2(nu)), nan=0.0, posinf=0.0, neginf=0.0)
        return torch.exp2(_clamp_exponent(e, top))


_BEYOND_EXPONENTS = 2.0 ** 20  # a log2 above any float's exponent range (float64's is 1024), minus any finite log2


def _power_of_two(ratio: float, nx: float, nu: float, top: int) -> float:
    """``2^round(log2(ratio nx / nu))``, in logs (a tangent 1e-30 times the primal's size would overflow the
    quotient), kept representable in the primal's dtype (:func:`_clamp_exponent`); 1 where ``nu`` is 0 or not
    finite. ``nx`` may be infinite (the norm of entries near the dtype's maximum overflows): the largest scale."""
    if not 0 < nu < math.inf:
        return 1.0
    e = math.log2(ratio) + math.log2(nx) - math.log2(nu)
    return 2.0 ** _clamp_exponent(round(e) if e < math.inf else top + 1, top)


def _clamp_exponent(e, top: int):
    """``e`` where ``2^e`` is representable (``-top <= e <= top``); above, ``top - SCALE_MARGIN``: the blocks
    ``x + s u`` then stay 2^SCALE_MARGIN below the dtype's largest number (a float32 primal of size 1e30, whose
    2^40 |x| / |u| float32 cannot hold); below, ``-top``. Works on ints and on tensors."""
    if isinstance(e, torch.Tensor):
        return torch.where(e > top, top - SCALE_MARGIN, e).clamp(min=-top)
    return top - SCALE_MARGIN if e > top else max(-top, e)


SCALE_MARGIN = 4


def _max_exponent(dtype: torch.dtype) -> int:
    """The largest ``e`` with ``2^e`` a finite number of ``dtype`` (15 for float16, 127 for float32)."""
    info = torch.finfo(dtype if dtype.is_floating_point else torch.float32)
    return int(math.log2(info.max))


def _device_norms(rows: torch.Tensor) -> torch.Tensor:
    """Float64 norms of the rows: directly for float32 and narrower entries (their squares stay within float64's
    range), scaled first for float64 ones (:func:`_scaled_norms`)."""
    if rows.dtype == torch.float64:
        return _scaled_norms(rows)
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)


def _scaled_norms(rows: torch.Tensor) -> torch.Tensor:
    """Float64 norms of the rows of a 2-d tensor, each row divided by its largest magnitude first, so that no square
    underflows (a float32 tangent of entries 1e-25) or overflows."""
    rows = rows.to(torch.float64)
    if rows.shape[1] == 0:  # empty rows: norm 0
        return rows.new_zeros(rows.shape[0])
    top = rows.abs().amax(dim=1, keepdim=True)
    top = torch.where(top > 0, top, 1.0)
    return top[:, 0] * torch.linalg.vector_norm(rows / top, dim=1)


_UNDERFLOW = 2.0 ** -50  # a float32 norm below this may have lost squares to underflow (entries below ~1e-19)


def _finite_norms(rows: torch.Tensor, k: int) -> tuple:
    """Norms of the ``k`` rows of a CPU tensor (``k=1``: the whole tensor), counting finite entries only, and
    whether every entry was finite.

    First in float32 (a third of float64's time): a finite norm means finite entries; an infinite one (an
    infinity, or an overflow) is redone in float64 over the finite entries and says "not known finite", and a tiny
    or zero one (squares of entries below ~1e-19 underflow float32) is redone with every row scaled first."""
    if rows.requires_grad:
        rows = rows.detach()
    low = rows.dtype if rows.dtype in (torch.float32, torch.float64) else torch.float32
    if k == 1:  # the norm of the whole tensor, no reshape
        norms = [torch.linalg.vector_norm(rows, dtype=low).item()]
    else:
        norms = torch.linalg.vector_norm(rows.reshape(k, -1), dim=1, dtype=low).tolist()
    finite = all(map(math.isfinite, norms))
    if finite and min(norms) > _UNDERFLOW:
        return norms, True
    # an infinity or an overflow (then: "not known finite"), or a norm whose squares may have underflowed
    rows = rows.reshape(k, -1)
    if not finite:
        rows = torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
    return _scaled_norms(rows).tolist(), finite


def scales(pairs: Sequence[tuple], k: int, scale: Any = "auto") -> torch.Tensor:
    """The ``(k,)`` float64 scales of one clone forward: :func:`choose_scales` for ``"auto"``, else ``scale``
    for every tangent (a positive finite number). ``pairs``: ``(value, tangents (k, *value.shape))``."""
    return _scales(pairs, k, scale)[0]


def _scales(pairs: Sequence[tuple], k: int, scale: Any = "auto", shared: bool = False) -> tuple:
    """:func:`scales` and, for ``"auto"`` on the CPU, whether the pairs are all finite (else ``None``)."""
    if scale == "auto":
        return _choose_scales(pairs, k, shared=shared)
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale: expected 'auto' or a positive finite number, got {scale!r}")
    return torch.full((k,), float(scale), dtype=torch.float64, device=pairs[0][0].device), None


@between_graphs
def checked_scales(pairs: Sequence[tuple], k: int, scale: Any = "auto") -> tuple:
    """``(s, finite)``: :func:`scales`, and whether every entry of the pairs is finite (``None`` where not known: on
    an accelerator, or with a fixed ``scale``), which a captured program's guard takes
    (:func:`jvpreg.clone.program.capture.call`'s ``finite``). A CPU ``s`` may be shared by calls with the same scales: read
    it, never write to it."""
    return _scales(pairs, k, scale, shared=True)


def clone_of(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, *, state: bool = False) -> torch.Tensor:
    """The clone batch ``[x; x + s_1 u_1; ...]`` of ``x`` carrying tangents ``u`` (shape ``(k, *x.shape)``)."""
    sv = s.to(x.dtype if x.is_floating_point() else torch.float32).reshape(-1, *([1] * x.dim()))
    return wrap(torch.cat([x.unsqueeze(0), x.unsqueeze(0) + sv * u]), state=state)


@between_graphs
def pack(primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor], *, scale: Any = "auto",
         extra_pairs: Sequence[tuple] = ()) -> tuple:
    """Build clone batches for ``primals`` carrying ``tangents`` (each of shape ``(k, *primal.shape)``).

    Returns ``(clones, scales)``: one :class:`CloneTensor` per primal (logical shape = the primal's)
    and the ``(k,)`` scales to pass to :func:`unpack`. ``extra_pairs`` joins other
    ``(value, tangent)`` pairs (parameters) to the scale choice.
    """
    k = tangents[0].shape[0] if tangents else extra_pairs[0][1].shape[0]
    pairs = list(zip(primals, tangents)) + list(extra_pairs)
    s = scales(pairs, k, scale)
    return tuple(clone_of(x, u, s) for x, u in zip(primals, tangents)), s


@between_graphs
def unpack(out: Any, scales: torch.Tensor, *, batched: bool = True) -> tuple:
    """Split a clone forward's output into ``(primal_output, tangent_output)`` pytrees.

    Tangent leaves have a leading ``k`` dim when ``batched`` (else ``k`` must be 1 and is dropped).
    Outputs that do not depend on the batch get zero tangents.
    """
    k = scales.shape[0]

    def split(leaf):
        if is_clone(leaf):
            p = leaf.as_subclass(torch.Tensor)
            # both reads through one split: under autograd its backward is one concatenation, where a select and a
            # slice each fill a zero tensor of the whole batch (then added)
            first, rest = p.split([1, p.shape[0] - 1])
            y0 = first.squeeze(0)
            if y0.is_floating_point() or y0.is_complex():
                sv = scales.to(p.dtype).reshape(-1, *([1] * y0.dim()))
                d = rest - y0  # block_delta's non-finite fix changes nothing where no difference is NaN
                # (checked on the host for free; a captured program keeps the fix where an infinity can reach it)
                if not on_host(d) or capturing() or bool(torch.isnan(d).any()):
                    d = block_delta(rest, y0)
                t = d / sv
            else:
                t = torch.zeros((k, *y0.shape), dtype=y0.dtype, device=y0.device)
            return y0, (t if batched else t[0])
        if isinstance(leaf, torch.Tensor):
            z = torch.zeros((k, *leaf.shape) if batched else leaf.shape, dtype=leaf.dtype, device=leaf.device)
            return leaf, z
        stored_clones.release_object(leaf)  # its tensors: their primal, as a plain forward returns them
        return leaf, None

    leaves, spec = tree_flatten(out)
    check_not_custom_output(leaves)
    pairs = [split(l) for l in leaves]
    return tree_unflatten([p[0] for p in pairs], spec), tree_unflatten([p[1] for p in pairs], spec)


def primal_of(out: Any) -> Any:
    """The primal block of every clone leaf (e.g. an ``aux`` output)."""
    return tree_map(lambda l: l.as_subclass(torch.Tensor)[0] if is_clone(l) else l, out)


_COMPLEX = ("{where}: {what} has dtype {dtype}; clone mode supports real floating-point tensors only (its rules "
            "linearise real functions: tanh, sigmoid and products would give wrong complex tangents). Use "
            "torch.func.jvp for complex inputs, or pass the real and imaginary parts (torch.view_as_real) as "
            "real tensors.")


def _refuse_vmap(where: str) -> None:
    """A clear error inside ``torch.func.vmap``, whose batched tensors have no values Python can read (the scale
    ``s`` is chosen from the tangents' norms; the guards read finiteness): the stacked-tangent call is the fast way."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(i.key() == torch._C._functorch.TransformType.Vmap for i in retrieve_all_functorch_interpreters()):
        raise RuntimeError(
            f"{where}: cannot run inside torch.func.vmap (clone mode reads the tangents' values to choose its step). "
            "For k tangent directions, stack them and pass batched_tangents=True: jvpreg.jvp(f, (x,), (U,), "
            "batched_tangents=True) with U of shape (k, *x.shape) computes all k JVPs in one forward pass of (k+1)B "
            "rows. For a batch of inputs, concatenate them along the batch dim.")


def _check_tangent(where: str, i: int, p: Any, t: Any, batched: bool) -> int:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected primals to be a tuple of tensors, got {type(p).__name__} at index {i}. "
                        "E.g. it should be valid to call f(*primals).")
    if p.is_complex():
        raise TypeError(_COMPLEX.format(where=where, what=f"primals[{i}]", dtype=p.dtype))
    if not p.is_floating_point():
        raise TypeError(f"{where}: primals[{i}] has dtype {p.dtype}; JVPs need floating-point primals.")
    if p.layout != torch.strided:

        raise UnsupportedOpError(f"{where}: primals[{i}] has layout {p.layout}; clone mode stacks dense blocks, so "
                                 "pass dense tensors (p.to_dense()).")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected tangents to be a tuple of tensors, got {type(t).__name__} at index {i}.")
    expected = tuple(p.shape)
    got = tuple(t.shape[1:]) if batched else tuple(t.shape)
    if got != expected:
        hint = " (batched_tangents=True expects a leading k dim)" if batched else ""
        raise ValueError(f"{where}: tangents[{i}] has shape {tuple(t.shape)}, expected {expected}{hint}.")
    if t.dtype != p.dtype or t.device != p.device:
        raise ValueError(f"{where}: tangents[{i}] is {t.dtype} on {t.device}, primals[{i}] {p.dtype} on {p.device}: "
                         "clone mode runs each tangent in its primal's batch, so they must share dtype and device "
                         f"(pass tangents[{i}].to(primals[{i}])).")
    if batched and t.shape[0] == 0:
        raise ValueError(f"{where}: tangents[{i}] holds no direction (k = 0); batched_tangents=True needs k >= 1.")
    return t.shape[0] if batched else 1


@between_graphs
def call(func: Callable, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *, engine: str = "auto") -> Any:
    """``func(*args, **kwargs)`` where the arguments hold clone batches (from :func:`pack`), run by ``engine``.

    The one way every entry point (``jvp``, ``jvp_params``, the losses and callbacks) runs a clone
    forward: ``"captured"`` replays a recorded aten program, ``"compiled"`` that program under
    ``torch.compile``, ``"eager"`` dispatches op by op; ``"auto"`` picks as :func:`jvp` documents.
    ``torch.compile``-d modules and functions run their original code (see :mod:`jvpreg.clone.program.capture`).
    """
    engine = capture.resolve_engine(engine, func, "jvpreg.clone.call(func, args, kwargs)")
    target = capture.unwrap_compiled(func)
    args, kwargs = tuple(args), dict(kwargs or {})
    if engine != "eager" and isinstance(target, nn.Module):
        return capture.call(target, args, kwargs, engine=engine)
    with active(target, (args, kwargs)), capture.uncompiled(target):
        return target(*args, **kwargs)


def packable(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether :func:`packed_call` can take this call: no argument is a container (a list, tuple or dict the
    forward could write into would be rebuilt inside the program, and the writes lost)."""
    return all(v is None or tree_is_leaf(v) for v in (*args, *kwargs.values()))


def packed_call(module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], index: int, u: torch.Tensor,
                s: Optional[torch.Tensor], *, fn: Callable, engine: str, finite: Optional[bool] = None) -> tuple:
    """``(f(x), J u, s)``: ``fn`` called with the argument at ``index`` of ``(*args, *kwargs.values())`` replaced by
    its clone batch ``[x; x + s u]``, and its output unpacked, recorded as *one* program as :func:`jvp`'s
    (``(args, u, s) -> (f(x), J u, s)``: the packing and unpacking run inside it, with no Python between them, and
    under ``engine="compiled"`` Inductor compiles them with the model's ops).

    ``s``: the ``(k,)`` scales, or ``None`` on an accelerator, where they are kernels inside the program
    (:func:`device_scales`) and returned. ``u``: the directions, shape ``(k, *x.shape)``. The arguments must be
    :func:`packable`. ``finite``: ``True`` when ``x`` and ``u`` are known finite (read off the norms ``s`` came
    from); the guard then checks no tensor, unless other arguments hold tensors (an additive mask of ``-inf``), when
    it checks every one. The shared forward of the Lightning callbacks runs through here
    (:class:`jvpreg.callbacks.SharedForward`)."""
    n, names = len(args), tuple(kwargs)
    leaves = [*args, *kwargs.values()]
    if finite and any(isinstance(v, torch.Tensor) for i, v in enumerate(leaves) if i != index):
        finite = None  # known for x, u and s only

    def body(*flat):
        vals, u_, s_ = list(flat[:len(leaves)]), flat[len(leaves)], flat[len(leaves) + 1:]
        x = vals[index]
        s_ = s_[0] if s_ else _program_scales((x,), (u_,), u_.shape[0])
        vals[index] = clone_of(x, u_, s_)
        out, tan = unpack(fn(*vals[:n], **dict(zip(names, vals[n:]))), s_)
        return out, tan, s_

    flat = (*leaves, u) if s is None else (*leaves, u, s)
    return capture.call(module, flat, engine=engine, key=("packed", id(getattr(fn, "__func__", fn)), n, names, index),
                        fn=body, finite=finite)


@between_graphs
def jvp(func: Callable, primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor], *, has_aux: bool = False,
        batched_tangents: bool = False, scale: Any = "auto", engine: str = "auto"):
    """Jacobian-vector product of ``func`` at ``primals`` in clone mode — a drop-in for ``torch.func.jvp``.

    ``func(*primals)`` runs once on a batch that holds the primals and ``primal + s_j * tangent_j``
    as blocks; every nonlinearity takes its state (masks, argmax, statistics) from the primal block,
    so ``(f(x + s u) - f(x)) / s`` is exactly ``J_f(x) u`` (docs/design.md §1). Works on unmodified
    modules and functions, train-mode BatchNorm (statistics and running averages from the primal
    alone) and fused attention, and is differentiable: gradients of any function of the JVP w.r.t.
    parameters are exact.

    Args:
        func: a function of tensors returning a tensor or a pytree (tuple/list/dict) of tensors.
        primals: tuple of floating-point tensors, ``func(*primals)`` must be valid.
        tangents: tuple of tensors with the primals' shapes; with ``batched_tangents=True`` each has
            a leading dim ``k`` and the ``k`` directions ride in one pass of ``(k+1)`` blocks.
        has_aux: ``func`` returns ``(output, aux)``; ``aux`` is returned as computed on the primal.
        batched_tangents: several tangents at once (see above); ``jvp_out`` leaves get the leading ``k``.
        scale: ``"auto"`` (see module docstring) or a fixed positive number ``s``.
        engine: how the clone forward runs (:mod:`jvpreg.clone.program.capture`): ``"captured"`` records it
            once per call signature as a plain aten program and replays it; ``"compiled"`` runs that
            program under ``torch.compile``; ``"eager"`` dispatches every op through the rules.
            ``"auto"``: ``"compiled"`` for a ``torch.compile``-d module; for other modules and callables
            ``"eager"`` on the first call of a call signature and ``"captured"`` from the second on (a capture
            costs 10-170x an eager call: not worth it for a call made once). Partials, lambdas, closures and
            bound methods are taken apart (:mod:`jvpreg.clone.callables`): the tensors they close over or bind
            are program inputs, so ``jvp(partial(model, y=c), (z, t, r), (v, 1, 0))`` made anew at every step
            replays one program; one that cannot be taken apart runs eagerly with a ``JVPCaptureWarning``.
            All engines give the same numbers.

    Returns:
        ``(output, jvp_out)``, or ``(output, jvp_out, aux)`` with ``has_aux=True``.

    Raises:
        TypeError/ValueError: malformed primals or tangents.
        UnsupportedOpError: an op with no rule whose exact fallback is impossible (names the op).

    Example::

        >>> model = torchvision.models.resnet18().train()
        >>> x, u = torch.randn(8, 3, 64, 64), torch.randn(8, 3, 64, 64)
        >>> y, Ju = jvpreg.jvp(model, (x,), (u,))           # train-mode BN: torch.func.jvp fails here
        >>> y, JU = jvpreg.jvp(model, (x,), (torch.randn(4, 8, 3, 64, 64),), batched_tangents=True)
    """
    where = "jvpreg.jvp(func, primals, tangents)"
    _refuse_vmap(where)
    if not callable(func):
        raise TypeError(f"{where}: expected func to be callable, got {type(func).__name__}.")
    engine = capture.resolve_engine(engine, func, where)
    if isinstance(primals, torch.Tensor) or not isinstance(primals, (tuple, list)):
        raise TypeError(f"{where}: expected primals to be a tuple of tensors. E.g. it should be valid to call "
                        "f(*primals). Got " + type(primals).__name__ + ".")
    if isinstance(tangents, torch.Tensor) or not isinstance(tangents, (tuple, list)):
        raise TypeError(f"{where}: expected tangents to be a tuple of tensors, got {type(tangents).__name__}.")
    if len(primals) != len(tangents):
        raise ValueError(f"{where}: expected primals and tangents to have the same length, got "
                         f"{len(primals)} and {len(tangents)}.")
    if len(primals) == 0:
        raise ValueError(f"{where}: expected at least one primal.")
    ks = {_check_tangent(where, i, p, t, batched_tangents) for i, (p, t) in enumerate(zip(primals, tangents))}
    if len(ks) != 1:
        raise ValueError(f"{where}: every tangent must carry the same number of directions k, got {sorted(ks)}.")
    tans = tuple(t if batched_tangents else t.unsqueeze(0) for t in tangents)
    target = capture.unwrap_compiled(func)
    module, parts = target, None
    if engine != "eager" and not isinstance(target, nn.Module):
        # a partial, lambda, closure or bound method: its values become program inputs, its modules are guarded
        parts = callables.take_apart(target)
        if parts.reason:
            _warn_uncaptured(target, parts.reason)
            engine, parts = "eager", None
        else:
            module = parts.module
    n, m = len(primals), len(parts.values) if parts is not None else 0
    values = tuple(parts.values) if parts is not None else ()
    program = engine != "eager"

    def run(*flat):  # the flat inputs less the callable's values, and the callable rebuilt from them (traced)
        if parts is None:
            return flat, target
        return flat[:len(flat) - m], parts.rebuild(flat[len(flat) - m:])

    key = ("jvp", n, batched_tangents, has_aux) + ((parts.structure,) if parts is not None else ())
    if program and scale == "auto" and not host_scales(primals[0]):
        # on an accelerator the scales are kernels: recorded into the program with the rest, which a compiled
        # program fuses into one or two kernels (launched one by one, they cost a small model as much as its JVP)
        k = tans[0].shape[0]

        def body(*flat):
            flat, f = run(*flat)
            return _jvp_body(f, flat[:n], flat[n:], _program_scales(flat[:n], flat[n:], k), has_aux,
                             batched_tangents, where)

        return capture.call(module, (*primals, *tans, *values), engine=engine, key=key, fn=body)
    s, finite = _scales(list(zip(primals, tans)), tans[0].shape[0], scale, shared=program)  # the program only reads s
    if program:
        def body(*flat):
            flat, f = run(*flat)
            return _jvp_body(f, flat[:n], flat[n:2 * n], flat[-1], has_aux, batched_tangents, where)

        # pack, forward and unpack recorded as one program: x, u, s (and the callable's values) in; output, tangent
        # (and aux) out. The norms vouch for x and u only: with values that hold tensors, the guard checks them all
        finite = True if finite and not any(isinstance(v, torch.Tensor) for v in tree_flatten(values)[0]) else None
        return capture.call(module, (*primals, *tans, s, *values), engine=engine, key=key, finite=finite, fn=body)
    with active(target), capture.uncompiled(target):
        return _jvp_body(target, primals, tans, s, has_aux, batched_tangents, where)


def _warn_uncaptured(func: Callable, reason: str) -> None:
    """One :class:`JVPCaptureWarning` per callable kind and reason: it runs eagerly (exact, slower)."""
    name = getattr(func, "__qualname__", None) or type(func).__name__
    capture.warn_once((name, reason),
                      f"jvpreg.jvp: {name} runs in eager clone mode (exact, but slower) because it cannot be captured: "
                      f"{reason}. Pass the model itself (an nn.Module), or a partial or lambda of it whose other values "
                      "are tensors, plain values or containers of them; engine='eager' silences this warning.",
                      stacklevel=4)


def _program_scales(primals: Sequence[torch.Tensor], tans: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """:func:`device_scales` of a JVP's pairs, as a captured program computes them (inside it)."""
    ref = primals[0]
    return device_scales(list(zip(primals, tans)), k, _ratio(ref.dtype, ref.device.type))


def _jvp_body(func: Callable, primals: Sequence[torch.Tensor], tans: Sequence[torch.Tensor], s: torch.Tensor,
              has_aux: bool, batched: bool, where: str) -> tuple:
    """Pack, run ``func`` on the clone batches, unpack: ``(output, jvp_out)`` or ``(output, jvp_out, aux)``."""
    result = func(*(clone_of(x, u, s) for x, u in zip(primals, tans)))
    if has_aux:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"{where}: has_aux=True expects func to return a (output, aux) tuple.")
        result, aux = result
    out, tan = unpack(result, s, batched=batched)
    return (out, tan, primal_of(aux)) if has_aux else (out, tan)


def _lookup_params(module: nn.Module, names: Mapping[str, torch.Tensor], where: str) -> Dict[str, torch.Tensor]:
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    found = {}
    for name in names:
        if name not in named:
            close = difflib.get_close_matches(name, list(named), n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{where}: module has no parameter {name!r}.{hint}")
        found[name] = named[name]
    return found


def _run_with_plain_prefix(module: nn.Module, primals: tuple, kwargs: dict, k: int, engine: str = "auto"):
    """``module(*primals)`` with plain inputs: the layers before the first perturbed parameter run once, on
    the plain batch. If the model then writes batch data in place into a tensor of that plain prefix (a
    residual ``x += shortcut(x)`` whose shortcut holds the perturbed weight: ResNeSt, ...), the call is
    redone from the start with the inputs as clones of zero tangent, after restoring the buffers and the
    random state, so running statistics are updated once and dropout draws the same masks."""

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    device = next((p.device for p in primals if isinstance(p, torch.Tensor)), torch.device("cpu"))
    rng = rng_state(device)
    try:
        return call(module, primals, kwargs, engine=engine)
    except BatchWriteError:
        pass
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    set_rng_state(rng, device)
    zero = tuple(clone_of(p, torch.zeros((k - 1, *p.shape), dtype=p.dtype, device=p.device),
                          torch.ones(k - 1, dtype=torch.float64, device=p.device), state=True)
                 if isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex()) else p
                 for p in primals)
    return call(module, zero, kwargs, engine=engine)


@between_graphs
def jvp_params(module: nn.Module, primals: Sequence[torch.Tensor], param_tangents: Mapping[str, torch.Tensor],
               tangents: Sequence[torch.Tensor] | None = None, *, kwargs: Mapping[str, Any] | None = None,
               batched_tangents: bool = False, has_aux: bool = False, scale: Any = "auto", engine: str = "auto"):
    """JVP w.r.t. named parameters (and optionally the inputs): the "swapped layer weight".

    Computes ``d/dt module(x + t u; W + t U)`` at ``t = 0``, where ``U`` is given per parameter name
    (``{"layer3.0.conv1.weight": U}``). Each perturbed parameter is replaced for this call by a clone
    ``[W; W + s U]``: a layer ``h = W z + b`` then gives ``W z_j + b + s U z_0`` in block j, and
    with no input tangent everything before the first perturbed layer runs once on the plain
    batch. Any use of the parameter (weight norm, tied weights, custom ops) is linearised too.

    Args:
        module: the ``nn.Module``; its parameters are not modified.
        primals: tuple of inputs, ``module(*primals, **kwargs)`` must be valid.
        param_tangents: mapping parameter (or buffer) name -> direction of the parameter's shape
            (with a leading ``k`` when ``batched_tangents``).
        tangents: optional input tangents (as in :func:`jvp`); ``None`` means zero.
        kwargs: extra keyword arguments for the module call.
        batched_tangents, has_aux, scale, engine: as in :func:`jvp`.

    Returns:
        ``(output, jvp_out)`` (plus ``aux``), like :func:`jvp`.

    Example::

        >>> U = torch.randn_like(model.layer3[0].conv1.weight)
        >>> y, JU = jvpreg.jvp_params(model, (x,), {"layer3.0.conv1.weight": U})
    """
    where = "jvpreg.jvp_params(module, primals, param_tangents)"
    _refuse_vmap(where)
    engine = capture.resolve_engine(engine, module, where)
    module = capture.unwrap_compiled(module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: expected an nn.Module, got {type(module).__name__}.")
    if isinstance(primals, torch.Tensor) or not isinstance(primals, (tuple, list)):
        raise TypeError(f"{where}: expected primals to be a tuple of tensors, got {type(primals).__name__}.")
    if not isinstance(param_tangents, Mapping) or not param_tangents:
        raise TypeError(f"{where}: expected param_tangents to be a non-empty dict name -> tensor.")
    params = _lookup_params(module, param_tangents, where)
    ks = set()
    for name, p in params.items():
        if p.is_complex():
            raise TypeError(_COMPLEX.format(where=where, what=f"parameter {name!r}", dtype=p.dtype))
        u = param_tangents[name]
        got = tuple(u.shape[1:]) if batched_tangents else tuple(u.shape)
        if not isinstance(u, torch.Tensor) or got != tuple(p.shape):
            raise ValueError(f"{where}: direction for {name!r} has shape {tuple(getattr(u, 'shape', ()))}, "
                             f"expected {tuple(p.shape)}" + (" with a leading k dim" if batched_tangents else "") + ".")
        if u.dtype != p.dtype or u.device != p.device:
            raise ValueError(f"{where}: direction for {name!r} is {u.dtype} on {u.device}, the parameter {p.dtype} on "
                             f"{p.device}: they must share dtype and device (pass it .to(the parameter)).")
        if batched_tangents and u.shape[0] == 0:
            raise ValueError(f"{where}: direction for {name!r} holds no direction (k = 0); batched_tangents=True "
                             "needs k >= 1.")
        ks.add(u.shape[0] if batched_tangents else 1)
    if tangents is not None:
        if len(tangents) != len(primals):
            raise ValueError(f"{where}: expected one tangent per primal, got {len(tangents)} for {len(primals)}.")
        ks |= {_check_tangent(where, i, p, t, batched_tangents) for i, (p, t) in enumerate(zip(primals, tangents))}
    if len(ks) != 1:
        raise ValueError(f"{where}: every direction must carry the same number of tangents k, got {sorted(ks)}.")
    lift = (lambda t: t) if batched_tangents else (lambda t: t.unsqueeze(0))
    pairs = [(p, lift(param_tangents[n])) for n, p in params.items()]
    if tangents is not None:
        inputs, s = pack(tuple(primals), tuple(lift(t) for t in tangents), scale=scale, extra_pairs=pairs)
    else:
        k = next(iter(ks))
        s = scales(pairs, k, scale)
        inputs = tuple(primals)
    swapped = {n: clone_of(p, u, s) for n, (p, u) in zip(params, pairs)}
    with swapped_tensors(module, {params[n]: t for n, t in swapped.items()}):
        if tangents is not None:
            result = call(module, inputs, kwargs, engine=engine)
        else:
            result = _run_with_plain_prefix(module, tuple(primals), dict(kwargs or {}), k=s.shape[0] + 1,
                                            engine=engine)
    if has_aux:
        result, aux = result
    out, tan = unpack(result, s, batched=batched_tangents)
    return (out, tan, primal_of(aux)) if has_aux else (out, tan)
