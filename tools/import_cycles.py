#!/usr/bin/env python3
"""The layers of a crate and its import cycles.

Layers: each crate's top-level modules (`src/x.rs` or `src/x/`) are ranked in `LAYERS`,
bottom first; a module may import from its own layer and the layers below, never from one
above, and a top-level module missing from the table is an error (put it in a layer).

Cycles: between its source files and between its top-level modules
(`src/x.rs` or `src/x/`): every `use crate::...`, `use super::...` and `crate::a::b` path in
a file is an edge to the file that defines the module it names; cycles are the strongly
connected components of more than one file (or module). A module and its own submodules
are one unit: a parent's `mod child;` and re-exports are not edges.

    python3 tools/import_cycles.py crates/burn-onnx-train/src crates/burn-ort-dist/src

Exits 1 when there is a cycle or a layer is crossed upwards. `mod.rs`/`lib.rs`
re-exports (`pub use`) count as edges too, except the block of old module paths kept for
one release (between `// -- old module paths` and `// -- end of old module paths --`).
"""
import os
import re
import sys

# Bottom first; modules in one inner list are one layer (lib.rs docs say what each holds).
LAYERS = {
    "burn-onnx-train": [
        ["error", "util"],
        ["value", "collective", "graph", "kernels", "ops"],
        ["model"],
        ["onnx"],
        ["parallel"],
        ["train"],
        ["frontend"],
    ],
    "burn-ort-dist": [
        ["error"],
        ["storage"],
        ["comm"],
        ["grads"],
        ["update"],
    ],
}


def module_files(src):
    """module path (tuple) -> file."""
    files = {}
    for dirpath, _, names in os.walk(src):
        for n in names:
            if not n.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, n), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            if parts and parts[0] == "bin":
                continue
            files[tuple(parts)] = os.path.join(src, rel)
    return files


def own_module(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    return tuple(rel[:-1]) if rel[-1] in ("mod", "lib") else tuple(rel)


PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")
GROUP = re.compile(r"\b(crate|super)((?:::\w+)*)::\{([^;]*?)\}", re.S)
LITERAL = re.compile(r'r(#*)".*?"\1|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\\\'])\'', re.S)


def blank(m):
    return " " * len(m.group(0))


def inline_mod_spans(text):
    """(start, end) of each inline `mod name { ... }` block (strings already blanked)."""
    spans = []
    for m in re.finditer(r"\bmod\s+\w+\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


def targets(src, path, files):
    text = open(path).read()
    text = re.sub(r"// -- old module paths.*?// -- end of old module paths --", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = LITERAL.sub(blank, text)
    # Leave out unit tests: they may import anything above.
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
    me = own_module(src, path)
    spans = inline_mod_spans(text)
    paths = []
    for m in GROUP.finditer(text):
        for item in re.split(r",", m.group(3)):
            item = item.strip().split(" as ")[0].split("::{")[0].strip()
            if item:
                paths.append((m.start(), m.group(1), m.group(2) + "::" + item))
    grouped = GROUP.sub(lambda m: " " * len(m.group(0)), text)
    for m in PATH.finditer(grouped):
        paths.append((m.start(), m.group(1), m.group(2)))
    out = set()
    for at, root, rest in paths:
        segs = [s for s in rest.split("::") if s]
        if root == "crate":
            base = []
        else:
            ups = 1
            while segs and segs[0] == "super":
                segs.pop(0)
                ups += 1
            # `super` out of an inline module stays in this file.
            ups -= sum(1 for s, e in spans if s < at < e)
            if ups <= 0:
                continue
            base = list(me)[: len(me) - ups]
        full = base + segs
        # The longest prefix that is a module file.
        for k in range(len(full), -1, -1):
            key = tuple(full[:k])
            if key in files:
                if files[key] != path:
                    out.add(files[key])
                break
    return out


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def layer_violations(src, graph, top):
    """Imports that go up a layer, and top-level modules in no layer."""
    crate = os.path.basename(os.path.dirname(os.path.abspath(src)))
    if crate not in LAYERS:
        print(f"{src}: no layers listed for crate {crate} in tools/import_cycles.py")
        return 1
    rank = {m: i for i, layer in enumerate(LAYERS[crate]) for m in layer}
    found = 0
    for m in sorted({top(f) for f in graph} - {"lib"} - set(rank)):
        print(f"{src}: top-level module {m} is in no layer (add it to LAYERS)")
        found += 1
    for f, ts in sorted(graph.items()):
        for t in sorted(ts):
            a, b = top(f), top(t)
            if a in rank and b in rank and rank[b] > rank[a]:
                found += 1
                print(f"{src}: {os.path.relpath(f, src)} ({a}) imports "
                      f"{os.path.relpath(t, src)} ({b}), a layer above it")
    return found


def main():
    found = 0
    for src in sys.argv[1:]:
        files = module_files(src)
        graph = {f: targets(src, f, files) for f in files.values()}
        for comp in sccs(graph):
            if len(comp) > 1:
                found += 1
                names = sorted(os.path.relpath(f, src) for f in comp)
                print(f"{src}: cycle of {len(comp)} files: {', '.join(names)}")
        # The same between top-level modules (the crate root, lib.rs, is left out: its
        # macros and re-exports are reachable from everywhere).
        top = lambda f: os.path.relpath(f, src).split(os.sep)[0].removesuffix(".rs")
        modules = {}
        for f, ts in graph.items():
            modules.setdefault(top(f), set()).update(
                top(t) for t in ts if top(t) not in (top(f), "lib")
            )
        modules.pop("lib", None)
        found += layer_violations(src, graph, top)
        for comp in sccs(modules):
            if len(comp) > 1:
                found += 1
                print(f"{src}: cycle of {len(comp)} modules: {', '.join(sorted(comp))}")
    print(f"{found} import cycle(s) or layer violation(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
