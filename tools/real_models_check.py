#!/usr/bin/env python3
"""Check `onnx-train` on real model families exported by PyTorch's two ONNX exporters.

Every model is built from a config with random weights (no hub access needed) at a tiny
size (2 layers, hidden 64, 4 heads, vocab 128, 64 positions), or from torchvision with
random weights, then exported with BOTH the TorchScript exporter (`dynamo=False`, opset 17)
and the dynamo exporter (`dynamo=True`, opset 18) at fixed input shapes. Parameters are
perturbed by N(0, 0.02) after init (`--no-perturb` keeps the raw init, whose all-ones / all-zero
tensors the exporters merge or drop). `resnet18_train` exports ResNet-18 in training mode
(BatchNorm kept); `resnet18` is the eval export (BatchNorm folded into Conv). Causal LMs whose
input_ids-only TorchScript export fails (transformers' `torch.diff`) get an all-ones
attention_mask input. For each file:

  * `onnx-train inspect` is run: trainable parameter elements are compared with PyTorch's
    `sum(p.numel() for p in model.parameters())`, and any "initializer ties" lines are kept;
  * `onnx-train run` and onnxruntime are run on the same fixed random input, and every
    graph output is compared (pass: np.allclose(rtol=1e-3, atol=1e-4));
  * onnxruntime is also compared with PyTorch itself, to tell exporter bugs from
    interpreter bugs;
  * every initializer `inspect` calls trainable is matched by value against the PyTorch
    parameters (same parameter twice, transposed copies, folded slices, non-parameter
    constants, parameters with no initializer).

A markdown table goes to OUT/report.md (and a JSON copy to OUT/results.json).

Needs: torch, transformers, onnx, onnxscript, onnxruntime, numpy (torchvision optional).

    python tools/real_models_check.py --binary target/release/onnx-train --out /tmp/rm
    python tools/real_models_check.py --binary target/release/onnx-train --out /tmp/rm \
        --families llama gpt2 --exporters torchscript
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch

warnings.filterwarnings("ignore")

RTOL, ATOL = 1e-3, 1e-4
BATCH, SEQ = 2, 8
VOCAB, HIDDEN, HEADS, LAYERS, POS, FFN = 128, 64, 4, 2, 64, 256


# --------------------------------------------------------------------------- models
class LogitsOnly(torch.nn.Module):
    """Wrap a HF model so the exported graph has plain tensor inputs and one output."""

    def __init__(self, model, extra=None):
        super().__init__()
        self.model = model
        self.extra = extra or {}
        self.arg_names = ["input_ids"]

    def forward(self, *args):
        # Graph inputs are passed by keyword, named as the exported graph names them.
        out = self.model(return_dict=False, **dict(zip(self.arg_names, args)), **self.extra)
        return out[0]


def _hf(kind, cfg_cls_name, **cfg_kwargs):
    import transformers

    def build(attn):
        cfg = getattr(transformers, cfg_cls_name)(**cfg_kwargs)
        auto = {"causal": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM,
                "s2s": transformers.AutoModelForSeq2SeqLM}[kind]
        model = auto.from_config(cfg, attn_implementation=attn).eval()
        extra = {"use_cache": False} if kind in ("causal", "s2s") else {}
        return model, LogitsOnly(model, extra)

    return build


def perturb(model, seed=0):
    """Add N(0, 0.02) noise to every parameter so no initializer is constant-filled (LayerNorm
    ones, zero biases) or equal to another one: that is what trained weights look like, and it
    keeps the exporters' optimizers from folding or merging parameters by value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _ids(seed, low=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)


DEC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
           intermediate_size=FFN, max_position_embeddings=POS)
ENC = dict(DEC, type_vocab_size=2)


def families():
    """name -> (builder(attn) -> (pytorch model, export wrapper), input names, inputs)."""
    ids = _ids(0)
    fams = {
        "llama": (_hf("causal", "LlamaConfig", num_key_value_heads=2, **DEC), ["input_ids"], [ids]),
        "mistral": (_hf("causal", "MistralConfig", num_key_value_heads=2, sliding_window=4, **DEC),
                    ["input_ids"], [ids]),
        "qwen2": (_hf("causal", "Qwen2Config", num_key_value_heads=2, **DEC), ["input_ids"], [ids]),
        "gpt_neox": (_hf("causal", "GPTNeoXConfig", **DEC), ["input_ids"], [ids]),
        "gpt2": (_hf("causal", "GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS,
                     n_positions=POS), ["input_ids"], [ids]),
        "bert": (_hf("mlm", "BertConfig", **ENC), ["input_ids"], [ids]),
        "distilbert": (_hf("mlm", "DistilBertConfig", vocab_size=VOCAB, dim=HIDDEN, n_heads=HEADS,
                           n_layers=LAYERS, hidden_dim=FFN, max_position_embeddings=POS), ["input_ids"], [ids]),
        # RoBERTa positions start at padding_idx + 1 = 2, so 64 positions + 2.
        "roberta": (_hf("mlm", "RobertaConfig", **dict(ENC, max_position_embeddings=POS + 2)), ["input_ids"], [ids]),
        "t5": (_hf("s2s", "T5Config", vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                   num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS),
               ["input_ids", "decoder_input_ids"], [ids, _ids(1)]),
    }

    def tv(name, size, train=False, batch=1):
        def build(attn):
            import torchvision
            m = getattr(torchvision.models, name)(weights=None)
            return m, (m.train() if train else m.eval())
        g = torch.Generator().manual_seed(2)
        return build, ["pixel_values"], [torch.randn(batch, 3, size, size, generator=g)]

    fams["resnet18"] = tv("resnet18", 64)
    # An eval-mode export folds every BatchNorm into the Conv before it (both exporters), so
    # also export in training mode (TrainingMode.TRAINING / module.train()): BatchNormalization
    # kept, batch statistics, running mean/var as state.
    fams["resnet18_train"] = tv("resnet18", 64, train=True, batch=2)
    fams["swin_t"] = tv("swin_t", 224)
    return fams


# --------------------------------------------------------------------------- export
def export(wrapper, inputs, names, path, exporter):
    if exporter == "torchscript":
        train = wrapper.training and not hasattr(wrapper, "arg_names")
        torch.onnx.export(wrapper, tuple(inputs), path, dynamo=False, opset_version=17,
                          input_names=names, output_names=["logits"], do_constant_folding=not train,
                          training=torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL)
    else:
        prog = torch.onnx.export(wrapper, tuple(inputs), dynamo=True, opset_version=18,
                                 input_names=names, output_names=["logits"])
        prog.save(path)


def first_line(exc):
    lines = [l for l in str(exc).strip().splitlines() if l.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


# --------------------------------------------------------------------------- checks
def inspect(binary, path):
    p = subprocess.run([binary, "inspect", path], capture_output=True, text=True, timeout=300)
    text = p.stdout + p.stderr
    m = re.search(r"initializers: \d+ parameters \((\d+) trainable elements, (\d+) state, (\d+) constant\)", text)
    ties, in_ties = [], False
    for line in text.splitlines():
        if line.startswith("initializer ties"):
            in_ties = True
            continue
        if in_ties:
            if line.startswith("  "):
                ties.append(line.strip())
            else:
                in_ties = False
    return {"ok": p.returncode == 0 and m is not None, "text": text,
            "trainable": int(m.group(1)) if m else None,
            "state": int(m.group(2)) if m else None,
            "constant_elems": int(m.group(3)) if m else None,
            "ties": ties, "error": None if p.returncode == 0 else _err_line(text)}


def _err_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    for l in lines:
        if "rror" in l or "panic" in l:
            return l.strip()[:400]
    return (lines[-1] if lines else "(no output)")[:400]


def run_binary(binary, path, feeds, work):
    os.makedirs(work, exist_ok=True)
    args = [binary, "run", path, "--output-dir", os.path.join(work, "out")]
    for name, arr in feeds.items():
        f = os.path.join(work, f"{name}.npy")
        np.save(f, arr)
        args += ["--input", f"{name}={f}"]
    t = time.time()
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    return p, time.time() - t


def compare(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        return False, float("inf"), f"shape {a.shape} vs {b.shape}"
    if a.dtype.kind in "iub" or b.dtype.kind in "iub":
        d = float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64)))) if a.size else 0.0
        return d == 0, d, ""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    d = float(np.max(np.abs(a64 - b64))) if a.size else 0.0
    return bool(np.allclose(a64, b64, rtol=RTOL, atol=ATOL)), d, ""


def check_one(fam, exporter, build, names, inputs, binary, out, do_perturb=True):
    row = {"family": fam, "exporter": exporter}
    path = os.path.join(out, f"{fam}_{exporter}.onnx")
    model = wrapper = None
    vision = fam.startswith(("resnet", "swin"))
    # Try input_ids only first; transformers' packed-sequence detection (torch.diff, not
    # exportable by TorchScript) only runs without an attention_mask, so retry with one.
    tries = [(None, False)] if vision else [("sdpa", False), ("eager", False), ("sdpa", True), ("eager", True)]
    first_err = None
    for attn, with_mask in tries:
        try:
            model, wrapper = build(attn)
            if do_perturb:
                perturb(model)
            ins, nms = list(inputs), list(names)
            if with_mask:
                ins.insert(1, torch.ones_like(inputs[0]))
                nms.insert(1, "attention_mask")
            if not vision:
                wrapper.arg_names = nms
            row["attn"] = (attn + ("+mask" if with_mask else "")) if attn else "-"
            with torch.no_grad():
                ref = wrapper(*ins)
            export(wrapper, ins, nms, path, exporter)
            row.pop("export_error", None)
            if first_err:
                row["first_export_error"] = first_err
            inputs, names = ins, nms
            break
        except Exception as e:  # next configuration, then give up
            row["export_error"] = first_line(e)
            first_err = first_err or row["export_error"]
            if os.environ.get("RM_VERBOSE"):
                traceback.print_exc()
    if "export_error" in row:
        return row
    row["torch_params"] = sum(p.numel() for p in model.parameters())
    row["onnx_bytes"] = os.path.getsize(path)

    ins = inspect(binary, path)
    row["trainable"] = ins["trainable"]
    row["state"] = ins["state"]
    row["ties"] = ins["ties"]
    row["inspect_error"] = ins["error"]
    with open(path + ".inspect.txt", "w") as f:
        f.write(ins["text"])
    if ins["ok"]:
        try:
            row["explain"] = explain_trainable(path, ins["text"], model)
        except Exception as e:
            row["explain_error"] = first_line(e)

    graph_inputs = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
    feeds = {n: t.numpy() for n, t in zip(names, inputs) if n in graph_inputs}
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    ort_outs = sess.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})
    ok, d, _ = compare(ref.numpy(), ort_outs[0])
    row["ort_vs_torch"] = d

    p, secs = run_binary(binary, path, feeds, os.path.join(out, f"{fam}_{exporter}"))
    row["run_secs"] = round(secs, 2)
    if p.returncode != 0:
        row["run_error"] = _err_line(p.stdout + p.stderr)
        return row
    results = []
    for name, want in zip(out_names, ort_outs):
        f = os.path.join(out, f"{fam}_{exporter}", "out", f"{name}.npy")
        if not os.path.exists(f):
            results.append((name, False, float("inf"), "missing output file"))
            continue
        got = np.load(f)
        okk, dd, note = compare(got, want)
        if got.dtype != want.dtype:
            note = (note + f" dtype {got.dtype} vs {want.dtype}").strip()
            okk = False
        results.append((name, okk, dd, note))
    row["outputs"] = results
    row["match"] = all(r[1] for r in results)
    row["max_diff"] = max((r[2] for r in results), default=0.0)
    return row


def explain_trainable(path, inspect_text, model):
    """Say, by value, what each initializer that `inspect` calls trainable is in PyTorch:
    a parameter ('param'), the transpose of one ('param^T': a weight the exporter folded a
    Transpose into, so if another initializer already holds that parameter it is a missed
    tie), a slice of one ('slice': e.g. position embeddings gathered at fixed positions and
    constant-folded), or nothing ('derived': a folded constant such as a causal mask or
    rotary cos/sin table, which is not a parameter)."""
    from onnx import numpy_helper
    names = [l.split()[0] for l in inspect_text.splitlines()
             if l.startswith("  ") and "trainable:" in l]
    inits = {i.name: i for i in onnx.load(path).graph.initializer}
    params = [(n, p.detach().numpy()) for n, p in model.named_parameters()]
    kinds, seen = {}, {}
    for name in names:
        if name not in inits:
            continue
        a = numpy_helper.to_array(inits[name])
        kind = "derived"
        for pn, p in params:
            if a.shape == p.shape and np.array_equal(a, p):
                kind = "param"
            elif a.ndim == 2 and a.shape == p.shape[::-1] and np.array_equal(a, p.T):
                kind = "param^T"
            elif a.size < p.size and a.ndim >= 1 and p.ndim >= 1 and a.shape[-1] == p.shape[-1]:
                rows = a.reshape(-1, a.shape[-1])
                if rows.shape[0] <= p.reshape(-1, p.shape[-1]).shape[0] and np.array_equal(
                        rows, p.reshape(-1, p.shape[-1])[:rows.shape[0]]):
                    kind = "slice"
            if kind != "derived":
                seen.setdefault(pn, []).append(name)
                break
        kinds[name] = (kind, a.size, tuple(a.shape))
    covered = set(seen)
    missing = [(n, p.size) for n, p in params if n not in covered]
    dup = {pn: ns for pn, ns in seen.items() if len(ns) > 1}
    return {"derived": [(n, k[2]) for n, k in kinds.items() if k[0] == "derived"],
            "derived_elems": sum(k[1] for k in kinds.values() if k[0] == "derived"),
            "slices": [(n, k[2]) for n, k in kinds.items() if k[0] == "slice"],
            "duplicated": dup,
            "dup_elems": sum(kinds[n][1] for ns in dup.values() for n in ns[1:]),
            "missing": missing}


# --------------------------------------------------------------------------- report
def _few(items, n=6):
    items = list(items)
    return ", ".join(items[:n]) + (f", … ({len(items) - n} more)" if len(items) > n else "")


def fmt_row(r):
    if "export_error" in r:
        return (f"| {r['family']} | {r['exporter']} | {r.get('attn', '')} | export failed | - | - | - | - | "
                f"`{r['export_error']}` |")
    loads = "yes" if not r.get("inspect_error") and "run_error" not in r else "**no**"
    match = "-" if "run_error" in r else ("yes" if r["match"] else "**no**")
    diff = "-" if "run_error" in r else f"{r['max_diff']:.2e}"
    tr = r["trainable"]
    pc = f"{tr} / {r['torch_params']}" + ("" if tr == r["torch_params"] else " **≠**")
    notes = []
    if r.get("inspect_error"):
        notes.append(f"inspect: `{r['inspect_error']}`")
    if "run_error" in r:
        notes.append(f"run: `{r['run_error']}`")
    for name, okk, dd, note in r.get("outputs", []):
        if not okk:
            notes.append(f"{name}: diff {dd:.2e} {note}".strip())
    if r.get("first_export_error"):
        notes.append(f"input_ids-only export failed: `{r['first_export_error']}`")
    ex = r.get("explain")
    if ex:
        if ex["duplicated"]:
            notes.append(f"same parameter trained twice (+{ex['dup_elems']}): " + "; ".join(
                f"{pn} as {', '.join(ns)}" for pn, ns in ex["duplicated"].items()))
        if ex["derived"]:
            notes.append(f"non-parameter constants trainable (+{ex['derived_elems']}): " + _few(
                f"{n}{list(sh)}" for n, sh in ex["derived"]))
        if ex["slices"]:
            notes.append("folded parameter slices: " + _few(f"{n}{list(sh)}" for n, sh in ex["slices"]))
        if ex["missing"]:
            notes.append(f"PyTorch parameters with no trainable initializer ({sum(k for _, k in ex['missing'])} elems): "
                         + _few(f"{n}({k})" for n, k in ex["missing"]))
    if r.get("ties"):
        notes.append("ties: " + "; ".join(t[:160] + ("…" if len(t) > 160 else "") for t in r["ties"]))
    if r.get("state"):
        notes.append(f"state elems {r['state']}")
    return (f"| {r['family']} | {r['exporter']} | {r.get('attn', '')} | {loads} | {match} | {diff} | "
            f"{r['ort_vs_torch']:.1e} | {pc} | {'<br>'.join(notes)} |")


def write_report(rows, out, header):
    lines = [header, "",
             f"Criterion: np.allclose(onnx-train, onnxruntime, rtol={RTOL}, atol={ATOL}) on every output. "
             "`ort↔torch` is onnxruntime vs PyTorch (exporter sanity). Params: trainable elements from "
             "`inspect` / `sum(p.numel() for p in model.parameters())`.", "",
             "| family | exporter | attn | loads | matches ORT | max abs diff | ort↔torch | trainable / torch params | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [fmt_row(r) for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return text


def main():
    fams = families()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default="target/release/onnx-train")
    ap.add_argument("--out", default="/tmp/rm")
    ap.add_argument("--families", nargs="*", default=list(fams), choices=list(fams))
    ap.add_argument("--exporters", nargs="*", default=["torchscript", "dynamo"], choices=["torchscript", "dynamo"])
    ap.add_argument("--no-perturb", action="store_true",
                    help="export the raw from_config init (LayerNorm ones, zero biases) instead of perturbed weights")
    ap.add_argument("--report-only", action="store_true", help="re-render OUT/report.md from OUT/results.json")
    a = ap.parse_args()
    binary = os.path.abspath(a.binary)
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    import transformers
    header = (f"# onnx-train on real model families\n\ntorch {torch.__version__}, transformers "
              f"{transformers.__version__}, onnx {onnx.__version__}, onnxruntime {ort.__version__}; "
              f"inputs [{BATCH}, {SEQ}] int64 ids (vision: [1, 3, H, W] f32); random init, seed 0"
              + ("; raw init (no perturbation)." if a.no_perturb else "; every parameter perturbed by N(0, 0.02)."))
    rows = []
    if a.report_only:
        with open(os.path.join(a.out, "results.json")) as f:
            print(write_report(json.load(f), a.out, header))
        return 0
    for fam in a.families:
        build, names, inputs = fams[fam]
        for exp in a.exporters:
            torch.manual_seed(0)
            t = time.time()
            try:
                r = check_one(fam, exp, build, names, inputs, binary, a.out, not a.no_perturb)
            except Exception as e:
                r = {"family": fam, "exporter": exp, "export_error": "check crashed: " + first_line(e)}
                traceback.print_exc()
            rows.append(r)
            print(f"[{time.time() - t:6.1f}s] {fmt_row(r)}", flush=True)
            write_report(rows, a.out, header)
    print(write_report(rows, a.out, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
