#!/usr/bin/env python3
"""Which way the layers of src/ point (docs/design.md): a file may name its
own layer and the ones below it, never one above.

    model    checkpoint, graph, tensor, options, retention, report, error,
             process, file helpers (the files at the top of src/)
    format   src/format/
    engine   src/engine/
    db       src/db/
    store    src/store/
    exchange, remote   src/exchange/, src/remote/ (beside each other; neither
                       names the other)

Every `crate::...` path is read (grouped `use crate::{a, b::{c, d}}` too),
and a name the crate root re-exports (`crate::CheckpointStore`) is resolved
to the module that defines it. `impl CheckpointStore` outside src/store/ is
counted as an edge from store up to that file's layer.

The edges that point the wrong way today are listed in
scripts/layers-known.txt: the check fails on any edge not listed there (a
new back-edge) and names listed edges that are gone (so the list shrinks
as the layering is mended). Run: python3 scripts/layers.py
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
KNOWN = ROOT / "scripts" / "layers-known.txt"

RANK = {"model": 0, "format": 1, "engine": 2, "db": 3, "store": 4, "exchange": 5, "remote": 5}


def layer_of_module(first: str) -> str:
    """The layer of a top-level module name of the crate."""
    return first if first in RANK else "model"


def layer_of_file(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC)
    if len(rel.parts) == 1:
        return "model"
    return layer_of_module(rel.parts[0])


def reexports() -> dict:
    """Names the crate root re-exports, mapped to their top-level module."""
    lib = (SRC / "lib.rs").read_text()
    out = {}
    for module, names in re.findall(r"pub use (\w+)::\{?([^;]*?)\}?;", lib, re.S):
        for name in re.split(r"[,\s]+", names):
            name = name.strip()
            if name:
                out[name] = module
    return out


def expand(tree: str) -> list:
    """`a, b::{c, d}, e::f` -> ['a', 'b::c', 'b::d', 'e::f']."""
    items, depth, cur = [], 0, ""
    for ch in tree:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur.strip())
    out = []
    for item in items:
        m = re.match(r"([\w:]*?)::\{(.*)\}$", item, re.S)
        if m:
            out += [f"{m.group(1)}::{sub}" for sub in expand(m.group(2))]
        elif item.startswith("{") and item.endswith("}"):
            out += expand(item[1:-1])
        else:
            out.append(item)
    return out


def paths_in(text: str) -> list:
    """Every crate path a file names."""
    text = re.sub(r"//[^\n]*", "", text)  # comments, doc comments included
    found = []
    for tree in re.findall(r"use crate::\{(.*?)\};", text, re.S):
        found += expand(tree)
    text = re.sub(r"use crate::\{.*?\};", "", text, flags=re.S)
    found += re.findall(r"crate::([A-Za-z_][\w:]*)", text)
    return found


def edges() -> set:
    names = reexports()
    out = set()
    for path in sorted(SRC.rglob("*.rs")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "bin" or rel.name == "lib.rs":
            continue
        here = layer_of_file(path)
        text = path.read_text()
        for p in paths_in(text):
            first = p.split("::")[0]
            module = names.get(first, first)
            there = layer_of_module(module)
            wrong = RANK[there] > RANK[here] or (
                there != here and RANK[there] == RANK[here] == RANK["remote"]
            )
            if wrong:
                out.add(f"{rel} -> {there}")
        if re.search(r"^impl CheckpointStore\b", text, re.M) and rel.parts[0] != "store":
            out.add(f"{rel} -> impl CheckpointStore")
    return out


def main() -> int:
    found = edges()
    known = set()
    if KNOWN.exists():
        known = {
            line.strip()
            for line in KNOWN.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
    new = sorted(found - known)
    gone = sorted(known - found)
    for e in new:
        print(f"layers: new edge against the layering: {e}")
    for e in gone:
        print(f"layers: mended, remove from {KNOWN.name}: {e}")
    print(f"layers: {len(found)} known back-edges, {len(new)} new, {len(gone)} mended")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
