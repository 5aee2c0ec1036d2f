#!/usr/bin/env python3
"""The GPU benchmark's PyTorch side (`tools/gpu/check.sh`): the nanoGPT-style GPT-2 of
tools/gen_train_refs.py at a given size, on one CUDA GPU.

    python3 tools/gpu/torch_gpt2.py export OUT.onnx --layers 12 --heads 12 --width 768
    python3 tools/gpu/torch_gpt2.py train --layers 12 --heads 12 --width 768 \
        --batch 8 --seq 256 --steps 20 --precision bf16

`export` writes the model with random weights through PyTorch's TorchScript exporter (the
file `onnx-train` trains in the same run); `train` trains the same module with AdamW,
bf16 autocast for `--precision bf16` (f32 master weights, like onnx-train's bf16), and
prints one JSON line: tokens per second over the last half of the updates (as onnx-train's
perf.json) and the peak memory PyTorch's allocator held.

`--variant` picks the PyTorch a user would run: `eager` is the module as written
(hand-written attention: matmul, masked_fill, softmax, matmul; GELU as five ops; AdamW's
foreach update), `fast` the same weights through `F.scaled_dot_product_attention` (causal),
`F.gelu(approximate="tanh")` and the fused AdamW, `compile` the `fast` module under
`torch.compile` (its compilation falls in the unmeasured first half of the updates).
"""
import argparse
import importlib.util
import json
import os
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("refs", os.path.join(here, "..", "gen_train_refs.py"))
refs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refs)
# gen_train_refs pins one thread and deterministic kernels for its references; not here.
torch.use_deterministic_algorithms(False)
torch.set_num_threads(os.cpu_count() or 1)

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["export", "train"])
p.add_argument("out", nargs="?")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--width", type=int, default=128)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--ctx", type=int, default=1024)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
p.add_argument("--variant", choices=["eager", "fast", "compile"], default="eager")
a = p.parse_args()


def fast_block_forward(self, x):
    """`refs.Block.forward` with PyTorch's fused attention and GELU (same weights, same
    function up to rounding)."""
    b, t, d = x.shape
    h = self.heads
    q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
    m = torch.nn.functional.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
    return x + self.mlp.c_proj(m)


if a.variant != "eager":
    refs.Block.forward = fast_block_forward

torch.manual_seed(0)
model = refs.GPT(vocab=a.vocab, ctx=a.ctx, d=a.width, layers=a.layers, heads=a.heads)
if a.mode == "export":
    ids = torch.randint(0, a.vocab, (1, 16))
    torch.onnx.export(model.eval(), (ids,), a.out, dynamo=False, opset_version=17,
                      input_names=["input_ids"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    raise SystemExit(0)

dev = torch.device("cuda")
model = model.to(dev).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=a.variant != "eager")
params = sum(p.numel() for p in model.parameters())
if a.variant == "compile":
    model = torch.compile(model)
gen = torch.Generator(device="cpu").manual_seed(0)
batches = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev) for _ in range(4)]
torch.cuda.reset_peak_memory_stats()
times = []
for step in range(a.steps):
    ids = batches[step % len(batches)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
        loss = refs.lm_loss(model(ids), ids)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
measured = times[len(times) // 2:]
ms = 1000 * sum(measured) / len(measured)
print(json.dumps({
    "variant": a.variant,
    "parameters": params,
    "avg_update_ms": ms,
    "tokens_per_sec": a.batch * a.seq / (ms / 1000),
    "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
    "final_loss": float(loss),
}))
