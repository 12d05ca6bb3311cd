"""Host time of eager op calls: what a training step pays per lsmini op before any kernel runs.

    python benchmarks/bench_host.py [--calls N]

Each dropout op is called with dropout 0.1 and with dropout 0 on tiny inputs, without autograd; the wall time
per call is the host's where the device time (timed too, with dropout) is shorter. The difference
is what dropout adds to a call's host time: drawing its Philox state (``_backend.dropout_rng``, timed alone
too) and whatever else the op and its launch do differently with dropout. Best of 5 repeats of --calls calls,
µs per call.

Then the compiled layer's operators, ``lsmini::layer`` and ``lsmini::layer_backward``, called directly for a
post-LN encoder layer (self, ffn) and decoder layer (self, cross, ffn) of the base shape (hidden 512, 8 heads,
FFN 2048, dropout 0.1) on a [2, 8] bf16 input with float32 parameters, as under autocast: the host time of one
layer call as a compiled step pays it, without the compiler's own wrapper around it. With layer graphs off
(every call issues its kernels) and on (the call site's graph replays; csrc/layers/layer.cpp).
"""
import argparse
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from lsmini import _backend  # noqa: E402
from lsmini.layers import TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer  # noqa: E402
from lsmini.layers.compiled import layer_backward_op, layer_op, set_layer_graphs  # noqa: E402
from lsmini.ops import (attention, attention_softmax, bias_act_dropout, bias_dropout_residual, embedding,  # noqa: E402
                        sinusoidal_positions)

P = 0.1


def host_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    best = min(timeit.repeat(fn, number=calls, repeat=5)) / calls
    torch.cuda.synchronize()
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    env = common.environment()
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}: host µs per eager call")
    dev, half = torch.device("cuda"), torch.float16
    # tiny inputs: a few µs of device time a call, well under the host's
    x = torch.randn(16, 64, device=dev, dtype=half)
    bias = torch.randn(64, device=dev, dtype=half)
    q = torch.randn(1, 2, 16, 64, device=dev, dtype=half)
    scores = torch.randn(1, 2, 16, 16, device=dev, dtype=half)
    tokens = torch.randint(4, 100, (2, 8), device=dev)
    weight = torch.randn(100, 64, device=dev, dtype=half)
    positions = sinusoidal_positions(8, 64).to(dev, half)
    ops = {
        "bias_dropout_residual": lambda p: bias_dropout_residual(x, bias, x, p),
        "bias_act_dropout": lambda p: bias_act_dropout(x, bias, "gelu", p),
        "attention_softmax": lambda p: attention_softmax(scores, None, True, p),
        "attention": lambda p: attention(q, q, q, None, True, p),
        "embedding": lambda p: embedding(tokens, weight, positions, dropout_p=p, check_tokens=False),
    }
    rows = [{"op": "dropout_rng", "p 0.1 µs": host_us(lambda: _backend.dropout_rng(P, dev), args.calls)}]
    for name, call in ops.items():
        with_p, without = host_us(lambda: call(P), args.calls), host_us(lambda: call(0.0), args.calls)
        device = common.time_ms(lambda: call(P), warmup=5, iters=20) * 1e3
        rows.append({"op": name, "p 0.1 µs": with_p, "p 0 µs": without, "dropout's share": 1 - without / with_p,
                     "device µs (p 0.1)": device})
    shown = [{k: (f"{v:.1%}" if k == "dropout's share" else f"{v:.2f}") if isinstance(v, float) else v
              for k, v in r.items()} for r in rows]
    print(common.markdown_table(shown, ["op", "p 0.1 µs", "p 0 µs", "dropout's share", "device µs (p 0.1)"]))
    print()
    print(common.markdown_table(layer_rows(dev, args.calls // 10),
                                ["operator", "layer", "graphs off µs", "graphs on µs"]))


def layer_rows(dev, calls):
    """Host µs per call of lsmini::layer and lsmini::layer_backward, encoder and decoder layer."""
    config = TransformerConfig(hidden_size=512, num_heads=8, ffn_size=2048, dropout=0.1, attn_dropout=0.1,
                               activation_dropout=0.1)
    x = torch.randn(2, 8, 512, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, 8, 1024, device=dev, dtype=torch.bfloat16)
    rows = []
    for name, layer, encoder_kv in (("encoder", TransformerEncoderLayer(config), (None, None)),
                                    ("decoder", TransformerDecoderLayer(config, own_kv=False), kv.chunk(2, 2))):
        layer = layer.to(dev).train()
        o = layer.options(name == "decoder", True)
        params = [p.detach() for block in layer.blocks() for p in block]
        options = (",".join(o.kinds), o.hidden, o.ffn, o.heads, o.scale, o.eps, o.pre_ln, o.activation, o.dropout,
                   o.attn_dropout, o.activation_dropout, o.causal, o.recompute)
        inputs = (x, None, *encoder_kv, None, params)
        forward, backward = ({"operator": op, "layer": name} for op in ("lsmini::layer", "lsmini::layer_backward"))
        for graphs in (False, True):
            column = f"graphs {'on' if graphs else 'off'} µs"
            before = set_layer_graphs(graphs)
            with torch.no_grad():  # as the compiled graph calls them
                y, state = layer_op(*inputs, *options)  # backward reads this state every time
                forward[column] = host_us(lambda: layer_op(*inputs, *options), calls)
                backward[column] = host_us(lambda: layer_backward_op(y, state, *inputs, *options), calls)
            set_layer_graphs(before)
        rows += [forward, backward]
    return [{k: f"{v:.1f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]


if __name__ == "__main__":
    main()
