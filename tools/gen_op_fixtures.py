#!/usr/bin/env python3
"""Generate small ONNX models exercising single ops (opsets 11-20) and record what
onnxruntime computes on seeded inputs. The outputs are the independent reference for
`crates/burn-onnx-train/tests/integration/ops.rs`.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install onnx onnxruntime numpy
    /tmp/venv/bin/python tools/gen_op_fixtures.py [CASE ...]

With case names, writes only those cases (every case's random inputs are still drawn, so
they get the same data as in a full run).

Writes `crates/burn-onnx-train/tests/data/ops/<case>.onnx` and `<case>.npz` (arrays
`in_<input>` and `out_<output>`). Cases whose outputs are random (training-mode dropout)
store only the inputs.
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "burn-onnx-train", "tests", "data", "ops")
rng = np.random.default_rng(1234)
F, I = TensorProto.FLOAT, TensorProto.INT64
ONLY = set(sys.argv[1:])


def wanted(case):
    return not ONLY or case in ONLY


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def save(case, nodes, inputs, outputs, feeds, opset, inits=(), run=True):
    if not wanted(case):
        return
    graph = helper.make_graph(
        nodes, case,
        [vi(n, F if a.dtype == np.float32 else (TensorProto.BOOL if a.dtype == bool else I), list(a.shape)) for n, a in inputs],
        [vi(n, e, None) for n, e in outputs],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="gen_op_fixtures")
    model.ir_version = 8 if opset <= 17 else 9
    # Output shapes are left unknown on purpose (the importer must not need them), which
    # the checker of onnx 1.23 refuses; onnxruntime below is the real check.
    path = os.path.join(OUT, case + ".onnx")
    onnx.save(model, path)
    arrays = {f"in_{n}": a for n, a in inputs}
    if run:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        res = sess.run([o for o, _ in outputs], dict(feeds))
        arrays.update({f"out_{o}": r for (o, _), r in zip(outputs, res)})
    np.savez(os.path.join(OUT, case + ".npz"), **arrays)
    print("wrote", case)


def single(case, op, ins, outs, opset, inits=(), out_elem=F, **attrs):
    """One node; `ins` is a list of (name, array) fed at run time; `inits` are initializers."""
    names = [n for n, _ in ins] + [n for n, _ in inits]
    node = helper.make_node(op, names if not attrs.get("_input_order") else attrs.pop("_input_order"), [o for o in outs], **attrs)
    save(case, [node], ins, [(o, out_elem) for o in outs], ins, opset, inits)


os.makedirs(OUT, exist_ok=True)

# --- opset 18+ forms -------------------------------------------------------------------
x = rand(2, 7, 3)
single("split_num_outputs_18", "Split", [("x", x)], ["a", "b", "c"], 18, axis=1, num_outputs=3)
single("split_sizes_input_13", "Split", [("x", x)], ["a", "b"], 13, inits=[("split", np.array([2, 5], np.int64))], axis=1)
single("reduce_mean_axes_input_18", "ReduceMean", [("x", rand(2, 3, 4, 5))], ["y"], 18,
       inits=[("axes", np.array([1, -1], np.int64))], keepdims=1)
single("reduce_mean_axes_attr_13", "ReduceMean", [("x", rand(2, 3, 4))], ["y"], 13, axes=[-1], keepdims=0)
single("reduce_sum_axes_input_13", "ReduceSum", [("x", rand(2, 3, 4))], ["y"], 13,
       inits=[("axes", np.array([0, 2], np.int64))], keepdims=0)
single("reduce_max_18", "ReduceMax", [("x", rand(3, 4, 5))], ["y"], 18, inits=[("axes", np.array([1], np.int64))])
single("layer_norm_last_axis_17", "LayerNormalization", [("x", rand(2, 5, 8))], ["y"], 17,
       inits=[("scale", rand(8)), ("bias", rand(8))], axis=-1, epsilon=1e-5)
single("layer_norm_two_axes_17", "LayerNormalization", [("x", rand(2, 3, 4, 5))], ["y"], 17,
       inits=[("scale", rand(4, 5)), ("bias", rand(4, 5))], axis=-2, epsilon=1e-3)
single("gelu_exact_20", "Gelu", [("x", rand(3, 17) * 3)], ["y"], 20)
single("gelu_tanh_20", "Gelu", [("x", rand(3, 17) * 3)], ["y"], 20, approximate="tanh")
single("batch_norm_training_15", "BatchNormalization", [("x", rand(4, 3, 5, 5) * 2 + 1)], ["y", "running_mean", "running_var"], 15,
       inits=[("scale", rand(3)), ("bias", rand(3)), ("mean", rand(3)), ("var", np.abs(rand(3)) + 0.5)],
       training_mode=1, momentum=0.8, epsilon=1e-5)
single("batch_norm_inference_15", "BatchNormalization", [("x", rand(2, 3, 4))], ["y"], 15,
       inits=[("scale", rand(3)), ("bias", rand(3)), ("mean", rand(3)), ("var", np.abs(rand(3)) + 0.5)])
# Dropout in training mode: random, so only inputs are stored; the test checks the mask statistics.
save("dropout_training_13",
     [helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"])],
     [("x", np.ones((64, 64), np.float32))], [("y", F), ("mask", TensorProto.BOOL)], [], 13,
     inits=[("ratio", np.array(0.25, np.float32)), ("training", np.array(True))], run=False)
single("dropout_inference_13", "Dropout", [("x", rand(4, 5))], ["y"], 13, inits=[("ratio", np.array(0.5, np.float32))])

# --- convolution and pooling -------------------------------------------------------------
single("conv1d_pads_13", "Conv", [("x", rand(2, 3, 11))], ["y"], 13, inits=[("w", rand(4, 3, 3)), ("b", rand(4))], pads=[1, 2], strides=[2])
single("conv2d_group_dilation_13", "Conv", [("x", rand(1, 4, 9, 8))], ["y"], 13,
       inits=[("w", rand(6, 2, 3, 3))], group=2, dilations=[2, 1], strides=[1, 2], pads=[1, 0, 2, 1])
single("conv2d_same_upper_13", "Conv", [("x", rand(1, 2, 7, 7))], ["y"], 13, inits=[("w", rand(3, 2, 4, 4)), ("b", rand(3))],
       auto_pad="SAME_UPPER", strides=[2, 2])
single("avgpool_pads_13", "AveragePool", [("x", rand(1, 2, 7, 6))], ["y"], 13, kernel_shape=[3, 2], pads=[1, 1, 1, 0], strides=[2, 2], count_include_pad=1)
single("avgpool_exclude_pad_13", "AveragePool", [("x", rand(1, 2, 7, 6))], ["y"], 13, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
single("maxpool_ceil_13", "MaxPool", [("x", rand(1, 2, 8, 8))], ["y"], 13, kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
single("maxpool1d_13", "MaxPool", [("x", rand(2, 3, 10))], ["y"], 13, kernel_shape=[3], strides=[2], pads=[1, 1])
single("global_max_pool_13", "GlobalMaxPool", [("x", rand(2, 3, 4, 5))], ["y"], 13)

# --- indexing and movement ---------------------------------------------------------------
single("gather_axis1_negative_13", "Gather", [("x", rand(3, 5, 2))], ["y"], 13, inits=[("idx", np.array([[0, -1], [2, 4]], np.int64))], axis=1)
single("slice_negative_steps_13", "Slice", [("x", rand(5, 6, 4))], ["y"], 13,
       inits=[("starts", np.array([-1, 1], np.int64)), ("ends", np.array([-100, 6], np.int64)),
              ("axes", np.array([0, 1], np.int64)), ("steps", np.array([-2, 2], np.int64))])
single("transpose_13", "Transpose", [("x", rand(2, 3, 4, 5))], ["y"], 13, perm=[0, 2, 3, 1])
single("expand_13", "Expand", [("x", rand(3, 1))], ["y"], 13, inits=[("shape", np.array([2, 1, 4], np.int64))])
single("unsqueeze_attr_11", "Unsqueeze", [("x", rand(3, 4))], ["y"], 11, axes=[0, -1])
single("squeeze_input_13", "Squeeze", [("x", rand(1, 3, 1, 4))], ["y"], 13, inits=[("axes", np.array([2], np.int64))])
single("flatten_axis2_13", "Flatten", [("x", rand(2, 3, 4, 5))], ["y"], 13, axis=2)
single("softmax_axis1_opset11", "Softmax", [("x", rand(2, 3, 4))], ["y"], 11, axis=1)
single("log_softmax_13", "LogSoftmax", [("x", rand(2, 3, 4))], ["y"], 13, axis=1)
single("matmul_vec_batched_13", "MatMul", [("a", rand(4)), ("b", rand(2, 4, 3))], ["y"], 13)
single("matmul_broadcast_batch_13", "MatMul", [("a", rand(2, 1, 3, 4)), ("b", rand(5, 4, 2))], ["y"], 13)
single("gemm_trans_alpha_13", "Gemm", [("a", rand(4, 3)), ("b", rand(5, 4))], ["y"], 13, inits=[("c", rand(5))], transA=1, transB=1, alpha=0.5, beta=2.0)
single("where_broadcast_13", "Where", [("x", rand(2, 3)), ("y_in", rand(3))], ["y"], 13,
       _input_order=["cond", "x", "y_in"], inits=[("cond", np.array([[True, False, True], [False, False, True]]))])
single("clip_13", "Clip", [("x", rand(3, 4) * 3)], ["y"], 13, inits=[("lo", np.array(-1.0, np.float32)), ("hi", np.array(0.5, np.float32))])
single("pow_tensor_13", "Pow", [("x", np.abs(rand(3, 4)) + 0.1), ("p", rand(4))], ["y"], 13)

# --- a small chain with shape arithmetic ---------------------------------------------------
nodes = [
    helper.make_node("Shape", ["x"], ["s"]),
    helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
    helper.make_node("Range", ["zero_s", "b", "one_s"], ["r"]),
    helper.make_node("Cast", ["r"], ["rf"], to=F),
    helper.make_node("Unsqueeze", ["rf", "ax1"], ["rf2"]),
    helper.make_node("Mul", ["x", "rf2"], ["xm"]),
    helper.make_node("ConstantOfShape", ["s"], ["ones"], value=helper.make_tensor("v", F, [1], [2.0])),
    helper.make_node("Div", ["xm", "ones"], ["xd"]),
    helper.make_node("Sigmoid", ["xd"], ["sg"]),
    helper.make_node("Erf", ["sg"], ["er"]),
    helper.make_node("Sqrt", ["er"], ["y"]),
]
xc = rand(3, 4)
save("shape_chain_13", nodes, [("x", xc)], [("y", F)], [("x", xc)], 13,
     inits=[("zero", np.array(0, np.int64)), ("zero_s", np.array(0, np.int64)), ("one_s", np.array(1, np.int64)), ("ax1", np.array([1], np.int64))])


# PyTorch's running-variance convention for the training-mode batch norm case (unbiased
# batch variance), computed here with numpy as the reference for the model's state update.
if wanted("batch_norm_training_15"):
    path = os.path.join(OUT, "batch_norm_training_15.npz")
    arrays = dict(np.load(path))
    m = onnx.load(os.path.join(OUT, "batch_norm_training_15.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    xb = arrays["in_x"]
    arrays["state_running_var"] = (inits["var"] * 0.8 + xb.var(axis=(0, 2, 3), ddof=1) * 0.2).astype(np.float32)
    arrays["state_running_mean"] = (inits["mean"] * 0.8 + xb.mean(axis=(0, 2, 3)) * 0.2).astype(np.float32)
    np.savez(path, **arrays)
    print("added PyTorch-convention running statistics to batch_norm_training_15")

# --- more ops seen in other exporters' files -------------------------------------------------
xs = rand(3, 5) * 3
for op in ["Sin", "Cos", "Floor", "Ceil", "Round", "Sign"]:
    single(f"{op.lower()}_13", op, [("x", xs)], ["y"], 13)
single("prelu_13", "PRelu", [("x", rand(2, 3, 4))], ["y"], 13, inits=[("slope", rand(3, 1))])
single("hard_swish_14", "HardSwish", [("x", rand(3, 7) * 4)], ["y"], 14)
single("mod_int_13", "Mod", [("a", np.array([[7, -7, 5], [-5, 9, -9]], np.int64)), ("b", np.array([3, 3, -2], np.int64))], ["y"], 13, out_elem=I)
single("fmod_float_13", "Mod", [("a", rand(2, 3) * 5), ("b", np.abs(rand(3)) + 0.5)], ["y"], 13, fmod=1)
single("pad_constant_18", "Pad", [("x", rand(2, 3, 4))], ["y"], 18,
       inits=[("pads", np.array([1, 2, 0, 1], np.int64)), ("value", np.array(1.5, np.float32)), ("axes", np.array([1, 2], np.int64))])
single("pad_reflect_13", "Pad", [("x", rand(1, 2, 4, 5))], ["y"], 13, inits=[("pads", np.array([0, 0, 2, 1, 0, 0, 1, 3], np.int64))], mode="reflect")
single("pad_edge_negative_13", "Pad", [("x", rand(3, 6))], ["y"], 13, inits=[("pads", np.array([2, -1, 1, -2], np.int64))], mode="edge")
single("tile_13", "Tile", [("x", rand(2, 3))], ["y"], 13, inits=[("reps", np.array([2, 3], np.int64))])
single("cumsum_13", "CumSum", [("x", rand(3, 4))], ["y"], 13, inits=[("axis", np.array(1, np.int64))])
single("cumsum_exclusive_reverse_13", "CumSum", [("x", rand(3, 4))], ["y"], 13, inits=[("axis", np.array(0, np.int64))], exclusive=1, reverse=1)
single("trilu_upper_14", "Trilu", [("x", rand(2, 4, 5))], ["y"], 14, inits=[("k", np.array(1, np.int64))])
single("trilu_lower_14", "Trilu", [("x", rand(4, 4))], ["y"], 14, inits=[("k", np.array(-1, np.int64))], upper=0)
single("argmax_keepdims_13", "ArgMax", [("x", rand(3, 4, 5))], ["y"], 13, out_elem=I, axis=1)
single("argmin_last_13", "ArgMin", [("x", np.array([[1, 0, 0, 2], [3, 3, 1, 1]], np.float32))], ["y"], 13, out_elem=I, axis=1, keepdims=0, select_last_index=1)
single("instance_norm_6", "InstanceNormalization", [("x", rand(2, 3, 4, 5))], ["y"], 13, inits=[("scale", rand(3)), ("bias", rand(3))], epsilon=1e-4)
single("reduce_l2_18", "ReduceL2", [("x", rand(3, 4, 5))], ["y"], 18, inits=[("axes", np.array([2], np.int64))], keepdims=0)
single("reduce_sum_square_18", "ReduceSumSquare", [("x", rand(3, 4))], ["y"], 18, inits=[("axes", np.array([0], np.int64))])
single("reduce_log_sum_exp_18", "ReduceLogSumExp", [("x", rand(3, 4) * 10)], ["y"], 18, inits=[("axes", np.array([1], np.int64))])
single("gather_elements_13", "GatherElements", [("x", rand(3, 4))], ["y"], 13, inits=[("idx", np.array([[0, 2, -1, 1], [2, 0, 0, 1], [1, 1, 2, 0]], np.int64))], axis=0)
single("conv_transpose2d_13", "ConvTranspose", [("x", rand(1, 4, 5, 6))], ["y"], 13,
       inits=[("w", rand(4, 3, 3, 3)), ("b", rand(6))], group=2, strides=[2, 1], pads=[1, 0, 0, 2], output_padding=[1, 0])
single("conv_transpose1d_output_shape_13", "ConvTranspose", [("x", rand(2, 3, 7))], ["y"], 13,
       inits=[("w", rand(3, 2, 4))], strides=[3], output_shape=[20])
single("conv_transpose_same_upper_13", "ConvTranspose", [("x", rand(1, 2, 4, 4))], ["y"], 13, inits=[("w", rand(2, 2, 3, 3))], strides=[2, 2], auto_pad="SAME_UPPER")
single("resize_nearest_scales_13", "Resize", [("x", rand(1, 2, 3, 4))], ["y"], 13,
       _input_order=["x", "", "scales"], inits=[("scales", np.array([1, 1, 2, 1.5], np.float32))], mode="nearest")
single("resize_linear_sizes_half_pixel_13", "Resize", [("x", rand(1, 2, 4, 5))], ["y"], 13,
       _input_order=["x", "", "", "sizes"], inits=[("sizes", np.array([1, 2, 7, 3], np.int64))], mode="linear")
single("resize_linear_align_corners_13", "Resize", [("x", rand(1, 1, 3, 4))], ["y"], 13,
       _input_order=["x", "", "scales"], inits=[("scales", np.array([1, 1, 2, 2], np.float32))], mode="linear", coordinate_transformation_mode="align_corners")
single("resize_nearest_asymmetric_floor_13", "Resize", [("x", rand(1, 1, 4, 4))], ["y"], 13,
       _input_order=["x", "", "scales"], inits=[("scales", np.array([1, 1, 0.5, 1.75], np.float32))], mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")

# --- model-local functions (as PyTorch's dynamo exporter emits) ----------------------------
def const_from_attr(out, ref):
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name=ref, type=onnx.AttributeProto.FLOAT))
    return node

scaled_tanh = helper.make_function(
    "custom", "ScaledTanh", ["x"], ["y"],
    [helper.make_node("Tanh", ["x"], ["t"]), const_from_attr("a", "alpha"), helper.make_node("Mul", ["t", "a"], ["y"])],
    opset_imports=[helper.make_opsetid("", 13)], attributes=[],
    attribute_protos=[helper.make_attribute("alpha", 2.0)])
outer = helper.make_function(
    "custom", "TwoBranches", ["x", "w"], ["y"],
    [helper.make_node("ScaledTanh", ["x"], ["p"], domain="custom", alpha=0.5),
     helper.make_node("ScaledTanh", ["x"], ["q"], domain="custom"),
     helper.make_node("MatMul", ["p", "w"], ["pw"]),
     helper.make_node("Add", ["pw", "q"], ["y"])],
    opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("custom", 1)], attributes=[])
xf = rand(3, 4)
wf = rand(4, 4)
if wanted("local_functions_13"):
    graph = helper.make_graph(
        [helper.make_node("TwoBranches", ["x", "w"], ["y"], domain="custom", name="call")], "local_functions",
        [vi("x", F, [3, 4])], [vi("y", F, None)], initializer=[numpy_helper.from_array(wf, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("custom", 1)],
                              functions=[scaled_tanh, outer], producer_name="gen_op_fixtures")
    model.ir_version = 8
    path = os.path.join(OUT, "local_functions_13.onnx")
    onnx.save(model, path)
    res = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["y"], {"x": xf})
    np.savez(os.path.join(OUT, "local_functions_13.npz"), in_x=xf, out_y=res[0])
    print("wrote local_functions_13")

# --- Einsum and GroupNormalization -----------------------------------------------------------
single("einsum_attention_12", "Einsum", [("q", rand(2, 3, 4, 5)), ("k", rand(2, 3, 6, 5))], ["y"], 12, equation="bhid,bhjd->bhij")
single("einsum_three_operands_12", "Einsum", [("a", rand(3, 4)), ("b", rand(4, 5)), ("c", rand(5, 2))], ["y"], 12, equation="ij,jk,kl->il")
single("einsum_sum_transpose_12", "Einsum", [("a", rand(2, 3, 4))], ["y"], 12, equation="abc->ca")
single("einsum_implicit_outer_12", "Einsum", [("a", rand(3)), ("b", rand(4))], ["y"], 12, equation="i,j")
single("einsum_bilinear_12", "Einsum", [("x", rand(5, 3)), ("y_in", rand(5, 4))], ["y"], 12, inits=[("w", rand(2, 3, 4))], _input_order=["x", "w", "y_in"], equation="bi,oij,bj->bo")
single("group_norm_per_channel_21", "GroupNormalization", [("x", rand(2, 6, 3, 3))], ["y"], 21,
       inits=[("scale", rand(6)), ("bias", rand(6))], num_groups=3, epsilon=1e-5)

# --- GELU, tanh form, as exporters write it (8 nodes; fused into one Gelu on load) -----------
def gelu_tanh_nodes(x, y, prefix):
    c = lambda name, v: helper.make_node("Constant", [], [prefix + name], value=numpy_helper.from_array(np.array(v, np.float32)))
    return [
        c("half", 0.5), c("three", 3.0), c("cubic", 0.044715), c("k", 0.7978845608), c("one", 1.0),
        helper.make_node("Mul", [x, prefix + "half"], [prefix + "h"]),
        helper.make_node("Pow", [x, prefix + "three"], [prefix + "p"]),
        helper.make_node("Mul", [prefix + "p", prefix + "cubic"], [prefix + "m"]),
        helper.make_node("Add", [x, prefix + "m"], [prefix + "a"]),
        helper.make_node("Mul", [prefix + "k", prefix + "a"], [prefix + "s"]),
        helper.make_node("Tanh", [prefix + "s"], [prefix + "t"]),
        helper.make_node("Add", [prefix + "one", prefix + "t"], [prefix + "a1"]),
        helper.make_node("Mul", [prefix + "a1", prefix + "h"], [y]),
    ]


xg = np.random.default_rng(99).standard_normal((4, 33)).astype(np.float32) * 3
save("gelu_tanh_pattern_13", gelu_tanh_nodes("x", "y", "g_"), [("x", xg)], [("y", F)], [("x", xg)], 13)
# The Tanh output is also a graph output: the pattern must stay unfused.
save("gelu_tanh_escaping_13", gelu_tanh_nodes("x", "y", "g_"), [("x", xg)], [("y", F), ("g_t", F)], [("x", xg)], 13)

# --- Conv followed by Relu (the Relu folded into the Conv on load) ------------------------
xc2 = np.random.default_rng(7).standard_normal((2, 3, 8, 8)).astype(np.float32)
wc2 = np.random.default_rng(8).standard_normal((4, 3, 3, 3)).astype(np.float32)
bc2 = np.random.default_rng(9).standard_normal(4).astype(np.float32)
conv_relu = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
save("conv_relu_pattern_13", conv_relu, [("x", xc2)], [("y", F)], [("x", xc2)], 13, inits=[("w", wc2), ("b", bc2)])
# The Conv output is also a graph output: the Relu must stay a node of its own.
save("conv_relu_escaping_13", conv_relu, [("x", xc2)], [("y", F), ("c", F)], [("x", xc2)], 13, inits=[("w", wc2), ("b", bc2)])

# --- Where with a constant scalar branch (attention masks; run as one masked fill) --------
scores = np.random.default_rng(11).standard_normal((2, 3, 5, 5)).astype(np.float32)
causal = np.tril(np.ones((5, 5), bool)).reshape(1, 1, 5, 5)
single("where_mask_fill_13", "Where", [("x", scores)], ["y"], 13,
       _input_order=["cond", "x", "fill"], inits=[("cond", causal), ("fill", np.array(-1e4, np.float32))])
# The scalar first, and a mask broadcast over inner axes (padding, [2, 1, 1, 5] over [2, 3, 5, 5]).
padding = np.random.default_rng(12).random((2, 1, 1, 5)) < 0.5
single("where_scalar_first_padding_mask_13", "Where", [("x", scores)], ["y"], 13,
       _input_order=["cond", "fill", "x"], inits=[("cond", padding), ("fill", np.array(-3.5, np.float32))])

# --- losses: scores as parameters, integer labels; ignored positions and class weights -------
# Labels a graph input; -1 is ignore_index; the weights are a host constant (a setting).
sce_labels = np.array([[0, 4], [-1, 2], [3, -1]], np.int64)
save("sce_mean_weights_ignore_13",
     [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels", "weights"], ["loss", "log_prob"],
                       reduction="mean", ignore_index=-1)],
     [("labels", sce_labels)], [("loss", F), ("log_prob", F)], [("labels", sce_labels)], 13,
     inits=[("scores", rand(3, 5, 2)), ("weights", np.abs(rand(5)) + 0.5)])
save("nllloss_sum_weights_12",
     [helper.make_node("NegativeLogLikelihoodLoss", ["x", "target", "weight"], ["loss"],
                       reduction="sum", ignore_index=-100)],
     [], [("loss", F)], [], 12,
     inits=[("x", rand(4, 6)), ("target", np.array([5, 0, -100, 3], np.int64)), ("weight", np.abs(rand(6)) + 0.5)])

# --- opset-23 transformer ops (their own seeded generator, independent of the draws above) ---
r23 = np.random.default_rng(2323)


def rand23(*shape):
    return r23.standard_normal(shape).astype(np.float32)


# Attention, 4-D: 4 query heads over 2 key/value heads, 3 queries against 5 keys (causal,
# aligned to the top left), a float mask per batch entry, V's head size differing from Q's.
single("attention_gqa_causal_mask_23", "Attention", [], ["y"], 23,
       inits=[("q", rand23(2, 4, 3, 8)), ("k", rand23(2, 2, 5, 8)), ("v", rand23(2, 2, 5, 6)),
              ("mask", rand23(2, 1, 3, 5))],
       is_causal=1)
# RotaryEmbedding on 3-D input (2 heads of 8), caches indexed by position ids; rotating the
# first 4 channels of each head by halves, and all 8 interleaved.
pos = np.arange(10, dtype=np.float32)[:, None]
for dim, interleaved, case in [(4, 0, "rotary_3d_partial_23"), (8, 1, "rotary_3d_interleaved_23")]:
    freq = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float32) * 2 / dim)
    single(case, "RotaryEmbedding", [], ["y"], 23,
           inits=[("x", rand23(2, 3, 16)), ("cos", np.cos(pos * freq).astype(np.float32)),
                  ("sin", np.sin(pos * freq).astype(np.float32)),
                  ("ids", np.array([[0, 1, 2], [4, 2, 7]], np.int64))],
           num_heads=2, rotary_embedding_dim=dim, interleaved=interleaved)
single("rms_norm_two_axes_23", "RMSNormalization", [], ["y"], 23,
       inits=[("x", rand23(2, 3, 4, 5)), ("scale", rand23(4, 5))], axis=-2, epsilon=1e-3)

# --- quantization-aware training: weight -> QuantizeLinear -> DequantizeLinear -> MatMul --------
# (their own seeded generator). Scales small enough that part of the weight saturates, so the
# straight-through estimator's mask matters (`tests/integration/quantization.rs`). The int8 zero points
# are all non-negative: only their declared type says int8, not their values. onnxruntime
# runs these without graph optimizations: its extended level rewrites DequantizeLinear ->
# MatMul into a dynamically quantized MatMul, which also quantizes `x`.
rq = np.random.default_rng(4242)


def randq(*shape):
    return rq.standard_normal(shape).astype(np.float32)


def save_unoptimized(case, nodes, inputs, outputs, opset, inits):
    save(case, nodes, inputs, outputs, inputs, opset, inits, run=False)
    if not wanted(case):
        return
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(os.path.join(OUT, case + ".onnx"), options, providers=["CPUExecutionProvider"])
    res = sess.run([o for o, _ in outputs], dict(inputs))
    arrays = {f"in_{n}": a for n, a in inputs}
    arrays.update({f"out_{o}": r for (o, _), r in zip(outputs, res)})
    np.savez(os.path.join(OUT, case + ".npz"), **arrays)


xq = randq(3, 4)
save_unoptimized("qdq_matmul_per_axis_int8_13",
                 [helper.make_node("QuantizeLinear", ["W", "w_scale", "w_zp"], ["Wq"], axis=1),
                  helper.make_node("DequantizeLinear", ["Wq", "w_scale", "w_zp"], ["Wd"], axis=1),
                  helper.make_node("MatMul", ["x", "Wd"], ["y"])],
                 [("x", xq)], [("y", F)], 13,
                 inits=[("W", randq(4, 5)), ("w_scale", np.array([0.004, 0.008, 0.01, 0.02, 0.05], np.float32)),
                        ("w_zp", np.array([0, 3, 5, 10, 2], np.int8))])
xq = randq(2, 6)
save_unoptimized("qdq_matmul_uint8_10",
                 [helper.make_node("QuantizeLinear", ["W", "w_scale", "w_zp"], ["Wq"]),
                  helper.make_node("DequantizeLinear", ["Wq", "w_scale", "w_zp"], ["Wd"]),
                  helper.make_node("MatMul", ["x", "Wd"], ["y"])],
                 [("x", xq)], [("y", F)], 10,
                 inits=[("W", randq(6, 3)), ("w_scale", np.array(0.01, np.float32)), ("w_zp", np.array(128, np.uint8))])

# --- control flow: weights read inside an If branch, a Loop body and a Scan body ------------
# (their own seeded generator). `tests/integration/finite_difference.rs` checks the gradients reaching
# the weights through the taken branch and through the unrolled iterations.
rng_cf = np.random.default_rng(5150)


def randcf(*shape):
    return rng_cf.standard_normal(shape).astype(np.float32)


def body(name, nodes, ins, outs):
    return helper.make_graph(nodes, name, [vi(n, e, s) for n, e, s in ins], [vi(n, e, None) for n, e in outs])


# If: the condition is computed (sum(x) > 0, true for these inputs); the then-branch reads the
# weight W (MatMul), the else-branch only x.
xcf = randcf(3, 4) + 1.0
save("if_weight_branch_16",
     [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
      helper.make_node("Greater", ["s", "zero"], ["c"]),
      helper.make_node("If", ["c"], ["y"],
                       then_branch=body("then", [helper.make_node("MatMul", ["x", "W"], ["t"])], [], [("t", F)]),
                       else_branch=body("else", [helper.make_node("Neg", ["x"], ["e"])], [], [("e", F)]))],
     [("x", xcf)], [("y", F)], [("x", xcf)], 16,
     inits=[("W", randcf(4, 4)), ("zero", np.array(0.0, np.float32))])
# Loop: 3 iterations (the trip count a Constant node), the carried state multiplied by the
# weight W each time; the states of every iteration as a scan output.
xcf = randcf(2, 3)
save("loop_weight_carried_16",
     [helper.make_node("Constant", [], ["M"], value=numpy_helper.from_array(np.array(3, np.int64))),
      helper.make_node("Constant", [], ["go"], value=numpy_helper.from_array(np.array(True))),
      helper.make_node("Loop", ["M", "go", "x"], ["y", "ys"],
                       body=body("loop_body",
                                 [helper.make_node("Identity", ["c_in"], ["c_out"]),
                                  helper.make_node("Mul", ["v_in", "W"], ["v_out"]),
                                  helper.make_node("Identity", ["v_out"], ["scan"])],
                                 [("i", I, []), ("c_in", TensorProto.BOOL, []), ("v_in", F, None)],
                                 [("c_out", TensorProto.BOOL), ("v_out", F), ("scan", F)]))],
     [("x", xcf)], [("y", F), ("ys", F)], [("x", xcf)], 16,
     inits=[("W", randcf(2, 3) + 0.5)])
# Scan: an RNN cell h = tanh(h W + x_t) over 5 steps read in reverse, W a weight.
xcf, hcf = randcf(5, 4), randcf(4)
save("scan_weight_rnn_16",
     [helper.make_node("Scan", ["h0", "xs"], ["h", "hs"], num_scan_inputs=1, scan_input_directions=[1],
                       body=body("scan_body",
                                 [helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
                                  helper.make_node("Add", ["hw", "x_t"], ["pre"]),
                                  helper.make_node("Tanh", ["pre"], ["h_out"]),
                                  helper.make_node("Identity", ["h_out"], ["h_scan"])],
                                 [("h_in", F, [4]), ("x_t", F, [4])],
                                 [("h_out", F), ("h_scan", F)]))],
     [("h0", hcf), ("xs", xcf)], [("h", F), ("hs", F)], [("h0", hcf), ("xs", xcf)], 16,
     inits=[("W", randcf(4, 4) * 0.5)])

# --- recurrent ops (their own seeded generator): W, R, B, the initial states and the
# peepholes are initializers, so they train; X is fed. Y comes first (the gradient tests
# differentiate the first output).
rng_rnn = np.random.default_rng(7007)


def rand_rnn(*shape, scale=0.5):
    return (rng_rnn.standard_normal(shape) * scale).astype(np.float32)


# LSTM, both directions, with biases, initial hidden and cell states and peepholes.
single("lstm_bidirectional_14", "LSTM", [("x", rand_rnn(4, 2, 3, scale=1.0))], ["y", "y_h", "y_c"], 14,
       _input_order=["x", "w", "r", "b", "", "h0", "c0", "p"],
       inits=[("w", rand_rnn(2, 20, 3)), ("r", rand_rnn(2, 20, 5)), ("b", rand_rnn(2, 40)),
              ("h0", rand_rnn(2, 2, 5)), ("c0", rand_rnn(2, 2, 5)), ("p", rand_rnn(2, 15))],
       direction="bidirectional", hidden_size=5)
# GRU with the reset gate applied after the recurrent product.
single("gru_linear_before_reset_14", "GRU", [("x", rand_rnn(4, 2, 3, scale=1.0))], ["y", "y_h"], 14,
       _input_order=["x", "w", "r", "b", "", "h0"],
       inits=[("w", rand_rnn(1, 15, 3)), ("r", rand_rnn(1, 15, 5)), ("b", rand_rnn(1, 30)),
              ("h0", rand_rnn(1, 2, 5))],
       hidden_size=5, linear_before_reset=1)
# RNN in reverse over entries of different lengths (each starts at its own last step).
single("rnn_reverse_seq_lens_14", "RNN", [("x", rand_rnn(5, 3, 3, scale=1.0))], ["y", "y_h"], 14,
       _input_order=["x", "w", "r", "b", "seq_lens"],
       inits=[("w", rand_rnn(1, 4, 3)), ("r", rand_rnn(1, 4, 4)), ("b", rand_rnn(1, 8)),
              ("seq_lens", np.array([5, 2, 3], np.int32))],
       direction="reverse", hidden_size=4)
# GRU both directions with parameterised activations (alphas and betas consumed in order by
# the activations that take them), clip and sequence lengths: forward only.
single("gru_activations_clip_seq_lens_14", "GRU", [("x", rand_rnn(4, 3, 2, scale=2.0))], ["y", "y_h"], 14,
       _input_order=["x", "w", "r", "b", "seq_lens"],
       inits=[("w", rand_rnn(2, 9, 2, scale=1.0)), ("r", rand_rnn(2, 9, 3, scale=1.0)), ("b", rand_rnn(2, 18)),
              ("seq_lens", np.array([4, 1, 3], np.int32))],
       direction="bidirectional", hidden_size=3, clip=1.5,
       activations=["HardSigmoid", "LeakyRelu", "Sigmoid", "Elu"],
       activation_alpha=[0.3, 0.05, 0.8], activation_beta=[0.4])

# --- sampling grids, image and signal ops (their own seeded generator). The float data are
# initializers, so `tests/integration/finite_difference.rs` checks their gradients; grid points keep
# away from pixel boundaries (and reflection borders), where the gradient with respect to
# the grid has kinks.
rng_vis = np.random.default_rng(9090)


def rand_vis(*shape):
    return rng_vis.standard_normal(shape).astype(np.float32)


def grid_vis(n, out_shape, dims, align):
    """Normalised grid [n, *out_shape, k] (components x, y, z) whose pixel coordinates lie in
    [-1, L] with fractional parts in 0.15-0.35 or 0.65-0.85."""
    k = len(dims)
    g = np.empty((n, *out_shape, k), np.float32)
    for j in range(k):
        length = dims[k - 1 - j]
        frac = rng_vis.uniform(0.15, 0.35, (n, *out_shape)) + 0.5 * rng_vis.integers(0, 2, (n, *out_shape))
        px = rng_vis.integers(-1, length, (n, *out_shape)) + frac
        g[..., j] = 2 * px / (length - 1) - 1 if align else (2 * px + 1) / length - 1
    return g


single("gridsample_bilinear_zeros_16", "GridSample", [], ["y"], 16,
       inits=[("x", rand_vis(2, 3, 4, 5)), ("grid", grid_vis(2, (3, 4), (4, 5), False))],
       mode="bilinear", padding_mode="zeros", align_corners=0)
single("gridsample_cubic_border_aligned_20", "GridSample", [], ["y"], 20,
       inits=[("x", rand_vis(1, 2, 5, 6)), ("grid", grid_vis(1, (2, 3), (5, 6), True))],
       mode="cubic", padding_mode="border", align_corners=1)
# Cubic pads its taps only (PyTorch and onnxruntime; the ONNX reference also clamps or
# reflects the coordinate itself, which differs near the borders).
single("gridsample_cubic_reflection_20", "GridSample", [], ["y"], 20,
       inits=[("x", rand_vis(2, 1, 4, 5)), ("grid", grid_vis(2, (3, 2), (4, 5), False))],
       mode="cubic", padding_mode="reflection", align_corners=0)
single("gridsample_volumetric_linear_reflection_20", "GridSample", [], ["y"], 20,
       inits=[("x", rand_vis(1, 2, 3, 4, 5)), ("grid", grid_vis(1, (2, 3, 2), (3, 4, 5), False))],
       mode="linear", padding_mode="reflection", align_corners=0)
single("gridsample_nearest_reflection_20", "GridSample", [("grid", grid_vis(2, (3, 3), (4, 5), False) * 1.3)], ["y"], 20,
       inits=[("x", rand_vis(2, 2, 4, 5))], _input_order=["x", "grid"],
       mode="nearest", padding_mode="reflection", align_corners=0)
single("affine_grid_2d_20", "AffineGrid", [], ["grid"], 20,
       inits=[("theta", rand_vis(2, 2, 3)), ("size", np.array([2, 1, 3, 4], np.int64))], align_corners=0)
single("affine_grid_3d_aligned_20", "AffineGrid", [], ["grid"], 20,
       inits=[("theta", rand_vis(1, 3, 4)), ("size", np.array([1, 2, 2, 3, 4], np.int64))], align_corners=1)
single("col2im_dilated_padded_18", "Col2Im", [], ["y"], 18,
       inits=[("x", rand_vis(2, 2 * 2 * 2, 16)), ("image_shape", np.array([4, 5], np.int64)),
              ("block_shape", np.array([2, 2], np.int64))],
       dilations=[1, 2], pads=[1, 0, 0, 1], strides=[1, 1])
single("lppool_2d_p2_18", "LpPool", [], ["y"], 18,
       inits=[("x", rand_vis(1, 2, 6, 5))], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 0, 1], p=2)
single("lppool_1d_p3_same_upper_18", "LpPool", [], ["y"], 18,
       inits=[("x", rand_vis(2, 3, 7))], kernel_shape=[3], strides=[2], auto_pad="SAME_UPPER", p=3)
single("maxunpool_2d_11", "MaxUnpool", [], ["y"], 11,
       inits=[("x", rand_vis(1, 2, 2, 3)),
              ("i", np.array([[[[0, 3, 4], [13, 14, 23]], [[25, 26, 29], [43, 44, 47]]]], np.int64))],
       kernel_shape=[2, 2], strides=[2, 2])
single("reverse_sequence_batch_major_10", "ReverseSequence", [], ["y"], 10,
       inits=[("x", rand_vis(3, 4, 2)), ("lens", np.array([4, 2, 1], np.int64))], batch_axis=0, time_axis=1)
single("det_batch_11", "Det", [], ["y"], 11, inits=[("x", rand_vis(2, 3, 3))])
single("center_crop_pad_18", "CenterCropPad", [], ["y"], 18,
       inits=[("x", rand_vis(5, 4, 3)), ("shape", np.array([2, 7], np.int64))], axes=[0, 1])
rois_vis = np.array([[0.5, 0.5, 4.2, 3.9], [1.0, 0.3, 5.5, 5.7], [2.2, 1.1, 3.1, 4.4]], np.float32)
for mode in ("avg", "max"):
    single(f"roi_align_{mode}_16", "RoiAlign", [], ["y"], 16,
           inits=[("x", rand_vis(2, 2, 6, 6)), ("rois", rois_vis), ("batch", np.array([0, 1, 1], np.int64))],
           mode=mode, output_height=3, output_width=2, sampling_ratio=2, spatial_scale=1.0)
xu = np.array([[1, 0, 1, 2, 0], [3, 0, 3, 1, 0]], np.float32)
save("unique_axis1_unsorted_11",
     [helper.make_node("Unique", ["x"], ["y", "indices", "inverse", "counts"], axis=1, sorted=0)],
     [("x", xu)], [("y", F), ("indices", I), ("inverse", I), ("counts", I)], [("x", xu)], 11)

# --- spectral ops and deformable convolution (own generator) ------------------------------
rng_sig = np.random.default_rng(20240917)


def rand_sig(*shape):
    return rng_sig.standard_normal(shape).astype(np.float32)


# Real signal, one-sided, zero-padded to dft_length 10 along axis 1 (opset 20: axis input).
single("dft_rfft_padded_20", "DFT", [], ["y"], 20,
       inits=[("x", rand_sig(2, 7, 3, 1)), ("n", np.array(10, np.int64)), ("axis", np.array(1, np.int64))],
       onesided=1)
# Complex signal, inverse, truncated to dft_length 5 (opset 17: axis attribute).
single("dft_complex_inverse_17", "DFT", [], ["y"], 17,
       inits=[("x", rand_sig(3, 6, 2)), ("n", np.array(5, np.int64))], axis=1, inverse=1)
single("stft_window_17", "STFT", [], ["y"], 17,
       inits=[("x", rand_sig(2, 20, 1)), ("step", np.array(4, np.int64)),
              ("window", np.hanning(8).astype(np.float32))], onesided=1)


def deform_offsets(*shape):
    """Offsets whose sampling points sit 0.2-0.4 or 0.6-0.8 away from integer positions (the
    base positions are integers), some of them outside the image."""
    frac = rng_sig.uniform(0.2, 0.4, shape) + 0.4 * rng_sig.integers(0, 2, shape)
    return (rng_sig.integers(-2, 2, shape) + frac).astype(np.float32)


single("deform_conv_groups_mask_19", "DeformConv", [], ["y"], 19,
       inits=[("x", rand_sig(1, 4, 5, 5)), ("w", rand_sig(4, 2, 2, 2)),
              ("offset", deform_offsets(1, 2 * 2 * 2 * 2, 5, 5)), ("b", rand_sig(4)),
              ("mask", rng_sig.uniform(0.3, 1.0, (1, 2 * 4, 5, 5)).astype(np.float32))],
       group=2, offset_group=2, pads=[1, 1, 0, 0], kernel_shape=[2, 2])
single("deform_conv_strided_dilated_19", "DeformConv", [], ["y"], 19,
       inits=[("x", rand_sig(2, 2, 6, 5)), ("w", rand_sig(3, 2, 2, 3)),
              ("offset", deform_offsets(2, 2 * 2 * 3, 4, 2))],
       strides=[2, 1], dilations=[1, 2], pads=[1, 0, 1, 1])

# --- session 13's element-wise, reduction, indexing and layout ops: the gradients of each
# checked by finite differences (tests/integration/finite_difference.rs); their own seeded generator.
rng_s13 = np.random.default_rng(1313)


def away_from(values, kinks, gap=0.05):
    """Move values within `gap` of a kink (where the op is not differentiable) off it."""
    for k in kinks:
        near = np.abs(values - k) < gap
        values[near] = k + np.sign(values[near] - k + 1e-9) * gap
    return values


xs = away_from(rng_s13.standard_normal((3, 5)).astype(np.float32) * 1.5, [0.0, 0.3, -0.4, 0.4])
save("activations_s13",
     [helper.make_node("Selu", ["x"], ["a"]), helper.make_node("Celu", ["x"], ["b"], alpha=0.7),
      helper.make_node("Mish", ["x"], ["c"]), helper.make_node("Softsign", ["x"], ["d"]),
      helper.make_node("ThresholdedRelu", ["x"], ["e"], alpha=0.3),
      helper.make_node("Shrink", ["x"], ["f"], lambd=0.4, bias=0.1),
      helper.make_node("Sum", ["a", "b", "c", "d", "e", "f"], ["y"])],
     [], [("y", F)], [], 22, inits=[("x", xs)])
t = (rng_s13.standard_normal((2, 6)).astype(np.float32))
save("trig_hyperbolic_s13",
     [helper.make_node("Tanh", ["x"], ["t0"]), helper.make_node("Mul", ["t0", "c09"], ["t"]),
      helper.make_node("Asin", ["t"], ["a"]), helper.make_node("Acos", ["t"], ["b"]),
      helper.make_node("Atanh", ["t"], ["c"]), helper.make_node("Atan", ["x"], ["d"]),
      helper.make_node("Sinh", ["x"], ["e"]), helper.make_node("Cosh", ["x"], ["f"]),
      helper.make_node("Asinh", ["x"], ["g"]), helper.make_node("Tan", ["t"], ["h"]),
      helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("Add", ["ax", "c15"], ["x1"]),
      helper.make_node("Acosh", ["x1"], ["i"]),
      helper.make_node("Sum", ["a", "b", "c", "d", "e", "f", "g", "h", "i"], ["y"])],
     [], [("y", F)], [], 13,
     inits=[("x", away_from(t, [0.0])), ("c09", np.array(0.9, np.float32)), ("c15", np.array(1.5, np.float32))])
r = rng_s13.standard_normal((2, 3, 4)).astype(np.float32)
save("reductions_s13",
     [helper.make_node("ReduceL1", ["x", "axes"], ["a"], keepdims=0),
      helper.make_node("ReduceProd", ["x", "axes"], ["b"], keepdims=0),
      helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("Add", ["ax", "half"], ["xp"]),
      helper.make_node("ReduceLogSum", ["xp", "axes"], ["c"], keepdims=0),
      helper.make_node("Sum", ["a", "b", "c"], ["y"])],
     [], [("y", F)], [], 18,
     inits=[("x", away_from(r, [0.0], 0.1)), ("axes", np.array([1, 2], np.int64)), ("half", np.array(0.5, np.float32))])
save("cumprod_exclusive_reverse_s13",
     [helper.make_node("CumProd", ["x", "axis"], ["y"], exclusive=1, reverse=1)],
     [], [("y", F)], [], 26, inits=[("x", rng_s13.standard_normal((3, 4)).astype(np.float32)),
                                    ("axis", np.array(1, np.int64))], run=False)
if wanted("cumprod_exclusive_reverse_s13"):
    # onnxruntime 1.32 has no CumProd: the reference evaluator gives the expected output.
    from onnx.reference import ReferenceEvaluator
    p = os.path.join(OUT, "cumprod_exclusive_reverse_s13")
    (y,) = ReferenceEvaluator(p + ".onnx").run(None, {})
    np.savez(p + ".npz", out_y=y)
g = rng_s13.standard_normal((3, 4, 2)).astype(np.float32)
save("gather_scatter_nd_s13",
     [helper.make_node("GatherND", ["x", "gi"], ["g"]),
      helper.make_node("ScatterND", ["base", "si", "g"], ["s"]),
      helper.make_node("ScatterElements", ["s", "ei", "eu"], ["y"], axis=1, reduction="add")],
     [], [("y", F)], [], 18,
     inits=[("x", g), ("gi", np.array([[2, 1], [0, 3]], np.int64)),
            ("base", rng_s13.standard_normal((4, 2)).astype(np.float32)),
            ("si", np.array([[3], [1]], np.int64)),
            ("ei", np.array([[1, 0], [0, 0]], np.int64)),
            ("eu", rng_s13.standard_normal((2, 2)).astype(np.float32))])
save("topk_compress_s13",
     [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=0),
      helper.make_node("Compress", ["v", "keep"], ["y"], axis=1)],
     [], [("y", F)], [], 11,
     inits=[("x", rng_s13.permutation(24).reshape(4, 6).astype(np.float32) * 0.3),
            ("k", np.array([3], np.int64)), ("keep", np.array([True, False, True]))])
save("local_norms_s13",
     [helper.make_node("LRN", ["x"], ["a"], size=3, alpha=0.2, beta=0.6, bias=1.5),
      helper.make_node("LpNormalization", ["a"], ["b"], axis=1, p=2),
      helper.make_node("MeanVarianceNormalization", ["b"], ["y"], axes=[0, 2, 3])],
     [], [("y", F)], [], 13, inits=[("x", rng_s13.standard_normal((2, 4, 3, 3)).astype(np.float32))])
single("pool3d_avg_dilated_s13", "AveragePool", [], ["y"], 19,
       inits=[("x", rng_s13.standard_normal((1, 2, 5, 5, 4)).astype(np.float32))],
       kernel_shape=[2, 2, 2], dilations=[2, 1, 2], pads=[1, 0, 1, 0, 1, 0], count_include_pad=1)
single("pool3d_max_s13", "MaxPool", [], ["y"], 12,
       inits=[("x", rng_s13.permutation(2 * 4 * 4 * 4).reshape(1, 2, 4, 4, 4).astype(np.float32) * 0.1)],
       kernel_shape=[2, 2, 2], strides=[2, 1, 2])
single("resize_cubic_antialias_s13", "Resize", [], ["y"], 18,
       inits=[("x", rng_s13.standard_normal((1, 1, 6, 7)).astype(np.float32)), ("roi", np.array([], np.float32)),
              ("scales", np.array([1, 1, 0.6, 1.3], np.float32))],
       _input_order=["x", "roi", "scales"], mode="cubic", antialias=1)
single("pad_wrap_s13", "Pad", [], ["y"], 19,
       inits=[("x", rng_s13.standard_normal((2, 3, 4)).astype(np.float32)), ("pads", np.array([0, 2, -1, 0, 1, 3], np.int64))],
       mode="wrap")
single("depth_to_space_crd_s13", "DepthToSpace", [], ["y"], 13,
       inits=[("x", rng_s13.standard_normal((1, 8, 2, 3)).astype(np.float32))], blocksize=2, mode="CRD")

# --- CausalConvWithState and LinearAttention (opset 27) --------------------------------
rng_s27 = np.random.default_rng(2727)
single("causal_conv_with_state_silu_27", "CausalConvWithState", [], ["y", "state"], 27,
       inits=[("x", rng_s27.standard_normal((2, 3, 5)).astype(np.float32)),
              ("w", rng_s27.standard_normal((3, 1, 3)).astype(np.float32) * 0.7),
              ("b", rng_s27.standard_normal(3).astype(np.float32)),
              ("past", rng_s27.standard_normal((2, 3, 2)).astype(np.float32))],
       activation="silu")
single("linear_attention_gated_delta_gqa_27", "LinearAttention", [], ["y", "state"], 27,
       inits=[("q", rng_s27.standard_normal((1, 3, 4 * 3)).astype(np.float32)),
              ("k", rng_s27.standard_normal((1, 3, 2 * 3)).astype(np.float32) * 0.5),
              ("v", rng_s27.standard_normal((1, 3, 2 * 2)).astype(np.float32)),
              ("past", rng_s27.standard_normal((1, 2, 3, 2)).astype(np.float32) * 0.3),
              ("decay", -np.abs(rng_s27.standard_normal((1, 3, 2))).astype(np.float32) * 0.3),
              ("beta", rng_s27.uniform(0.2, 0.9, (1, 3, 2)).astype(np.float32))],
       q_num_heads=4, kv_num_heads=2)

# --- 3-D ConvTranspose, output_shape padding, Einsum diagonal (own generator) -----------
rng_ctd = np.random.default_rng(2718)
single("conv_transpose3d_grad_ct", "ConvTranspose", [], ["y"], 13,
       inits=[("x", rng_ctd.standard_normal((1, 2, 3, 2, 3)).astype(np.float32)),
              ("w", rng_ctd.standard_normal((2, 2, 2, 3, 2)).astype(np.float32)),
              ("b", rng_ctd.standard_normal((2,)).astype(np.float32))],
       strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1], output_padding=[1, 0, 0])
single("conv_transpose_output_shape_extra_ct", "ConvTranspose", [], ["y"], 13,
       inits=[("x", rng_ctd.standard_normal((1, 1, 3, 3)).astype(np.float32)),
              ("w", rng_ctd.standard_normal((1, 2, 3, 3)).astype(np.float32)),
              ("b", rng_ctd.standard_normal((2,)).astype(np.float32))],
       strides=[3, 2], output_shape=[10, 8])
single("einsum_batch_diagonal_ct", "Einsum", [], ["y"], 12,
       inits=[("x", rng_ctd.standard_normal((2, 3, 4, 4)).astype(np.float32))], equation="...ii->...i")
single("einsum_diagonal_matmul_ct", "Einsum", [], ["y"], 12,
       inits=[("a", rng_ctd.standard_normal((3, 3, 4)).astype(np.float32)),
              ("b", rng_ctd.standard_normal((4, 5)).astype(np.float32))], equation="iij,jk->ik")

# --- FlexAttention (ai.onnx.preview opset 1; own generator) ------------------------------
# Grouped-query heads (4 query, 2 key/value), a soft-capping score_mod that also adds an
# outer-scope weight (a captured initializer, so it trains), and a prob_mod scaling by a
# body constant. onnxruntime has no FlexAttention: the reference evaluator gives the output.
rng_fa = np.random.default_rng(4242)
if wanted("flex_attention_mods_gqa_fa"):
    case = "flex_attention_mods_gqa_fa"
    score_mod = helper.make_graph(
        [helper.make_node("Div", ["scores", "cap"], ["scaled"]),
         helper.make_node("Tanh", ["scaled"], ["capped_unit"]),
         helper.make_node("Mul", ["capped_unit", "cap"], ["capped"]),
         helper.make_node("Add", ["capped", "rel_bias"], ["scores_out"])],
        "score_mod_soft_cap_bias", [vi("scores", F, None)], [vi("scores_out", F, None)],
        initializer=[numpy_helper.from_array(np.array(2.5, np.float32), "cap")])
    prob_mod = helper.make_graph(
        [helper.make_node("Mul", ["probs", "pscale"], ["probs_out"])],
        "prob_mod_scale", [vi("probs", F, None)], [vi("probs_out", F, None)],
        initializer=[numpy_helper.from_array(np.array(0.8, np.float32), "pscale")])
    inits = [("q", rng_fa.standard_normal((1, 4, 3, 4)).astype(np.float32)),
             ("k", rng_fa.standard_normal((1, 2, 5, 4)).astype(np.float32)),
             ("v", rng_fa.standard_normal((1, 2, 5, 3)).astype(np.float32)),
             ("rel_bias", rng_fa.standard_normal((3, 5)).astype(np.float32) * 0.5)]
    graph = helper.make_graph(
        [helper.make_node("FlexAttention", ["q", "k", "v"], ["y"], domain="ai.onnx.preview",
                          scale=0.4, score_mod=score_mod, prob_mod=prob_mod)],
        case, [], [vi("y", F, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26),
                                                    helper.make_opsetid("ai.onnx.preview", 1)],
                              producer_name="gen_op_fixtures")
    model.ir_version = 10
    path = os.path.join(OUT, case + ".onnx")
    onnx.save(model, path)
    try:
        (y,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["y"], {})
    except Exception:  # onnxruntime refuses the preview domain
        # The reference evaluator does not resolve outer-scope names inside FlexAttention's
        # subgraphs: it runs a copy with rel_bias moved into score_mod (the same values).
        from onnx.reference import ReferenceEvaluator
        ref = onnx.ModelProto()
        ref.CopyFrom(model)
        for a in ref.graph.node[0].attribute:
            if a.name == "score_mod":
                a.g.initializer.append(numpy_helper.from_array(inits[3][1], "rel_bias"))
        (y,) = ReferenceEvaluator(ref).run(None, {})
    np.savez(os.path.join(OUT, case + ".npz"), out_y=y)
    print("wrote", case)

# --- batch norm in training inside subgraphs: the running statistics are outer
# initializers, updated through the If branch once and through each Loop iteration in turn
# (the second iteration reads the first's update), PyTorch's convention (unbiased batch
# variance in the running variance, biased in the normalisation), computed with numpy;
# onnxruntime gives the inference-mode output (running statistics) as for every fixture.
rng_bn = np.random.default_rng(777)
bn_inits = [("scale", rng_bn.standard_normal(3).astype(np.float32)),
            ("bias", rng_bn.standard_normal(3).astype(np.float32)),
            ("mean", rng_bn.standard_normal(3).astype(np.float32)),
            ("var", (np.abs(rng_bn.standard_normal(3)) + 0.5).astype(np.float32))]
xbn = (rng_bn.standard_normal((4, 3, 5, 5)) * 2 + 1).astype(np.float32)


def bn_train_numpy(x, mean, var, momentum=0.8, eps=1e-5):
    p = dict(bn_inits)
    bm, bv = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    shape = (1, 3, 1, 1)
    y = p["scale"].reshape(shape) * (x - bm.reshape(shape)) / np.sqrt(bv.reshape(shape) + eps) + p["bias"].reshape(shape)
    return (y.astype(np.float32), mean * momentum + bm * (1 - momentum),
            var * momentum + x.var(axis=(0, 2, 3), ddof=1) * (1 - momentum))


def bn_node(x, y):
    return helper.make_node("BatchNormalization", [x, "scale", "bias", "mean", "var"], [y], momentum=0.8, epsilon=1e-5)


for case, nodes, iterations in [
    ("batch_norm_in_if_15",
     [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True))),
      helper.make_node("If", ["c"], ["y"],
                       then_branch=body("then", [bn_node("x", "t")], [], [("t", F)]),
                       else_branch=body("else", [helper.make_node("Identity", ["x"], ["e"])], [], [("e", F)]))],
     1),
    ("batch_norm_in_loop_15",
     [helper.make_node("Constant", [], ["M"], value=numpy_helper.from_array(np.array(2, np.int64))),
      helper.make_node("Constant", [], ["go"], value=numpy_helper.from_array(np.array(True))),
      helper.make_node("Loop", ["M", "go", "x"], ["y"],
                       body=body("loop_body",
                                 [helper.make_node("Identity", ["c_in"], ["c_out"]), bn_node("v_in", "v_out")],
                                 [("i", I, []), ("c_in", TensorProto.BOOL, []), ("v_in", F, None)],
                                 [("c_out", TensorProto.BOOL), ("v_out", F)]))],
     2),
]:
    if not wanted(case):
        continue
    save(case, nodes, [("x", xbn)], [("y", F)], [("x", xbn)], 15, inits=bn_inits)
    v, mean, var = xbn, dict(bn_inits)["mean"], dict(bn_inits)["var"]
    for _ in range(iterations):
        v, mean, var = bn_train_numpy(v, mean, var)
    path = os.path.join(OUT, case + ".npz")
    arrays = dict(np.load(path))
    arrays.update(state_running_mean=mean.astype(np.float32), state_running_var=var.astype(np.float32),
                  train_y=v)
    np.savez(path, **arrays)
    print("added numpy running statistics to", case)

# --- sequences (their own seeded generator): a product cut into a sequence, one piece
# scaled by a weight and inserted in front, the last piece erased, the rest stacked; the
# gradients of W and V flow through SplitToSequence, SequenceAt, SequenceInsert,
# SequenceErase and ConcatFromSequence.
rng_seq = np.random.default_rng(9009)
xs = rng_seq.standard_normal((2, 4)).astype(np.float32)
save("sequence_weights_18",
     [helper.make_node("MatMul", ["x", "W"], ["h"]),
      helper.make_node("SplitToSequence", ["h", "three"], ["pieces"], axis=1),
      helper.make_node("SequenceAt", ["pieces", "first"], ["p0"]),
      helper.make_node("Mul", ["p0", "V"], ["scaled"]),
      helper.make_node("SequenceInsert", ["pieces", "scaled", "first"], ["with_scaled"]),
      helper.make_node("SequenceErase", ["with_scaled"], ["kept"]),
      helper.make_node("ConcatFromSequence", ["kept"], ["y"], axis=0, new_axis=1)],
     [("x", xs)], [("y", F)], [("x", xs)], 18,
     inits=[("W", rng_seq.standard_normal((4, 9)).astype(np.float32)),
            ("V", rng_seq.standard_normal((2, 3)).astype(np.float32)),
            ("three", np.array(3, np.int64)), ("first", np.array(0, np.int64))])
