#!/usr/bin/env python3
"""Two copies of one small MLP (8 -> 16 -> 4, random weights) for
`crates/burn-onnx-train/tests/integration/graph_loss.rs`: `mlp_logits.onnx` ends in its logits (the
runner attaches cross-entropy), `mlp_sce.onnx` ends in its own SoftmaxCrossEntropyLoss
over a `labels` input (ORT Training's way, `loss = "graph"`).

    /tmp/venv/bin/python tools/gen_graph_loss_fixtures.py
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "burn-onnx-train", "tests", "data", "graph_loss")
rng = np.random.default_rng(5)
inits = [numpy_helper.from_array(a, n) for n, a in [
    ("w1", (rng.standard_normal((8, 16)) * 0.4).astype(np.float32)),
    ("b1", (rng.standard_normal(16) * 0.1).astype(np.float32)),
    ("w2", (rng.standard_normal((16, 4)) * 0.4).astype(np.float32)),
    ("b2", (rng.standard_normal(4) * 0.1).astype(np.float32))]]
body = [helper.make_node("Gemm", ["input", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"])]
x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])
for name, nodes, inputs, outputs in [
    ("mlp_logits", body, [x], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])]),
    ("mlp_sce", body + [helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"],
                                         reduction="mean")],
     [x, helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
     [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]),
]:
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, initializer=inits),
                              opset_imports=[helper.make_opsetid("", 13)], producer_name="gen_graph_loss_fixtures")
    onnx.checker.check_model(model)
    onnx.save(model, os.path.join(OUT, name + ".onnx"))
print("wrote", OUT)
