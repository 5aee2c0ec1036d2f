#!/usr/bin/env python3
"""PyTorch's gradients of SqueezeNet 1.1 for `tests/integration/squeezenet_gradients.rs`, independent of
our code: torchvision's own `squeezenet1_1` module with the weights of the refkit ONNX file
(same parameter names) in eval mode (the file has no Dropout: it was exported for
inference), a seeded batch of 2 images and labels, mean cross-entropy, one backward in
float64 (and float32 for the record). Written to
`crates/burn-onnx-train/tests/data/squeezenet_grads/`: `batch.npz` (input, target),
`grads.npz` (the gradients of the first convolution, one fire module's three
convolutions, a late 3x3 expand and the classifier's bias, stored as float32),
`loss.json`.

    /tmp/pyref/bin/pip install torch torchvision onnx numpy
    /tmp/pyref/bin/python tools/gen_squeezenet_grads.py
"""
import json
import os

import numpy as np
import onnx
import torch
import torchvision
from onnx import numpy_helper

torch.set_num_threads(1)
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "burn-onnx-train", "tests", "data")
model_path = os.path.join(root, "refkit", "models", "squeezenet1_1_dynbatch.onnx")
out = os.path.join(root, "squeezenet_grads")
os.makedirs(out, exist_ok=True)

weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(model_path).graph.initializer}
rng = np.random.default_rng(2024)
x = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
target = np.array([3, 997], dtype=np.int64)
kept = ["features.0.weight", "features.0.bias", "features.3.squeeze.weight", "features.3.expand1x1.weight",
        "features.3.expand3x3.weight", "features.3.expand3x3.bias", "features.12.expand3x3.weight",
        "classifier.1.bias"]

results = {}
for dtype in (torch.float64, torch.float32):
    net = torchvision.models.squeezenet1_1(num_classes=1000)
    missing = set(net.state_dict()) ^ set(weights)
    assert not missing, f"names differ: {missing}"
    net.load_state_dict(weights)
    net = net.to(dtype).eval()
    loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x).to(dtype)), torch.from_numpy(target))
    loss.backward()
    params = dict(net.named_parameters())
    results[dtype] = (loss.item(), {k: params[k].grad.numpy().astype(np.float64) for k in kept})

loss64, grads64 = results[torch.float64]
loss32, grads32 = results[torch.float32]
np.savez(os.path.join(out, "batch.npz"), input=x, target=target)
np.savez(os.path.join(out, "grads.npz"), **{k: g.astype(np.float32) for k, g in grads64.items()})
rel = max(float(np.abs(grads32[k] - grads64[k]).max() / np.abs(grads64[k]).max()) for k in kept)
with open(os.path.join(out, "loss.json"), "w") as f:
    json.dump({"loss_fp64": loss64, "loss_fp32": loss32, "grad_fp32_vs_fp64_max_rel_to_max": rel}, f, indent=1)
print("loss", loss64, "fp32 vs fp64 gradients, max |diff| / max |grad|:", rel)
