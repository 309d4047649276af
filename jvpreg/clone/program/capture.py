"""Captured clone mode: record a module's clone forward once as a plain aten program, then replay it.

:func:`call` runs the eager clone forward of a call signature once under ``make_fx(pre_dispatch=True,
tracing_mode="real")`` and keeps what reached the dispatcher: a ``torch.fx.GraphModule`` of aten ops on the physical
``(K, *shape)`` tensors, with no tensor subclass and no rule lookup left, shrunk by :mod:`.passes`. Later calls of the
signature replay it (:mod:`.replay`) while its guards hold (:mod:`.guards`); ``engine="compiled"`` hands it to
``torch.compile``. What cannot be replayed exactly runs in eager clone mode with one :class:`JVPCaptureWarning` that
says why. The design, its guards and its limits: ``docs/engine.md``, "Engines: eager, captured, compiled".
"""
from __future__ import annotations

import contextlib
import gc
import math
import operator
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from jvpreg.clone.core.errors import CaptureError, JVPCaptureWarning
from jvpreg.clone.program import checkpointed_regions, sharded_units
from jvpreg.clone.eager import compiled_code, forward, parameter_slots
from jvpreg.clone.core import device_paths
from jvpreg.clone.rules import kernels
from jvpreg.clone.core import tensor as _tensor
from jvpreg.clone.eager.dispatch import get_fallback
from jvpreg.clone.core.registry import Handlers
from jvpreg.clone.program.guards import ATTRIBUTES, VALUES, Guards, Miss, ModuleGuard
from jvpreg.clone.program.value_guard import expected_reads, split_off
from jvpreg.clone.program.value_reads import ValueReads
from jvpreg.clone.program.replay import replay_function
from jvpreg.clone.program.side_effects import (AttributeReads, Attributes, Generators, Globals, argument_objects,
    held_generators)
from jvpreg.clone.core.held_objects import is_held_object
from jvpreg.clone.core.session import current, holding
from jvpreg.clone.program.passes import largest_magnitude, optimize
from jvpreg.clone.core.tensor import any_autocast, CloneTensor

__all__ = ["CaptureError", "JVPCaptureWarning", "ENGINES", "MAX_PROGRAMS", "EAGER_CALLS_BEFORE_CAPTURE", "call", "reset",
           "uncompiled", "resolve_engine", "programs", "inductor_options"]

ENGINES = ("auto", "eager", "captured", "compiled", "graphed")
MAX_PROGRAMS = 16
#: Programs recorded for one call signature whose Python reads tensor values (one per set of values read,
#: :mod:`jvpreg.clone.program.value_guard`); past this many the signature runs in eager clone mode.
#: ``engine="auto"`` records one for values that no program holds only when they recur
#: (:data:`EAGER_CALLS_BEFORE_CAPTURE`), and gives up after :data:`MAX_MISSED_VALUES` distinct values that did not
#: (values that change on every call).
MAX_VARIANTS = 4
MAX_MISSED_VALUES = 16
#: a program replayed this many times before an attribute it read changed counts as steady: its recapture does
#: not count toward the MAX_VARIANTS changes after which a signature runs eagerly
STEADY_REPLAYS = 16
#: ``engine="auto"`` runs this many calls of a new call signature in eager clone mode before it captures one: a
#: capture costs many eager calls (``docs/engine.md``), which a signature called once (an analysis call, a notebook
#: cell, a last partial batch) never earns back.
EAGER_CALLS_BEFORE_CAPTURE = 1
_MAX_SEEN = 256  # signatures remembered as seen-but-not-captured per module (transient shapes stay eager)


def inductor_options(device_type: str) -> Dict[str, Any]:
    """Inductor options ``engine="compiled"`` compiles a program with (``torch.compile(..., options=...)``).

    On the CPU, no layout optimisation: Inductor would switch convolutions to channels-last and, since a
    program's weights are its inputs, copy every convolution weight to that layout on every call, which made
    small-batch convolutional networks slower compiled than without it; training steps gained at every size
    measured. What it costs: eval-mode programs of convolution-heavy models at large activations are slower than
    under torch.compile's default (the figures: ``docs/engine.md``). The benchmarks compile their 2B forward
    alike."""
    return {"layout_optimization": False} if device_type == "cpu" else {}


def graphed_options(device_type: str) -> Dict[str, Any]:
    """``engine="graphed"``: the compiled program replayed as CUDA graphs (Inductor's ``triton.cudagraphs``, what
    ``mode="reduce-overhead"`` turns on): one launch per replay instead of one per kernel, for small-op models whose
    step is launch-bound. The program's input shapes are guarded as every program's are (a new shape records and
    graphs a new program, ``dynamic=False``). Off the GPU there is nothing to graph: the program is compiled as
    ``engine="compiled"`` compiles it, with one :class:`JVPCaptureWarning`."""
    if device_type == "cuda":
        return {"triton.cudagraphs": True}
    warn_once(("graphed", device_type), f"jvpreg: engine='graphed' replays CUDA graphs, which need CUDA tensors; "
                                        f"these are on {device_type}: compiled without graphs (engine='compiled').",
              stacklevel=5)
    return inductor_options("cpu" if device_type == "cpu" else "accelerator")


def warn_once(key: Any, message: str, stacklevel: int = 4) -> None:
    """One :class:`JVPCaptureWarning` per ``key`` in a process (what runs eagerly, and why)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, JVPCaptureWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------------- compiled modules


def _orig_of(mod: Any) -> Any:
    return getattr(mod, "_orig_mod", None) if type(mod).__name__ == "OptimizedModule" else None


def compiled_in_place(module: Any) -> bool:
    """True for a module compiled by ``module.compile()``: its ``__call__`` runs a compiled ``_call_impl``
    (the module and its ``state_dict`` keys stay as they were, unlike ``torch.compile(module)``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def is_compiled(func: Any) -> bool:
    """True for a ``torch.compile``-d module or function, or a module compiled in place (``module.compile()``)."""
    return unwrap_compiled(func) is not func or (isinstance(func, nn.Module) and compiled_in_place(func))


def unwrap_compiled(func: Any) -> Any:
    """The module or function under ``torch.compile`` (``func`` itself if it is not compiled)."""
    orig = _orig_of(func)
    if orig is not None:
        return orig
    if isinstance(func, nn.Module):  # a module's __getattr__ miss is slow: only functions carry it
        return func
    return getattr(func, "_torchdynamo_orig_callable", func)


@contextlib.contextmanager
def uncompiled(module: Any):
    """Inside: every ``torch.compile``-d submodule of ``module`` is its original module, and every module
    compiled in place (``module.compile()``, ``module`` itself included) calls its plain ``_call_impl``.

    Dynamo cannot trace a clone batch (its tensors report the primal's shape); the clone forward
    runs the original modules, and ``engine="compiled"`` compiles the captured clone program instead.
    """
    swaps, in_place = [], []
    if isinstance(module, nn.Module):
        for sub in module.modules():
            if compiled_in_place(sub):
                in_place.append((sub, sub._compiled_call_impl))
            for name, child in sub._modules.items():
                orig = _orig_of(child)
                if orig is not None:
                    swaps.append((sub._modules, name, child, orig))
    try:
        for store, name, _, orig in swaps:
            store[name] = orig
        for sub, _ in in_place:
            sub._compiled_call_impl = None
        yield
    finally:
        for store, name, child, _ in swaps:
            store[name] = child
        for sub, compiled in in_place:
            sub._compiled_call_impl = compiled


def resolve_engine(engine: str, func: Any, where: str) -> str:
    """``"auto"`` -> ``"compiled"`` for compiled modules, ``"eager"`` for other compiled functions, ``"auto"``
    (captured from the second call of a signature: :data:`EAGER_CALLS_BEFORE_CAPTURE`) for modules and every other
    callable (:mod:`jvpreg.clone.callables` takes partials, lambdas and closures apart for the capture)."""
    if engine not in ENGINES:
        raise ValueError(f"{where}: expected engine to be one of {', '.join(repr(e) for e in ENGINES)}, "
                         f"got {engine!r}.")
    if engine != "auto":
        return engine
    if is_compiled(func):
        return "compiled" if isinstance(unwrap_compiled(func), nn.Module) else "eager"
    return "auto"


# --------------------------------------------------------------------------------- per-module state


@dataclass
class _Program:
    gm: Optional[Callable]              # None: this signature runs in eager clone mode
    keep: Tuple[Any, ...] = ()          # plain parameters/buffers traced, argument objects signed by identity (alive,
                                        # so an equal id is the same object)
    guards: Guards = Guards()           # what it holds for besides its signature, re-checked before each replay
    out_spec: Any = None
    out_kinds: Tuple[Any, ...] = ()     # per output leaf: "clone"/"state"/"tensor" or the constant
    compiled: Optional[Callable] = None
    reason: str = ""
    replay: Optional[Callable] = None   # gm's forward with cheap exact op calls (engine="captured")
    out_pairs: bool = False             # the output is a flat tuple of plain tensors (no rebuild needed)
    variants: List["_Program"] = field(default_factory=list)  # programs of the same signature for other values
    misses: Dict[str, int] = field(default_factory=dict)  # engine="auto": values no program holds, and their calls
    replays: int = 0                    # calls this program ran (read by _after_attribute_change)


@dataclass
class _Record(ModuleGuard):
    """What is known about one module: what every call re-reads of it (:class:`ModuleGuard`), and its captured
    programs."""

    programs: Dict[Any, _Program] = field(default_factory=dict)
    seen: Dict[Any, int] = field(default_factory=dict)  # engine="auto": eager calls so far of a signature not captured
    read_changes: Dict[Any, int] = field(default_factory=dict)  # recaptures of a signature for changed attributes


_RECORDS: "weakref.WeakKeyDictionary[nn.Module, _Record]" = weakref.WeakKeyDictionary()
_WARNED: set = set()


def reset(module: Optional[nn.Module] = None) -> None:
    """Forget the captured programs of ``module`` (of every module with ``None``)."""
    if module is None:
        _RECORDS.clear()
    else:
        _RECORDS.pop(module, None)


def programs(module: nn.Module) -> Dict[Any, _Program]:
    """The captured programs of ``module`` by guard key (for tests and introspection)."""
    rec = _RECORDS.get(module)
    return {} if rec is None else dict(rec.programs)


#: why a module that holds FSDP units is not captured whole (each FSDP2 unit's body is: :mod:`sharded_units`)
SHARDED = "the module is sharded by FSDP (its all-gathers run in FSDP's hooks)"
IN_TRANSFORM = ("it runs inside a torch.func transform (grad, vjp, jacrev, jvp) or forward-mode AD: a program "
                "holds plain tensors, not wrapped or dual ones")


def _unsupported(module: nn.Module, rec: _Record, hooks_outside: bool = False) -> str:
    for m in (module, *rec.modules):
        if sharded_units.is_unit(m) and not (hooks_outside and m is module):
            return SHARDED
        if isinstance(m, nn.SyncBatchNorm) and m.training:
            return "SyncBatchNorm gathers statistics across processes (collectives run eagerly)"
        if isinstance(m, torch.jit.ScriptModule):
            return "the module contains a TorchScript module"
    if rec.hooks:
        return f"forward hooks on {rec.hooks} (their Python side effects would not be replayed)"
    return ""


def _slot_finite(value: torch.Tensor) -> bool:
    """A parameter or buffer is finite, read once at capture on any device (a capture reads values anyway; the
    per-call guard reads none on a device). A ``meta`` tensor has no values: counted as finite, as a trained model's
    parameters are, so that a program recorded there (``scripts/op_counts.py``) keeps the ops a GPU's would."""
    t = _phys(value) if type(value) is CloneTensor else value
    return t.is_meta or _all_finite(t)


def _slot_magnitude(t: torch.Tensor) -> float:
    """:func:`jvpreg.clone.program.passes.largest_magnitude` of a parameter or buffer; 0 on ``meta``
    (:func:`_slot_finite`)."""
    return 0.0 if t.is_meta else largest_magnitude(t)


# --------------------------------------------------------------------------------- the guard key


def _finite(leaf: torch.Tensor) -> bool:
    """Every entry of ``leaf`` (every block, for a clone) is finite. Checked on the CPU only: on a device it
    would cost a host synchronisation, so a device tensor counts as possibly non-finite."""
    t = _phys(leaf) if type(leaf) is CloneTensor else leaf
    return device_paths.on_host(t) and _all_finite(t)


def _all_finite(t: torch.Tensor) -> bool:
    # a sum is finite only if every entry is (overflow can only say "non-finite"): faster than isfinite().all()
    if t.is_floating_point():
        return math.isfinite(t.detach().sum())
    return not t.is_complex() or math.isfinite(abs(complex(t.detach().sum())))


def _leaf_sig(leaf: Any, finite: Optional[bool] = None) -> Any:
    """Guard signature of one call leaf (``finite``: already known for a tensor leaf, else checked)."""
    t = type(leaf)
    if t is CloneTensor:
        with DisableTorchFunctionSubclass():
            return ("clone", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad, bool(leaf._jvp_state),
                    _finite(leaf) if finite is None else finite)
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad,
                _finite(leaf) if finite is None else finite)
    try:
        hash(leaf)
    except TypeError:
        return ("object", id(leaf))
    return ("const", t, leaf)


def _autocast_state() -> Tuple[Any, ...]:
    if not any_autocast():  # one call in the usual case
        return ()
    out = []
    for dev in ("cpu", "cuda"):
        try:
            on = torch.is_autocast_enabled(dev)
            out.append((dev, on, torch.get_autocast_dtype(dev) if on else None))
        except (TypeError, RuntimeError, AttributeError):  # older torch
            pass
    return tuple(out)


_TRAINING = operator.attrgetter("training")


def _key(rec: _Record, call_id: Any, in_spec: Any, leaves: List[Any], slot_values: List[Any],
         finite: Optional[bool] = None) -> Tuple[Any, ...]:
    if _clone_slots(slot_values):
        slot_sig = tuple(id(v) if type(v) is not CloneTensor else _leaf_sig(v) for v in slot_values)
    else:
        slot_sig = tuple(map(id, slot_values))
    sigs = tuple(map(_leaf_sig, leaves)) if finite is None else tuple(_leaf_sig(leaf, finite) for leaf in leaves)
    return (call_id, in_spec, sigs, slot_sig,
            rec.root_flagged and rec.root().training, tuple(map(_TRAINING, rec.flagged)), torch.is_grad_enabled(),
            _autocast_state(), torch.get_default_dtype(),  # factory ops without a dtype (torch.full, arange)
            get_fallback(), device_paths.simulated(), Handlers.version)  # the rules the program ran


def _varying_sizes(keys: List[Tuple[Any, ...]]) -> str:
    """A clause for the warning when what changes between call signatures ``keys`` (:func:`_key`) includes the
    sizes of the call's tensors, with the usual cause and its cure; else ``""`` (the same clause every time: the
    warning is given once)."""
    shapes = {tuple(sig[1] for sig in key[2] if isinstance(sig, tuple) and sig and sig[0] in ("clone", "tensor"))
              for key in keys}
    if len(shapes) < 2:
        return ""
    return (" (the sizes of the call's tensors vary: batches padded to their longest sequence? pad them to a few "
            "lengths, e.g. pad_to_multiple_of=32 in Hugging Face's DataCollatorWithPadding)")


# --------------------------------------------------------------------------------- capture and replay


def _phys(leaf: Any) -> torch.Tensor:
    if type(leaf) is CloneTensor:
        with DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(leaf, torch.Tensor)
    return leaf


@contextlib.contextmanager
def _no_gc():
    """No garbage collection while tracing: a finalizer that switches grad mode (``torch.no_grad()`` in a
    ``__del__``) would be recorded into the program, or break the tracer's code generation (``KeyError:
    _set_grad_enabled``, seen when a collection happened to run inside ``make_fx``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _restored_state(module: nn.Module, generators: Generators):
    """Run something for its trace only: buffers and the random number generators come back as they were."""
    buffers = [b for b in module.buffers() if b is not None]
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    states = generators.states()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                # through .data: the restore must not bump version counters (BatchNorm saves its running
                # statistics for backward and updates them in its kernel without a bump)
                b.data.copy_(s)
        generators.set(states)


def _trace(module: nn.Module, fn: Callable, in_spec: Any, leaves: List[Any], rec: _Record,
           slot_values: List[Any]) -> _Program:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    if not parameter_slots.swapped() and CloneTensor in set(map(type, slot_values)):
        raise CaptureError("a parameter or buffer slot holds a clone tensor that jvpreg.clone.swapped_tensors "
                           "did not put there (swap parameter directions in with it, or use jvpreg.jvp_params)")
    clone_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    slot_pos = [i for i, v in enumerate(slot_values) if isinstance(v, torch.Tensor)]
    n_in = len(clone_pos)
    out_meta: Dict[str, Any] = {}

    def traced(*flat):
        tracer = get_proxy_mode().tracer
        _note_grad_mode(tracer)
        reads = out_meta["reads"] = ValueReads(tracer)
        with holding(tracer=tracer), reads.active():
            new_leaves = list(leaves)
            args, kwargs = _traced_arguments(new_leaves, flat, clone_pos, slot_values, slot_pos, in_spec)
            out = fn(*args, **kwargs)
            if type(in_spec) is not int:  # the trace's own copies of the lists and dicts passed in: a replay
                out_meta["argument_writes"] = _argument_writes(args, kwargs, new_leaves, in_spec)  # writes none
            tensors = _traced_outputs(out, out_meta)
            out_meta["traced_storages"] = _traced_storages(tracer)
            return tensors + reads.tensors  # the values Python read: split off into the guard program

    inputs = _trace_inputs(leaves, clone_pos, slot_values, slot_pos)
    objects = argument_objects(leaves)  # signed by identity: kept alive, so an equal id is the same object
    generators = Generators(module, next((t.device for t in inputs), torch.device("cpu")))
    attribute_reads = AttributeReads(module, objects)  # the objects passed in are read like the modules
    module_globals = Globals(module)
    gm, rng_start, rng_traced = _run_trace(module, make_fx(traced, tracing_mode="real", pre_dispatch=True), inputs,
                                           objects, generators, attribute_reads, module_globals)
    _refuse_what_a_replay_would_not_do(gm, out_meta, generators)
    draws = any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)
    expected, names = expected_reads(gm, out_meta["reads"])
    _pin_grad_modes(gm.graph, torch.is_grad_enabled())
    optimize(gm, *_finiteness(leaves, clone_pos, slot_values, slot_pos))
    values = split_off(gm, expected, names) if expected else None
    guards = Guards.record(gm, rec.root(), rec.modules, attribute_reads, module_globals, values)
    compiling = current().compiling  # compiled: never replayed, torch.compile reads the sub-programs
    checkpointed_regions.outline(gm, (lambda sub: sub) if compiling else replay_function, torch.is_grad_enabled(),
                                 n_in)
    replay = None if compiling else replay_function(gm)
    if draws or not _same_rng(rng_traced, rng_start):  # a program to be compiled is checked as recorded
        _check_rng_replayed(module, gm if compiling else replay, leaves, clone_pos, slot_values, slot_pos,
                            generators, rng_start, rng_traced)
    spec, kinds = out_meta["spec"], out_meta["kinds"]
    flat = spec == tree_flatten((0,) * spec.num_leaves)[1]  # a flat tuple
    return _Program(gm=gm, keep=tuple(v for v in slot_values if type(v) is not CloneTensor) + tuple(objects),
                    guards=guards, out_spec=spec, out_kinds=kinds, replay=replay,
                    out_pairs=flat and all(k == "tensor" for k in kinds))


def _traced_arguments(new_leaves: List[Any], flat: tuple, clone_pos: List[int], slot_values: List[Any],
                      slot_pos: List[int], in_spec: Any) -> Tuple[tuple, dict]:
    """The call's arguments as the trace passes them: ``new_leaves`` (a copy of the call's leaves) with the tracer's
    tensors ``flat`` in place of the call's tensors (wrapped as clones where the call passed clones), in place; the
    clones in parameter slots (parameter directions) track the tracer's tensors of their slots."""
    n_in = len(clone_pos)
    for i, t in zip(clone_pos, flat[:n_in]):
        old = new_leaves[i]
        new_leaves[i] = _tensor.wrap(t, state=bool(old._jvp_state)) if type(old) is CloneTensor else t
    for j, t in zip(slot_pos, flat[n_in:]):
        if type(slot_values[j]) is CloneTensor:
            _tensor.track(slot_values[j], t)
    return (tuple(new_leaves), {}) if type(in_spec) is int else tree_unflatten(new_leaves, in_spec)


def _traced_outputs(out: Any, out_meta: Dict[str, Any]) -> List[torch.Tensor]:
    """The traced tensors of the forward's output ``out`` (a clone's physical batch); into ``out_meta``: the output's
    structure, the kind of each leaf, and the types of the objects among them that hold tensors."""
    out_leaves, out_spec = tree_flatten(out)
    kinds, tensors = [], []
    for leaf in out_leaves:
        if type(leaf) is CloneTensor:
            kinds.append("state" if leaf._jvp_state else "clone")
            tensors.append(_tensor.tracked_phys(leaf))
        elif isinstance(leaf, torch.Tensor):
            kinds.append("tensor")
            tensors.append(leaf)
        else:
            kinds.append(("const", leaf))
            if _holds_tensor(leaf, 4):
                out_meta.setdefault("objects_with_tensors", []).append(type(leaf).__name__)
    out_meta["spec"], out_meta["kinds"] = out_spec, tuple(kinds)
    return tensors


def _traced_storages(tracer: Any) -> Dict[int, set]:
    """Storage address -> the graph nodes of the tensors ``tracer`` tracks on it (:func:`_check_constants`)."""
    # one C-level copy: a weakref callback cannot run midway (no tracker in some torch: no check)
    tracked = list(getattr(getattr(tracer, "tensor_tracker", None), "data", {}).items())
    return _storage_nodes((ref(), proxy) for ref, proxy in tracked)


def _trace_inputs(leaves: List[Any], clone_pos: List[int], slot_values: List[Any],
                  slot_pos: List[int]) -> List[torch.Tensor]:
    """What a trace (or a check of one) runs on: copies of the call's tensors, which require grad as they do (an
    in-place op on an input must not reach the replay twice), then the parameters and buffers themselves (restored
    afterwards: :func:`_restored_state`)."""
    with torch.no_grad():
        copies = [_phys(leaves[i]).clone() for i in clone_pos]
    inputs = [c.requires_grad_(leaves[i].requires_grad) for c, i in zip(copies, clone_pos)]
    return inputs + [_phys(slot_values[j]) for j in slot_pos]


def _run_trace(module: nn.Module, record: Callable, inputs: List[torch.Tensor], objects: List[Any],
               generators: Generators, attribute_reads: AttributeReads,
               module_globals: Globals) -> Tuple[torch.fx.GraphModule, tuple, tuple]:
    """``record(*inputs)``, the forward traced into a program, run for its trace only: the buffers, the random number
    generators, the Python attributes of the modules and ``objects`` and the module globals are as they were
    afterwards. Returns the program and the generators' states the trace started and ended at (it starts one draw
    past the caller's: :func:`_check_rng_replayed`). Raises :class:`CaptureError` where the forward set attributes or
    globals."""
    attributes = Attributes(module, objects)
    with _restored_state(module, generators), warnings.catch_warnings(), _no_gc():
        warnings.simplefilter("ignore", category=UserWarning)  # the eager run's fallback notes repeat at replay
        generators.step()  # the trace's draws are thrown away: from a state no seed gives (see _check_rng_replayed)
        rng_start = generators.states()
        try:
            # (traced_through: a compiled function's code is recorded; attribute_reads: what the program holds for)
            with compiled_code.traced_through(), checkpointed_regions.recording(), attribute_reads.recording():
                gm = record(*inputs)
        finally:
            written = attributes.changed() + module_globals.changed()
            attributes.restore()  # as they were: a call that runs eagerly sets them once
            module_globals.restore()
        rng_traced = generators.states()
    if written:
        raise CaptureError(f"its forward sets Python attributes or module globals ({', '.join(written[:4])}"
                           f"{' ...' if len(written) > 4 else ''}), which a replay would not set (if only its first "
                           "calls set them, e.g. a cache, call jvpreg.clone.program.capture.reset(model) after those)")
    return gm, rng_start, rng_traced


def _refuse_what_a_replay_would_not_do(gm: torch.fx.GraphModule, out_meta: Dict[str, Any],
                                       generators: Generators) -> None:
    """Raise :class:`CaptureError` where replaying ``gm`` would not do what the traced forward did: return an object
    holding tensors, write into what it was passed, draw from a generator the model does not hold, place data by
    storage offset, or read a constant that aliases a traced tensor."""
    if out_meta.get("objects_with_tensors"):
        names = ", ".join(sorted(set(out_meta["objects_with_tensors"])))
        raise CaptureError(f"its forward returns an object holding tensors ({names}), which a replay would return as "
                           "the capture left it (a Hugging Face cache: call the model with use_cache=False)")
    if out_meta.get("argument_writes"):
        raise CaptureError(f"its forward writes into a list or dict it is given ({out_meta['argument_writes']}), "
                           "which a replay would not (return what it writes there instead)")
    if any(not generators.holds(g) for g in held_generators(gm)):
        raise CaptureError("its forward draws random numbers from a torch.Generator that is not an attribute of "
                           "the model (one made inside the forward, or held elsewhere), which a captured program "
                           "cannot replay as the forward draws from it")
    strided = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target in _STRIDED})
    if strided:
        raise CaptureError(f"its clone forward places data by storage offset ({', '.join(strided)}), whose gradient "
                           "through a replayed program differs from the forward's (found with as_strided_scatter on a "
                           "view)")
    _check_constants(gm, out_meta["traced_storages"])


def _finiteness(leaves: List[Any], clone_pos: List[int], slot_values: List[Any],
                slot_pos: List[int]) -> Tuple[List[bool], List[float]]:
    """What :func:`optimize` knows of the program's inputs: which hold finite values only, and the largest finite
    magnitude in each (the parameters and buffers as captured, a ``finfo.min`` mask buffer; the call's data counts
    as 0)."""
    finite = [_finite(leaves[i]) for i in clone_pos] + [_slot_finite(slot_values[j]) for j in slot_pos]
    magnitudes = [0.0] * len(clone_pos) + [_slot_magnitude(_phys(slot_values[j])) for j in slot_pos]
    return finite, magnitudes


#: ops that address memory by storage offset: refused in a program (:func:`_trace`)
_STRIDED = frozenset(getattr(torch.ops.aten, name).default for name in ("as_strided", "as_strided_", "as_strided_scatter"))


def _holds_tensor(value: Any, depth: int) -> bool:
    """A tensor among the fields of ``value`` (an object that is no pytree node: a Hugging Face ``DynamicCache``)
    and the lists, tuples and dicts they hold, ``depth`` levels deep."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth - 1) for v in value.values())
    return is_held_object(value) and any(_holds_tensor(v, depth - 1) for v in vars(value).values())


def _argument_writes(args: tuple, kwargs: dict, leaves: List[Any], in_spec: Any) -> str:
    """Where the forward wrote into the lists and dicts it was passed (an item set, added or removed), or ``""``."""
    after, spec = tree_flatten((args, kwargs))
    if spec != in_spec:
        return "an item added or removed"
    at = [i for i, (a, b) in enumerate(zip(after, leaves)) if a is not b]
    return f"the argument leaves {at[:4]} replaced" if at else ""


def _same_rng(a: Tuple[torch.Tensor, ...], b: Tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _check_rng_replayed(module: nn.Module, replay: Callable, leaves: List[Any], clone_pos: List[int],
                        slot_values: List[Any], slot_pos: List[int], generators: Generators,
                        rng_start: Tuple[torch.Tensor, ...], rng_traced: Tuple[torch.Tensor, ...]) -> None:
    """The traced forward drew random numbers or moved the random number generators: run the program once from the
    state the trace started from (buffers and generators restored afterwards) and require it to leave them where
    the forward did. Python that seeds or sets them (``torch.manual_seed``, ``torch.set_rng_state``,
    ``torch.random.fork_rng``, ``self.gen.manual_seed``) inside the forward is not part of the program: its replays
    would draw other dropout masks than the forward does, or leave the generators elsewhere, so such a forward
    runs in eager clone mode. The trace started one draw past the caller's state, which no seeding gives, so a
    forward that seeds a generator cannot happen to end where the replay does (it would from a freshly seeded
    state)."""
    inputs = _trace_inputs(leaves, clone_pos, slot_values, slot_pos)
    try:  # in the call's grad mode, as the program will replay
        with _restored_state(module, generators), warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            generators.set(rng_start)
            replay(*inputs)
            replayed = generators.states()
    except Exception as err:  # noqa: BLE001  (said in the reason: eager clone mode instead)
        raise CaptureError(f"the recorded program, replayed once to check its random draws, raised "
                           f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}") from err
    if not _same_rng(replayed, rng_traced):
        raise CaptureError("its Python code seeds or sets a random number generator inside the forward "
                           "(torch.manual_seed, torch.set_rng_state, torch.random.fork_rng, Generator.manual_seed), "
                           "which a captured program does not replay: its random ops (dropout) would draw other "
                           "numbers")


def _storages(tensors) -> set:
    out = set()
    for t in tensors:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
            continue
        if ptr:
            out.add(ptr)
    return out


def _storage_nodes(tracked) -> Dict[int, set]:
    """Storage address -> the graph nodes of the traced tensors on it, for ``(tensor, proxy)`` pairs."""
    out: Dict[int, set] = {}
    for t, proxy in tracked:
        if t is not None:
            for ptr in _storages([t]):
                out.setdefault(ptr, set()).add(getattr(getattr(proxy, "proxy", None), "node", None))
    return out


def _derived_from(node: Any, const: torch.fx.Node) -> bool:
    """``node`` is ``const`` or computed from it by recorded ops."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is const:
            return True
        if isinstance(n, torch.fx.Node) and n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _check_constants(gm: torch.fx.GraphModule, traced: Dict[int, set]) -> None:
    """A tensor the tracer holds as a constant must not alias a tensor it traced, unless the traced tensor is
    one the recorded ops made from the constant (``torch.as_tensor(c)``, a view of it): another alias (made by a
    path the tracer cannot see, e.g. ``as_subclass``) would replay the values of the capturing call forever."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor):
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(value):
            raise CaptureError(f"the program would hold {node.target} as a constant that a torch.func transform inside "
                               "the forward wrapped (vmap's batched tensor, as FlexAttention makes under no_grad), "
                               "which no replay can read")
        aliases = set().union(*(traced.get(ptr, set()) for ptr in _storages([value])))
        if not all(_derived_from(n, node) for n in aliases):
            raise CaptureError(f"the program would hold {node.target} {tuple(value.shape)} as a constant, but it "
                               "shares memory with a tensor of the traced call (an alias made where the tracer "
                               "cannot see it)")


def _note_grad_mode(tracer: Any) -> None:
    """Mark every node with the grad mode it was recorded in. Grad-mode switches made *inside* a
    ``__torch_function__`` handler (a rule's ``torch.no_grad()``) are invisible to the pre-dispatch
    tracer, whose function mode is paused there; the marks let :func:`_pin_grad_modes` put them back."""
    create = tracer.create_node

    def create_node(*args, **kwargs):
        node = create(*args, **kwargs)
        node.meta["jvpreg_grad"] = torch.is_grad_enabled()
        checkpointed_regions.tag(node)
        return node

    tracer.create_node = create_node


def _pin_grad_modes(graph: torch.fx.Graph, initial: bool) -> None:
    """Insert ``torch._C._set_grad_enabled`` so the replay runs every op in its recorded grad mode."""
    state = initial
    for node in list(graph.nodes):
        if node.op == "output":
            if state != initial:
                with graph.inserting_before(node):
                    graph.call_function(torch._C._set_grad_enabled, (initial,))
            break
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            state = bool(node.args[0])
            continue
        want = node.meta.get("jvpreg_grad")
        if want is not None and want != state:
            with graph.inserting_before(node):
                graph.call_function(torch._C._set_grad_enabled, (want,))
            state = want


def _clone_slots(slot_values: List[Any]) -> bool:
    """Some parameter or buffer slot holds a clone (parameter directions). Known without reading the slots'
    tensors while no clone is swapped in (:func:`jvpreg.clone.eager.parameter_slots.swap_in` lists them): the usual
    call."""
    return bool(parameter_slots.swapped()) and CloneTensor in set(map(type, slot_values))


def _inputs(leaves: List[Any], slot_values: List[Any]) -> List[torch.Tensor]:
    flat = [_phys(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if _clone_slots(slot_values):
        return flat + [_phys(v) for v in slot_values if isinstance(v, torch.Tensor)]
    return flat + [v for v in slot_values if v is not None]


def _rebuild(prog: _Program, outs: List[torch.Tensor]) -> Any:
    if prog.out_pairs:  # (y, t) or (y, t, aux) of plain tensors: jvp's usual output
        return tuple(outs)
    it = iter(outs)
    leaves = []
    for kind in prog.out_kinds:
        if kind == "clone":
            leaves.append(_tensor.wrap(next(it)))
        elif kind == "state":
            leaves.append(_tensor.wrap(next(it), state=True))
        elif kind == "tensor":
            leaves.append(next(it))
        else:
            leaves.append(kind[1])
    return tree_unflatten(leaves, prog.out_spec)


def _warn_eager(module: nn.Module, reason: str) -> None:
    warn_once((type(module).__qualname__, reason),
              f"jvpreg: the clone forward of {type(module).__name__} runs in eager clone mode (exact, but slower) "
              f"because it cannot be captured: {reason}. Pass engine='eager' to silence this warning.", stacklevel=6)


def _run_eager(module: nn.Module, fn: Callable, args: tuple, kwargs: dict, reason: str, engine: str) -> Any:
    """``fn`` in eager clone mode because of ``reason``: said once by a warning, except for a module that holds FSDP
    units, whose bodies are captured in turn (:mod:`jvpreg.clone.program.sharded_units`)."""
    if reason == SHARDED and sharded_units.has_fsdp2_units(module):
        with forward.active(module, (args, kwargs)), uncompiled(module), sharded_units.routed(module, engine, call):
            return fn(*args, **kwargs)
    _warn_eager(module, reason)
    with forward.active(module, (args, kwargs)), uncompiled(module):
        return fn(*args, **kwargs)


def call(module: nn.Module, args: tuple, kwargs: Optional[dict] = None, *, engine: str = "captured",
         fn: Optional[Callable] = None, key: Any = None, finite: Optional[bool] = None,
         hooks_outside: bool = False) -> Any:
    """Run ``fn(*args, **kwargs)`` (default ``module``) as ``module``'s captured clone forward.

    ``args``/``kwargs`` hold clone tensors (and anything else); ``module``'s parameters may have
    been swapped for clones (parameter directions). Returns what the eager clone forward returns:
    the same clone tensors (exactly the same values: the replay runs the recorded kernels).

    Args:
        module: the module whose parameters, buffers and submodules the call reads.
        args, kwargs: the call's arguments.
        engine: ``"captured"`` (replay the recorded program), ``"auto"`` (the same, after
            :data:`EAGER_CALLS_BEFORE_CAPTURE` eager calls of the signature), ``"compiled"`` (the program under
            ``torch.compile``), or ``"eager"`` (plain clone mode).
        fn: the callable to record (e.g. ``module.forward`` to skip the module's own hooks).
        key: what names ``fn`` in the guard key (hashable; default: ``fn`` itself). A caller that makes
            a new closure per call passes the same ``key`` for closures that record the same program.
        finite: ``True`` when the caller already knows that every tensor in ``args``/``kwargs`` is finite
            (:func:`jvpreg.clone.api.jvp` reads it off its scale norms); ``None``: checked here.
        hooks_outside: ``fn`` is the body of an FSDP unit ``module``, whose hooks run around this call
            (:mod:`jvpreg.clone.program.sharded_units`).
    """
    fn = module if fn is None else fn
    return _call(module, args, {} if kwargs is None else kwargs, engine, fn,
                 id(getattr(fn, "__func__", fn)) if key is None else key, finite, hooks_outside)


def _call(module: nn.Module, args: tuple, kwargs: dict, engine: str, fn: Callable, fn_key: Any,
          finite: Optional[bool] = None, hooks_outside: bool = False) -> Any:
    if engine != "eager" and kernels.inside_transform():
        if engine != "auto":  # asked for a program; "auto" promised none
            _warn_eager(module, IN_TRANSFORM)
        engine = "eager"
    if engine == "eager":
        with forward.active(module, (args, kwargs)), uncompiled(module):
            return fn(*args, **kwargs)
    rec = _record(module)
    if rec.hooks:  # checked before any program: a hook registered after a capture must run too
        return _run_eager(module, fn, args, kwargs, _unsupported(module, rec, hooks_outside), engine)
    leaves, in_spec = _flatten(args, kwargs)
    slot_values = rec.slot_values()
    compiled = engine in ("compiled", "graphed")  # its own program: rules may pick what Inductor fuses best
    key = _key(rec, (fn_key, engine) if compiled else fn_key, in_spec, leaves, slot_values, finite)
    this_call = _ThisCall(module, fn, in_spec, leaves, rec, slot_values, compiled)
    prog, inputs = _program(this_call, key, engine, hooks_outside)
    if prog is None:  # engine="auto": the signature, or the values its Python reads, seen for the first time
        return _run_uncaptured(module, fn, args, kwargs, rec, engine, hooks_outside)
    if prog.gm is None:
        return _run_eager(module, fn, args, kwargs, prog.reason, engine)
    return _replay(prog, engine, _inputs(leaves, slot_values) if inputs is None else inputs)


def _record(module: nn.Module) -> _Record:
    """``module``'s record: made anew where a guarded module's children changed, its hooks rescanned if any moved."""
    rec = _RECORDS.get(module)
    if rec is None or not rec.valid():
        rec = _RECORDS[module] = _Record.of(module)
    else:
        rec.check_hooks(module)
    return rec


def _flatten(args: tuple, kwargs: dict) -> Tuple[List[Any], Any]:
    """The call's leaves and their structure (an int, the number of arguments, for the usual ``f(x1, ..., xn)``)."""
    if not kwargs and all(type(a) is CloneTensor or type(a) is torch.Tensor for a in args):
        return list(args), len(args)  # the usual call f(x1, ..., xn): no pytree walk
    return tree_flatten((args, kwargs))


class _ThisCall(NamedTuple):
    """What :func:`_capture` records a program of: the call being made."""

    module: nn.Module
    fn: Callable
    in_spec: Any
    leaves: List[Any]
    rec: _Record
    slot_values: List[Any]
    compiled: bool


def _program(call: _ThisCall, key: Any, engine: str, hooks_outside: bool) -> Tuple[Optional[_Program], Any]:
    """The program to run this call (with its inputs, where its guards read them): one whose guards hold, or one
    recorded now; a program-less record where the call runs eagerly for a reason; ``None`` where ``engine="auto"``
    runs it eagerly this time (not worth a capture yet)."""
    rec, module = call.rec, call.module
    prog, inputs = rec.programs.get(key), None
    if prog is not None and prog.gm is not None:
        inputs = _inputs(call.leaves, call.slot_values)
        base, (prog, miss) = prog, _replayable(prog, module, inputs)
        if prog is None and miss.what == VALUES:
            return _for_other_values(call, key, engine, base, miss), inputs
        if miss is not None and miss.what == ATTRIBUTES:
            prog = _after_attribute_change(rec, key, base, module)
    if prog is None:
        if engine == "auto" and _not_worth_a_capture_yet(rec, key):
            return None, inputs
        prog = rec.programs[key] = _new_program(call, key, hooks_outside)
    return prog, inputs


def _replayable(base: _Program, module: nn.Module, inputs: List[torch.Tensor]) -> Tuple[Optional[_Program],
                                                                                          Optional[Miss]]:
    """The first of ``base`` and its variants whose guards hold for this call, or ``None``; and what ``base``'s
    guards found changed (``None`` where they hold). Variants differ in the values read: where ``base``'s constants
    or attributes changed, none is tried."""
    miss = base.guards.check(module, inputs)
    if miss is None:
        return base, None
    if miss.what != VALUES:
        return None, miss
    return next((prog for prog in base.variants if prog.guards.check(module, inputs) is None), None), miss


def _after_attribute_change(rec: _Record, key: Any, base: _Program, module: nn.Module) -> Optional[_Program]:
    """An attribute the forward read changed (dropout p, eps, a flag): the program holds for the old values.
    ``None`` (record anew), or a program-less record once they changed :data:`MAX_VARIANTS` times with fewer than
    :data:`STEADY_REPLAYS` calls between (one that changes now and then, an annealed dropout p, recaptures each
    time)."""
    steady = base.replays >= STEADY_REPLAYS
    rec.read_changes[key] = 1 if steady else rec.read_changes.get(key, 0) + 1
    if rec.read_changes[key] < MAX_VARIANTS:
        return None
    prog = rec.programs[key] = _Program(
        gm=None, reason=f"attributes its forward reads ({', '.join(base.guards.changed_attributes(module)[:4])}) "
                        f"change every few calls ({MAX_VARIANTS} times with fewer than {STEADY_REPLAYS} "
                        "calls between; a program holds for one set of values)")
    return prog


def _for_other_values(call: _ThisCall, key: Any, engine: str, base: _Program, miss: Miss) -> Optional[_Program]:
    """The Python read tensor values that no program of the signature holds: a variant recorded for them; ``None``
    (eager) for values seen once under ``engine="auto"``; a program-less record once there are too many."""
    values = repr(miss.read)
    if len(base.variants) + 1 >= MAX_VARIANTS or len(base.misses) >= MAX_MISSED_VALUES:
        names = ", ".join(sorted(set(base.guards.values.names)))
        prog = call.rec.programs[key] = _Program(
            gm=None, reason=f"its Python code reads tensor values ({names}) that differ from call to call "
                            "(a program holds for one set of values)")
        return prog
    if engine == "auto" and base.misses.get(values, 0) < EAGER_CALLS_BEFORE_CAPTURE:
        base.misses[values] = base.misses.get(values, 0) + 1  # values seen once: eager, unless they recur
        return None
    base.misses.pop(values, None)
    prog = _capture(*call)
    base.variants.append(prog)  # one that cannot be captured: eager for the values no variant holds
    return prog


def _not_worth_a_capture_yet(rec: _Record, key: Any) -> bool:
    """``engine="auto"``: the call is one of the first :data:`EAGER_CALLS_BEFORE_CAPTURE` of a signature that no
    program holds (counted here; past them the count is dropped, as a program is recorded)."""
    calls = rec.seen.get(key, 0)
    if calls < EAGER_CALLS_BEFORE_CAPTURE:
        if len(rec.seen) >= _MAX_SEEN:
            rec.seen.clear()
        rec.seen[key] = calls + 1
        return True
    rec.seen.pop(key, None)
    return False


def _new_program(call: _ThisCall, key: Any, hooks_outside: bool) -> _Program:
    """A program recorded for a signature that has none, or a program-less record that says why not."""
    reason = _unsupported(call.module, call.rec, hooks_outside)
    if not reason and len(call.rec.programs) >= MAX_PROGRAMS:
        return _Program(gm=None, reason=f"more than {MAX_PROGRAMS} call signatures (shapes, modes) were seen"
                                        f"{_varying_sizes(list(call.rec.programs) + [key])}; call "
                                        "jvpreg.clone.program.capture.reset(module) if they are transient")
    if reason:
        return _Program(gm=None, reason=reason)
    return _capture(*call)


def _run_uncaptured(module: nn.Module, fn: Callable, args: tuple, kwargs: dict, rec: _Record, engine: str,
                    hooks_outside: bool) -> Any:
    """``fn`` in eager clone mode without a warning (``engine="auto"`` before a capture); the bodies of a sharded
    module's FSDP units are captured in turn (:mod:`jvpreg.clone.program.sharded_units`)."""
    sharded = _unsupported(module, rec, hooks_outside) == SHARDED and sharded_units.has_fsdp2_units(module)
    with forward.active(module, (args, kwargs)), uncompiled(module), \
            sharded_units.routed(module, engine, call) if sharded else contextlib.nullcontext():
        return fn(*args, **kwargs)


def _replay(prog: _Program, engine: str, inputs: List[torch.Tensor]) -> Any:
    """Run ``prog`` on ``inputs`` (compiled first, for ``engine="compiled"`` or ``"graphed"``) and rebuild the
    call's output."""
    prog.replays += 1
    run = prog.replay or prog.gm
    compiled = engine in ("compiled", "graphed")
    if compiled:
        if prog.compiled is None:
            types_ = {t.device.type for t in inputs}
            device = "cpu" if types_ <= {"cpu"} else "accelerator"
            options = graphed_options(next(iter(types_ - {"cpu"}), "cpu")) if engine == "graphed" else \
                inductor_options(device)
            prog.compiled = torch.compile(prog.gm, dynamic=False, options=options)
        run = prog.compiled
    # grad mode restored even if the replay raises midway; a compiled program stays compiled inside a clone forward
    stance = compiled_code.caller_stance() if compiled else contextlib.nullcontext()
    with torch.set_grad_enabled(torch.is_grad_enabled()), stance:
        outs = run(*inputs)
    return _rebuild(prog, outs)


def _capture(module: nn.Module, fn: Callable, in_spec: Any, leaves: List[Any], rec: _Record, slot_values: List[Any],
             compiled: bool) -> _Program:
    """Record a program for this call, or a program-less record that says why it cannot be captured."""
    try:
        with forward.active(module), uncompiled(module), holding(compiling=compiled):
            return _trace(module, fn, in_spec, leaves, rec, slot_values)
    except CaptureError as err:
        return _Program(gm=None, reason=str(err))
    except NotImplementedError as err:  # the tracer cannot record an argument (torch 2.11: a torch.Generator);
        # a forward's own NotImplementedError is raised again by its eager run
        return _Program(gm=None, reason=f"the tracer cannot record it (NotImplementedError: "
                                        f"{str(err).splitlines()[0][:120] if str(err) else ''})")
    except RuntimeError as err:
        if "data-dependent" not in str(err) and "tracing tensor" not in str(err):
            raise
        return _Program(gm=None, reason="its Python control flow reads tensor values inside an op (data-dependent "
                                        "control flow the capture cannot re-check)")
