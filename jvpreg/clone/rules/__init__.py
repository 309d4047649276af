"""Clone rules, one module per family of nonlinear ops (importing registers them)."""
from . import attention, bilinear, cpa, dropout, embedding, normalization, pooling, recurrent, smooth  # noqa: F401
