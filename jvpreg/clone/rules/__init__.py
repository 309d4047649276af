"""Clone rules, one module per family of nonlinear ops (importing registers them)."""
from jvpreg.clone.rules import (  # noqa: F401  (registers the rules)
    attention, bilinear, composite, cpa, dropout, embedding, flex_attention, normalization, pooling, recurrent, smooth)
