#!/usr/bin/env python3
"""Export a GPT-2 124M-shaped model (the nanoGPT of gen_train_refs.py: 12 layers, 12 heads,
width 768, vocab 50257, 1024 positions; random weights) with PyTorch's TorchScript exporter,
for the load benchmark in BENCHMARKS.md:

    /tmp/pyref/bin/python tools/export_gpt2_124m.py runs/gpt2_124m_torchscript.onnx
"""
import importlib.util
import os
import sys

import torch

spec = importlib.util.spec_from_file_location("refs", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen_train_refs.py"))
refs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refs)

torch.manual_seed(0)
model = refs.GPT(vocab=50257, ctx=1024, d=768, layers=12, heads=12).eval()
ids = torch.randint(0, 50257, (1, 64))
out = sys.argv[1]
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
torch.onnx.export(model, (ids,), out, dynamo=False, opset_version=17, input_names=["input_ids"], output_names=["logits"],
                  dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
print(out, os.path.getsize(out), "bytes")
