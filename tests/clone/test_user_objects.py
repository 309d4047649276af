"""The capture never calls methods of user objects it does not own (a config mapping that refuses ``update``, a
frozen dataclass, a property that raises): each model is exact against ``torch.func.jvp`` in float64 and captured
(diffusers' ``UNet2DModel`` holds its config in a ``FrozenDict`` whose ``update`` raises)."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone.program import capture


class FrozenMapping(OrderedDict):
    """diffusers' FrozenDict: every mutating method raises."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__frozen = True

    def _refuse(self, *args, **kwargs):
        raise Exception(f"You cannot use a mutating method on a {type(self).__name__} instance.")

    update = pop = setdefault = popitem = clear = __delitem__ = _refuse

    def __setitem__(self, key, value):
        if getattr(self, "_FrozenMapping__frozen", False):
            raise Exception("frozen")
        super().__setitem__(key, value)


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float = 0.5


class RaisingProperty:
    @property
    def boom(self):
        raise RuntimeError("this property must never be read")

    def __eq__(self, other):
        raise RuntimeError("__eq__ must never be called by the capture")

    __hash__ = object.__hash__


class Model(nn.Module):
    def __init__(self, holder):
        super().__init__()
        self.config = holder
        self.frozen = Frozen()
        self.odd = RaisingProperty()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        cfg = self.config
        k = cfg["k"] if isinstance(cfg, dict) else 1.0
        return torch.tanh(self.lin(x)) * k * self.frozen.scale


@pytest.mark.parametrize("holder", [FrozenMapping(k=2.0), {"k": 2.0}, [1, 2]], ids=["frozen_mapping", "dict", "list"])
def test_user_objects_are_left_alone_and_the_call_is_captured(holder):
    torch.manual_seed(0)
    model = Model(holder).double()
    x, u = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    ref = torch.func.jvp(model, (x,), (u,))
    for _ in range(3):  # eager, capture, replay
        y, t = jvpreg.jvp(model, (x,), (u,))
        torch.testing.assert_close(y, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(t, ref[1], rtol=1e-12, atol=1e-12)
    progs = capture.programs(model)
    assert len(progs) == 1 and all(p.gm is not None and p.replays >= 1 for p in progs.values())
    assert model.config is holder and model.config == holder


def test_a_changed_value_in_a_plain_dict_recaptures():
    torch.manual_seed(0)
    model = Model({"k": 2.0}).double()
    x, u = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    for _ in range(2):
        jvpreg.jvp(model, (x,), (u,), engine="captured")
    before = [p for p in capture.programs(model).values() if p.gm is not None]
    model.config["k"] = 3.0
    y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-12, atol=1e-12)
    after = [p for p in capture.programs(model).values() if p.gm is not None]
    assert len(before) == len(after) == 1 and after[0] is not before[0] and after[0].replays == 1  # recorded anew
