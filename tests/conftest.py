"""Shared test harness: pytree comparison against a reference, seeding, and the float64 default dtype name.

``assert_tree_close(got, want, rtol=1e-10, what="")``: same pytree structure; float leaves equal to ``rtol``
with ``atol = rtol * max|want|`` (1 for an all-zero reference); integer/bool leaves exactly; other leaves
with ``==``. Import it as ``from conftest import assert_tree_close`` (pytest puts ``tests/`` on the path).
``assert_as_plain(got, want)``: a clone forward's primal output or stored state against a plain forward's, up to the
last bits the BLAS's row count moves (its docstring).
``reference_jvp(f, x, u)``: torch.func.jvp, or the reverse-mode Jacobian where forward AD is missing.
``count_captures()`` (a context manager) and the ``capture_counts`` fixture: how many programs the captured and
compiled engines recorded, refused and replayed (``CaptureCounts``), to prove that a program ran, not only that the
result was right (eager clone mode gives the same numbers). ``runs_engine(engine, calls, refused="")`` (a context
manager) asserts that the engine a test names ran its calls, or that their capture was refused with that reason.

Three tiers (``tier(item)``): **sweep** (``@pytest.mark.sweep``: the op-by-op and model-by-model sweeps past their
quick cases: OpInfo, keyword forms, replay, the model, client and capture zoos), **slow** (``@pytest.mark.slow``:
DDP/FSDP workers, Hydra runs in subprocesses, benchmarks, whole models, and every other case that took 1 s or more in a
quick run) and **quick** (the rest: each file keeps its cheapest tests, each sweep a few representatives).
``python -m pytest tests -q -n 2`` is the quick run; ``--slow`` runs all three tiers (``python -m pytest tests -q
--slow -n 2``: CI); ``--tier slow`` / ``--tier sweep`` (repeatable) runs the tiers named. An explicit ``-m`` without
``--tier`` selects by itself (``-m sweep``: every sweep case, the captured sweep on its quick sample count).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._pytree import tree_flatten

D = torch.float64
RTOL = 1e-10


def assert_tree_close(got, want, rtol: float = RTOL, what: str = "") -> None:
    """Same pytree; float leaves equal to ``rtol`` (atol scaled by the leaf's largest entry)."""
    gl, gs = tree_flatten(got)
    wl, ws = tree_flatten(want)
    assert gs == ws, f"{what}: output structure {gs} != reference {ws}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        if not isinstance(w, torch.Tensor):
            assert g == w or (g is None and w is None), f"{what}[{i}]: {g!r} != {w!r}"
            continue
        assert isinstance(g, torch.Tensor), f"{what}[{i}]: got {type(g).__name__}"
        g, w = g.detach(), w.detach()
        if w.is_floating_point() or w.is_complex():
            atol = rtol * max(w.abs().max().item() if w.numel() else 0.0, 1.0 if not w.any() else 0.0)
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{i}]: {m}")
        else:
            assert torch.equal(g, w.to(g.dtype)), f"{what}[{i}]: integer outputs differ"


def assert_as_plain(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """``got`` (a clone forward's primal output or state) equals ``want`` (a plain forward's on the B primal rows) up
    to the last bits a matrix product's row count moves: MKL on AVX-512 gives a row of a product on 3 rows other
    last bits than on 6 (``Linear(4, 4)`` in float64: 5.6e-17 apart; 4, 8 and 16 rows: equal), and a clone forward
    multiplies all ``(1 + k) B`` rows at once. 64 ulps of the largest entry: a stored clone batch, a tangent block or a
    state updated twice is off by the entries themselves."""
    assert type(got) is torch.Tensor, f"{what}: got {type(got).__name__}, expected a plain tensor"
    scale = want.detach().abs().max().item() if want.numel() else 0.0
    atol = 64 * torch.finfo(want.dtype).eps * max(scale, torch.finfo(want.dtype).tiny)
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def reference_jvp(f, x: torch.Tensor, u: torch.Tensor):
    """``(f(x), J u)`` by ``torch.func.jvp``; where this torch has no forward-mode formula for an op (torch 2.11 has
    none for ``grid_sampler_2d``), by the reverse-mode Jacobian of ``f`` at ``x`` applied to ``u``."""
    try:
        return torch.func.jvp(f, (x,), (u,))
    except NotImplementedError as err:
        if "forward AD" not in str(err):
            raise
    y = f(x)
    jac = torch.autograd.functional.jacobian(f, x)
    return y, (jac.reshape(y.numel(), x.numel()) @ u.reshape(-1)).reshape(y.shape)


@dataclass
class CaptureCounts:
    """What :mod:`jvpreg.clone.program.capture` did inside :func:`count_captures`: ``recorded`` programs (a capture that
    gave a program), ``refused`` captures (a capture attempt that gave a program-less record: eager clone mode, with
    its reason), ``replays`` (calls that ran a recorded program, compiled or not) and ``eager`` (calls of the
    captured/compiled/auto engines that ran in eager clone mode for a reason: a refused capture, a hook, too many
    signatures; not the ``"auto"`` engine's first eager calls of a signature, nor ``engine="eager"``), with their
    ``reasons``; ``raised``: captures that raised (the forward's own error, e.g. torch's ``ValueError``, raised while
    it was recorded); ``uncaptured``: why :func:`jvpreg.jvp` could not take a callable apart
    (:func:`jvpreg.clone.callables.take_apart`: the call then runs in eager clone mode with a ``JVPCaptureWarning``,
    said once per process: :func:`runs_engine` asserts it).

    A test that claims a program was recorded asserts ``recorded`` (e.g. ``== 1``), one that claims a replay asserts
    ``replays``: ``all(p.gm is not None for p in capture.programs(m).values())`` holds for an empty dict, i.e.
    when everything ran eagerly."""

    recorded: int = 0
    refused: int = 0
    replays: int = 0
    eager: int = 0
    raised: int = 0
    reasons: list = field(default_factory=list)
    uncaptured: list = field(default_factory=list)

    def ran_programs(self, calls: int) -> None:
        """Every one of ``calls`` calls replayed a recorded program (and none ran eagerly)."""
        assert self.replays == calls and self.eager == 0, f"expected {calls} replays and no eager run, got {self}"

    def ran_engine(self, engine: str, calls: int, signatures: int = 1) -> None:
        """The engine a test names ran: ``"eager"``: no program and no capture; ``"captured"``: every one of
        ``calls`` calls replayed a program; ``"auto"``: the first calls of each of ``signatures`` signatures
        (``capture.EAGER_CALLS_BEFORE_CAPTURE``: one) ran eagerly and every later call replayed a program (call
        ``capture.reset()`` first: a program an earlier test recorded for the same code replays on a first call)."""
        if engine == "eager":
            assert self.recorded == self.refused == self.replays == self.eager == 0 and not self.uncaptured, self
        elif engine == "auto":
            from jvpreg.clone.program import capture

            first = signatures * capture.EAGER_CALLS_BEFORE_CAPTURE
            assert self.replays == calls - first and self.eager == 0 and not self.uncaptured, (
                f"expected {first} eager first call(s), then {calls - first} replays, got {self}")
        else:
            assert not self.uncaptured, f"the callable was not taken apart: {self.uncaptured}"
            self.ran_programs(calls)

    def refused_with(self, reason: str, calls: int) -> None:
        """Every one of ``calls`` calls ran in eager clone mode because its capture was refused for a reason that
        contains ``reason`` (a refused capture, or a callable that could not be taken apart), and no program ran."""
        why = self.reasons + self.uncaptured
        assert self.replays == 0 and self.recorded == 0, f"a program ran: {self}"
        assert len(why) == calls, f"expected {calls} refused calls, got {self}"
        assert all(reason in r for r in why), f"expected the reason {reason!r}, got {why}"


@contextlib.contextmanager
def count_captures():
    """Count, in a :class:`CaptureCounts`, the captures, replays and eager runs of the captured engine inside the
    ``with``. Counts ``capture._capture`` (every recording), ``capture._rebuild`` (every replay) and
    ``capture._run_eager`` by wrapping them in the module (``capture._call`` looks them up there on each call)."""
    from jvpreg.clone import callables
    from jvpreg.clone.program import capture

    counts = CaptureCounts()
    record, rebuild, run_eager = capture._capture, capture._rebuild, capture._run_eager
    take_apart = callables.take_apart

    def counted_record(*args, **kwargs):
        try:
            prog = record(*args, **kwargs)
        except BaseException:
            counts.raised += 1
            raise
        if prog.gm is None:
            counts.refused += 1
        else:
            counts.recorded += 1
        return prog

    def counted_rebuild(*args, **kwargs):
        counts.replays += 1
        return rebuild(*args, **kwargs)

    def counted_eager(module, fn, args, kwargs, reason, engine):
        counts.eager += 1
        counts.reasons.append(reason)
        return run_eager(module, fn, args, kwargs, reason, engine)

    def counted_take_apart(fn):
        parts = take_apart(fn)
        if parts.reason:
            counts.uncaptured.append(parts.reason)
        return parts

    capture._capture, capture._rebuild, capture._run_eager = counted_record, counted_rebuild, counted_eager
    callables.take_apart = counted_take_apart
    try:
        yield counts
    finally:
        capture._capture, capture._rebuild, capture._run_eager = record, rebuild, run_eager
        callables.take_apart = take_apart


@contextlib.contextmanager
def runs_engine(engine: str, calls: int, refused: str = "", signatures: int = 1):
    """Asserts that the ``calls`` calls inside the ``with`` ran the engine they name (:meth:`CaptureCounts.ran_engine`;
    ``"auto"``: its programs are forgotten first, so that its first call of a signature runs eagerly) or, with
    ``refused``, that each ran in eager clone mode because its capture was refused for a reason that contains
    ``refused``, said by a ``JVPCaptureWarning`` (the record of warnings already said is emptied for the ``with``: a
    warning is said once per process). Yields the :class:`CaptureCounts`; a body that raises asserts nothing."""
    import warnings

    from jvpreg.clone.program import capture

    if engine == "auto":
        capture.reset()
    if not refused:
        with count_captures() as counts:
            yield counts
        counts.ran_engine(engine, calls, signatures)
        return
    said = set(capture._WARNED)
    capture._WARNED.clear()
    try:
        with warnings.catch_warnings(record=True) as seen, count_captures() as counts:
            warnings.simplefilter("always")
            yield counts
    finally:
        capture._WARNED.clear()
        capture._WARNED.update(said)
    counts.refused_with(refused, calls)
    assert any(issubclass(w.category, capture.JVPCaptureWarning) and refused in str(w.message) for w in seen), (
        f"no JVPCaptureWarning that says {refused!r}: {[str(w.message)[:200] for w in seen]}")


@pytest.fixture
def capture_counts():
    """:func:`count_captures` around the whole test: ``assert capture_counts.replays > 0`` where the engine is
    ``"captured"``/``"auto"``/``"compiled"`` proves that a program ran."""
    with count_captures() as counts:
        yield counts


def sinh_rule_with_a_detached_slope(func, args, kwargs):
    """A sinh rule exact in value whose slope ``cosh(a)`` is detached from the primal: its penalty gradients miss
    the second-order term (what the sweep's gradient check must catch)."""
    from torch._C import DisableTorchFunctionSubclass

    from jvpreg.clone.core.tensor import stack_blocks, wrap

    with DisableTorchFunctionSubclass():
        z = args[0].as_subclass(torch.Tensor)
        a = z[0]
        return wrap(stack_blocks(torch.sinh(a), torch.sinh(a) + torch.cosh(a).detach() * (z[1:] - a)))


def once_more_if_a_spawned_worker_aborts_at_exit(run):
    """``run()``, and once more if a spawned gloo worker aborted as it exited (SIGABRT after its work was done,
    "terminate called without an active exception": a background thread left at interpreter teardown; seen in
    2 of 4 full runs of one day, both with other jobs loading the CPU, in tests whose work had passed). Any other failure, or the same one twice, raises."""
    try:
        return run()
    except torch.multiprocessing.ProcessExitedException as err:
        if getattr(err, "signal_name", None) != "SIGABRT":
            raise
        return run()


def load_script(name: str):
    """The module ``scripts/<name>.py`` (the scripts are no package), loaded afresh."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIERS = ("quick", "slow", "sweep")


def tier(item) -> str:
    """A test's tier: ``sweep`` if marked sweep, else ``slow`` if marked slow, else ``quick``."""
    if item.get_closest_marker("sweep") is not None:
        return "sweep"
    return "slow" if item.get_closest_marker("slow") is not None else "quick"


#: slow tests in modules that do not import pytest (a marker would be its only use there), as "file::function"
def pytest_configure(config):
    """Under pytest-xdist (``-n 2``: CI) each worker is one of two processes on two cores: one intra-op thread
    each, or they fight over the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run every tier: quick, slow and sweep (CI runs everything)")
    parser.addoption("--tier", action="append", default=[], choices=TIERS,
                     help="run only this tier (repeat the option for several); default: quick, or all with --slow")


def pytest_collection_modifyitems(config, items):
    """Deselect the tiers a run does not select: all run with ``--slow``; those named by ``--tier``; else the quick
    tier. An explicit ``-m`` without ``--tier`` selects by itself (``-m sweep``: every test marked sweep)."""
    chosen = set(config.getoption("--tier"))
    if config.getoption("--slow") or (config.getoption("markexpr") and not chosen):
        return
    chosen = chosen or {"quick"}
    left = [item for item in items if tier(item) not in chosen]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if tier(item) in chosen]
