"""The package's import graph in numbers: modules per folder, imports between folders, imports that run
against the layers pyproject.toml's import-linter contract states, and circles between modules.

Every import counts, those inside functions too (the layers hold for what a process may load, not only
for what it loads at start).  `lint-imports` enforces the layers; this prints what the map in
docs/architecture.md quotes.

    python scripts/import_graph.py [REPO]       (default: this checkout)
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re


def modules(root: str) -> dict[str, str]:
    """helixtok's modules: dotted name -> path."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, "helixtok")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the helixtok modules it imports (a package's __init__ only when nothing under it is named)."""
    edges = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def folder_of(mods: dict[str, str]):
    """name -> its folder under helixtok/ ("(root)" for the modules beside __init__.py)."""
    folders = {n.split(".")[1] for n, p in mods.items() if n.count(".") == 1 and p.endswith("__init__.py")}

    def folder(name: str) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in folders else "(root)"
    return folder


def layers(root: str) -> list[set[str]]:
    """The layers contract's layers, top first, each a set of folder names."""
    text = open(os.path.join(root, "pyproject.toml"), encoding="utf-8").read()
    m = re.search(r'^layers = \[(.*?)\]', text, re.MULTILINE)
    if m is None:
        return []
    return [set(x.strip() for x in re.split(r"[|:]", layer)) for layer in re.findall(r'"([^"]+)"', m.group(1))]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    root = ap.parse_args().repo
    mods = modules(root)
    folder = folder_of(mods)
    edges = imports(mods)
    per = collections.Counter(folder(n) for n in mods)
    print(f"{len(mods)} modules, {sum(map(len, edges.values()))} imports between them")
    print("modules per folder: " + ", ".join(f"{f} {n}" for f, n in sorted(per.items())))
    between = collections.Counter((folder(a), folder(b)) for a, bs in edges.items() for b in bs
                                  if folder(a) != folder(b))
    print("imports between folders: " + ", ".join(f"{a} -> {b} {n}" for (a, b), n in sorted(between.items())))
    rank = {f: i for i, layer in enumerate(layers(root)) for f in layer}
    back = sorted((a, b) for a, bs in edges.items() for b in bs if folder(a) != folder(b)
                  and folder(a) in rank and folder(b) in rank and rank[folder(b)] <= rank[folder(a)])
    print(f"imports against the layers: {len(back)}" + "".join(f"\n  {a} -> {b}" for a, b in back))
    found = circles(edges)
    print(f"circles: {len(found)}" + "".join("\n  " + " <-> ".join(g) for g in found))


if __name__ == "__main__":
    main()
