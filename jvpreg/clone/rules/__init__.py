"""Clone rules and fast paths, one module per family of ops (importing registers them); :mod:`.kinds` registers
them by kind and :mod:`.blocks` splits and stacks their blocks."""
from jvpreg.clone.rules import (  # noqa: F401  (registers the rules)
    shape, linear, convolution, attention, batch_norm, bilinear, composite, cpa, dropout, embedding, flex_attention,
    normalization, pooling, recurrent, smooth)
