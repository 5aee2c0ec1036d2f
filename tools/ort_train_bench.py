#!/usr/bin/env python3
"""onnxruntime-training reference for BENCHMARKS.md: train a GPT-2 ONNX file (logits
[batch, seq, vocab] from input_ids) with onnxruntime-training's on-device training API,
AdamW, no clipping, on --threads intra-op threads, and print the same JSON line as
tools/torch_bench.py (avg_update_ms over the last half of the steps).

The loss is ORT's built-in SoftmaxCrossEntropyLoss over every position, the logits
reshaped to [batch * seq, vocab] (a Reshape node appended to the graph) against the next
token: the work of our `lm_cross_entropy` (which drops the last position) plus one row.

    python3 -m venv /tmp/ortt && /tmp/ortt/bin/pip install onnxruntime-training onnx==1.16.2 numpy
    /tmp/ortt/bin/python tools/ort_train_bench.py MODEL.onnx --batch 4 --seq 128 --steps 30

onnxruntime-training 1.19 imports torch when its `training` package loads: the venv needs
torch too (or a .pth file pointing at a venv that has it; its own onnxruntime must not
shadow onnxruntime-training's). onnx 1.16 keeps the optimizer graph at IR version 10,
the newest onnxruntime 1.19 loads.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--vocab", type=int, default=1024)
args = p.parse_args()

import onnxruntime as ort  # noqa: E402
from onnxruntime.training import artifacts  # noqa: E402
from onnxruntime.training.api import CheckpointState, Module, Optimizer  # noqa: E402

ort.set_default_logger_severity(3)

work = tempfile.mkdtemp(prefix="ort-train-bench.")
model = onnx.load(args.model)
g = model.graph
logits = g.output[0].name
g.initializer.append(numpy_helper.from_array(np.array([-1, args.vocab], dtype=np.int64), "bench_rows_shape"))
g.node.append(helper.make_node("Reshape", [logits, "bench_rows_shape"], ["bench_rows"]))
del g.output[:]
g.output.append(helper.make_tensor_value_info("bench_rows", onnx.TensorProto.FLOAT, ["rows", args.vocab]))
# ORT's LayerNormalization gradient reads the saved mean and inverse deviation, optional
# outputs the exporters leave off: name them.
for i, node in enumerate(g.node):
    if node.op_type == "LayerNormalization" and len(node.output) == 1:
        node.output.extend([f"bench_ln{i}_mean", f"bench_ln{i}_inv_std"])
trainable = [t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT and t.name != "bench_rows_shape"]
artifacts.generate_artifacts(
    model,
    requires_grad=trainable,
    frozen_params=[],
    loss=artifacts.LossType.CrossEntropyLoss,
    optimizer=artifacts.OptimType.AdamW,
    artifact_directory=work,
)

opts = ort.SessionOptions()
opts.intra_op_num_threads = args.threads
opts.inter_op_num_threads = 1
state = CheckpointState.load_checkpoint(os.path.join(work, "checkpoint"))
module = Module(os.path.join(work, "training_model.onnx"), state, os.path.join(work, "eval_model.onnx"), session_options=opts)
optimizer = Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
optimizer.set_learning_rate(1e-3)
module.train()
rng = np.random.default_rng(0)
times, losses = [], []
for step in range(args.steps):
    ids = rng.integers(0, args.vocab, (args.batch, args.seq), dtype=np.int64)
    labels = np.roll(ids, -1, axis=1).reshape(-1)
    t = time.perf_counter()
    loss = module(ids, labels)
    optimizer.step()
    module.lazy_reset_grad()
    times.append(time.perf_counter() - t)
    losses.append(float(loss))
half = times[len(times) // 2 :]
ms = 1000 * sum(half) / len(half)
print(json.dumps({
    "framework": f"onnxruntime-training {ort.__version__}",
    "avg_update_ms": ms,
    "throughput_per_sec": args.batch * args.seq * 1000 / ms,
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "threads": args.threads,
}))
