"""jvpreg: fast exact Jacobian-vector products of deep networks (clone mode) and JVP regularizers.

``jvpreg.jvp`` is a drop-in for ``torch.func.jvp``; ``jvpreg.jvp_params`` differentiates w.r.t.
named parameters. Lightning callbacks, losses and the Hydra app import lazily, so the engine needs
only torch.
"""
from .clone import JVPCaptureWarning, JVPFallbackWarning, UnsupportedOpError, jvp, jvp_params

__version__ = "0.1.0"
__all__ = ["JVPCaptureWarning", "JVPFallbackWarning", "UnsupportedOpError", "jvp", "jvp_params", "__version__"]
