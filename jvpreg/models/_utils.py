"""Small argument-validation helpers shared by the model builders."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["ACTIVATIONS", "check_positive_int", "make_activation", "to_pair"]

#: Activation names accepted by :func:`make_activation` (module classes, so that
#: module-level rewriting, e.g. JVP clone rules, can find and replace them).
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "leaky_relu": nn.LeakyReLU,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softplus": nn.Softplus,
    "identity": nn.Identity,
}


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive ``int``, else raise.

    Args:
        value: The value to check.
        name: Argument name used in the error message.

    Returns:
        The value, unchanged.

    Raises:
        TypeError: If ``value`` is not an ``int`` (``bool`` is rejected).
        ValueError: If ``value`` is not strictly positive.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def to_pair(image_size: int | Sequence[int], name: str = "image_size") -> tuple[int, int]:
    """Normalize an image size given as ``int`` or ``(H, W)`` to a pair of ints.

    Args:
        image_size: ``S`` (meaning ``S x S``) or a length-2 sequence ``(H, W)``.
        name: Argument name used in the error message.

    Returns:
        ``(H, W)``.

    Raises:
        TypeError: If ``image_size`` is neither an int nor a length-2 sequence of ints.
        ValueError: If a side is not positive.
    """
    if isinstance(image_size, int) and not isinstance(image_size, bool):
        return check_positive_int(image_size, name), image_size
    if isinstance(image_size, Sequence) and not isinstance(image_size, str) and len(image_size) == 2:
        h = check_positive_int(image_size[0], f"{name}[0]")
        w = check_positive_int(image_size[1], f"{name}[1]")
        return h, w
    raise TypeError(f"{name} must be an int or a (H, W) pair of ints, got {image_size!r}")


def make_activation(activation: str | Callable[[], nn.Module]) -> nn.Module:
    """Instantiate an activation module.

    Args:
        activation: A name from :data:`ACTIVATIONS` (case-insensitive) or a
            zero-argument callable returning an ``nn.Module`` (e.g. ``nn.ReLU``).

    Returns:
        A fresh activation module.

    Raises:
        ValueError: If the name is unknown.
        TypeError: If ``activation`` is neither a string nor a callable returning a module.
    """
    if isinstance(activation, str):
        key = activation.lower()
        if key not in ACTIVATIONS:
            raise ValueError(
                f"Unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}"
            )
        return ACTIVATIONS[key]()
    if callable(activation):
        module = activation()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"activation callable must return an nn.Module, got {type(module).__name__}"
            )
        return module
    raise TypeError(
        f"activation must be a str or a callable returning nn.Module, got {type(activation).__name__}"
    )
