#!/usr/bin/env python3
"""docs/config-reference.md, generated from the config types' own doc comments.

Reads `crates/burn-onnx-train/src/train/config/*.rs`: `TrainingConfig`'s fields give the
sections in order, each section's struct gives its keys (a field's `///` comment is its
description, `#[serde(alias = "...")]` its other names), and a field whose type is a
plain enum there lists that enum's values. The file it writes is committed; the test
`config_reference::` regenerates it (`--check`) and also compares its keys with
`TrainingConfig::default()` serialised, so neither the descriptions nor the keys can
drift from the code.

    python3 tools/config_reference.py            # rewrite docs/config-reference.md
    python3 tools/config_reference.py --check    # exit 1 when it is out of date
"""
import glob
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SOURCES = os.path.join(ROOT, "crates/burn-onnx-train/src/train/config")
CRATE = os.path.join(ROOT, "crates/burn-onnx-train/src")
OUT = os.path.join(ROOT, "docs/config-reference.md")

HEADER = """# Config reference

Every key a config file takes, section by section, with what it does. Generated from the
doc comments of the config types (`crates/burn-onnx-train/src/train/config/`) by
`tools/config_reference.py`; a test fails when this page and the code disagree, so edit
the doc comment and rerun the script rather than this page. How files, ORT's flat names,
DeepSpeed files and `--set` map onto these keys is in the [user guide](user-guide.md#config-files);
`onnx-train train --print-config` prints a run's resolved values, `onnx-train init M.onnx`
writes a commented starter file.
"""


def strip_code(text):
    """Source without `#[cfg(test)] mod tests` and without `//` comments (docs kept)."""
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
    return re.sub(r"(?m)^\s*//(?![/!]).*$", "", text)


def items(text):
    """(kind, name, doc lines, attribute lines, body) of each `pub struct`/`pub enum`."""
    out = []
    for m in re.finditer(r"(?m)^((?:\s*(?:///.*|#\[.*\])\n)*)pub (struct|enum) (\w+)[^{;]*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        lead = m.group(1).splitlines()
        doc = [l.strip()[3:].strip() for l in lead if l.strip().startswith("///")]
        attrs = [l.strip() for l in lead if l.strip().startswith("#[")]
        out.append((m.group(2), m.group(3), doc, attrs, text[m.end():i - 1]))
    return out


def fields(body):
    """(name, type, doc lines, aliases) of each `pub name: Type,` in a struct body."""
    out, doc, aliases = [], [], []
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("///"):
            doc.append(s[3:].strip())
        elif s.startswith("#["):
            aliases += re.findall(r'alias\s*=\s*"([^"]+)"', s)
        elif s.startswith("pub "):
            m = re.match(r"pub (\w+):\s*(.+?),?$", s)
            out.append((m.group(1), m.group(2), doc, aliases))
            doc, aliases = [], []
    return out


def enum_values(attrs, body):
    """The serde names of a unit-only enum (`rename_all = "lowercase"/"snake_case"`)."""
    rename = next((re.search(r'rename_all\s*=\s*"(\w+)"', a).group(1)
                   for a in attrs if "rename_all" in a), None)
    names = []
    for line in body.splitlines():
        s = line.strip()
        if not s or s.startswith(("///", "#[")):
            continue
        m = re.match(r"(\w+),?$", s)
        if not m:
            return None  # a variant with data: no plain list
        names.append(m.group(1))
    if rename == "lowercase":
        return [n.lower() for n in names]
    if rename == "snake_case":
        return [re.sub(r"(?<!^)([A-Z])", r"_\1", n).lower() for n in names]
    return None


def describe_type(ty, enums):
    optional = ty.startswith("Option<")
    inner = ty[7:-1] if optional else ty
    plain = {
        "bool": "true or false", "usize": "integer", "u64": "integer", "u32": "integer",
        "i64": "integer", "f32": "number", "f64": "number", "String": "string",
        "PathBuf": "path", "Vec<String>": "list of strings", "Vec<usize>": "list of integers",
    }
    if inner in plain:
        text = plain[inner]
    elif inner in enums:
        text = "one of " + ", ".join(f"`{v}`" for v in enums[inner])
    else:
        text = "see the description"
    return text + (" (optional)" if optional else "")


def plain_doc(text):
    """A doc comment as page text: intra-doc links become code spans."""
    return re.sub(r"\[`([^`]+)`\](\([^)]*\))?", r"`\1`", text)


def section_doc(doc):
    """A section struct's doc without its leading `[name]:`, capitalised."""
    text = plain_doc(re.sub(r"^`\[\w+\]`:\s*", "", " ".join(doc)))
    return text[:1].upper() + text[1:] + "\n"


def generate():
    text = "".join(strip_code(open(p).read()) for p in sorted(glob.glob(os.path.join(SOURCES, "*.rs")))
                   if not p.endswith("deepspeed.rs"))
    structs = {name: (doc, fields(body)) for kind, name, doc, _, body in items(text) if kind == "struct"}
    # Plain enums anywhere in the crate (a loss kind, a precision) list their values.
    enums = {}
    for path in sorted(glob.glob(os.path.join(CRATE, "**/*.rs"), recursive=True)):
        for kind, name, _, attrs, body in items(strip_code(open(path).read())):
            values = enum_values(attrs, body) if kind == "enum" else None
            if values:
                enums[name] = values
    lines = [HEADER]
    for section, ty, _, _ in structs["TrainingConfig"][1]:
        doc, keys = structs[ty]
        lines.append(f"## `[{section}]`\n")
        lines.append(section_doc(doc))
        lines.append("| key | takes | what it does |")
        lines.append("|---|---|---|")
        for key, kty, kdoc, aliases in keys:
            what = plain_doc(" ".join(kdoc)).replace("|", "\\|")
            if aliases:
                what += " Also read as " + ", ".join(f"`{a}`" for a in aliases) + "."
            lines.append(f"| `{key}` | {describe_type(kty, enums)} | {what} |")
        lines.append("")
    return "\n".join(lines)


def main():
    text = generate()
    if "--check" in sys.argv[1:]:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if current != text:
            print("docs/config-reference.md is out of date: run python3 tools/config_reference.py")
            sys.exit(1)
        print("docs/config-reference.md is current")
        return
    open(OUT, "w").write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()
