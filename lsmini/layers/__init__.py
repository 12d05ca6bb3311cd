"""nn.Modules built from lsmini's fused ops and torch GEMMs."""
from lsmini.layers.layernorm import LayerNorm
