"""The clone-mode engine: exact JVPs of unmodified PyTorch programs in one concatenated batch.

Layout: ``tensor`` (the K-block batch type), ``registry`` (the one rule registry), ``dispatch``
(routing and the exact fallback), ``rules/`` (one module per family of ops, registered by kind; shape and affine
fast paths), ``functions`` (custom autograd.Functions), ``checkpointing``
(``torch.utils.checkpoint`` regions recomputed in clone mode), ``session`` (the state of a running clone forward),
``parameter_slots`` (``swapped_tensors``: clones in parameter slots), ``api``
(``jvp``, ``jvp_params``, ``pack``/``call``/``unpack``, and the pieces the losses share:
``scales``, ``clone_of``),
``shared_forward`` (the losses' and callbacks' shared clone forward of a module call: ``SharedCall``),
``capture`` (the captured and compiled engines), ``device_paths``
(the host's path or an accelerator's, and :func:`~jvpreg.clone.core.device_paths.accelerator_path` to test the latter).
"""
from jvpreg.clone import rules  # noqa: F401  (registers the rules)
from jvpreg.clone.api import call, choose_scales, clone_of, jvp, jvp_params, pack, primal_of, scales, unpack
from jvpreg.clone.shared_forward import SharedCall, packed_scales, swapped_clones
from jvpreg.clone.program.capture import ENGINES
from jvpreg.clone.eager.compiled_code import between_graphs
from jvpreg.clone.core.errors import JVPCaptureWarning
from jvpreg.clone.core.errors import JVPFallbackWarning, UnsupportedOpError
from jvpreg.clone.eager.dispatch import fallback_mode, set_fallback
from jvpreg.clone.eager.functions import register_function_rule
from jvpreg.clone.eager.parameter_slots import swapped_tensors
from jvpreg.clone.core.registry import register_handler, rule_for
from jvpreg.clone.rules.kinds import register_rule, register_state
from jvpreg.clone.core.tensor import CloneTensor, is_clone

__all__ = [
    "CloneTensor", "JVPCaptureWarning", "JVPFallbackWarning", "UnsupportedOpError", "call", "choose_scales",
    "clone_of", "fallback_mode", "is_clone", "jvp", "jvp_params", "pack", "primal_of", "register_function_rule",
    "register_handler", "register_rule", "register_state", "rule_for", "scales", "set_fallback",
    "swapped_tensors", "unpack",
    "ENGINES", "SharedCall", "between_graphs", "packed_scales", "swapped_clones",
]
