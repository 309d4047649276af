"""``torch.func`` transforms inside a clone forward: a model whose forward calls ``vmap``, ``grad``, ``jacrev``...

functorch wraps a transform's inputs in C++ (a batched or grad-tracking tensor): a clone batch would lose its
subclass there and the transform's ops would treat its blocks as samples (a per-sample ``vmap`` in a forward, an
input-gradient feature ``grad(f)(x) * x``: wrong JVPs, silently). While a clone forward runs (a route of its
session: :func:`~jvpreg.clone.core.session.register_patches`):

* ``torch.vmap`` / ``torch.func.vmap``, ``torch.func.grad`` and ``grad_and_value`` called on clone arguments are one op
  to the engine: the exact fallback (:func:`jvpreg.clone.eager.dispatch.fallback`) linearises the whole transformed call at
  the primal block (``torch.func.jvp`` of it, which functorch nests), eagerly (a captured model that calls one runs
  in eager clone mode);
* any other transform that would wrap a clone batch (``vjp``, ``jacrev``, ``jvp``, ``jacfwd``, ``hessian``) raises
  :class:`UnsupportedOpError` naming it, where functorch wraps it;
* a clone batch that reaches a transform by closure (``vmap(lambda w: tanh(x @ w))(W)``) raises at its first op
  inside (the engine's dispatch compares functorch's interpreter level with the one the clone forward's session
  began at: :func:`jvpreg.clone.eager.dispatch.dispatch`).
"""
from __future__ import annotations

from typing import Callable

from torch._C import DisableTorchFunctionSubclass
from torch._functorch import apis, eager_transforms
from torch._functorch import vmap as vmap_module

from jvpreg.clone.core.errors import UnsupportedOpError
from jvpreg.clone.core.session import register_patches
from jvpreg.clone.core.tensor import iter_clones
from jvpreg.clone.eager.dispatch import fallback

# (module, name): the callable there, looked up by functorch at call time
_ROUTED_NAMES = ((apis, "vmap_impl"), (eager_transforms, "grad_impl"), (eager_transforms, "grad_and_value_impl"))
_GUARDED_NAMES = ((vmap_module, "_add_batch_dim"), (eager_transforms, "_wrap_for_grad"),
                  (eager_transforms, "_jvp_with_argnums"))  # (jvp and jacfwd make dual tensors, not wrappers)
_ORIGINALS = {(m, n): getattr(m, n) for m, n in _ROUTED_NAMES + _GUARDED_NAMES}
HINT = ("A torch.func transform called on a clone batch inside the forward is linearised as one op where jvpreg "
        "can (torch.vmap, torch.func.grad); for others, compute the transform outside the model's forward, or write "
        "the per-sample function batched.")


class _TransformCall:
    """A transformed call (``vmap(f)(*args)``), as one op for the fallback, named in its errors and warnings."""

    def __init__(self, name: str, run: Callable):
        self.run, self.hint = run, HINT
        self.__name__ = self.__qualname__ = name
        self.__module__ = "torch.func"

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def _vmap_impl(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
    original = _ORIGINALS[(apis, "vmap_impl")]
    if next(iter_clones((args, kwargs)), None) is None:
        return original(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)
    call = _TransformCall(f"torch.vmap({getattr(func, '__qualname__', 'func')})",
                          lambda *a, **k: original(func, in_dims, out_dims, randomness, chunk_size, *a, **k))
    with DisableTorchFunctionSubclass():
        return fallback(call, args, kwargs)


def _grad_routed(name: str) -> Callable:
    original = _ORIGINALS[(eager_transforms, name)]

    def impl(func, argnums, has_aux, args, kwargs):
        if next(iter_clones((args, kwargs)), None) is None:
            return original(func, argnums, has_aux, args, kwargs)
        transform = name.replace("_impl", "")
        call = _TransformCall(f"torch.func.{transform}({getattr(func, '__qualname__', 'func')})",
                              lambda *a, **k: original(func, argnums, has_aux, a, k))
        with DisableTorchFunctionSubclass():
            return fallback(call, tuple(args), dict(kwargs))

    return impl


def _guarded(name: str) -> Callable:
    original = _ORIGINALS[next(key for key in _GUARDED_NAMES if key[1] == name)]

    def wrap(*args, **kwargs):
        if next(iter_clones((args, kwargs)), None) is not None:
            raise UnsupportedOpError(
                "jvpreg clone mode: a torch.func transform (vjp, jacrev, jvp, jacfwd, hessian...) inside the model's "
                "forward received a clone batch; functorch would unwrap it and treat its blocks as samples (a wrong "
                f"JVP). {HINT}")
        return original(*args, **kwargs)

    return wrap


_REPLACEMENTS = {(apis, "vmap_impl"): _vmap_impl,
                 (eager_transforms, "grad_impl"): _grad_routed("grad_impl"),
                 (eager_transforms, "grad_and_value_impl"): _grad_routed("grad_and_value_impl"),
                 **{(m, n): _guarded(n) for m, n in _GUARDED_NAMES}}


register_patches(_REPLACEMENTS)  # the transforms are routed while a clone forward runs
