"""Fused ops. Each ``lsmini.ops.<op>(...)`` runs the CUDA kernel for CUDA tensors when the extension is
built, and its pure-PyTorch reference ``<op>_ref`` otherwise.

``lsmini/ops/<op>.py`` holds everything of one op: the public function, the reference, the autograd
Function and, for the ops inside the fused layers, the forward/backward primitives the layers' hand-written
backward is built on. What several ops share lives in modules named by their role: ``checks`` (argument
checks), ``dropout`` (the references' dropout masks) and ``reference_grads`` (a reference's backward by
autograd). Kernel dtypes and size limits come from ``lsmini.limits``.

Every op works under ``torch.compile(fullgraph=True)``. The reference path is plain PyTorch, which the
compiler traces. The kernel path is also registered as PyTorch custom operators, ``lsmini::<op>`` and
``lsmini::<op>_backward`` (fake implementations for tracing, registered autograd; ``library`` holds what
they share): the ops call them while torch.compile traces them and keep their autograd Functions in eager
mode. The host-syncing value checks (embedding's token range, cross_entropy's targets) are skipped while
compiling, and which path runs (``LSMINI_FORCE_REFERENCE`` included) is decided when the function is
compiled, not at every call.
"""
from lsmini.ops.layernorm import layer_norm, layer_norm_ref
from lsmini.ops.heads import merge_heads, merge_heads_ref, split_heads, split_heads_ref
from lsmini.ops.attention_softmax import attention_softmax, attention_softmax_ref
from lsmini.ops.attention import attention, attention_ref, dropout_bits, fused_attention_supported
from lsmini.ops.cross_entropy import cross_entropy, cross_entropy_ref
from lsmini.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from lsmini.ops.embedding import embedding, embedding_ref, sinusoidal_positions
from lsmini.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_ref
