"""Clone rules, one module per family of nonlinear ops (importing registers them)."""
from . import attention, bilinear, composite, cpa, dropout, embedding, normalization, pooling, recurrent, smooth  # noqa: F401,E501
