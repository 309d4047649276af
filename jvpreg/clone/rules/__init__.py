"""Clone rules, one module per family of nonlinear ops (importing registers them)."""
from . import attention, bilinear, cpa, dropout, normalization, pooling, recurrent, smooth  # noqa: F401
