"""The Python work of a replayed clone forward does not grow with the model, and touches no class.

A replay runs one recorded program: the Python around it (guards, packing, the callbacks' hooks) must cost the same
for a 3-layer and a 30-layer network; anything walking the modules or the parameters one by one in Python would show
here as more Python calls (counted with ``sys.setprofile``: deterministic, unlike a timing). Assigning an attribute
of a class many modules derive from (``nn.Module.__setattr__``) makes no Python call but re-derives the slots of
every subclass (0.3-0.6 ms a call): checked separately.
"""
from __future__ import annotations

import gc
import sys

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.callbacks.shared import SharedForward
from jvpreg.losses import JacobianFrobenius


def _mlp(depth: int) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def _python_calls(fn) -> int:
    """Python frames entered while ``fn`` runs (the garbage collector off: its finalizers would count)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls[0]


def _jvp_call(model: nn.Module, engine: str = "captured"):
    x = torch.randn(8, 16)
    u = torch.randn_like(x)
    return lambda: jvpreg.jvp(model, (x,), (u,), engine=engine)


def _regularized_step(model: nn.Module, engine: str = "captured"):
    """One training step as the callbacks run it (the clone forward under the user's ``model(x)``)."""
    shared = SharedForward(model, engine=engine)
    x = torch.randn(8, 16)

    def step():
        shared.arm([(JacobianFrobenius(1), 1.0, 1.0)])
        try:
            loss = model(x).sum() + shared.total()
        finally:
            shared.disarm()
        loss.backward()

    return step


@pytest.mark.parametrize("path", [_jvp_call, _regularized_step], ids=["jvp", "regularized_step"])
@pytest.mark.slow
def test_the_python_work_of_a_replay_does_not_grow_with_depth(path):
    torch.manual_seed(0)
    counts = {}
    for depth in (3, 30):
        run = path(_mlp(depth))
        for _ in range(3):  # capture, then replays
            run()
        counts[depth] = _python_calls(run)
    assert counts[3] == counts[30], counts
    assert counts[3] < 400, counts  # the Python around one program, not the engine's per-op dispatch


@pytest.mark.parametrize("path, engine", [(_jvp_call, "eager"), (_regularized_step, "eager"),
                                          (_regularized_step, "captured")],
                         ids=["jvp-eager", "regularized_step-eager", "regularized_step-captured"])
def test_a_clone_forward_leaves_the_classes_of_modules_alone(path, engine):
    """No attribute of ``nn.Module`` or of the model's classes is assigned during a clone forward (looked at from a
    global forward hook: inside every submodule call of an eager forward; around the replay of the callbacks' step,
    whose own hooks open and close the clone forward)."""
    model = _mlp(2)
    run = path(model, engine)
    for _ in range(2):
        run()
    classes = {cls: dict(vars(cls)) for m in model.modules() for cls in type(m).__mro__
               if cls is not object and issubclass(cls, nn.Module)}
    seen = []

    def probe(*_):
        seen.append(sorted(f"{cls.__name__}.{k}" for cls, before in classes.items()
                           for k in vars(cls).keys() | before.keys() if vars(cls).get(k) is not before.get(k)))

    handle = nn.modules.module.register_module_forward_hook(probe)
    try:
        run()
    finally:
        handle.remove()
    assert seen, "the probe never ran inside the clone forward"
    assert seen == [[]] * len(seen), seen
