#!/usr/bin/env python3
"""PyTorch references for a Hugging Face GPT-2 exported by the TorchScript exporter (issue 51).

    python3 -m venv /tmp/torch-venv
    /tmp/torch-venv/bin/pip install torch transformers onnx==1.22.0 onnxruntime numpy
    /tmp/torch-venv/bin/python tools/refs/hf_gpt2_torchscript.py

Writes `crates/burn-onnx-train/tests/data/hf_gpt2_torchscript/` (test:
`tests/integration/initializer_ties.rs`, the `a_fresh_hf_gpt2_torchscript_*` tests):

- `model.onnx`: `transformers.GPT2LMHeadModel` (2 layers, 2 heads, width 24, vocabulary 64,
  16 positions, dropout 0, tied `lm_head`), FRESH from its seeded init: LayerNorm weights
  all ones, every bias all zeros. `torch.onnx.export(dynamo=False, opset_version=17,
  do_constant_folding=True)`, input `input_ids` [batch, seq], output `logits` only. The
  exporter's rewrites are what the test is about: it merges the equal-valued parameters
  (5 LayerNorm weights, 9 zero vectors of width 24, the 2 c_attn and the 2 c_fc biases)
  into 4 initializers read through `Identity` nodes, and folds the tied head into a
  transposed copy of the embedding (`onnx::MatMul_N`).
- `batch.npz`: `input_ids` int64 [4, 16] (seeded).
- `mapping.json`: for every PyTorch parameter, the ONNX nodes that read it, as
  `[node name, input slot, transposed]` (found by following the `Identity` nodes, whose
  outputs the exporter names after the parameters, and by comparing the folded copy with
  the embedding), plus the merged initializers and the library versions.
- `losses.json`: float64 PyTorch training, 3 updates of AdamW (lr 1e-3, betas 0.9/0.999,
  eps 1e-8, weight decay 0.01 on EVERY parameter, PyTorch's decoupled form) after
  `clip_grad_norm_(1.0)` (onnx-train's default `max_grad_norm`): `loss[k]` and
  `grad_norm[k]` (before clipping) at update k+1. Loss: mean next-token cross-entropy,
  `cross_entropy(logits[:, :-1], input_ids[:, 1:])`. `untied_head` holds the same run with
  `lm_head` a parameter of its own starting equal to the embedding (what training the
  folded copy apart gives, as onnxruntime-training and refkit's references do): it is NOT
  PyTorch's model, and the test checks that its numbers are told apart from the tied ones.
- `grads.npz`: d loss / d parameter at update 1 (float64 computed, stored float32), keyed
  by PyTorch parameter name (the tied embedding's is the sum over its two uses).
- `params_step3.npz`: every parameter after the 3 updates (float32), by PyTorch name.

The ONNX file is checked with `onnx.checker`, and onnxruntime's logits on the batch match
PyTorch's (max abs diff printed, asserted < 1e-5). transformers >= 5 finds packed sequences
with `torch.diff`, which opset 17 cannot export: the export replaces that search by "no
packed sequences" (what it finds for an unpadded batch anyway). Deterministic: seeded, one
thread.
"""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
import transformers.masking_utils as masking_utils
from onnx import numpy_helper
from transformers import GPT2Config, GPT2LMHeadModel

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "burn-onnx-train",
                   "tests", "data", "hf_gpt2_torchscript")
VOCAB, SEQ, BATCH, UPDATES = 64, 16, 4, 3
CONFIG = dict(n_layer=2, n_head=2, n_embd=24, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


def fresh_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()


class LogitsOnly(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def export(model, ids, path):
    search = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        torch.onnx.export(LogitsOnly(model), (ids,), path, dynamo=False, opset_version=17,
                          do_constant_folding=True, input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    finally:
        masking_utils.find_packed_sequence_indices = search
    onnx.checker.check_model(onnx.load(path))


def readers(path, params):
    """PyTorch parameter -> [[node, slot, transposed]] in the ONNX file."""
    g = onnx.load(path).graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    alias = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Identity"}
    out = {name: [] for name in params}
    for n in g.node:
        if n.op_type in ("Identity", "Constant"):
            continue
        for slot, x in enumerate(n.input):
            root = x
            while root in alias:
                root = alias[root]
            if root not in inits:
                continue
            # The exporter names each merged parameter's `Identity` output after it.
            name = x[2:] if x.startswith("m.") and x[2:] in params else root[2:] if root.startswith("m.") else None
            if name in params:
                out[name].append([n.name, slot, False])
                continue
            value = inits[root]
            hits = [p for p, v in params.items() if v.ndim == 2 and value.shape == v.T.shape and np.array_equal(value, v.T)]
            assert len(hits) == 1, f"{n.name} input {slot} ({root}) is no parameter"
            out[hits[0]].append([n.name, slot, True])
    for name, r in out.items():
        assert r, f"no node reads {name}"
    merged = {}
    for n in g.node:
        if n.op_type == "Identity" and n.input[0] in inits:
            merged.setdefault(n.input[0], [n.input[0]]).append(n.output[0])
    return out, merged


def train(model, ids, tie_head):
    m = GPT2LMHeadModel(GPT2Config(**CONFIG))
    m.load_state_dict(model.state_dict())
    m = m.double().train()
    if not tie_head:
        m.lm_head.weight = torch.nn.Parameter(m.transformer.wte.weight.detach().clone())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses, norms, grads = [], [], None
    for step in range(UPDATES):
        logits = m(input_ids=ids, use_cache=False, return_dict=False)[0]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().float().numpy().copy() for n, p in m.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item())
        losses.append(loss.item())
        opt.step()
    params = {n: p.detach().float().numpy().copy() for n, p in m.named_parameters()}
    return losses, norms, grads, params


def main():
    os.makedirs(OUT, exist_ok=True)
    model = fresh_model()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = os.path.join(OUT, "model.onnx")
    export(model, ids, path)
    with torch.no_grad():
        want = LogitsOnly(model)(ids).numpy()
    got = ort.InferenceSession(path).run(None, {"input_ids": ids.numpy()})[0]
    diff = float(np.abs(got - want).max())
    print("onnxruntime vs PyTorch logits: max abs diff", diff)
    assert diff < 1e-5

    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    found, merged = readers(path, params)
    losses, norms, grads, after = train(model, ids, tie_head=True)
    u_losses, u_norms, _, _ = train(model, ids, tie_head=False)
    print("tied        losses", losses, "grad norms", norms)
    print("untied head losses", u_losses, "grad norms", u_norms)

    np.savez(os.path.join(OUT, "batch.npz"), input_ids=ids.numpy().astype(np.int64))
    np.savez(os.path.join(OUT, "grads.npz"), **grads)
    np.savez(os.path.join(OUT, f"params_step{UPDATES}.npz"), **after)
    with open(os.path.join(OUT, "mapping.json"), "w") as f:
        json.dump({"parameters": found, "merged_initializers": merged,
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "onnx": onnx.__version__, "onnxruntime": ort.__version__}}, f, indent=1)
    with open(os.path.join(OUT, "losses.json"), "w") as f:
        json.dump({"optimizer": "AdamW lr 1e-3 betas (0.9, 0.999) eps 1e-8 weight_decay 0.01 on every parameter",
                   "max_grad_norm": 1.0, "updates": UPDATES, "dtype": "float64",
                   "loss": losses, "grad_norm": norms,
                   "untied_head": {"loss": u_losses, "grad_norm": u_norms},
                   "onnxruntime_vs_torch_logits_max_abs": diff}, f, indent=1)
    for name in sorted(os.listdir(OUT)):
        print(name, os.path.getsize(os.path.join(OUT, name)), "bytes")


if __name__ == "__main__":
    main()
