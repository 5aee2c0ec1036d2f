#!/usr/bin/env python3
"""The ONNX backend node tests (onnx 1.22.0's `onnx/backend/test/data/node`) through
`onnx-train run`, or through onnxruntime for the comparison figure.

Every test's `model.onnx` runs on its `test_data_set_0` inputs and each output is compared
with the expected one: shape and dtype must match, floats at rtol 1e-3 / atol 1e-5 (NaN
equals NaN), everything else exactly. Each test ends in one class:

  pass         every output right
  wrong        ran, but an output has the wrong shape, dtype or values
  unsupported  refused at load with "unsupported operator" (the error names the node)
  error        any other clear error (exit status 1, message on stderr)
  panic        a Rust panic, a signal, or no exit within the time limit

Usage:
  tools/node_suite.py --binary target/release/onnx-train [--json OUT.json]
                      [--floor N] [--filter SUBSTRING] [--jobs 2] [--verbose]
  tools/node_suite.py --onnxruntime [--json OUT.json]

With --floor, the exit status is 1 when the pass count is below N or any test panicked;
`tools/node_suite_floor.txt` holds the committed floor (CI: tests/integration/node_suite.rs).
"""

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import onnx
from onnx import numpy_helper

RTOL, ATOL = 1e-3, 1e-5
TIME_LIMIT_S = 120


def node_dir():
    import onnx.backend.test as t

    d = os.path.join(os.path.dirname(t.__file__), "data", "node")
    if not os.path.isdir(d):
        sys.exit(f"{d} is missing: the node tests ship in the onnx wheel up to 1.22.0 "
                 f"(this is onnx {onnx.__version__})")
    return d


def load_case(case_dir):
    """(model, [(input name, value, ONNX type)], [(output name, value, ONNX type)]).

    Values are NumPy arrays for tensors (strings included), lists for sequences and
    `None`-or-value for optionals; the type is the data type code, or the kind of a
    non-tensor ("sequence_type", "optional_type")."""
    model = onnx.load(os.path.join(case_dir, "model.onnx"))
    data = os.path.join(case_dir, "test_data_set_0")
    inits = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in inits]
    feeds, expected = [], []
    for kind, values, infos in (("input", feeds, graph_inputs),
                                ("output", expected, list(model.graph.output))):
        files = sorted((f for f in os.listdir(data) if f.startswith(kind + "_")),
                       key=lambda f: int(re.findall(r"\d+", f)[0]))
        for f, info in zip(files, infos):
            with open(os.path.join(data, f), "rb") as fh:
                raw = fh.read()
            which = info.type.WhichOneof("value")
            if which == "tensor_type":
                t = onnx.TensorProto()
                t.ParseFromString(raw)
                values.append((info.name, numpy_helper.to_array(t), t.data_type))
            elif which == "sequence_type":
                s = onnx.SequenceProto()
                s.ParseFromString(raw)
                values.append((info.name, numpy_helper.to_list(s), which))
            else:
                o = onnx.OptionalProto()
                o.ParseFromString(raw)
                values.append((info.name, numpy_helper.to_optional(o), which))
    return model, feeds, expected


def write_feed(tmp, i, value):
    """A feed where `onnx-train run` reads it: `.npy` for a tensor, a directory of them for
    a sequence; None (an empty optional, left out) for None."""
    if value is None:
        return None
    if isinstance(value, list):
        path = os.path.join(tmp, f"in{i}")
        os.makedirs(path)
        for k, a in enumerate(value):
            np.save(os.path.join(path, f"{k:05}.npy"), to_npy_array(a, None))
        return path
    path = os.path.join(tmp, f"in{i}.npy")
    np.save(path, to_npy_array(value, None))
    return path


def read_output(out, name):
    """What `onnx-train run` wrote for output `name`: an array, a list of them (a
    sequence's directory), or None (nothing written)."""
    path = os.path.join(out, sanitize(name))
    if os.path.isdir(path):
        return [np.load(os.path.join(path, f)) for f in sorted(os.listdir(path))]
    if os.path.exists(path + ".npy"):
        return np.load(path + ".npy")
    return None


# ONNX types `.npy` cannot hold, carried widened: 4- and 2-bit integers as int8 / uint8,
# 8- and 4-bit floats as float32 (exact in both cases).
NARROW_INTS = {"int4": np.int8, "int2": np.int8, "uint4": np.uint8, "uint2": np.uint8}
NPY_NATIVE = {"bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
              "uint8", "uint16", "uint32", "uint64"}


def as_str(a):
    """A string tensor (numpy objects of str or bytes) as numpy's unicode strings."""
    flat = [x.decode() if isinstance(x, bytes) else str(x) for x in a.ravel()]
    return np.array(flat, dtype=str).reshape(a.shape)


def to_npy_array(a, data_type):
    """What `.npy` can carry: strings as numpy's unicode, bfloat16 and the 8/4-bit float
    types as float32, 4/2-bit integers as int8/uint8."""
    if a.dtype.kind in "OSU":
        return as_str(a)
    if a.dtype.name in NARROW_INTS:
        return a.astype(NARROW_INTS[a.dtype.name])
    if a.dtype.name not in NPY_NATIVE:
        return a.astype(np.float32)
    return a


def sanitize(name):
    return "".join(c if (c.isalnum() or c in "._-") else "_" for c in name)


def compare(name, got, want):
    """None when `got` matches `want`, else the reason."""
    want_np = to_npy_array(want, None)
    if got.shape != want_np.shape:
        return f"output '{name}': shape {got.shape}, expected {want_np.shape}"
    if got.dtype != want_np.dtype:
        return f"output '{name}': dtype {got.dtype}, expected {want_np.dtype}"
    if want_np.dtype.kind == "f":
        g, w = got.astype(np.float64), want_np.astype(np.float64)
        ok = np.isclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True)
        if not ok.all():
            i = np.argwhere(~ok)[0]
            return (f"output '{name}': {int((~ok).sum())} of {ok.size} values differ, "
                    f"first at {tuple(i)}: {g[tuple(i)]} vs {w[tuple(i)]}")
        return None
    if not np.array_equal(got, want_np):
        return f"output '{name}': values differ"
    return None


def compare_any(name, got, want):
    """`compare` for tensors, strings, sequences (lists) and optionals (None)."""
    if want is None or got is None:
        return None if got is None and want is None else f"output '{name}': optional differs"
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"output '{name}': sequence length differs"
        return next((w for w in (compare_any(name, g, x) for g, x in zip(got, want)) if w), None)
    if want.dtype.kind in "OUS":
        got, want = as_str(np.asarray(got)), as_str(want)
        return None if np.array_equal(got, want) else f"output '{name}': values differ"
    return compare(name, to_npy_array(np.asarray(got), None), want)


def run_ours(binary, case_dir):
    _, feeds, expected = load_case(case_dir)
    with tempfile.TemporaryDirectory() as tmp:
        args = [binary, "run", os.path.join(case_dir, "model.onnx"),
                "--output-dir", os.path.join(tmp, "out")]
        for i, (name, a, _) in enumerate(feeds):
            path = write_feed(tmp, i, a)
            if path is not None:
                args += ["--input", f"{name}={path}"]
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=TIME_LIMIT_S,
                               env={**os.environ, "RUST_BACKTRACE": "0"})
        except subprocess.TimeoutExpired:
            return "panic", f"no exit within {TIME_LIMIT_S} s"
        err = p.stderr.strip().splitlines()
        last = err[-1] if err else ""
        if p.returncode < 0 or p.returncode == 101 or "panicked" in p.stderr:
            return "panic", next((l for l in err if "panicked" in l), f"status {p.returncode}")
        if p.returncode != 0:
            kind = "unsupported" if "unsupported operator" in p.stderr else "error"
            return kind, last
        for name, want, _ in expected:
            got = read_output(os.path.join(tmp, "out"), name)
            if got is None and want is not None:
                return "wrong", f"output '{name}' was not written"
            why = compare_any(name, got, want)
            if why:
                return "wrong", why
    return "pass", ""


def run_onnxruntime(case_dir):
    import onnxruntime as ort

    _, feeds, expected = load_case(case_dir)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        s = ort.InferenceSession(os.path.join(case_dir, "model.onnx"), opts,
                                 providers=["CPUExecutionProvider"])
        outs = s.run([n for n, _, _ in expected], {n: a for n, a, _ in feeds})
    except Exception as e:  # noqa: BLE001 - any refusal is this test's result
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return ("unsupported" if "NOT_IMPLEMENTED" in msg else "error"), msg
    for (name, want, dt), got in zip(expected, outs):
        why = compare_any(name, got, want)
        if why:
            return "wrong", why
    return "pass", ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", help="the onnx-train binary")
    ap.add_argument("--onnxruntime", action="store_true", help="run onnxruntime instead")
    ap.add_argument("--json", help="write every test's class and reason here")
    ap.add_argument("--floor", type=int, help="fail below this pass count or on any panic")
    ap.add_argument("--filter", default="", help="only tests whose name contains this")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--verbose", action="store_true", help="print every test's result")
    args = ap.parse_args()
    if not args.onnxruntime and not args.binary:
        ap.error("--binary or --onnxruntime is required")
    root = node_dir()
    cases = sorted(c for c in os.listdir(root) if args.filter in c)

    def one(c):
        d = os.path.join(root, c)
        try:
            return run_onnxruntime(d) if args.onnxruntime else run_ours(args.binary, d)
        except Exception as e:  # noqa: BLE001 - the harness itself must not stop
            return "error", f"harness: {type(e).__name__}: {e}"

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(cases, pool.map(one, cases)))
    counts = collections.Counter(k for k, _ in results.values())
    for c, (k, why) in results.items():
        if args.verbose or k in ("panic", "wrong"):
            print(f"{k:12} {c}: {why}")
    who = "onnxruntime" if args.onnxruntime else "onnx-train run"
    print(f"{who}: {len(cases)} tests, onnx {onnx.__version__}: " + ", ".join(
        f"{k} {counts.get(k, 0)}" for k in ("pass", "wrong", "unsupported", "error", "panic")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "tests": {c: {"class": k, "reason": w}
                                                   for c, (k, w) in results.items()}},
                      f, indent=1, sort_keys=True)
    if args.floor is not None:
        if counts.get("panic", 0):
            print(f"FAIL: {counts['panic']} tests panicked")
            return 1
        if counts.get("pass", 0) < args.floor:
            print(f"FAIL: {counts.get('pass', 0)} passed, below the floor {args.floor}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
