"""JVP penalties and the one shared clone forward that serves all of them.

A penalty is an ``nn.Module`` that declares *directions* and scores the JVPs along them:

* ``directions(x, context) -> (k, *x.shape)`` input-space tangents ``u_1..u_k`` (or ``None``);
* ``param_directions(model, context) -> {name: (k, *p.shape)}`` weight-space tangents (or ``None``);
* ``penalty(jvp, context) -> scalar`` where ``jvp`` has shape ``(k, m, *out.shape[1:])``:
  ``jvp[j] = J_x f(x) u_j + J_W f(x) U_j`` on the ``m`` leading rows that carry tangents.

:func:`prepare` concatenates the directions of every penalty in a stack into ONE clone batch of
``(1 + sum_i k_i) * B`` rows (input tangents are zero for penalties with weight directions only, and
vice versa), swaps the perturbed parameters for clones ``[W; W + s U_1; ...]``, and :meth:`Plan.finish`
slices the JVPs back per penalty. The primal block of the output is the exact plain forward ``f(x)``
(train-mode BatchNorm statistics and running averages from the primal rows only; one dropout mask
for every block), so one forward and one backward give the task loss and every penalty with exact
gradients (docs/design.md, "Shared forward in training"). The Lightning callbacks run the same
:func:`prepare`/:meth:`Plan.finish` from forward hooks; :func:`regularized_forward` runs them around
an explicit call.

Batch fraction (implementation choice). Clone mode needs tangent blocks of the primal's shape, so a
penalty restricted to the first ``m = ceil(f * B)`` rows gets *zero* tangents on the other rows and
scores only the first ``m`` rows of its JVP (means are over those rows, which keeps the estimates
unbiased for the per-sample mean). The cost is that of the full batch: use fewer projections or
``every_n_steps`` to save time. With train-mode BatchNorm a zero row still receives the small
cross-sample terms of the other rows' tangents; those rows are not scored.

Random directions come from the global RNG, or from a private ``torch.Generator`` when the penalty is
built with ``seed=``; its state is part of the penalty's ``state_dict`` (``_extra_state``), so a
resumed run draws the same directions as an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import clone
from . import row_subset as _row_subset
from . import sharded as _sharded

__all__ = [
    "JVPPenalty", "PenaltyContext", "Plan", "Stack", "prepare", "regularized_forward",
]

_DISTRIBUTIONS = ("gaussian", "rademacher")


# --------------------------------------------------------------------------- validation helpers


def check_int(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected {name} to be an int >= {minimum}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{where}: expected {name} to be an int >= {minimum}, got {value!r}.")
    return value


def check_float(where: str, name: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float in the given interval or a TypeError/ValueError naming ``name``."""
    lb, hb = ("(" if low_open else "["), (")" if high_open else "]")
    interval = f"{lb}{low}, {high}{hb}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected {name} to be a number in {interval}, got {type(value).__name__} {value!r}.")
    v = float(value)
    ok = math.isfinite(v) or (v == high == math.inf and not high_open)
    ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        raise ValueError(f"{where}: expected {name} to be a number in {interval}, got {value!r}.")
    return v


def check_choice(where: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``, else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{where}: expected {name} to be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")
    return value


def check_seed(where: str, seed: Any) -> Optional[int]:
    if seed is None:
        return None
    return check_int(where, "seed", seed, 0)


def accum(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype fit for reductions: half precision (AMP outputs) goes to float32."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def snake_name(cls_name: str) -> str:
    """``JacobianFrobenius`` -> ``jacobian_frobenius``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls_name).lower()


def _output_keys(tree: Any) -> str:
    """The keys / indices / attributes of a model output that hold tensors, for error messages."""
    if isinstance(tree, Mapping):  # dicts and Hugging Face ModelOutput
        keys = [k for k, v in tree.items() if isinstance(v, torch.Tensor)]
    elif isinstance(tree, (tuple, list)):
        keys = [i for i, v in enumerate(tree) if isinstance(v, torch.Tensor)]
    else:
        keys = [k for k, v in vars(tree).items() if isinstance(v, torch.Tensor)] if hasattr(tree, "__dict__") else []
    return ", ".join(repr(k) for k in keys) or "none"


def select_output(tree: Any, key: Any, where: str) -> torch.Tensor:
    """The tensor of a model output that a penalty scores.

    ``key`` is an index of a tuple/list output, a key of a dict output (Hugging Face ``ModelOutput``
    included) or the name of an attribute of the output object.
    """
    if key is None:
        if not isinstance(tree, torch.Tensor):
            raise TypeError(f"{where}: the model returned a {type(tree).__name__}; pass output_key=<index, key or "
                            f"attribute> to choose the tensor to regularize (tensors in it: {_output_keys(tree)}), "
                            "e.g. JacobianRegularizer(..., output_key='logits').")
        return tree
    try:
        out = tree[key]
    except (KeyError, IndexError, TypeError) as err:
        if not (isinstance(key, str) and hasattr(tree, key)):
            raise ValueError(f"{where}: output_key={key!r} does not select an output of the model (got a "
                             f"{type(tree).__name__}; tensors in it: {_output_keys(tree)}).") from err
        out = getattr(tree, key)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{where}: output_key={key!r} selects a {type(out).__name__}, expected a tensor "
                        f"(tensors in the output: {_output_keys(tree)}).")
    return out


# --------------------------------------------------------------------------- context and base class


@dataclass
class PenaltyContext:
    """What a penalty may look at while it builds directions and scores JVPs.

    Attributes:
        x: the primal input batch ``(B, ...)`` (as passed to the model).
        target: the batch's targets when known (the callbacks take them from the batch), else ``None``.
        model: the module whose forward is cloned (parameter names are relative to it).
        rows: number ``m`` of leading rows that carry tangents (``ceil(batch_fraction * B)``).
        forward: ``forward(z) -> output`` runs the model on another input with the same other
            arguments, outside the shared forward (for extra power iterations).
        output: the primal output ``f(x)`` (the selected tensor), set before ``penalty`` is called.
        extra: scratch space a penalty may fill in ``directions`` and read in ``penalty``.
    """

    x: torch.Tensor
    target: Any = None
    model: Optional[nn.Module] = None
    rows: int = 0
    forward: Optional[Callable[[torch.Tensor], Any]] = None
    output: Optional[torch.Tensor] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.rows:
            self.rows = int(self.x.shape[0]) if self.x.dim() else 1


class JVPPenalty(nn.Module):
    """Base class of the JVP penalties: declare directions, score their JVPs.

    Subclasses implement :meth:`penalty` and at least one of :meth:`directions` (input space) and
    :meth:`param_directions` (weight space). Calling the module runs one clone forward of ``model``:
    ``out, penalty = reg(model, x)`` with ``out = f(x)`` exactly as a plain forward returns it.

    Args:
        name: name used in logs (``train/<name>``); default: the class name in snake case.
        output_key: index or key of the tensor to regularize when the model returns a tuple/list/dict.
        seed: seed of a private random generator for the random directions (``None``: global RNG).

    Example::

        >>> class Invariance(JVPPenalty):          # penalise J_f(x) u for a fixed direction u
        ...     def directions(self, x, context):
        ...         return torch.ones_like(x)[None]
        ...     def penalty(self, jvp, context):
        ...         return jvp.pow(2).flatten(2).sum(-1).mean()
        >>> out, pen = Invariance()(model, x)
    """

    def __init__(self, *, name: Optional[str] = None, output_key: Any = None, seed: Optional[int] = None):
        super().__init__()
        where = f"{type(self).__name__}(...)"
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{where}: expected name to be a non-empty str, got {name!r}.")
        if output_key is not None and (isinstance(output_key, bool) or not isinstance(output_key, (int, str))):
            raise TypeError(f"{where}: expected output_key to be None, an int or a str, got {output_key!r}.")
        self.name = name or snake_name(type(self).__name__)
        self.output_key = output_key
        self.seed = check_seed(where, seed)
        self._generator: Optional[torch.Generator] = None

    # -- interface ---------------------------------------------------------------------------
    def directions(self, x: torch.Tensor, context: PenaltyContext) -> Optional[torch.Tensor]:
        """Input-space tangents ``(k, *x.shape)``, or ``None`` for none."""
        return None

    def param_directions(self, model: nn.Module, context: PenaltyContext) -> Optional[Dict[str, torch.Tensor]]:
        """Weight-space tangents ``{parameter name: (k, *p.shape)}``, or ``None`` for none."""
        return None

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        """Scalar penalty from ``jvp`` of shape ``(k, m, *out.shape[1:])``."""
        raise NotImplementedError(f"{type(self).__name__} must implement penalty(jvp, context).")

    @clone.between_graphs
    def forward(self, model: nn.Module, x: torch.Tensor, target: Any = None, *, batch_fraction: float = 1.0,
                args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None, engine: str = "auto",
                row_subset: Any = None):
        """``(f(x), penalty)`` from one clone forward of ``model(x, *args, **kwargs)`` (``engine``, ``row_subset``:
        see :func:`regularized_forward`)."""
        return regularized_forward(model, x, self, target=target, batch_fraction=batch_fraction, args=args,
                                   kwargs=kwargs, engine=engine, row_subset=row_subset)

    # -- random directions -------------------------------------------------------------------
    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """The private generator on ``device`` (``None`` without a seed: the global RNG is used)."""
        if self.seed is None:
            return None
        device = torch.device(device)
        g = self._generator
        if g is None or g.device.type != device.type:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generator = g
        return g

    def sample(self, shape: Sequence[int], like: torch.Tensor, distribution: str = "gaussian") -> torch.Tensor:
        """Random tensor of ``shape`` (dtype/device of ``like``): standard normal or Rademacher (±1).

        Drawn in float32 whatever the dtype, so a seeded penalty gives the same directions to a float32
        and a float64 (or half precision) model.
        """
        dtype = like.dtype if like.is_floating_point() else torch.float32
        g = self.generator(like.device)
        if distribution == "rademacher":
            r = torch.randint(0, 2, tuple(shape), generator=g, device=like.device, dtype=torch.int8)
            return r.to(dtype) * 2 - 1
        return torch.randn(tuple(shape), generator=g, device=like.device, dtype=torch.float32).to(dtype)

    def get_extra_state(self) -> Dict[str, Any]:
        g = self._generator
        if g is None:
            return {}
        return {"generator_device": g.device.type, "generator_state": g.get_state()}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        if not state or self.seed is None:
            return
        device = state.get("generator_device", "cpu")
        if device != "cpu" and not getattr(torch, device).is_available():  # resumed on another machine
            self._generator = None
            return
        g = torch.Generator(device=device)
        g.set_state(state["generator_state"])
        self._generator = g

    def extra_repr(self) -> str:
        return f"name={self.name!r}" + (f", seed={self.seed}" if self.seed is not None else "")


# --------------------------------------------------------------------------- the shared forward


@dataclass
class _Slot:
    penalty: JVPPenalty
    weight: float
    name: str
    start: int
    stop: int
    context: PenaltyContext


@dataclass
class Plan:
    """One prepared clone forward: the input to feed, the parameter clones, the bookkeeping.

    Built by :func:`prepare`; feed ``x_in`` to the model inside :meth:`swapped`, then call
    :meth:`finish` on what the model returned.

    Example::

        >>> plan = prepare(model, x, [(JacobianFrobenius(), 1.0, 1.0)])
        >>> with plan.swapped(model):
        ...     raw = model(plan.x_in)                     # (1 + k) B rows underneath, logical shape of x
        >>> out, (jac,) = plan.finish(raw)                 # out == model(x); jac the penalty
    """

    x_in: Optional[torch.Tensor]  # None: the caller packs x with ``u`` inside its program (prepare(pack=False))
    scales: Optional[torch.Tensor]  # None: chosen inside that program (on an accelerator), set from its output
    params: Dict[str, torch.Tensor]
    slots: List[_Slot] = field(default_factory=list)
    sharded: Dict[str, torch.Tensor] = field(default_factory=dict)  # FSDP2 name -> directions (k, *W.shape)
    u: Optional[torch.Tensor] = None  # the input directions of every slot, (k, *x.shape)
    finite: Optional[bool] = None  # whether x and u are all finite (None: not known)

    @contextlib.contextmanager
    def swapped(self, model: nn.Module, *, watch: bool = True) -> Iterator[None]:
        """Context in which ``model``'s perturbed parameters are their clones (FSDP2-sharded ones are cloned
        from their unsharded values inside the forward, :func:`jvpreg.losses.sharded.swapped_unsharded`).

        ``watch``: as in :func:`jvpreg.clone.swapped_clones` (``True``: the forward inside runs ``model`` itself)."""
        with contextlib.ExitStack() as stack:
            named = _named_tensors(model) if self.params else {}
            replace = {named[n]: c for n, c in self.params.items()}
            stack.enter_context(clone.swapped_clones(model, replace, watch=watch))
            if self.sharded:  # FSDP2: cloned from the unsharded weights, inside the forward
                stack.enter_context(_sharded.swapped_unsharded(model, self.sharded, self.scales))
            yield

    def enter(self, model: nn.Module, *, watch: bool = True):
        """Enter :meth:`swapped` by hand (forward hooks); returns the context manager to exit."""
        cm = self.swapped(model, watch=watch)
        cm.__enter__()
        return cm

    def finish(self, raw_output: Any) -> Tuple[Any, List[torch.Tensor]]:
        """``(f(x), [penalty_i])`` from the clone forward's output."""
        return self.penalties(*clone.unpack(raw_output, self.scales, batched=True))

    def penalties(self, out: Any, tan: Any) -> Tuple[Any, List[torch.Tensor]]:
        """``(f(x), [penalty_i])`` from the unpacked output ``f(x)`` and tangent output (leading dim ``k``)."""
        values = []
        for slot in self.slots:
            where = f"{type(slot.penalty).__name__}"
            y = select_output(out, slot.penalty.output_key, where)
            t = select_output(tan, slot.penalty.output_key, where)
            b = slot.context.x.shape[0]
            if y.dim() == 0 or y.shape[0] != b:
                raise ValueError(f"{where}: expected the model output to have the batch ({b} rows) as first dim, "
                                 f"got shape {tuple(y.shape)}.")
            t = t[slot.start:slot.stop]
            m = slot.context.rows
            if m < b:
                t, y = t[:, :m], y[:m]
            slot.context.output = y
            value = slot.penalty.penalty(t, slot.context)
            if not (isinstance(value, torch.Tensor) and value.dim() == 0):
                raise TypeError(f"{where}.penalty(jvp, context) must return a scalar tensor, got "
                                f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}.")
            values.append(value)
        return out, values

    def total(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """``sum_i weight_i * penalty_i``."""
        tot = None
        for slot, v in zip(self.slots, values):
            term = v if slot.weight == 1.0 else v * slot.weight
            tot = term if tot is None else tot + term
        return tot


Term = Tuple[JVPPenalty, float, float]  # (penalty, weight, batch_fraction)


def _named_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``name -> tensor`` for every parameter and buffer of ``model``."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def _check_directions(where: str, u: Any, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"{where}.directions(x, context) must return a tensor of shape (k, *x.shape) or None, "
                        f"got {type(u).__name__}.")
    if u.dim() != x.dim() + 1 or tuple(u.shape[1:]) != tuple(x.shape) or u.shape[0] < 1:
        raise ValueError(f"{where}.directions(x, context) returned shape {tuple(u.shape)}, expected "
                         f"(k, {', '.join(str(s) for s in x.shape)}) with k >= 1.")
    return u


def _check_param_directions(where: str, dirs: Any, named: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if not isinstance(dirs, Mapping) or not dirs:
        raise TypeError(f"{where}.param_directions(model, context) must return a non-empty dict "
                        f"name -> (k, *p.shape) or None, got {type(dirs).__name__}.")
    ks = set()
    for name, u in dirs.items():
        if name not in named:
            raise ValueError(f"{where}.param_directions: the model has no parameter {name!r}.")
        p = named[name]
        if not isinstance(u, torch.Tensor) or tuple(u.shape[1:]) != tuple(p.shape):
            raise ValueError(f"{where}.param_directions: direction for {name!r} has shape "
                             f"{tuple(getattr(u, 'shape', ()))}, expected (k, {', '.join(str(s) for s in p.shape)}).")
        ks.add(u.shape[0])
    if len(ks) != 1:
        raise ValueError(f"{where}.param_directions: every parameter needs the same number k of directions, "
                         f"got {sorted(ks)}.")
    return dict(dirs)


def prepare(model: nn.Module, x: torch.Tensor, terms: Sequence[Term], *, target: Any = None,
            targets: Optional[Sequence[Any]] = None, forward: Optional[Callable[[torch.Tensor], Any]] = None,
            scale: Any = "auto", pack: bool = True) -> Plan:
    """Build ONE clone forward for every ``(penalty, weight, batch_fraction)`` in ``terms``.

    Args:
        model: the module whose forward will be cloned (parameter directions are looked up in it).
        x: the primal input batch (floating point, batch first).
        terms: penalties with their weights and batch fractions.
        target: the batch's targets (passed to the penalties' context).
        targets: one target per term instead (overrides ``target``).
        forward: ``forward(z)`` runs the model on another input (see :class:`PenaltyContext`).
        scale: ``"auto"`` or a fixed difference scale (see :func:`jvpreg.clone.pack`).
        pack: ``False`` where the caller packs inside its program (:meth:`jvpreg.clone.SharedCall.packed`): when
            only the input carries directions, ``plan.x_in`` is then ``None`` and ``plan.u`` holds them.

    Returns:
        A :class:`Plan`; the input to feed is ``plan.x_in``.

    Raises:
        TypeError: a non-float input, or directions of the wrong type.
        ValueError: directions of the wrong shape, or a penalty with no directions.

    Example::

        >>> plan = prepare(model, x, [(JacobianFrobenius(2), 1.0, 1.0), (TangentProp(), 0.1, 0.5)])
        >>> plan.x_in.as_subclass(torch.Tensor).shape[0]  # 1 + 2 + 4 blocks
        7
    """
    where = "jvpreg.losses.prepare(model, x, terms)"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        got = f"{type(x).__name__}" + (f" of dtype {x.dtype} and shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
        raise TypeError(f"{where}: clone mode needs a floating-point input with a batch dim, got {got}. "
                        "Regularize a submodule that receives float features (e.g. after the embedding).")
    b = x.shape[0]
    named_cache: List[Dict[str, torch.Tensor]] = []

    def named() -> Dict[str, torch.Tensor]:  # built when needed: a walk over every tensor of a deep network
        if not named_cache:
            named_cache.append(_named_tensors(model))
        return named_cache[0]

    if _sharded.may_be_sharded():
        _sharded.check_sharding(model, named(), where)
    input_dirs: List[Optional[torch.Tensor]] = []
    param_dirs: List[Optional[Dict[str, torch.Tensor]]] = []
    slots: List[_Slot] = []
    start = 0
    names_seen: Dict[str, int] = {}
    if targets is not None and len(targets) != len(terms):
        raise ValueError(f"{where}: expected one target per term ({len(terms)}), got {len(targets)}.")
    for i, (pen, weight, fraction) in enumerate(terms):
        cls = type(pen).__name__
        rows = b if fraction >= 1.0 else max(1, min(b, math.ceil(fraction * b)))
        ctx = PenaltyContext(x=x, target=target if targets is None else targets[i], model=model, rows=rows,
                             forward=forward)
        u = pen.directions(x, ctx)
        pd = pen.param_directions(model, ctx)
        if u is None and pd is None:
            raise ValueError(f"{cls}: directions() and param_directions() both returned None; a penalty needs "
                             "at least one kind of direction.")
        k = None
        if u is not None:
            u = _check_directions(cls, u, x)
            k = u.shape[0]
            if rows < b:
                keep = torch.zeros((1, b) + (1,) * (x.dim() - 1), dtype=u.dtype, device=u.device)
                keep[:, :rows] = 1
                u = u * keep
        if pd is not None:
            pd = _check_param_directions(cls, pd, named())
            kp = next(iter(pd.values())).shape[0]
            if k is not None and kp != k:
                raise ValueError(f"{cls}: directions() gave k={k} but param_directions() gave k={kp}.")
            k = kp
        n = names_seen.get(pen.name, 0)
        names_seen[pen.name] = n + 1
        name = pen.name if n == 0 else f"{pen.name}_{n}"
        slots.append(_Slot(pen, float(weight), name, start, start + k, ctx))
        input_dirs.append(u)
        param_dirs.append(pd)
        start += k
    if not slots:
        raise ValueError(f"{where}: expected at least one penalty.")
    total_k = start

    def fill(parts: List[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        chunks = []
        for slot, part in zip(slots, parts):
            if part is None:
                part = torch.zeros((slot.stop - slot.start, *like.shape), dtype=like.dtype, device=like.device)
            chunks.append(part.to(dtype=like.dtype, device=like.device))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    pairs = []
    param_names: List[str] = []
    for pd in param_dirs:
        for name in pd or ():
            if name not in param_names:
                param_names.append(name)
    for name in param_names:
        p = named()[name]
        _sharded.check_swappable(name, p, where)
        pairs.append((p, fill([None if pd is None else pd.get(name) for pd in param_dirs], p)))
    with_input = any(u is not None for u in input_dirs)
    if with_input and not pack and not pairs:  # the caller's program packs x (SharedCall.packed)
        u = fill(input_dirs, x)
        s, finite = clone.packed_scales(x, u, scale)  # s None: chosen in the program
        return Plan(x_in=None, scales=s, params={}, slots=slots, u=u, finite=finite)
    scale_pairs = [_sharded.scale_pair(p, u) for p, u in pairs]
    if with_input:
        (x_in,), s = clone.pack((x,), (fill(input_dirs, x),), scale=scale, extra_pairs=scale_pairs)
    else:
        s = clone.scales(scale_pairs, total_k, scale)
        x_in = x
    params = {name: clone.clone_of(p, u, s) for name, (p, u) in zip(param_names, pairs)
              if not _sharded.is_sharded(p)}
    sharded = {name: u for name, (p, u) in zip(param_names, pairs) if _sharded.is_sharded(p)}
    return Plan(x_in=x_in, scales=s, params=params, slots=slots, sharded=sharded)


# --------------------------------------------------------------------------- composition


class Stack(nn.Module):
    """Several penalties in ONE clone forward: ``sum_i w_i * penalty_i`` with directions concatenated.

    ``Stack([P_1, ..., P_n])`` packs ``(1 + sum_i k_i)`` blocks and slices the JVPs back per penalty,
    so stacking costs one forward of the larger batch instead of one forward per penalty.

    Args:
        penalties: the :class:`JVPPenalty` modules (nested stacks are flattened).
        weights: one weight per penalty (default all 1.0).
        batch_fractions: one batch fraction in ``(0, 1]`` per penalty (default all 1.0).

    Raises:
        TypeError: a member is not a :class:`JVPPenalty`, or weights are not numbers.
        ValueError: empty stack, or weights/fractions of the wrong length or range.

    Example::

        >>> reg = Stack([JacobianFrobenius(), TangentProp(("rotate",))], weights=[1.0, 0.1])
        >>> out, pen = reg(model, x)                       # one forward of 1 + 1 + 1 blocks
        >>> loss = F.cross_entropy(out, y) + 0.01 * pen
        >>> out, pen, parts = reg(model, x, return_parts=True)   # parts: {name: value}
    """

    def __init__(self, penalties: Sequence[JVPPenalty], weights: Optional[Sequence[float]] = None,
                 batch_fractions: Optional[Sequence[float]] = None):
        super().__init__()
        where = "Stack(penalties)"
        if isinstance(penalties, (JVPPenalty, Stack)):
            penalties = [penalties]
        elif isinstance(penalties, nn.ModuleList):
            penalties = list(penalties)
        if isinstance(penalties, (str, bytes, nn.Module)) or not isinstance(penalties, Sequence) or not penalties:
            raise ValueError(f"{where}: expected a non-empty list of JVPPenalty modules, got {penalties!r}.")
        flat: List[Term] = []
        n = len(penalties)
        ws = self._numbers(where, "weights", weights, n, low=0.0, low_open=False)
        fs = self._numbers(where, "batch_fractions", batch_fractions, n, low=0.0, low_open=True, high=1.0)
        for i, p in enumerate(penalties):
            if isinstance(p, Stack):
                flat.extend((q, w * ws[i], min(f, fs[i])) for q, w, f in p.terms)
            elif isinstance(p, JVPPenalty):
                flat.append((p, ws[i], fs[i]))
            else:
                raise TypeError(f"{where}: expected JVPPenalty modules, got {type(p).__name__} at index {i}.")
        self.members = nn.ModuleList([t[0] for t in flat])
        self._weights = [t[1] for t in flat]
        self._fractions = [t[2] for t in flat]

    @staticmethod
    def _numbers(where, name, values, n, **bounds) -> List[float]:
        if values is None:
            return [1.0] * n
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{where}: expected {name} to be a sequence of {n} numbers, got {values!r}.")
        if len(values) != n:
            raise ValueError(f"{where}: expected {n} {name} (one per penalty), got {len(values)}.")
        return [check_float(where, f"{name}[{i}]", v, **bounds) for i, v in enumerate(values)]

    @property
    def terms(self) -> List[Term]:
        """``[(penalty, weight, batch_fraction), ...]``."""
        return list(zip(self.members, self._weights, self._fractions))

    @clone.between_graphs
    def forward(self, model: nn.Module, x: torch.Tensor, target: Any = None, *, args: Sequence[Any] = (),
                kwargs: Optional[Mapping[str, Any]] = None, return_parts: bool = False, engine: str = "auto",
                row_subset: Any = None):
        """``(f(x), sum_i w_i penalty_i)`` (plus ``{name: penalty_i}`` with ``return_parts=True``); ``row_subset``:
        see :func:`regularized_forward`."""
        row_subset = _row_subset.check_rows("Stack.forward(model, x)", row_subset)
        out, total, parts = _run(model, x, self.terms, target, args, kwargs, engine, row_subset)
        return (out, total, parts) if return_parts else (out, total)


def as_terms(penalties: Any, where: str) -> List[Term]:
    """Normalise a penalty, a :class:`Stack` or a list of penalties to ``[(penalty, weight, fraction)]``."""
    if isinstance(penalties, Stack):
        return penalties.terms
    if isinstance(penalties, JVPPenalty):
        return [(penalties, 1.0, 1.0)]
    if isinstance(penalties, Sequence) and not isinstance(penalties, (str, bytes)) and penalties:
        return Stack(list(penalties)).terms
    raise TypeError(f"{where}: expected a JVPPenalty, a Stack or a non-empty list of JVPPenalty, "
                    f"got {type(penalties).__name__}.")


def subset_rows(terms: Sequence[Term], x: torch.Tensor, row_subset: Any):
    """``(S, R)`` row indices of a row subset of ``x``'s batch (:mod:`jvpreg.losses.row_subset`), or ``None`` when
    every row carries tangents; drawn with the first seeded penalty's generator, else the global RNG."""
    batch = int(x.shape[0]) if x.dim() else 1
    b = _row_subset.subset_size(row_subset, batch)
    if b >= batch:
        return None
    seeded = next((p for p, _, _ in terms if p.seed is not None), None)
    gen = None if seeded is None else seeded.generator(x.device)
    return _row_subset.draw(batch, b, gen, x.device)


def _run(model, x, terms, target, args, kwargs, engine="auto", row_subset=None):
    args, kwargs = tuple(args), dict(kwargs or {})
    shared = clone.SharedCall(model, engine, where="regularized_forward(model, x, penalties)")
    plain, model = model, shared.module
    rows = subset_rows(terms, x, row_subset)
    if rows is not None:  # the subset as the clone forward's own primal, then the other rows plainly
        s, r = rows
        batch = x.shape[0]
        x_r, args_r, kwargs_r = _row_subset.split((x, args, kwargs), batch, r)
        x, args, kwargs, target = _row_subset.split((x, args, kwargs, target), batch, s)
        out, total, parts = _run(plain, x, terms, target, args, kwargs, shared.engine)
        out_r = plain(x_r, *args_r, **kwargs_r) if r.numel() else None
        return _row_subset.merge(out, out_r, s, r), total, parts
    packs = shared.packs((x, *args), kwargs, x)
    plan = prepare(model, x, terms, target=target, forward=lambda z: model(z, *args, **kwargs), pack=not packs)
    if plan.x_in is None:  # one program (args, u, s) -> (f(x), J u, s), as the callbacks' shared forward
        out, tan, plan.scales = shared.packed((x, *args), kwargs, x, plan.u, plan.scales, finite=plan.finite)
        out, values = plan.penalties(out, tan)
    else:
        with plan.swapped(model, watch=False):
            raw = shared((plan.x_in, *args), kwargs)
        out, values = plan.finish(raw)
    parts = {slot.name: v for slot, v in zip(plan.slots, values)}
    return out, plan.total(values), parts


@clone.between_graphs
def regularized_forward(model: nn.Module, x: torch.Tensor, penalties: Any, *, target: Any = None,
                        batch_fraction: float = 1.0, args: Sequence[Any] = (),
                        kwargs: Optional[Mapping[str, Any]] = None, engine: str = "auto",
                        row_subset: Any = None) -> Tuple[Any, torch.Tensor]:
    """``(f(x), penalty)`` from one clone forward: the helper for hand-written training loops.

    Runs ``model(x, *args, **kwargs)`` once on the concatenated batch of every penalty's directions;
    ``out`` is exactly the plain forward's output (use it for the task loss) and
    ``penalty = sum_i w_i penalty_i`` is differentiable, so ``(task(out) + lam * penalty).backward()``
    gives exact gradients. This is what the Lightning callbacks run from forward hooks, and the way to
    use the penalties under manual optimization.

    Args:
        model: any ``nn.Module`` (train or eval mode).
        x: the input batch (floating point, batch first).
        penalties: a :class:`JVPPenalty`, a :class:`Stack`, or a list of penalties (weights 1).
        target: the batch's targets, passed to the penalties (e.g. ``JVPConstraint``'s ``direction(x, y)``).
        batch_fraction: apply the penalties to the first ``ceil(f * B)`` rows only (see module docstring).
        args, kwargs: further arguments of the model call.
        engine: how the clone forward runs (see :func:`jvpreg.jvp`): ``"auto"`` replays a program
            captured on the second call of an input signature (compiled if the model is ``torch.compile``-d),
            ``"eager"`` forces
            op-by-op clone mode.
        row_subset: carry tangents on a random subset of the rows only: a fraction ``f`` in ``(0, 1]``
            (``b = ceil(f B)`` rows) or a row count ``b``; ``None``: every row. The step then costs
            ``B + b`` rows instead of ``2B``, and the penalty (a mean over the ``b`` rows) stays unbiased.
            Train-mode BatchNorm then normalizes the subset and the other rows apart
            (:mod:`jvpreg.losses.row_subset`).

    Returns:
        ``(out, penalty)``.

    Raises:
        TypeError: ``penalties`` of the wrong type, or a non-float input.
        ValueError: ``batch_fraction`` outside ``(0, 1]``, or ``row_subset`` neither a fraction in ``(0, 1]``
            nor a count ``>= 1``.

    Example::

        >>> def training_step(self, batch, batch_idx):          # manual optimization
        ...     x, y = batch
        ...     out, pen = regularized_forward(self.net, x, JacobianFrobenius())
        ...     loss = F.cross_entropy(out, y) + 0.01 * pen
        ...     opt = self.optimizers(); opt.zero_grad(); self.manual_backward(loss); opt.step()
    """
    where = "regularized_forward(model, x, penalties)"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: expected model to be an nn.Module, got {type(model).__name__}.")
    f = check_float(where, "batch_fraction", batch_fraction, low=0.0, high=1.0, low_open=True)
    terms = [(p, w, min(fr, f)) for p, w, fr in as_terms(penalties, where)]
    rows = _row_subset.check_rows(where, row_subset)
    out, total, _ = _run(model, x, terms, target, args, kwargs, engine, rows)
    return out, total
