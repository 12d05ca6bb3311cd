"""Fused ops. Each ``lsmini.ops.<op>(...)`` runs the CUDA kernel for CUDA tensors when the extension is
built, and its pure-PyTorch reference ``<op>_ref`` otherwise."""
from lsmini.ops.layernorm import layer_norm, layer_norm_ref
from lsmini.ops.heads import merge_heads, merge_heads_ref, split_heads, split_heads_ref
from lsmini.ops.attention_softmax import attention_softmax, attention_softmax_ref
from lsmini.ops.attention import attention, attention_ref, fused_attention_supported
from lsmini.ops.cross_entropy import cross_entropy, cross_entropy_ref
from lsmini.ops.embedding import embedding, embedding_ref, sinusoidal_positions
from lsmini.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_ref
