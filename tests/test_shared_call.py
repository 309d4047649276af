"""``jvpreg.clone.SharedCall``: where the shared clone forward packs its input, and the same JVP either way."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from jvpreg.clone import SharedCall, clone_of, pack, packed_scales, scales, swapped_clones, unpack
from jvpreg.clone.core.device_paths import accelerator_path
from jvpreg.clone.program import capture

D = torch.float64


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)


def shared_jvp(shared: SharedCall, x: torch.Tensor, u: torch.Tensor):
    if shared.packs((x,), {}, x):
        s, finite = packed_scales(x, u)
        out, tan, _ = shared.packed((x,), {}, x, u, s, finite=finite)
        return out, tan
    (xc,), s = pack((x,), (u,))
    return unpack(shared((xc,), {}), s)


SETTINGS = [
    dict(id="captured", engine="captured", args=lambda x: (x,), packs=True),
    dict(id="auto", engine="auto", args=lambda x: (x,), packs=True),
    dict(id="eager engine", engine="eager", args=lambda x: (x,), packs=False),
    dict(id="container argument", engine="captured", args=lambda x: (x, [x]), packs=False),
    dict(id="input passed twice", engine="captured", args=lambda x: (x, x), packs=False),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=[s["id"] for s in SETTINGS])
def test_where_the_input_is_packed(setting):
    x = torch.randn(5, 3, dtype=D)
    shared = SharedCall(mlp(), setting["engine"])
    assert shared.packs(setting["args"](x), {}, x) is setting["packs"]
    assert not shared.packs((x,), {}, x, hooks_outside=True)


@pytest.mark.parametrize("engine", ["auto", "captured", "eager"])
def test_both_ways_give_torch_func_jvp(engine):
    model, x, u = mlp(), torch.randn(5, 3, dtype=D), torch.randn(2, 5, 3, dtype=D)
    want = [torch.func.jvp(model, (x,), (u[j],)) for j in range(2)]
    shared = SharedCall(model, engine)
    for _ in range(3):  # "auto": eager, then recorded, then replayed
        out, tan = shared_jvp(shared, x, u)
        torch.testing.assert_close(out, want[0][0], rtol=1e-12, atol=0)
        for j in range(2):
            torch.testing.assert_close(tan[j], want[j][1], rtol=1e-10, atol=1e-14)
    packed = [k for k in capture.programs(model) if isinstance(k[0], tuple) and k[0][0] == "packed"]
    assert len(packed) == (0 if engine == "eager" else 1)


def test_a_compiled_module_is_cloned_through_its_original_code():
    model = mlp()
    shared = SharedCall(torch.compile(model))
    assert shared.module is model and shared.engine == "compiled"


def test_packed_scales_are_the_hosts_choice_or_left_to_the_program_on_an_accelerator():
    x, u = torch.randn(5, 3, dtype=D), torch.randn(2, 5, 3, dtype=D)
    s, finite = packed_scales(x, u)
    assert torch.equal(s, scales([(x, u)], 2)) and finite is True
    assert packed_scales(x, u, scale=0.5)[1] is None
    with accelerator_path():
        assert packed_scales(x, u) == (None, None)


def test_swapped_clones_puts_the_originals_back():
    model, u = mlp(), torch.randn(1, 4, 3, dtype=D)
    w = model[0].weight
    clone = clone_of(w.detach(), u, torch.ones(1, dtype=D))
    with swapped_clones(model, {w: clone}, watch=False):
        assert model[0].weight is clone
    assert model[0].weight is w
    with swapped_clones(model, {}):
        assert model[0].weight is w


def test_errors_name_the_call_and_the_fix():
    x, u = torch.randn(5, 3, dtype=D), torch.randn(1, 5, 3, dtype=D)
    with pytest.raises(ValueError, match=r"my_step\(model\): expected engine to be one of .*got 'fast'"):
        SharedCall(mlp(), "fast", where="my_step(model)")
    with pytest.raises(RuntimeError, match=r"input is passed 2 times .* where SharedCall.packs says so"):
        SharedCall(mlp(), "captured").packed((x, x), {}, x, u, None)
