#!/usr/bin/env python3
"""Models with the initializer ties TorchScript exports make, for
`crates/burn-onnx-train/tests/integration/initializer_ties.rs` (which computes its expectations in
closed form):

- `tied_lm_head.onnx`: an embedding table `E` read by Gather, and its transposed copy `W`
  (a separate initializer, as TorchScript folds GPT-2's `lm_head`) read by MatMul;
- `merged_norm.onnx`: two LayerNormalization nodes sharing one all-ones scale (the second
  through an `Identity` node) and one all-zeros bias;
- `merged_bn_stats.onnx`: two BatchNormalization nodes on two inputs sharing one running
  mean (zeros) and variance (ones), each read through its own `Identity` node;
- `folded_mask.onnx`: a causal mask of finfo.min folded into an initializer (a constant).

    /tmp/venv/bin/python tools/gen_tie_fixtures.py
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "burn-onnx-train", "tests", "data", "ties")
rng = np.random.default_rng(77)
F, I = TensorProto.FLOAT, TensorProto.INT64


def save(name, nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              initializer=[numpy_helper.from_array(a, n) for n, a in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="gen_tie_fixtures")
    onnx.checker.check_model(model)
    onnx.save(model, os.path.join(OUT, name + ".onnx"))


# 32 x 16: big enough that float sums over E and over its transpose differ in the last bits
# (an order-dependent fingerprint would miss the tie, as it did on real GPT-2 exports).
E = rng.standard_normal((32, 16)).astype(np.float32)
save("tied_lm_head",
     [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"])],
     [helper.make_tensor_value_info("ids", I, [4])],
     [helper.make_tensor_value_info("y", F, [4, 32])],
     [("E", E), ("W", np.ascontiguousarray(E.T))])

save("merged_norm",
     [helper.make_node("LayerNormalization", ["x", "S", "B"], ["a"]),
      helper.make_node("MatMul", ["a", "M"], ["b"]),
      helper.make_node("Identity", ["S"], ["S_alias"]),
      helper.make_node("LayerNormalization", ["b", "S_alias", "B"], ["y"])],
     [helper.make_tensor_value_info("x", F, [2, 4])],
     [helper.make_tensor_value_info("y", F, [2, 4])],
     [("S", np.ones(4, np.float32)), ("B", np.zeros(4, np.float32)),
      ("M", rng.standard_normal((4, 4)).astype(np.float32))])

save("merged_bn_stats",
     [helper.make_node("Identity", ["mean"], ["mean_1"]),
      helper.make_node("Identity", ["var"], ["var_1"]),
      helper.make_node("Identity", ["mean"], ["mean_2"]),
      helper.make_node("Identity", ["var"], ["var_2"]),
      helper.make_node("BatchNormalization", ["x1", "s1", "b1", "mean_1", "var_1"], ["y1"]),
      helper.make_node("BatchNormalization", ["x2", "s2", "b2", "mean_2", "var_2"], ["y2"])],
     [helper.make_tensor_value_info("x1", F, [3, 2, 2, 2]),
      helper.make_tensor_value_info("x2", F, [3, 2, 2, 2])],
     [helper.make_tensor_value_info("y1", F, [3, 2, 2, 2]),
      helper.make_tensor_value_info("y2", F, [3, 2, 2, 2])],
     [("s1", rng.standard_normal(2).astype(np.float32)), ("b1", rng.standard_normal(2).astype(np.float32)),
      ("s2", rng.standard_normal(2).astype(np.float32)), ("b2", rng.standard_normal(2).astype(np.float32)),
      ("mean", np.zeros(2, np.float32)), ("var", np.ones(2, np.float32))], opset=15)
print("wrote", OUT)

# A causal mask folded into an initializer (dynamo at fixed shapes): finfo(float32).min above
# the diagonal. It is a constant, not a parameter.
mask = np.triu(np.full((4, 4), np.finfo(np.float32).min, np.float32), 1)
save("folded_mask",
     [helper.make_node("MatMul", ["x", "W"], ["s"]), helper.make_node("Add", ["s", "mask"], ["m"]),
      helper.make_node("Softmax", ["m"], ["y"], axis=-1)],
     [helper.make_tensor_value_info("x", F, [4, 4])],
     [helper.make_tensor_value_info("y", F, [4, 4])],
     [("W", rng.standard_normal((4, 4)).astype(np.float32)), ("mask", mask)])
print("wrote folded_mask")
