"""Floor 1 of the engine: eager clone mode.

``dispatch`` routes every torch function that touches a clone batch to its rule, a fast path or the exact fallback
(``torch.func.jvp`` of that one op); ``writes`` is where in-place results land. The other modules are the routes for
code out of ``__torch_function__``'s sight, each installed while a clone forward runs and removed after it: custom
autograd Functions (``functions``), activation checkpointing (``checkpointing``), compiled code
(``compiled_code``), TorchScript (``torchscript``), torch.func transforms (``nested_transforms``), tensors made from
sizes alone (``made_tensors``) and clone batches a forward stores on its modules (``stored_clones``).
Imports only :mod:`jvpreg.clone.core`.
"""
