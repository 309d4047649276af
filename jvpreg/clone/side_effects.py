"""What a traced forward changes besides its tensors, which a captured program would not replay.

A captured program (:mod:`jvpreg.clone.capture`) replays the forward's tensor ops. Two kinds of state live
outside them:

* **random number generators**: the default CPU and device generators, and any ``torch.Generator`` the model
  holds as an attribute (``torch.randn(..., generator=self.gen)``). The program replays the random ops, not Python
  that seeds or sets a generator; :class:`Generators` reads, sets and steps them so the capture can check that a
  replay leaves them where the forward did. A program whose random ops name a generator the model does not hold
  (:func:`held_generators`) would keep drawing from the one it saw at capture.
* **Python attributes of the model's modules** that the forward sets (``self.calls += 1``, ``self.last = h``): a
  replay would not set them. :class:`Attributes` takes a snapshot before the trace and names what changed; the
  capture puts the old values back (the call then runs eagerly, once) and runs such a forward in eager clone mode.
  A write of an equal number, string or flag (``self.flag = True`` on every call) changes nothing and is allowed;
  so is weight and spectral norm's ``module.weight``, which their hooks recompute inside the program. Changes
  inside a container (``self.log.append(h)``) are not seen.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

__all__ = ["Generators", "held_generators", "Attributes"]


class Generators:
    """The random number generators a forward on ``device`` may draw from: the default CPU one, the device's, and
    those the model holds as attributes."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = device
        seen: Dict[int, torch.Generator] = {}
        for mod in module.modules():
            for value in vars(mod).values():
                if isinstance(value, torch.Generator):
                    seen.setdefault(value._cdata, value)  # one generator may have several Python objects
        self.owned = list(seen.values())

    def states(self) -> Tuple[torch.Tensor, ...]:
        states = (torch.get_rng_state(),)
        if self.device.type == "cuda":
            states += (torch.cuda.get_rng_state(self.device),)
        return states + tuple(g.get_state() for g in self.owned)

    def set(self, states: Tuple[torch.Tensor, ...]) -> None:
        torch.set_rng_state(states[0])
        rest = states[1:]
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(rest[0], self.device)
            rest = rest[1:]
        for g, state in zip(self.owned, rest):
            g.set_state(state)

    def step(self) -> None:
        """Each generator one draw on: a state that no seeding gives (a freshly seeded Mersenne twister has read
        none of its words, a freshly seeded Philox has offset 0), so a forward that seeds one cannot end where a
        replay from here ends."""
        torch.empty(1).random_()
        if self.device.type == "cuda":
            torch.empty(1, device=self.device).random_()
        for g in self.owned:
            torch.empty(1, device=g.device).random_(generator=g)

    def holds(self, generator: torch.Generator) -> bool:
        return any(g._cdata == generator._cdata for g in self.owned)


def held_generators(gm: torch.fx.GraphModule) -> List[torch.Generator]:
    """The generators a recorded program's random ops name (``generator=``): it holds them as constants."""
    return [getattr(gm, n.target) for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Generator)]


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_MISSING = object()


def _same(old: Any, new: Any) -> bool:
    """A replay that does not write ``new`` over ``old`` leaves what the forward would: the same object, or an equal
    number, string or flag (tuples of them too)."""
    if old is new:
        return True
    if isinstance(old, tuple) and isinstance(new, tuple):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    return type(old) is type(new) and isinstance(old, _PLAIN) and old == new


def _recomputed_by_hooks(mod: nn.Module) -> set:
    """Attributes that weight and spectral norm's pre-hooks set on every forward, from tensors the program computes."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return {h.name for h in mod._forward_pre_hooks.values() if isinstance(h, (SpectralNorm, WeightNorm))}


class Attributes:
    """A snapshot of the Python attributes (``vars``) of every module of ``module``, parameters and buffers
    included (rebinding one is a write too)."""

    def __init__(self, module: nn.Module):
        self.mods = list(module.named_modules(remove_duplicate=True))
        self.before = [self._attributes(mod) for _, mod in self.mods]

    @staticmethod
    def _attributes(mod: nn.Module) -> Dict[Tuple[str, str], Any]:
        out = {("", k): v for k, v in vars(mod).items() if k not in ("_parameters", "_buffers", "_modules")}
        out.update((("_parameters", k), v) for k, v in mod._parameters.items())
        out.update((("_buffers", k), v) for k, v in mod._buffers.items())
        out.update((("_modules", k), v) for k, v in mod._modules.items())
        return out

    def changed(self) -> List[str]:
        """``module.attribute`` names the forward set since the snapshot (to a different value)."""
        names = []
        for (prefix, mod), before in zip(self.mods, self.before):
            after = self._attributes(mod)
            skip = _recomputed_by_hooks(mod)
            for key in before.keys() | after.keys():
                if key[1] in skip or _same(before.get(key, _MISSING), after.get(key, _MISSING)):
                    continue
                names.append(f"{prefix or type(mod).__name__}.{key[1]}")
        return sorted(names)

    def restore(self) -> None:
        """Put every attribute back as it was at the snapshot (new ones removed)."""
        for (_, mod), before in zip(self.mods, self.before):
            after = self._attributes(mod)
            for (where, name) in after.keys() - before.keys():
                del (vars(mod) if where == "" else getattr(mod, where))[name]
            for (where, name), value in before.items():
                (vars(mod) if where == "" else getattr(mod, where))[name] = value
