"""Document boundaries of packed chunks in the forms attention kernels take: position_ids,
document_ids, cu_seqlens/max_seqlen, and a dense block-causal mask for SDPA."""

from __future__ import annotations

import numpy as np

from . import require_torch

torch = require_torch()


def boundaries(starts: list[np.ndarray], seq_len: int) -> dict:
    """From each row's document start offsets (ds.document_starts(i)), a batch's boundaries.

    - position_ids [B, L]: distance from the latest document start (or the row start);
    - document_ids [B, L]: 0 for the piece a row begins with, +1 at every document start in it
      (a FlexAttention mask_mod or `block_causal_mask` compares them within a row);
    - cu_seqlens int32 [segments + 1]: cumulative lengths of the row pieces over the flattened
      batch (B * L tokens), for flash-attention varlen; max_seqlen: the longest piece.

    Example: starts [[0, 3]], seq_len 5 -> position_ids [[0, 1, 2, 0, 1]],
      document_ids [[0, 0, 0, 1, 1]], cu_seqlens [0, 3, 5], max_seqlen 3.
    """
    B, L = len(starts), seq_len
    pos = np.empty((B, L), dtype=np.int64)
    doc = np.empty((B, L), dtype=np.int64)
    ar = np.arange(L)
    cuts = []
    for b, st in enumerate(starts):
        st = np.asarray(st, dtype=np.int64)
        marks = np.zeros(L, dtype=np.int64)
        marks[st] = st
        pos[b] = ar - np.maximum.accumulate(marks)
        begin = np.zeros(L, dtype=np.int64)
        begin[st[st > 0]] = 1
        doc[b] = np.cumsum(begin)
        row_cuts = np.union1d([0], st)
        cuts.append(row_cuts + b * L)
    cu = np.concatenate(cuts + [np.array([B * L])]).astype(np.int32)
    return {"position_ids": torch.from_numpy(pos), "document_ids": torch.from_numpy(doc),
            "cu_seqlens": torch.from_numpy(cu), "max_seqlen": int(np.diff(cu).max()) if B else 0}


def block_causal_mask(document_ids):
    """bool [B, 1, L, L] for scaled_dot_product_attention(attn_mask=...): a token attends to
    earlier tokens of its own document only."""
    L = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def flex_block_mask(document_ids):
    """The same mask as a FlexAttention BlockMask (torch >= 2.5), sparse: blocks across documents are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, L = document_ids.shape

    def mask_mod(b, h, q, kv):
        return (document_ids[b, q] == document_ids[b, kv]) & (kv <= q)

    return create_block_mask(mask_mod, B, None, L, L, device=str(document_ids.device))
