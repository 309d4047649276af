"""Everything re-checked before a captured program replays.

A program (:mod:`jvpreg.clone.program.capture`) replays the tensor ops of one run of a forward's Python, so it is
exact for the calls that would run that Python the same way. What steers the Python is re-checked before each
replay, at two levels:

* **per module** (:class:`ModuleGuard`, made at the module's first call): its submodules (a swapped submodule makes a
  new guard), its parameter and buffer slots, the modules whose ``training`` flag its forward may read, and its
  forward hooks (rescanned whenever torch's hook-handle counter moved: a hook registered after a capture sends the
  module to eager clone mode). The capture's call signature reads these together with the call's arguments and the
  global modes, and picks the program recorded for it;
* **per program** (:class:`Guards`, made when the program is recorded; :meth:`Guards.check` before every replay):
  the tensor attributes it holds as constants (by identity), the Python attributes and module globals its forward
  read (:mod:`jvpreg.clone.program.side_effects`), and the tensor values its Python read and the shapes that depend
  on values (:mod:`jvpreg.clone.program.value_guard`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from jvpreg.clone.program import sharded_units
from jvpreg.clone.program.side_effects import AttributeReads, Globals, changed, hold
from jvpreg.clone.program.value_guard import ValueGuard

__all__ = ["ModuleGuard", "Guards", "Miss", "CONSTANTS", "ATTRIBUTES", "VALUES"]


def _stateless_types() -> frozenset:
    """torch.nn module classes whose forward neither reads ``self.training`` nor calls a submodule
    (checked against torch's sources: only RReLU, MultiheadAttention and the dropout, batch-norm,
    instance-norm, RNN and transformer modules read ``training`` in ``torch/nn/modules``)."""
    names = """Linear Bilinear Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d ReLU ReLU6 LeakyReLU
        PReLU ELU SELU CELU GELU SiLU Mish Tanh Sigmoid Hardswish Hardsigmoid Hardtanh Softplus Softsign Tanhshrink
        Softmax LogSoftmax Identity Flatten Unflatten MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d
        AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d
        LayerNorm GroupNorm RMSNorm LocalResponseNorm Embedding Upsample PixelShuffle PixelUnshuffle ZeroPad1d
        ZeroPad2d ZeroPad3d ConstantPad1d ConstantPad2d ConstantPad3d ReflectionPad1d ReflectionPad2d
        ReflectionPad3d ReplicationPad1d ReplicationPad2d ReplicationPad3d ChannelShuffle""".split()
    return frozenset(getattr(nn, n) for n in names if hasattr(nn, n))


_STATELESS = _stateless_types()


def _stateless_leaf(m: nn.Module) -> bool:
    """A torch.nn leaf whose forward ignores ``training`` and submodules: its flag and children need no guard.
    The class itself, not a subclass (one may read ``training`` in a method the forward calls)."""
    return type(m) in _STATELESS and not m._modules


@dataclass
class ModuleGuard:
    """What every call of one module re-reads of it (module docstring).

    The parameter and buffer slots of every module; the ``training`` flag and the children of every module except
    torch.nn leaves whose forward reads neither (``Linear``, ``ReLU``, ...: :func:`_stateless_leaf`); the forward
    hooks through torch's global hook-handle counter."""

    modules: List[nn.Module]            # the submodules, the module itself left out (see ``root``)
    children: List[Tuple[Any, ...]]
    slots: List[Tuple[Dict[str, Any], str]]
    child_dicts: List[Dict[str, Any]] = field(default_factory=list)
    hooks: str = ""                     # modules with forward hooks whose side effects a replay would lose
    flagged: List[nn.Module] = field(default_factory=list)   # submodules whose training flag is guarded
    hook_epoch: int = -1
    slot_stores: Optional[Tuple[Dict[str, Any], ...]] = None  # slots, unzipped once
    slot_names: Tuple[str, ...] = ()
    root: Optional[Callable[[], Any]] = None  # a weak reference: the guard is the value of a weak-keyed dict, and
    root_flagged: bool = False                # a strong one would keep the module (and its programs) alive forever

    @classmethod
    def of(cls, module: nn.Module) -> "ModuleGuard":
        mods = list(module.modules())
        plain = [m for m in mods if not isinstance(m, torch.jit.ScriptModule)]  # (TorchScript's stores are not
        # dicts; a module that holds one runs eagerly)
        slots = [(store, name) for m in plain for store in (m._parameters, m._buffers) for name in store]
        guarded = [m for m in plain if not _stateless_leaf(m)]
        dicts = [m._modules for m in guarded]
        return cls([m for m in mods if m is not module], [tuple(d.values()) for d in dicts], slots,
                   child_dicts=dicts, hooks=_foreign_hooks(module, mods),
                   flagged=[m for m in guarded if m is not module], hook_epoch=RemovableHandle.next_id,
                   root=weakref.ref(module), root_flagged=any(m is module for m in guarded))

    def valid(self) -> bool:
        """No guarded module's children were swapped since :meth:`of` (else a new guard is made)."""
        return list(map(tuple, map(dict.values, self.child_dicts))) == self.children

    def check_hooks(self, root: nn.Module) -> None:
        """Rescan the forward hooks if any hook was registered anywhere since the last scan (one int compare)."""
        if self.hook_epoch != RemovableHandle.next_id:
            self.hooks, self.hook_epoch = _foreign_hooks(root, [root, *self.modules]), RemovableHandle.next_id

    def slot_values(self) -> List[Any]:
        """The tensor (or ``None``) in every parameter and buffer slot now."""
        if self.slot_stores is None:
            self.slot_stores, self.slot_names = (tuple(t) for t in zip(*self.slots)) if self.slots else ((), ())
        return list(map(dict.get, self.slot_stores, self.slot_names))


#: Hooks whose effect a replay may drop: Hugging Face's activation checkpointing registers
#: ``make_inputs_require_grads`` (``output.requires_grad_(True)`` on the input embeddings) so that a *reentrant*
#: checkpoint of a frozen-embedding model reaches its adapters' gradients; jvpreg runs every checkpoint
#: non-reentrant, where every parameter's gradient flows without it.
_DROPPABLE_HOOKS = ("enable_input_require_grads.<locals>.make_inputs_require_grads",)


def _droppable(hook: Any) -> bool:
    return getattr(hook, "__qualname__", "").endswith(_DROPPABLE_HOOKS)


def _foreign_hooks(root: nn.Module, mods: List[nn.Module]) -> str:
    """Names of modules with forward hooks whose side effects a replay would lose ('' if none)."""
    from torch.nn.modules import module as module_mod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    pure = (SpectralNorm, WeightNorm)
    bad = []
    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        bad.append("global forward hooks")
    for m in mods:
        if sharded_units.is_unit(m):
            continue  # FSDP's hooks and any other on a unit run eagerly around its captured body (sharded_units)
        hooks = list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values())
        if m is root:
            hooks = [h for h in hooks if not getattr(getattr(h, "__self__", None), "_jvpreg_shared", False)]
        if any(not (isinstance(h, pure) or _droppable(h)) for h in hooks):
            bad.append(type(m).__name__)
    return ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")


#: What :meth:`Guards.check` found changed: a tensor attribute the program holds as a constant was reassigned; an
#: attribute or module global the forward read changed; a tensor value its Python read (or a value-dependent shape)
#: differs.
CONSTANTS, ATTRIBUTES, VALUES = "constants", "attributes", "values"


class Miss(NamedTuple):
    """A guard of a program that does not hold for this call: ``what`` (:data:`CONSTANTS`, :data:`ATTRIBUTES` or
    :data:`VALUES`) and, for values, what the value guard read (:meth:`ValueGuard.read`)."""

    what: str
    read: Any = None


@dataclass(frozen=True)
class Guards:
    """What one program holds for besides its call signature (module docstring), recorded with it.

    ``constants``: ``(dict, name, tensor)`` per plain tensor attribute of the modules that the program holds as a
    constant (``self.scale = torch.tensor(2.0)``: reassigned, it must recapture, not replay the old tensor), ``None``
    for the root module's own ``__dict__`` (read at the call: the guards hold the module weakly); ``attributes``: the
    attributes and globals the forward read (:meth:`jvpreg.clone.program.side_effects.AttributeReads.checks`);
    ``values``: the value guard, or ``None`` where the Python read no tensor value."""

    constants: Tuple[Tuple[Optional[Dict[str, Any]], str, torch.Tensor], ...] = ()
    attributes: Tuple[Tuple[Any, str, Any, bool, str], ...] = ()
    values: Optional[ValueGuard] = None

    @classmethod
    def record(cls, gm: torch.fx.GraphModule, root: nn.Module, modules: Sequence[nn.Module],
               reads: AttributeReads, module_globals: Globals, values: Optional[ValueGuard]) -> "Guards":
        """The guards of ``gm``, recorded from ``root`` (and its submodules ``modules``) by a trace that noted
        ``reads`` and ``module_globals``."""
        held = {id(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        constants = tuple((None if m is root else m.__dict__, name, value) for m in (root, *modules)
                          for name, value in m.__dict__.items()
                          if isinstance(value, torch.Tensor) and id(value) in held)
        return cls(constants, reads.checks(root) + module_globals.checks(), values)

    def check(self, root: nn.Module, inputs: Sequence[torch.Tensor]) -> Optional[Miss]:
        """``None`` where every guard holds for a call of ``root`` with the program's ``inputs``; else the first that
        does not, in the order constants, attributes, values."""
        if self.constants and not all((root.__dict__ if d is None else d).get(n) is v for d, n, v in self.constants):
            return Miss(CONSTANTS)
        if self.attributes and not hold(root, self.attributes):
            return Miss(ATTRIBUTES)
        if self.values is not None:
            got = self.values.read(inputs)
            if not self.values.matches(got):
                return Miss(VALUES, got)
        return None

    def changed_attributes(self, root: nn.Module) -> List[str]:
        """The names of the attributes and globals read that changed (``config.field`` for a held object's)."""
        return changed(root, self.attributes)
