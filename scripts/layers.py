#!/usr/bin/env python3
"""Which way the layers of src/ point (docs/design.md): a file may name its
own layer and the ones below it, never one above.

    model    checkpoint, graph, tensor, options, retention, report, error,
             process, file helpers (the files at the top of src/)
    format   src/format/
    engine   src/engine/
    exchange src/exchange/ (codecs: safetensors in and out, over the
             engine's step data; the store calls them)
    db       src/db/
    store    src/store/ (the local public API)
    remote   src/remote/ (over the store's step reader and commit API)
    tier     src/tier/ (a node's directory of the local tier, over the store)

Inside src/remote/ its parts point one way too, lowest first: format
(the bucket's names and bodies), s3, bucket (the one place requests are
made), coordination (locks, the prefix's owner, the collection mark and
what is remembered under it), read, write, gc, global. A file of a part
may name, by a `crate::remote::` path or by calling a method that a file
of another part defines on a part's type, only its own part and those
below. The parts' work is on their own types (coordination `Shared`,
read `Reader`, write `Writer`, gc `Collector`, global `Coordinator`);
`Remote`'s methods are its front door, in src/remote/mod.rs and each
part's mod.rs, and a part's front door hands its calls to its own type
alone.

The modules of the Python bindings (python/src/) and of the CLI
(src/bin/ckpt/) must not name each other in a circle either, nor the
modules of the Python package (python/pysrc/ckptstore/), whose front
doors, its packages' `__init__.py` (the package's and `ckptstore.dcp`'s),
only re-export (no module imports one) and whose modules import no
underscored name of another (imports under `if TYPE_CHECKING:` are for
annotations only, and not counted). Inside `ckptstore.dcp` its parts
point one way, lowest first (PACKAGE_ORDER): the ranks' wire, the
metadata document, the rank-local mode's rules, the targets (their
protocols, the bucket, the local store, which one a user names), the
striped loads (`stripes/`: plan, proofs, run), the reader, the writer,
the exports, the local tier (`tiers/`: layout, a node, the save, the
load, the upload, `Tiers`).

Every `crate::...` path is read (grouped `use crate::{a, b::{c, d}}` too),
and a name the crate root re-exports (`crate::CheckpointStore`) is resolved
to the module that defines it. `impl CheckpointStore` outside src/store/ is
counted as an edge from store up to that file's layer.

The edges that point the wrong way today are listed in
scripts/layers-known.txt: the check fails on any edge not listed there (a
new back-edge) and names listed edges that are gone (so the list shrinks
as the layering is mended). Run: python3 scripts/layers.py
"""

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
KNOWN = ROOT / "scripts" / "layers-known.txt"

RANK = {"model": 0, "format": 1, "engine": 2, "exchange": 3, "db": 4, "store": 5, "remote": 6, "tier": 7}


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
            wrong = RANK[there] > RANK[here]
            if wrong:
                out.add(f"{rel} -> {there}")
        if re.search(r"^impl CheckpointStore\b", text, re.M) and rel.parts[0] != "store":
            out.add(f"{rel} -> impl CheckpointStore")
    return out | remote_edges()


REMOTE = SRC / "remote"
REMOTE_RANK = {"format": 0, "s3": 1, "bucket": 2, "coordination": 3, "read": 4, "write": 5, "gc": 6, "global": 7}


def _remote_part(path: pathlib.Path) -> str:
    rel = path.relative_to(REMOTE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


ROLE = {"coordination": "shared", "read": "reader", "write": "writer", "gc": "collector", "global": "coordinator"}
TYPES = r"(?:Remote|Shared|Reader|Writer|Collector|Coordinator)(?:<'_>)?"


def _remote_impls(text: str) -> list:
    """The bodies of a file's `impl` blocks of `Remote` and the parts'
    types (comments removed)."""
    return re.findall(r"^impl " + TYPES + r" \{(.*?)^\}", re.sub(r"//[^\n]*", "", text), re.S | re.M)


def front_door_edges(path: pathlib.Path, part: str, text: str) -> set:
    """`impl Remote` outside a front door, or a front door handing calls
    to another part's type."""
    rel = path.relative_to(SRC)
    if path.name != "mod.rs":
        return {f"{rel} -> impl Remote"} if re.search(r"^impl Remote \{", text, re.M) else set()
    out = set()
    for body in re.findall(r"^impl Remote \{(.*?)^\}", text, re.S | re.M):
        for role in set(re.findall(r"self\.(\w+)\(\)\.", body)):
            if role != ROLE.get(part):
                out.add(f"{rel} -> remote ({role}: not this part's type)")
    return out


def remote_edges() -> set:
    """Edges inside src/remote/ that point up its parts (REMOTE_RANK)."""
    files = [p for p in sorted(REMOTE.rglob("*.rs")) if p != REMOTE / "mod.rs"]
    defined = {}  # method of Remote -> the parts that define it
    for path in files:
        for body in _remote_impls(path.read_text()):
            for name in re.findall(r"fn (\w+)\s*(?:<[^>]*>)?\(\s*&(?:mut )?self", body):
                defined.setdefault(name, set()).add(_remote_part(path))
    out = set()
    for path in files:
        here, text = _remote_part(path), path.read_text()
        rel = path.relative_to(SRC)
        for part in set(re.findall(r"crate::remote::(\w+)", re.sub(r"//[^\n]*", "", text))):
            if REMOTE_RANK.get(part, -1) > REMOTE_RANK[here]:
                out.add(f"{rel} -> remote/{part}")
        out |= front_door_edges(path, here, text)
        for body in _remote_impls(text):
            for name in set(re.findall(r"\bself\s*\.(\w+)\(", body)):
                for part in defined.get(name, ()):
                    if REMOTE_RANK[part] > REMOTE_RANK[here]:
                        out.add(f"{rel} -> remote/{part} ({name})")
    return out


def module_file(parts: list):
    """The file of the longest module path `parts` names, or None."""
    for n in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:n])
        for candidate in (base.with_suffix(".rs"), base / "mod.rs"):
            if candidate.is_file():
                return candidate, parts[n:]
    return None, parts


def resolve(parts: list, names: dict):
    """The file defining what a module path names: a re-export of the
    module's front door (`pub use sub::Name`) is followed to `sub`."""
    if parts and parts[0] in names and not module_file(parts[:1])[0]:
        parts = [names[parts[0]]] + parts
    path, rest = module_file(parts)
    while path is not None and path.name == "mod.rs" and rest:
        text = path.read_text()
        m = re.search(
            r"pub(?:\(crate\))? use (\w+)::(?:\{[^}]*\b%s\b[^}]*\}|%s\b)" % (rest[0], rest[0]),
            text,
        )
        if not m or not (path.parent / (m.group(1) + ".rs")).exists() and not (
            path.parent / m.group(1) / "mod.rs"
        ).exists():
            break
        sub = list(path.relative_to(SRC).parent.parts) + [m.group(1)]
        path, rest = module_file(sub)[0], rest
        if path is None or path.name != "mod.rs":
            break
    return path


def file_edges() -> dict:
    """file -> files it names, by `crate::` and `super::` paths."""
    names = reexports()
    graph = {}
    for path in sorted(SRC.rglob("*.rs")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "bin" or rel.name == "lib.rs":
            continue
        text = re.sub(r"//[^\n]*", "", path.read_text())
        here = list(rel.parent.parts) if rel.name == "mod.rs" else list(rel.with_suffix("").parts)
        targets = set()
        for p in paths_in(text):
            targets.add(resolve(p.split("::"), names))
        for sup in re.findall(r"super::([\w:]+)", text):
            targets.add(resolve(here[:-1] + sup.split("::"), {}))
        for tree in re.findall(r"use super::\{(.*?)\};", text, re.S):
            for item in expand(tree):
                targets.add(resolve(here[:-1] + item.split("::"), {}))
        graph[path] = {t for t in targets if t is not None and t != path}
    return graph


def circles(graph: dict) -> list:
    """Strongly connected sets of more than one file (Tarjan), leaving out
    each folder's front door (`mod.rs`) with the files below it (its
    folder's and its subfolders': the front door re-exports them, and they
    name the types it defines)."""

    def front_door(a, b):
        return (a.name == "mod.rs" and a.parent in b.parents) or (
            b.name == "mod.rs" and b.parent in a.parents
        )

    g = {a: {b for b in bs if b in graph and not front_door(a, b)} for a, bs in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
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
            if len(comp) > 1:
                out.append(sorted(str(c.relative_to(ROOT)) for c in comp))

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


# Flat folders of modules under one root file, checked for circles too:
# the Python bindings and the CLI.
FLAT = [(ROOT / "python" / "src", "lib.rs"), (SRC / "bin" / "ckpt", "main.rs")]


def flat_edges(folder: pathlib.Path, root: str) -> dict:
    """module file -> the sibling module files it names (`crate::m`,
    `super::m`, `use crate::{m, ...}`, `use super::{m, ...}`), the root
    file left out."""
    files = {p.stem: p for p in folder.glob("*.rs") if p.name != root}
    graph = {}
    for name, path in files.items():
        text = re.sub(r"//[^\n]*", "", path.read_text())
        named = set(re.findall(r"\b(?:crate|super)::(\w+)", text))
        for tree in re.findall(r"use (?:crate|super)::\{(.*?)\};", text, re.S):
            named |= {item.split("::")[0].strip() for item in expand(tree)}
        graph[path] = {files[n] for n in named if n in files and n != name}
    return graph


PACKAGE = ROOT / "python" / "pysrc" / "ckptstore"


# The order of the parts of `ckptstore.dcp` and of its subpackages, lowest
# first: a module may import its own part and the parts before it, never
# one after (as src/remote/'s parts).
PACKAGE_ORDER = {
    "dcp": [
        "_wire", "_document", "_rank_local", "_targets", "_bucket", "_local", "_choose", "stripes", "_reader", "_writer",
        "_export", "tiers",
    ],
    "dcp.stripes": ["_plan", "_proofs", "_run"],
    "dcp.tiers": ["_layout", "_node", "_save", "_load", "_upload", "_tiers"],
}


def _runtime_imports(tree: ast.Module):
    """The package-relative imports of a module run at import time or
    later (not those under `if TYPE_CHECKING:`)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and id(node) not in skip:
            yield node


def _package_modules() -> dict:
    """Every module of the package by dotted name below `ckptstore` (a
    package by its own name, the root's front door as `__init__`)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.ImportFrom, here: str, modules: dict) -> list:
    """The modules a relative import in module `here` names (a name that is
    no module is the package's, or the module's, own)."""
    package = here.split(".")[:-1] if not modules[here].name == "__init__.py" else here.split(".")
    if here == "__init__":
        package = []
    base = package[: len(package) - (node.level - 1)]
    if node.module:
        target = ".".join(base + node.module.split("."))  # `_ckptstore` has no file
        subs = [f"{target}.{a.name}" for a in node.names]
        return subs if all(m in modules for m in subs) else [target]  # a package's modules, or names
    found = []
    for alias in node.names:
        target = ".".join(base + [alias.name])
        found.append(target if target in modules else (".".join(base) or "__init__"))
    return found


def _out_of_order(here: str, target: str):
    """The order of the package whose parts module `here` importing
    `target` points up, or None."""
    for package, order in PACKAGE_ORDER.items():
        prefix = package + "."
        if not (here.startswith(prefix) and target.startswith(prefix)):
            continue
        mine, theirs = here[len(prefix):].split(".")[0], target[len(prefix):].split(".")[0]
        if mine in order and theirs in order and order.index(theirs) > order.index(mine):
            return order
    return None


def package_edges() -> tuple:
    """module file -> the package's module files it imports; and the
    problems of the front doors, of the order of `ckptstore.dcp`'s parts
    and of underscored names imported."""
    modules = _package_modules()
    doors = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph, problems = {}, []
    for here, path in modules.items():
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            for target in _imported(node, here, modules):
                targets.add(target)
                names_of = node.module and target.split(".")[-1] == node.module.split(".")[-1]
                if names_of and target != "_ckptstore" and target in modules and target not in doors:
                    hidden = [a.name for a in node.names if a.name.startswith("_")]
                    if hidden:
                        problems.append(f"{path.name} imports {', '.join(hidden)} of {target}")
                order = _out_of_order(here, target)
                if order:
                    problems.append(f"{here} imports {target}, a part after its own (lowest first: {', '.join(order)})")
        targets.discard(here)
        for door in doors & targets:
            # A front door is imported by no module (a package's own
            # parts neither: they import the module that defines a name).
            if not here.startswith(door + ".") or door == "__init__":
                problems.append(f"{here} imports the front door {door}: import the module that defines it")
        graph[path] = {modules[t] for t in targets if t in modules}
    for door in doors:
        for node in ast.parse(modules[door].read_text()).body:
            plain = isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            )
            named_all = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
            if not plain and not named_all:
                problems.append(f"{modules[door].relative_to(PACKAGE)} line {node.lineno}: a front door only re-exports")
    return graph, problems


def main() -> int:
    loops = circles(file_edges())
    for folder, root in FLAT:
        loops += circles(flat_edges(folder, root))
    package, problems = package_edges()
    loops += circles(package)
    for problem in problems:
        print("layers: python package: " + problem)
    for loop in loops:
        print("layers: files that name each other: " + " <-> ".join(loop))
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
    return 1 if new or gone or loops or problems else 0


if __name__ == "__main__":
    sys.exit(main())
