#!/usr/bin/env python3
"""PyTorch references for the trainer, independent of our code.

    python3 -m venv /tmp/pyref && /tmp/pyref/bin/pip install torch onnxscript onnxruntime onnx numpy
    /tmp/pyref/bin/python tools/gen_train_refs.py

Part A writes `crates/burn-onnx-train/tests/data/dynamo_gpt2/`: a small nanoGPT-style GPT-2
with a TIED embedding, exported by the dynamo exporter (opset 18), which stores graph
constants (attention scale, GELU coefficients, mask values) as scalar initializers; the
batch, PyTorch's gradients, and 10 AdamW steps (lr 1e-3, wd 0.01 on every parameter).
`mapping.json` lists which initializers are PyTorch parameters and which are constants.

Part B writes `crates/burn-onnx-train/tests/data/optim/`: a small MLP (TorchScript exporter,
opset 17) and 10-step trajectories of SGD (momentum, L2 decay, global clipping), Adam (L2),
AdamW and LAMB (float64 reference), each with weight decay on weights and not on biases.
Part C writes `crates/burn-onnx-train/tests/data/external/mlp_per_tensor/`: that MLP saved by
the `onnx` package with every tensor in its own external file.
Deterministic: seeded, one thread, float32.
"""
import json
import math
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "burn-onnx-train", "tests", "data")


# ---------------------------------------------------------------- Part A: dynamo GPT-2
class Block(nn.Module):
    def __init__(self, d, heads, ctx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)).view(1, 1, ctx, ctx), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(~self.bias[:, :, :t, :t], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.attn.c_proj(y)
        m = self.mlp.c_fc(self.ln_2(x))
        m = 0.5 * m * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (m + 0.044715 * torch.pow(m, 3.0))))
        return x + self.mlp.c_proj(m)


class GPT(nn.Module):
    def __init__(self, vocab=256, ctx=64, d=64, layers=2, heads=4):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.wpe = nn.Embedding(ctx, d)
        self.transformer.h = nn.ModuleList([Block(d, heads, ctx) for _ in range(layers)])
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids):
        t = ids.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def lm_loss(logits, ids):
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


def onnx_params(path):
    m = onnx.load(path)
    return {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}, m


def part_a():
    out = os.path.join(ROOT, "dynamo_gpt2")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = GPT()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:  # LayerNorm weights/biases and biases: distinct values (exporters dedupe equal ones)
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.eval()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    path = os.path.join(out, "gpt2_tied.onnx")
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=64)
    prog = torch.onnx.export(model, (ids,), dynamo=True, opset_version=18, input_names=["input_ids"], output_names=["logits"],
                             dynamic_shapes={"ids": {0: batch, 1: seq}})
    prog.save(path, external_data=False)
    onnx.checker.check_model(path)
    inits, m = onnx_params(path)
    print("dynamo file: opset", [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")], "IR", m.ir_version)
    ops = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    print("ops:", dict(sorted(ops.items())))

    # The exporter's optimizer folds `Transpose(weight)` of every Linear into a new
    # initializer (`val_N`, the transposed weight) and names the tied table after one of its
    # users: match initializers to PyTorch parameters by value, directly or transposed.
    torch_params = {n: p.detach().numpy() for n, p in model.named_parameters()}  # tied weight once
    mapping, constants = {}, []
    for name, a in inits.items():
        hit = None
        if a.dtype == np.float32 and a.size > 1:
            for tn, tv in torch_params.items():
                if a.shape == tv.shape and np.array_equal(a, tv):
                    hit = {"torch": tn, "transposed": False}
                elif a.ndim == 2 and a.shape == tv.T.shape and np.array_equal(a, tv.T):
                    hit = {"torch": tn, "transposed": True}
                if hit:
                    break
        if hit:
            mapping[name] = hit
        elif a.dtype in (np.float32, np.float16, np.float64):
            constants.append(name)
        print(f"  {name:32s} {str(list(a.shape)):16s} {str(a.dtype):8s} {hit or 'constant'}")
    assert sorted(h["torch"] for h in mapping.values()) == sorted(torch_params), "every PyTorch parameter is one initializer"
    scalars = [c for c in constants if inits[c].size <= 1]
    assert scalars, "expected scalar float initializers from the dynamo exporter"
    tied = next(o for o, h in mapping.items() if h["torch"] == "transformer.wte.weight")
    users = [n.op_type for n in m.graph.node if tied in n.input]
    print(f"tied embedding '{tied}' read by:", users)
    assert "Gather" in users and len(users) >= 2, users

    with torch.no_grad():
        want = model(ids).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy()})[0]
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()

    np.savez(os.path.join(out, "batch.npz"), input_ids=ids.numpy())

    def in_onnx_layout(values):
        """Torch arrays by parameter name -> arrays by ONNX initializer name, ONNX layout."""
        return {o: (values[h["torch"]].T if h["transposed"] else values[h["torch"]]).copy() for o, h in mapping.items()}

    params_init = in_onnx_layout({n: p.detach().numpy() for n, p in model.named_parameters()})
    model.train()
    loss = lm_loss(model(ids), ids)
    loss.backward()
    grads = in_onnx_layout({n: p.grad.detach().numpy() for n, p in model.named_parameters()})
    loss0 = float(loss)
    model.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = lm_loss(model(ids), ids)
        losses.append(float(loss))
        loss.backward()
        opt.step()
    np.savez(os.path.join(out, "params_init.npz"), **params_init)
    np.savez(os.path.join(out, "grads.npz"), **grads)
    np.savez(os.path.join(out, "adamw_step10.npz"), **in_onnx_layout({n: p.detach().numpy() for n, p in model.named_parameters()}))
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"loss0": loss0, "adamw_losses": losses}, f, indent=1)
    with open(os.path.join(out, "mapping.json"), "w") as f:
        json.dump({"parameters": mapping, "constants": constants}, f, indent=1)


# ---------------------------------------------------------------- Part B: optimizers
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def lamb_step(params, state, lr, b1, b2, eps, wd_of):
    """LAMB in float64 on float64 copies; results rounded to float32."""
    for name, p in params:
        g = p.grad.detach().double()
        s = state.setdefault(name, {"t": 0, "m": torch.zeros_like(g), "v": torch.zeros_like(g), "p": p.detach().double().clone()})
        s["p"] = p.detach().double().clone()
        s["t"] += 1
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        m_hat = s["m"] / (1 - b1 ** s["t"])
        v_hat = s["v"] / (1 - b2 ** s["t"])
        u = m_hat / (v_hat.sqrt() + eps) + wd_of(name) * s["p"]
        pn, un = s["p"].norm(), u.norm()
        trust = (pn / un) if (pn > 0 and un > 0) else 1.0
        with torch.no_grad():
            p.copy_((s["p"] - lr * trust * u).float())


def part_b():
    out = os.path.join(ROOT, "optim")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(3)
    base = MLP()
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(5))
    path = os.path.join(out, "mlp_small.onnx")
    torch.onnx.export(base, (x,), path, dynamo=False, opset_version=17, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    inits, _ = onnx_params(path)
    assert set(inits) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}, set(inits)
    np.savez(os.path.join(out, "batch.npz"), input=x.numpy(), target=y.numpy())
    init_state = {k: v.clone() for k, v in base.state_dict().items()}

    m = MLP()
    m.load_state_dict(init_state)
    F.cross_entropy(m(x), y).backward()
    np.savez(os.path.join(out, "grads0.npz"), **{n: p.grad.numpy() for n, p in m.named_parameters()})

    cases = {
        "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01, max_grad_norm=0.5),
        "adam": dict(lr=0.01, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01, max_grad_norm=0.0),
        "adamw": dict(lr=0.01, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1, max_grad_norm=0.0),
        "lamb": dict(lr=0.01, betas=[0.9, 0.999], eps=1e-6, weight_decay=0.01, max_grad_norm=0.0),
    }
    refs = {}
    for case, hp in cases.items():
        m = MLP()
        m.load_state_dict(init_state)
        named = list(m.named_parameters())
        decay = [p for n, p in named if not n.endswith("bias")]
        no_decay = [p for n, p in named if n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
        if case == "sgd":
            opt = torch.optim.SGD(groups, lr=hp["lr"], momentum=hp["momentum"], dampening=0, nesterov=False)
        elif case == "adam":
            opt = torch.optim.Adam(groups, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"])
        elif case == "adamw":
            opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"])
        else:
            opt, state = None, {}
        losses = []
        for step in range(10):
            m.zero_grad()
            loss = F.cross_entropy(m(x), y)
            losses.append(float(loss))
            loss.backward()
            if hp["max_grad_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(m.parameters(), hp["max_grad_norm"])
            if opt is not None:
                opt.step()
            else:
                lamb_step(named, state, hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"],
                          lambda n: 0.0 if n.endswith("bias") else hp["weight_decay"])
            if step in (0, 9):
                snap = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
                np.savez(os.path.join(out, f"{case}_step{step + 1}.npz"), **snap)
        refs[case] = dict(hp, losses=losses)
    with open(os.path.join(out, "refs.json"), "w") as f:
        json.dump(refs, f, indent=1)


# ---------------------------------------------------------------- Part C: external data
def part_c():
    """The Part B MLP saved by the onnx package with one external file per tensor."""
    out = os.path.join(ROOT, "external", "mlp_per_tensor")
    os.makedirs(out, exist_ok=True)
    m = onnx.load(os.path.join(ROOT, "optim", "mlp_small.onnx"))
    onnx.save_model(m, os.path.join(out, "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    onnx.checker.check_model(os.path.join(out, "model.onnx"))
    print("external files:", sorted(os.listdir(out)))


if __name__ == "__main__":
    part_a()
    part_b()
    part_c()
