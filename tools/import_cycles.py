#!/usr/bin/env python3
"""The import cycles of a crate, between its source files and between its top-level modules
(`src/x.rs` or `src/x/`): every `use crate::...`, `use super::...` and `crate::a::b` path in
a file is an edge to the file that defines the module it names; cycles are the strongly
connected components of more than one file (or module). A module and its own submodules
are one unit: a parent's `mod child;` and re-exports are not edges.

    python3 tools/import_cycles.py crates/burn-onnx-train/src crates/burn-ort-dist/src

Exits 1 when there is a cycle. `mod.rs`/`lib.rs` re-exports (`pub use`) count as edges too.
"""
import os
import re
import sys


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


def targets(src, path, files):
    text = open(path).read()
    text = re.sub(r"//[^\n]*", "", text)
    # Leave out unit tests: they may import anything above.
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
    me = own_module(src, path)
    is_mod = os.path.basename(path) in ("mod.rs", "lib.rs")
    paths = []
    for m in GROUP.finditer(text):
        for item in re.split(r",", m.group(3)):
            item = item.strip().split(" as ")[0].split("::{")[0].strip()
            if item:
                paths.append((m.group(1), m.group(2) + "::" + item))
    for m in PATH.finditer(GROUP.sub("", text)):
        paths.append((m.group(1), m.group(2)))
    out = set()
    for root, rest in paths:
        segs = [s for s in rest.split("::") if s]
        if root == "crate":
            base = []
        else:
            base = list(me if is_mod else me[:-1])
            while segs and segs[0] == "super":
                segs.pop(0)
                base = base[:-1]
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
        for comp in sccs(modules):
            if len(comp) > 1:
                found += 1
                print(f"{src}: cycle of {len(comp)} modules: {', '.join(sorted(comp))}")
    print(f"{found} import cycle(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
