"""Clone rules, one module per family of nonlinear ops (importing registers them)."""
from . import (attention, bilinear, composite, cpa, dropout, embedding, flex_attention, normalization,  # noqa: F401
               pooling, recurrent, smooth)
