"""Floor 1 of the engine: eager clone mode.

``dispatch`` routes every torch function that touches a clone batch to its rule, a fast path or the exact fallback
(``torch.func.jvp`` of that one op); ``writes`` is where in-place results land; ``forward`` is the scope of a clone
forward (its session, :mod:`jvpreg.clone.core.session`, opened with ``dispatch``); ``parameter_slots`` swaps clones
into parameter slots (parameter directions); ``stored_clones`` makes the clone batches a forward stores on its modules
their primals when it ends. The other modules are the routes for code out of ``__torch_function__``'s sight, each
installed by the session while a clone forward runs and removed after it: custom autograd Functions (``functions``),
activation checkpointing (``checkpointing``), compiled code (``compiled_code``), TorchScript (``torchscript``),
torch.func transforms (``nested_transforms``) and tensors made from sizes alone (``made_tensors``); importing one
registers it, so the floor imports them all here. Imports only :mod:`jvpreg.clone.core`.
"""
from jvpreg.clone.eager import (  # noqa: F401  (importing a route registers it with the session)
    checkpointing, compiled_code, functions, made_tensors, nested_transforms, torchscript)
