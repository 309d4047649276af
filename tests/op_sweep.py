"""The engine swept over PyTorch's own op database (OpInfo), against ``torch.func.jvp`` in float64.

For every OpInfo with float64 and a derivative, up to ``N_SAMPLES`` (40) sample inputs, each floating
tensor operand in turn as the differentiated input (the others held constant), and the in-place
variant (differentiated in its ``self`` operand), one case compares ``jvpreg.jvp`` with
``torch.func.jvp`` (``torch.autograd.functional.jvp``, reverse mode, where forward AD fails, as for ``cdist``,
``index_reduce`` and attention, or is wrong: :data:`REVERSE_REFERENCE`; the definition where both are wrong:
:data:`DEFINITIONS`) and classifies the result:

* ``rule``: exact, no op took the fallback;          * ``fallback``: exact, some op took the fallback;
* ``error``: a clear :class:`UnsupportedOpError`;    * ``skip``: the reference itself fails, or the op is random;
* ``mismatch``: a wrong primal or tangent (silently wrong: a bug);
* ``crash``: any other exception from the engine (a bug).

Comparison: same pytree structure; float leaves to ``rtol = atol / max|ref| = 1e-7``. Where the reference
primal output is not finite the difference form carries no tangent: there 0 (an infinity shared by
every block, e.g. a ``-inf`` mask) or NaN is accepted (convention: :func:`jvpreg.clone.core.tensor.block_delta`),
any other value is not.

Gradients (what a penalty on the JVP trains with): where the values match and every input and reference output
is finite, ``d/d(x, u)`` of a random linear functional ``L = <w_y, f(x)> + <w_t, J(x) u>`` is compared with
reverse mode through ``torch.func.jvp`` (through the double-backward trick where the reference is reverse mode);
where the two differ, the directional derivative of ``L`` (``torch.func.jvp``
values at ``x + h v``, Richardson-extrapolated central differences) decides, since torch's own reverse-over-forward
is wrong for some ops (batch and layer norm). A wrong gradient is a ``mismatch``; an exception from the
backward a ``crash`` (an :class:`UnsupportedOpError` there: an ``error``).

``engine="captured"`` (:func:`run_case`, :func:`run_op`) runs the same cases through the captured engine: the op
wrapped in a module, recorded into a program and replayed, so the program's passes and its replay are swept as the
rules are; ``Result.capture`` says whether the case was captured or ran eagerly, and why.

:func:`value_shaped` sweeps the database for ops whose output *shape* follows their inputs' values (every OpInfo,
in int64 or bool where it has no float64): each sample recorded as the capture records it, then on other values of
the same shapes; such an op must be one the capture guards (:func:`jvpreg.clone.program.value_shapes.dynamic_shapes`).

Used by ``tests/clone/test_opinfo_sweep.py`` and ``scripts/coverage_table.py`` (the op database needs ``expecttest``);
:func:`check` runs the same comparison on any function, for a rule of your own.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

D = torch.float64
RTOL = 1e-7
N_SAMPLES = 40  # the first samples of an op are often 0-d tensors: the larger ones come later
MAX_OPERANDS = 3

# Ops whose outputs are random draws: the engine draws one mask from the primal block, torch.func draws its
# own, so values cannot be compared with the reference (their rules are tested in tests/clone/test_rules.py).
RANDOM_OPS = {
    "bernoulli", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "pca_lowrank",
    "svd_lowrank", "normal", "uniform", "multinomial", "cauchy", "exponential", "geometric", "log_normal",
    "nn.functional.multi_head_attention_forward",
}


def _linear_cross_entropy_by_definition(input, linear_weight, target, *, linear_bias=None, weight=None,
                                        reduction="mean", ignore_index=None, label_smoothing=0.0, options=None):
    """torch's documented reference implementation of ``F.linear_cross_entropy``."""
    import torch.nn.functional as F

    classes, *out_features, in_features = linear_weight.shape
    logits = F.linear(input, linear_weight.reshape(-1, in_features),
                      None if linear_bias is None else linear_bias.reshape(-1))
    logits = logits.reshape(*input.shape[:-1], classes, *out_features)
    return F.cross_entropy(logits, target, weight=weight, reduction=reduction,
                           ignore_index=-100 if ignore_index is None else ignore_index, label_smoothing=label_smoothing)


# Ops whose derivatives torch gets wrong in both modes, checked against their definition instead: the chunked
# linear_cross_entropy operators take their gradient flags from requires_grad at the call (torch.func.jvp gives a
# zero tangent), and their backward is not differentiable (no double-backward reference).
DEFINITIONS = {"nn.functional.linear_cross_entropy": _linear_cross_entropy_by_definition}

# Ops whose forward-mode formula torch gets wrong (its OpInfo marks them unsupported, and torch.func.jvp still runs):
# reverse-mode references. Elsewhere torch.func.jvp comes first and reverse mode is the reference only where it fails
# (``native_layer_norm``, which the OpInfo also marks, has a correct forward-mode formula, and reverse mode treats its
# statistics as constants).
REVERSE_REFERENCE = {"scatter_reduce.prod"}


@dataclasses.dataclass
class Case:
    op: str            # OpInfo name
    variant: str       # "" | "inplace"
    sample: int
    operand: int       # index of the differentiated leaf among the sample's flattened arguments
    fn: Callable
    primal: torch.Tensor
    forward_ad: bool = True  # False: torch's forward AD of the op is wrong; the references are reverse mode
    ref_fn: Callable | None = None  # the references' function where it is not ``fn`` (:data:`DEFINITIONS`)
    where: str = ""    # the differentiated leaf's path in ``(input, args, kwargs)``: "[0]", "[2]['weight']"
    sample_input: Any = None  # the OpInfo SampleInput (what a test's expected failures select samples by)

    @property
    def reference_fn(self) -> Callable:
        return self.fn if self.ref_fn is None else self.ref_fn

    @property
    def id(self) -> str:
        v = f".{self.variant}" if self.variant else ""
        return f"{self.op}{v}[s{self.sample}x{self.operand}]"


@dataclasses.dataclass
class Result:
    case: Case
    kind: str          # rule | fallback | error | skip | mismatch | crash
    detail: str = ""
    fallbacks: tuple = ()
    capture: str = ""  # engine="captured": "captured", or "eager: <why the capture fell back>"


def sweep_ops() -> list:
    """OpInfos with float64 and a derivative (forward or reverse mode) on CPU."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if (o.supports_forward_ad or o.supports_autograd) and D in o.supported_dtypes("cpu")]


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _call(variant_fn, flat, spec, i, clone_self):
    def fn(x):
        f2 = list(flat)
        f2[i] = x
        inp, args, kwargs = tree_unflatten(f2, spec)
        if clone_self and isinstance(inp, torch.Tensor):
            inp = inp.clone()
        return variant_fn(inp, *args, **kwargs)

    return fn


def strided(samples: list, every: int = 1) -> Iterator[tuple]:
    """``(index, sample)`` of every ``every``-th sample, the last one included (a sweep's shorter form: the first
    samples of an op are often 0-d tensors, the larger ones come later)."""
    for si, s in enumerate(samples):
        if si % every == 0 or si == len(samples) - 1:
            yield si, s


def cases(op, n_samples: int = N_SAMPLES, every: int = 1) -> Iterator[Case]:
    """The cases of one OpInfo (see module docstring), of every ``every``-th of its first ``n_samples`` samples
    (:func:`strided`; the case ids keep the samples' indices)."""
    torch.manual_seed(0)
    samples = list(itertools.islice(op.sample_inputs("cpu", D, requires_grad=False), n_samples))
    for si, s in strided(samples, every):
        flat, spec = tree_flatten((s.input, tuple(s.args), dict(s.kwargs)))
        paths = [keystr(path) for path, _ in tree_flatten_with_path((s.input, tuple(s.args), dict(s.kwargs)))[0]]
        floats = [i for i, v in enumerate(flat) if _is_float(v) and v.dtype == D][:MAX_OPERANDS]
        definition = DEFINITIONS.get(op.name)
        forward_ad = (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) not in REVERSE_REFERENCE
        for i in floats:
            ref = None if definition is None else _call(definition, flat, spec, i, False)
            yield Case(op.name, "", si, i, _call(op.op, flat, spec, i, False), flat[i], forward_ad, ref, paths[i], s)
        inplace = op.inplace_variant
        if inplace is not None and floats and floats[0] == 0 and isinstance(s.input, torch.Tensor):
            yield Case(op.name, "inplace", si, 0, _call(inplace, flat, spec, 0, True), flat[0], forward_ad,
                       where=paths[0], sample_input=s)


#: call forms of :func:`keyword_cases`: every argument after the input by keyword; the first one by position and
#: the rest by keyword; everything by keyword, the input too (torch functions only: a method's receiver is
#: positional)
CALL_FORMS = ("keywords", "mixed", "all_keywords")


def _variants(op) -> list:
    """``(name, callable)`` of an OpInfo's torch function and Tensor method, where they are torch's own (an OpInfo's
    ``op`` is often a test lambda, whose signature says nothing of torch's)."""
    out = []
    for name, fn in (("function", op.op), ("method", op.method_variant)):
        if fn is None or getattr(fn, "__name__", "<lambda>") == "<lambda>":
            continue
        module = getattr(fn, "__module__", None) or ""
        if name == "method" or module.startswith("torch") or type(fn).__name__ == "builtin_function_or_method":
            out.append((name, fn))
    return out


def _keyword_form(fn, method: bool, n_args: int, keys: frozenset, form: str):
    """``(input_name, names)``: the keywords to pass the first ``n_args`` arguments by, in ``form``, from the
    first of ``fn``'s signatures that takes them with the sample's own keywords; ``None`` if none does."""
    from jvpreg.clone.core.registry import overloads

    for ov in overloads(fn):
        names = [n for n, _ in ov.positional]
        if len(names) < 1 + n_args or any(k not in names[1 + n_args:] and k not in ov.keyword_only for k in keys):
            continue
        if form == "all_keywords":
            return (None if method else names[0]), names[1:1 + n_args]
        return None, names[1:1 + n_args]
    return None


def keyword_cases(op, n_samples: int = 8) -> Iterator[Case]:
    """The cases of :func:`cases` called in other forms (:data:`CALL_FORMS`), with the keyword names taken from
    torch's own signatures of the op (:func:`jvpreg.clone.core.registry.overloads`: the ATen schemas the argument parser
    binds by). A form torch itself refuses, or that gives other values than the positional call, is not a case:
    the sweep checks the engine on the calls torch accepts."""
    torch.manual_seed(0)
    samples = list(itertools.islice(op.sample_inputs("cpu", D, requires_grad=False), n_samples))
    for vname, fn in _variants(op):
        method = vname == "method"
        for si, s in enumerate(samples):
            args, kw = tuple(s.args), dict(s.kwargs)
            if not isinstance(s.input, torch.Tensor):
                continue
            for form in CALL_FORMS:
                if (form == "mixed" and len(args) < 2) or (form != "all_keywords" and not args) or (
                        form == "all_keywords" and method):
                    continue
                names = _keyword_form(fn, method, len(args), frozenset(kw), form)
                if names is None:
                    continue
                call = _formed_call(fn, names, form)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        torch.manual_seed(0)
                        want = fn(s.input, *args, **kw)
                        torch.manual_seed(0)
                        got = call(s.input, args, kw)
                except Exception:
                    continue  # torch refuses this form (or the sample itself)
                if mismatch(got, want, want, "form"):
                    continue
                flat, spec = tree_flatten((s.input, args, kw))
                floats = [i for i, v in enumerate(flat) if _is_float(v) and v.dtype == D][:MAX_OPERANDS]
                forward_ad = (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) \
                    not in REVERSE_REFERENCE
                definition = DEFINITIONS.get(op.name)
                for i in floats:  # the reference: the positional call (the same values, checked above)
                    ref = None if definition is None else _call(definition, flat, spec, i, False)
                    yield Case(op.name, f"{vname}.{form}", si, i, _formed(call, flat, spec, i), flat[i], forward_ad,
                               ref)


def _formed_call(fn, names: tuple, form: str) -> Callable:
    first, rest = names

    def call(inp, args, kw):
        if form == "mixed":
            return fn(inp, args[0], **dict(zip(rest[1:], args[1:])), **kw)
        by_name = dict(zip(rest, args), **kw)
        return fn(**{first: inp}, **by_name) if first is not None else fn(inp, **by_name)

    return call


def _formed(call, flat, spec, i):
    def fn(x):
        f2 = list(flat)
        f2[i] = x
        inp, args, kw = tree_unflatten(f2, spec)
        return call(inp, args, kw)

    return fn


def run_keyword_op(op, n_samples: int = 8) -> list:
    """Every case of :func:`keyword_cases` of one OpInfo, run on the eager engine."""
    try:
        cs = list(keyword_cases(op, n_samples))
    except Exception as err:  # pragma: no cover - depends on the torch version
        return [Result(Case(op.name, "", -1, -1, None, None), "skip", f"samples failed: {err}")]
    return [run_case(c) for c in cs]


def _tangent_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if x.is_complex():
        return torch.randn(x.shape, dtype=x.dtype, generator=g)
    return torch.randn(x.shape, dtype=x.dtype, generator=g)


def reference(fn: Callable, x: torch.Tensor, u: torch.Tensor, forward_ad: bool = True):
    """``(f(x), J u)`` by ``torch.func.jvp``; reverse mode (double-backward trick) where it fails, or where
    ``forward_ad`` is False (torch's forward-mode formula for the op is missing or wrong)."""
    first, second = ((lambda: torch.func.jvp(fn, (x,), (u,))), (lambda: _double_vjp(fn, x, u)))
    if not forward_ad:  # torch.func.jvp only where reverse mode cannot run (integer outputs)
        first, second = second, first
    try:
        return first()
    except Exception:
        return second()


def _double_vjp(fn: Callable, x: torch.Tensor, u: torch.Tensor, create_graph: bool = False):
    """``(f(x), J u)`` by the double-backward trick (differentiable with ``create_graph``)."""
    out = fn(x.clone())
    if not all(_is_float(o) or not isinstance(o, torch.Tensor) for o in tree_flatten(out)[0]):
        raise TypeError("the reverse-mode reference takes float outputs only")
    return torch.autograd.functional.jvp(lambda z: fn(z.clone()), (x,), (u,), create_graph=create_graph)


def mismatch(got, want, ref_primal, what: str) -> str:
    """"" (close) or a description of the first difference; the comparison of the module docstring."""
    gl, gs = tree_flatten(got)
    wl, ws = tree_flatten(want)
    pl = tree_flatten(ref_primal)[0]
    if gs != ws:
        return f"{what}: structure {gs} != reference {ws}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        if not isinstance(w, torch.Tensor):
            if g != w and not (g is None and w is None):
                return f"{what}[{i}]: {g!r} != {w!r}"
            continue
        if not isinstance(g, torch.Tensor):
            return f"{what}[{i}]: got {type(g).__name__}, expected a tensor"
        g, w = g.detach(), w.detach()
        if g.shape != w.shape:
            return f"{what}[{i}]: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not _is_float(w):
            if not torch.equal(g, w.to(g.dtype)):
                return f"{what}[{i}]: integer/bool outputs differ"
            continue
        g = g.to(w.dtype)
        p = pl[i] if i < len(pl) and isinstance(pl[i], torch.Tensor) and pl[i].shape == w.shape else None
        if p is not None and _is_float(p):  # non-finite primal entries: 0 or NaN accepted (block_delta)
            nonfin = ~torch.isfinite(p)
            g = torch.where(nonfin & (torch.isnan(g) | (g == 0)), w, g)
        fin = torch.isfinite(w)
        scale = w[fin].abs().max().item() if fin.any() else 1.0
        atol = RTOL * max(scale, 1.0)
        if not torch.allclose(g, w, rtol=RTOL, atol=atol, equal_nan=True):
            err = (g - w).abs()
            err = torch.where(torch.isnan(err), torch.full_like(err.real if err.is_complex() else err, float("inf")),
                              err.real if err.is_complex() else err)
            return f"{what}[{i}]: max abs error {err.max().item():.3g} (scale {scale:.3g})"
    return ""


def run_case(case: Case, u: torch.Tensor | None = None, engine: str = "eager") -> Result:
    """Run one case and classify it (see module docstring); ``u``: the tangent (a seeded random one by default);
    ``engine``: ``"eager"`` (the op's rules dispatched one by one), ``"captured"`` (the op wrapped in a module and
    run as the captured program the callbacks replay, then replayed on other values: :func:`_replay_mismatch`) or
    ``"compiled"`` (the same program under ``torch.compile``; seconds per case)."""
    from jvpreg.clone.core.errors import UnsupportedOpError
    from jvpreg.clone.eager.dispatch import record_fallbacks

    x = case.primal
    u = _tangent_like(x, 1) if u is None else u
    try:
        torch.manual_seed(0)
        ref_y, ref_t = reference(case.reference_fn, x.clone(), u, case.forward_ad)
    except Exception as err:  # the reference refuses: nothing to compare with
        return Result(case, "skip", f"reference failed: {type(err).__name__}: {str(err)[:120]}")
    if case.op in RANDOM_OPS:
        return Result(case, "skip", "random op")
    module = None if engine == "eager" else _AsModule(case.fn)
    try:
        with warnings.catch_warnings(), record_fallbacks() as seen:
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            y, t = _ours(case.fn, x.clone(), u, engine, module)
    except UnsupportedOpError as err:
        return Result(case, "error", str(err).split(". ")[0][:200])
    except Exception as err:
        import traceback

        tb = traceback.extract_tb(err.__traceback__)
        where = next((f"{fr.filename.split('jvpreg/')[-1]}:{fr.lineno}" for fr in reversed(tb)
                      if "jvpreg/clone" in fr.filename), "?")
        return Result(case, "crash", f"{type(err).__name__} at {where}: {str(err)[:200]}")
    note = LAST_CAPTURE[0] if engine != "eager" else ""
    bad = mismatch(y, ref_y, ref_y, "primal") or mismatch(t, ref_t, ref_y, "tangent")
    if not bad and note == "captured":
        try:
            bad = _replay_mismatch(case, module, x, u, engine)
        except UnsupportedOpError as err:
            return Result(case, "error", "replay: " + str(err).split(". ")[0][:200], capture=note)
        except Exception as err:
            return Result(case, "crash", f"replay: {type(err).__name__}: {str(err)[:200]}", capture=note)
    if bad:
        return Result(case, "mismatch", bad, tuple(seen), note)
    try:
        bad = gradient_mismatch(case.fn, x, u, ref_y, ref_t, case.forward_ad, case.ref_fn, engine)
    except UnsupportedOpError as err:
        return Result(case, "error", "backward: " + str(err).split(". ")[0][:200], capture=note)
    except Exception as err:
        return Result(case, "crash", f"backward: {type(err).__name__}: {str(err)[:200]}", capture=note)
    if bad:
        return Result(case, "mismatch", bad, tuple(seen), note)
    return Result(case, "fallback" if seen else "rule", "", tuple(sorted(set(seen))), note)


def _float_leaves(tree) -> list:
    return [l for l in tree_flatten(tree)[0] if isinstance(l, torch.Tensor) and l.dtype == D]


def _functional(y, t, weights) -> torch.Tensor:
    """``<w_y, y> + <w_t, t>`` over the float leaves (``None`` weights skipped)."""
    total = torch.zeros((), dtype=D)
    for leaf, w in zip(_float_leaves(y) + _float_leaves(t), weights):
        if w is not None:
            total = total + (leaf * w).sum()
    return total


def _differentiable_run(jvp: Callable, fn: Callable, x: torch.Tensor, u: torch.Tensor) -> tuple:
    """``((y, t), x', u')``: ``jvp(fn, x', u')`` on copies of ``x, u`` that require grad."""
    xr, ur = x.clone().requires_grad_(), u.clone().requires_grad_()
    torch.manual_seed(0)
    return jvp(fn, xr, ur), xr, ur


def _grads(run: tuple, weights) -> list:
    """``[dL/dx, dL/du]`` of a :func:`_differentiable_run` (zeros where ``L`` does not depend on one)."""
    (y, t), xr, ur = run
    total = _functional(y, t, weights)
    if not total.requires_grad:
        return [torch.zeros_like(xr), torch.zeros_like(ur)]
    grads = torch.autograd.grad(total, (xr, ur), allow_unused=True)
    return [torch.zeros_like(v) if g is None else g for g, v in zip(grads, (xr, ur))]


class _AsModule(torch.nn.Module):
    """A function as a module's forward: what the captured engine records (it captures modules, not functions)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


#: what the last captured run of :func:`_ours` did: ``"captured"``, or ``"eager: <the capture's reason>"``
LAST_CAPTURE: list = [""]


def _ours(fn, x, u, engine: str = "eager", module: torch.nn.Module | None = None):
    """``jvpreg.jvp(fn, (x,), (u,))``; with another engine (``"captured"``, ``"compiled"``) through ``module``
    (default: a fresh one, so a fresh capture), whose outcome :data:`LAST_CAPTURE` records."""
    import jvpreg
    from jvpreg.clone.program import capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine == "eager":
            return jvpreg.jvp(fn, (x,), (u,))
        module = _AsModule(fn) if module is None else module
        out = jvpreg.jvp(module, (x,), (u,), engine=engine)
        progs = list(capture.programs(module).values())
        LAST_CAPTURE[0] = next(("eager: " + p.reason for p in progs if p.gm is None), "captured" if progs else
                               "eager: no program")
        return out


def _torch_func(fn, x, u):
    return torch.func.jvp(fn, (x,), (u,))


def _torch_reverse(fn, x, u):
    return _double_vjp(fn, x, u, create_graph=True)


def _replay_mismatch(case: Case, module: torch.nn.Module, x: torch.Tensor, u: torch.Tensor,
                     engine: str = "captured") -> str:
    """"" or a difference of the captured program, replayed on other values of ``x``, from the reference there: a
    value the capture baked into the program, or a guard that missed a read whose value changed, shows here. The
    other values: ``x (1 + n_1 / 10) + std(x) n_2 / 10`` (small entries change sign; non-finite ones are kept, so the
    call's signature is the same and the program replays or records a variant for the new values)."""
    if not _is_float(x) or x.numel() == 0:
        return ""
    g = torch.Generator().manual_seed(3)
    real = x.real if x.is_complex() else x
    fin = torch.isfinite(real) if not x.is_complex() else torch.isfinite(x.real) & torch.isfinite(x.imag)
    spread = float(real[fin].std()) if int(fin.sum()) > 1 else 1.0
    noise = [torch.randn(x.shape, dtype=real.dtype, generator=g) for _ in range(2)]
    x2 = torch.where(fin, x * (1 + noise[0] / 10) + (spread if math.isfinite(spread) else 1.0) * noise[1] / 10, x)
    try:
        torch.manual_seed(0)
        ref_y, ref_t = reference(case.reference_fn, x2.clone(), u, case.forward_ad)
    except Exception:  # the reference refuses the new values (a domain): nothing to compare with
        return ""
    torch.manual_seed(0)
    y, t = _ours(case.fn, x2.clone(), u, engine, module)
    return mismatch(y, ref_y, ref_y, "replay on other values: primal") or \
        mismatch(t, ref_t, ref_y, "replay on other values: tangent")


def gradient_mismatch(fn: Callable, x: torch.Tensor, u: torch.Tensor, ref_y, ref_t, forward_ad: bool = True,
                      ref_fn: Callable | None = None, engine: str = "eager") -> str:
    """"" (close, or nothing to compare) or a description of a wrong gradient; see the module docstring
    (``ref_fn``: the references' function, where it is not ``fn``; ``engine``: ours, as in :func:`run_case`)."""
    ref_fn = fn if ref_fn is None else ref_fn
    if not _is_float(x) or x.is_complex() or x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return ""
    leaves = _float_leaves(ref_y) + _float_leaves(ref_t)
    if not leaves or not all(bool(torch.isfinite(l).all()) for l in leaves):
        return ""
    g = torch.Generator().manual_seed(2)
    ref_run, differentiable = None, [True] * len(leaves)
    for run in ((_torch_func, _torch_reverse) if forward_ad else (_torch_reverse,)):
        try:
            ref_run = _differentiable_run(run, ref_fn, x, u)
            # outputs torch declares non-differentiable (batch norm's saved statistics) are left out of L
            differentiable = [l.requires_grad for l in _float_leaves(ref_run[0])]
            break
        except Exception:
            continue
    weights = [torch.randn(l.shape, dtype=D, generator=g) if d else None for l, d in zip(leaves, differentiable)]
    try:
        ref = None if ref_run is None else _grads(ref_run, weights)
    except Exception:  # no reverse-over-forward in torch: the finite differences alone decide
        ref = None
    try:
        ours = _grads(_differentiable_run(functools.partial(_ours, engine=engine), fn, x, u), weights)
    except Exception:
        if ref is None:  # torch cannot differentiate this JVP either (a target, a class weight, a sparse grad)
            return ""
        raise
    if ref is not None and all(_close(a, b) for a, b in zip(ours, ref)):
        return ""
    vx = torch.randn(x.shape, dtype=D, generator=g)
    vu = torch.randn(u.shape, dtype=D, generator=g)

    def along(h: float) -> float:
        torch.manual_seed(0)
        y, t = reference(ref_fn, x + h * vx, u + h * vu, forward_ad)
        return float(_functional(y, t, weights))

    got = float((ours[0] * vx).sum() + (ours[1] * vu).sum())
    auto = ("" if ref is None else
            f", reverse mode through torch.func.jvp {float((ref[0] * vx).sum() + (ref[1] * vu).sum()):.6g}")
    h = 1e-3 * max(1.0, float(x.abs().max()))
    try:
        fd = [(along(s) - along(-s)) / (2 * s) for s in (h, h / 2)]
    except Exception:  # no finite differences: the reverse-mode reference alone decides (none: nothing to compare)
        return "" if ref is None else f"gradient of <w, (f(x), J u)>: directional derivative {got:.6g}{auto}"
    fd = (4 * fd[1] - fd[0]) / 3  # Richardson: O(h^4)
    if abs(got - fd) <= 1e-5 * max(1.0, abs(fd)):
        return ""
    which = [n for n, a, b in zip(("x", "u"), ours, ref or [None, None]) if b is None or not _close(a, b)]
    return (f"gradient of <w, (f(x), J u)> w.r.t. {'/'.join(which)}: directional derivative {got:.6g}, "
            f"finite differences {fd:.6g}{auto}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    fin = b[torch.isfinite(b)]
    scale = fin.abs().max().item() if fin.numel() else 0.0
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6 * max(scale, 1.0), equal_nan=True)


def check(fn: Callable, x: torch.Tensor, u: torch.Tensor | None = None) -> str:
    """``""`` when ``jvpreg.jvp(fn, (x,), (u,))`` matches ``torch.func.jvp`` in value and in the gradients of a
    functional of its outputs (this module's comparison), else ``"<kind>: <first difference>"`` (kinds of
    :func:`run_case`): the sweep's check of one op, for a rule of your own. ``x`` in float64; ``u``: a random
    direction by default."""
    result = run_case(Case(getattr(fn, "__name__", "fn"), "", 0, 0, fn, x), u)
    return "" if result.kind in ("rule", "fallback") else f"{result.kind}: {result.detail}"


def run_op(op, n_samples: int = N_SAMPLES, engine: str = "eager", every: int = 1) -> list:
    """Every case of one OpInfo (of every ``every``-th sample: :func:`cases`); a failure to build the samples is a
    ``skip`` of the whole op."""
    try:
        cs = list(cases(op, n_samples, every))
    except Exception as err:  # pragma: no cover - depends on the torch version
        return [Result(Case(op.name, "", -1, -1, None, None), "skip", f"samples failed: {err}")]
    return [run_case(c, engine=engine) for c in cs]


# ----------------------------------------------------------------------------- float32 precision

F32_RATIO = 10.0    # our float32 error may be this many times torch.func's own float32 error ...
F32_ATOL = 1e-6     # ... plus this fraction of max |f(x)|: the difference form's absolute error is eps |y_0| / s


def float32_errors(op, n_samples: int = N_SAMPLES, skip: Callable[[Any], bool] | None = None) -> list:
    """``(case id, our error, torch.func's error, allowed)`` of every float32 case of ``op`` whose tangent is further
    from the float64 reference (:func:`reference` on the same inputs cast to float64) than ``F32_RATIO`` times
    the reference's own float32 error plus ``F32_ATOL * max |f(x)|``: a JVP silently wrong in the dtype models
    train in. Compared where the reference primal and tangent are finite (elsewhere the 0/NaN convention of the
    float64 sweep holds); cases where either side raises are left to the float64 sweep. ``skip(sample_input)``: the
    samples not compared (an op whose result is unspecified on some samples)."""
    import jvpreg

    f32 = torch.float32
    if f32 not in op.supported_dtypes("cpu") or op.name in RANDOM_OPS:
        return []
    torch.manual_seed(0)
    samples = []
    for s in itertools.islice(op.sample_inputs("cpu", f32, requires_grad=False), n_samples):
        # copied as they come: some generators write into earlier samples' tensors (masked.* put -inf in)
        flat, spec = tree_flatten((s.input, tuple(s.args), dict(s.kwargs)))
        samples.append(None if skip is not None and skip(s) else
                       ([v.clone() if isinstance(v, torch.Tensor) else v for v in flat], spec))
    bad = []
    definition = DEFINITIONS.get(op.name, op.op)  # the references' function and mode, as in the float64 sweep
    forward_ad = (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) not in REVERSE_REFERENCE
    for si, sample in enumerate(samples):
        if sample is None:
            continue
        flat, spec = sample
        for i in [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.dtype == f32][:MAX_OPERANDS]:
            u = _tangent_like(flat[i], 1)
            try:
                ref_y, ref_t = reference(_call(definition, [_as(v, D) for v in flat], spec, i, False),
                                         flat[i].double(), u.double(), forward_ad)
                fn = _call(op.op, flat, spec, i, False)
                _, torch_t = reference(_call(definition, flat, spec, i, False), flat[i].clone(), u, forward_ad)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _, t = jvpreg.jvp(fn, (flat[i].clone(),), (u,))
            except Exception:
                continue
            ys, rts, tts, ts = (tree_flatten(v)[0] for v in (ref_y, ref_t, torch_t, t))
            scale = max((y[torch.isfinite(y)].abs().max().item() for y in ys
                         if isinstance(y, torch.Tensor) and y.is_floating_point() and torch.isfinite(y).any()),
                        default=0.0)
            for y, r, a, b in zip(ys, rts, tts, ts):
                if not (isinstance(r, torch.Tensor) and r.is_floating_point() and isinstance(b, torch.Tensor)
                        and b.shape == r.shape and a.shape == r.shape):
                    continue
                ok = torch.isfinite(r) & (torch.isfinite(y) if y.shape == r.shape else True)
                if not ok.any():
                    continue
                ours = (b.double() - r)[ok].abs().nan_to_num(math.inf).max().item()
                theirs = (a.double() - r)[ok].abs().nan_to_num(math.inf).max().item()
                allowed = F32_RATIO * theirs + F32_ATOL * scale
                if ours > allowed:
                    bad.append((f"{op.name}[s{si}x{i}]", ours, theirs, allowed))
    return bad


def _as(v: Any, dtype: torch.dtype) -> Any:
    return v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v


# ----------------------------------------------------------------------------- ops whose output shape follows values

VALUE_SHAPE_PERTURBATIONS = 4


def value_shape_ops() -> list:
    """Every OpInfo that runs on the CPU in float64, int64 or bool (a program records index and mask ops too)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if _value_shape_dtype(o) is not None]


def _value_shape_dtype(op) -> torch.dtype | None:
    dtypes = op.supported_dtypes("cpu")
    return next((d for d in (D, torch.int64, torch.bool) if d in dtypes), None)


def _shape_of(value: Any) -> Any:
    """A node's value as shapes: tensors by their shape, everything else (sizes, dims, flags) by repr."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _shape_of(v)) for k, v in sorted(value.items()))
    return repr(value)


def _recorded_ops(fn: Callable, tensors: list) -> tuple:
    """``fn(*tensors)`` recorded as the capture records a forward (``make_fx``, pre-dispatch, real tensors): the
    graph and, per aten op, ``(node, its arguments as shapes, its output as shapes)``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="real", pre_dispatch=True)(*tensors)
    ops = [(n, _shape_of((n.target, n.args, n.kwargs)), _shape_of(n.meta.get("val"))) for n in gm.graph.nodes
           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    return gm, ops


def _other_values(t: Any, kind: int, gen: torch.Generator) -> Any:
    """A tensor shaped like ``t`` with other values: half its floats zeroed (``kind`` 0) or fresh normal ones (1);
    its integers permuted (0: indices stay valid) or drawn within their range (1); random bools."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.layout != torch.strided:
        return t
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) < 0.5
    if t.is_floating_point() or t.is_complex():
        if kind == 0:
            return t * (torch.rand(t.shape, generator=gen) < 0.5).to(t.dtype)
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    flat = t.reshape(-1)
    if kind == 0:
        return flat[torch.randperm(flat.numel(), generator=gen)].reshape(t.shape)
    return torch.randint(int(t.min()), int(t.max()) + 1, t.shape, generator=gen, dtype=t.dtype)


def value_shaped(op, n_samples: int = N_SAMPLES, every: int = 1) -> list:
    """``(aten op, sample, guarded)`` for each op in the recorded program of one of ``op``'s samples whose output
    shape changes with its arguments' *values*; ``guarded``: :func:`jvpreg.clone.program.value_shapes.dynamic_shapes` (what the
    capture guards) holds it. One that it leaves out would make a program hold the recorded shape without a guard,
    silently wrong or crashing on other values.

    Each sample is recorded as the capture records (:func:`_recorded_ops`) and recorded again on other values of
    the same shapes (:func:`_other_values`); the two programs' ops are compared in order up to the first op whose
    target, arguments' shapes or non-tensor arguments differ (the control flow parted). An op with the same
    arguments and another output shape is value-shaped. Values the op rejects (an index out of range), and samples
    that cannot be recorded, are skipped. ``every``: every ``every``-th sample only (:func:`strided`)."""
    from jvpreg.clone.program.value_shapes import dynamic_shapes

    dtype = _value_shape_dtype(op)
    torch.manual_seed(0)
    try:
        samples = list(itertools.islice(op.sample_inputs("cpu", dtype), n_samples))
    except Exception:  # pragma: no cover - depends on the torch version
        return []
    found = set()
    for si, s in strided(samples, every):
        flat, spec = tree_flatten((s.input, tuple(s.args), dict(s.kwargs)))
        pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.layout == torch.strided]

        def fn(*tensors, flat=flat, spec=spec, pos=pos):
            leaves = list(flat)
            for i, t in zip(pos, tensors):
                leaves[i] = t
            inp, args, kwargs = tree_unflatten(leaves, spec)
            return op.op(inp, *args, **kwargs)

        try:
            gm, base = _recorded_ops(fn, [flat[i] for i in pos])
        except Exception:
            continue
        guarded = {node for node, _, _ in dynamic_shapes(gm.graph)}
        for k in range(VALUE_SHAPE_PERTURBATIONS):
            gen = torch.Generator().manual_seed(k)
            try:
                _, other = _recorded_ops(fn, [_other_values(flat[i], k % 2, gen) for i in pos])
            except Exception:
                continue
            for (node, args, out), (_, args2, out2) in zip(base, other):
                if args != args2:
                    break
                if out != out2:
                    found.add((str(node.target), si, node in guarded or bool(guarded.intersection(node.users))))
                    break
    return sorted(found)
