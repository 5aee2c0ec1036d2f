#!/usr/bin/env python3
"""Models of the random generators for `crates/burn-onnx-train/tests/integration/random_ops.rs` (which
checks what they draw against the distributions' closed forms):

- `draws.onnx`: RandomUniform [200, 500] on [-2, 3), RandomNormal [200, 500] with mean 1 and
  scale 2 (seed attribute 3), RandomNormalLike and RandomUniformLike of the input `x`
  [300, 400], Bernoulli of the probabilities `p` [4, 10000] (as floats and as bool),
  Multinomial of the logits `logits` [2, 4] (20000 samples, int64);
- `reparam.onnx`: a VAE's reparameterisation `z = mu + exp(0.5 logvar) * eps` with
  `eps = RandomNormalLike(mu)`, `mu` and `logvar` trainable initializers [8, 16].

    /tmp/venv/bin/python tools/gen_random_fixtures.py
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "burn-onnx-train", "tests", "data", "random")
F, I, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
rng = np.random.default_rng(5)


def save(name, nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              initializer=[numpy_helper.from_array(a, n) for n, a in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="gen_random_fixtures")
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, os.path.join(OUT, name + ".onnx"))


save("draws",
     [helper.make_node("RandomUniform", [], ["u"], shape=[200, 500], low=-2.0, high=3.0),
      helper.make_node("RandomNormal", [], ["n"], shape=[200, 500], mean=1.0, scale=2.0, seed=3.0),
      helper.make_node("RandomNormalLike", ["x"], ["nl"]),
      helper.make_node("RandomUniformLike", ["x"], ["ul"]),
      helper.make_node("Bernoulli", ["p"], ["b"]),
      helper.make_node("Bernoulli", ["p"], ["bb"], dtype=B),
      helper.make_node("Multinomial", ["logits"], ["m"], sample_size=20000, dtype=I)],
     [helper.make_tensor_value_info("x", F, [300, 400]),
      helper.make_tensor_value_info("p", F, [4, 10000]),
      helper.make_tensor_value_info("logits", F, [2, 4])],
     [helper.make_tensor_value_info("u", F, [200, 500]),
      helper.make_tensor_value_info("n", F, [200, 500]),
      helper.make_tensor_value_info("nl", F, [300, 400]),
      helper.make_tensor_value_info("ul", F, [300, 400]),
      helper.make_tensor_value_info("b", F, [4, 10000]),
      helper.make_tensor_value_info("bb", B, [4, 10000]),
      helper.make_tensor_value_info("m", I, [2, 20000])])

save("reparam",
     [helper.make_node("RandomNormalLike", ["mu"], ["eps"]),
      helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
      helper.make_node("Mul", ["logvar", "half"], ["hl"]),
      helper.make_node("Exp", ["hl"], ["std"]),
      helper.make_node("Mul", ["std", "eps"], ["noise"]),
      helper.make_node("Add", ["mu", "noise"], ["z"])],
     [],
     [helper.make_tensor_value_info("z", F, [8, 16])],
     [("mu", rng.standard_normal((8, 16)).astype(np.float32)),
      ("logvar", (0.5 * rng.standard_normal((8, 16))).astype(np.float32))])
