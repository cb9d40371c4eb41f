"""llm.c's token file (a 256-int32 header, then the ids) from a packed build's stream."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..format.errors import ConfigError
from ..format.manifest import load_manifest, split_entry
from ..read.splitview import SplitView

# llm.c dev/data/data_common.py HEADERS_INFO: (magic, version) per token width.
HEADERS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}


def export_llmc(src: str, dest: str, *, split: str = "train") -> dict:
    """Write `dest`: header[0] = magic, header[1] = version, header[2] = token count, 256
    int32 in all, then the split's token stream (every chunk, in order) as llm.c reads it."""
    m = load_manifest(src)
    s = split_entry(m, split, src)
    if m["packing"] != "packed":
        raise ConfigError(f"{src}: llm.c reads one token stream; this build is {m['packing']}-packed "
                          "(rebuild with --pack packed)")
    n = int(s["num_tokens"])
    if n >= 2**31:
        raise ConfigError(f"{src}: {n} tokens; llm.c's header counts at most 2**31 - 1: export fewer shards")
    if os.path.exists(dest):
        raise ConfigError(f"{dest}: exists; give a new file name")
    magic, version = HEADERS[m["dtype"]]
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, n
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)  # as the other exports make theirs
    tmp = dest + ".tmp"
    view = SplitView(src, m, split)
    step = 1 << 24
    try:
        with open(tmp, "wb") as out:
            out.write(header.tobytes())
            for a in range(0, n, step):  # the chunks' tokens: not the stream's last partial chunk
                out.write(view.tokens(a, min(n, a + step)).tobytes())
    except BaseException:  # a refusal (a damaged shard) or a full disk leaves nothing in the user's folder
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, dest)
    return {"tokens": n, "dtype": m["dtype"], "magic": magic, "version": version}
