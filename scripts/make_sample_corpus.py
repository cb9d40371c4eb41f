"""Write a small offline corpus (the docstrings of Python's own standard library) for the quickstart.

Every Python install has these texts (PSF License), so the README's first command needs no
download.  Output: OUT/stdlib_docs.jsonl (one module per line) and OUT/readme.txt.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import warnings


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")
                   and m.module_finder.path.startswith(sys.base_prefix))
    n = 0
    warnings.simplefilter("ignore")  # deprecated modules warn on import and on attribute access
    with open(os.path.join(out, "stdlib_docs.jsonl"), "w", encoding="utf-8") as fh:
        for name in names:
            if name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
                continue
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - optional modules missing on this Python are fine
                continue
            parts = [mod.__doc__ or ""]
            for attr in sorted(dir(mod)):
                obj = getattr(mod, attr, None)
                doc = getattr(obj, "__doc__", None) if callable(obj) else None
                if doc and not attr.startswith("_"):
                    parts.append(f"{attr}: {doc}")
            text = "\n\n".join(p for p in parts if p.strip())
            if text:
                fh.write(json.dumps({"id": name, "text": text}) + "\n")
                n += 1
    with open(os.path.join(out, "readme.txt"), "w", encoding="utf-8") as fh:
        fh.write("Docstrings of the Python standard library, as a tiny corpus for helixtok's quickstart.\n")
    print(f"{out}: {n + 1} documents ({n} module docstrings in stdlib_docs.jsonl, readme.txt)", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/make_sample_corpus.py OUT_DIR")
    main(sys.argv[1])
