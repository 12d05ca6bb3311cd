"""Fused ops. Each op is registered once as a PyTorch operator, ``torch.ops.lsmini.<op>`` (with
``lsmini::<op>_backward`` where its backward is an operator of its own), whose CUDA implementation runs the
extension's kernel and whose CPU implementation is the op's pure-PyTorch reference ``<op>_ref`` (a backward
operator's: the reference's gradients by autograd). The public ``lsmini.ops.<op>(...)`` checks its
arguments and calls that operator, in eager and compiled code alike, for the dtypes and sizes the kernel
takes; other inputs (float64, a head_dim without a kernel, tensors on another device), CUDA tensors
without the built extension, and a forced reference (``lsmini.config.reference``, read at every call) run
``<op>_ref`` directly.

``lsmini/ops/<op>.py`` holds everything of one op: the public function, the reference, the registered
operators (implementations, fake implementation for tracing, autograd registered once) and, for the ops
inside the fused layers, the forward/backward primitives the layers' hand-written backward is built on.
What several ops share lives in modules named by their role: ``checks`` (argument checks), ``dropout``
(the references' dropout masks), ``library`` (what the registered operators share: the dropout state a
forward hands its backward, optional outputs) and ``reference_grads`` (a reference's backward by
autograd). Kernel dtypes and size limits come from ``lsmini.limits``.

Every op works under ``torch.compile(fullgraph=True)``: the compiler sees the operators through their fake
implementations and registered autograd, and the same operators run as in eager mode. The host-syncing
value checks (embedding's token range, cross_entropy's targets) are skipped while compiling, and which
path runs (``lsmini.config.reference`` included) is decided when the function is compiled (a change of it
recompiles).
"""
from lsmini.ops.layernorm import layer_norm, layer_norm_ref
from lsmini.ops.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from lsmini.ops.heads import merge_heads, merge_heads_ref, split_heads, split_heads_ref
from lsmini.ops.attention_softmax import attention_softmax, attention_softmax_ref
from lsmini.ops.attention import attention, attention_ref, fused_attention_supported
from lsmini.ops.cross_entropy import cross_entropy, cross_entropy_ref
from lsmini.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from lsmini.ops.embedding import embedding, embedding_ref, sinusoidal_positions
from lsmini.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_ref
from lsmini.ops.glu import geglu, glu_ref, swiglu
from lsmini.ops.rotary import rotary, rotary_cos_sin, rotary_ref
