#!/usr/bin/env python3
"""PyTorch 2.x CPU reference for BENCHMARKS.md: train the SAME ONNX files our examples
train (converted with onnx2torch), same batch, same optimizer, same thread count, and
report throughput over the last half of the steps, like our perf.json.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch onnx2torch onnx numpy
    /tmp/torchvenv/bin/python tools/torch_bench.py gpt2 runs/gpt2/gpt2.onnx --batch 8 --seq 64 --steps 30
    /tmp/torchvenv/bin/python tools/torch_bench.py squeezenet crates/burn-onnx-train/tests/data/refkit/models/squeezenet1_1_dynbatch.onnx --batch 8 --steps 20

`--native` trains PyTorch's own module of the same architecture instead of the converted
file: torchvision's `squeezenet1_1`, or for gpt2 transformers' `GPT2LMHeadModel` with the
file's sizes (vocabulary, width, positions and layers read from its initializers, `--heads`
given; no dropout, as the exported graph has none). `--max-norm 0` turns clipping off.
"""
import argparse
import json
import time

import onnx
import torch
from onnx2torch import convert
from onnx2torch.node_converters.registry import add_converter
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult, onnx_mapping_from_node


class LessOrEqual(torch.nn.Module):
    def forward(self, a, b):
        return torch.le(a, b)


# onnx2torch 1.5 has no LessOrEqual converter (used by the GPT-2 causal mask).
@add_converter(operation_type="LessOrEqual", version=16)
def _less_or_equal(node, graph):
    return OperationConverterResult(torch_module=LessOrEqual(), onnx_mapping=onnx_mapping_from_node(node))

p = argparse.ArgumentParser()
p.add_argument("kind", choices=["gpt2", "squeezenet"])
p.add_argument("model")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--native", action="store_true", help="PyTorch's own module (torchvision / transformers)")
p.add_argument("--heads", type=int, default=4, help="gpt2 --native: attention heads")
p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (0: none)")
args = p.parse_args()


def native_gpt2(path, heads):
    """transformers' GPT2LMHeadModel with the sizes of the GPT-2 ONNX file at `path`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shapes = {t.name: list(t.dims) for t in onnx.load(path, load_external_data=False).graph.initializer}
    wte = next(v for k, v in shapes.items() if k.endswith("wte.weight"))
    wpe = next(v for k, v in shapes.items() if k.endswith("wpe.weight"))
    layers = len({k.split(".h.")[1].split(".")[0] for k in shapes if ".h." in k})
    config = GPT2Config(vocab_size=wte[0], n_embd=wte[1], n_positions=wpe[0], n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return lambda ids: model(ids).logits, model


torch.set_num_threads(args.threads)
torch.manual_seed(0)
if args.native and args.kind == "gpt2":
    forward, net = native_gpt2(args.model, args.heads)
    net.train()
elif args.native:
    import torchvision
    net = torchvision.models.squeezenet1_1(num_classes=1000).train()
    forward = net
else:
    net = convert(onnx.load(args.model)).train()
    forward = net
opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
times, losses = [], []
for step in range(args.steps):
    if args.kind == "gpt2":
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        t = time.perf_counter()
        logits = forward(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        items = args.batch * args.seq
    else:
        x = torch.randn(args.batch, 3, 224, 224)
        y = torch.randint(0, 10, (args.batch,))
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        items = args.batch
    opt.zero_grad()
    loss.backward()
    if args.max_norm > 0:
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_norm)
    opt.step()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
half = times[len(times) // 2:]
print(json.dumps({
    "framework": f"torch {torch.__version__}" + (" native" if args.native else " onnx2torch"), "model": args.model, "batch": args.batch,
    "seq": args.seq if args.kind == "gpt2" else None, "threads": torch.get_num_threads(),
    "avg_update_ms": 1000 * sum(half) / len(half),
    "throughput_per_sec": items * len(half) / sum(half),
    "first_loss": losses[0], "last_loss": losses[-1],
}))
