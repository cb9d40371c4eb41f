"""Document masking is real: a packed chunk with its boundaries gives each document's logits as if it were alone."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from helixtok import MemmapChunkDataset
from helixtok.read.masking import block_causal_mask, boundaries, flex_block_mask


def test_boundaries_example():
    b = boundaries([np.array([0, 3]), np.array([2])], 5)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 7, 10] and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"] == 3


@settings(max_examples=200, deadline=None)
@given(L=st.integers(1, 40), rows=st.lists(st.sets(st.integers(0, 39)), min_size=1, max_size=4))
def test_cu_seqlens_cut_the_flat_batch_exactly_at_rows_and_documents(L, rows):
    starts = [np.array(sorted(x for x in r if x < L), dtype=np.int64) for r in rows]
    b = boundaries(starts, L)
    cu = b["cu_seqlens"].numpy()
    assert cu[0] == 0 and cu[-1] == len(rows) * L and (np.diff(cu) > 0).all()
    want = sorted({r * L for r in range(len(rows))} | {r * L + s for r, st_ in enumerate(starts) for s in st_})
    assert cu[:-1].tolist() == want
    doc, pos = b["document_ids"].flatten().numpy(), b["position_ids"].flatten().numpy()
    for a, z in zip(cu[:-1], cu[1:]):  # each segment: one document id, positions 0..n-1 or a row's first piece
        assert len(set(doc[a:z])) == 1 and (np.diff(pos[a:z]) == 1).all()
    assert b["max_seqlen"] == int(np.diff(cu).max())


def test_dataset_boundaries_come_from_the_docs_sidecar(dev_packed, dev_ids):
    ds = MemmapChunkDataset(dev_packed, document_masking=True)
    L = ds.seq_len
    doc_starts = np.concatenate(([0], np.cumsum([len(x) + 1 for x in dev_ids])))  # each doc + EOS
    idx = [0, 1, 7, len(ds) // 2, len(ds) - 1]
    batch = ds.collate(ds.__getitems__(idx))
    flat = batch["input_ids"].flatten()
    cu = batch["cu_seqlens"].tolist()
    want = set()
    for r, i in enumerate(idx):
        want |= {r * L} | {r * L + int(s) - i * L for s in doc_starts if i * L <= s < (i + 1) * L}
    assert cu[:-1] == sorted(want) and cu[-1] == len(idx) * L
    assert batch["max_seqlen"] == max(np.diff(cu))
    # Every cut inside a row follows an EOS: a document ends exactly there.
    eos = int(np.fromfile(f"{dev_packed}/train-000000-0000.bin", dtype="<u2")[doc_starts[1] - 1])
    assert all(int(flat[c - 1]) == eos for c in cu[1:-1] if c % L)
    # Per-sample items carry the per-token fields only; a DataLoader batch equals __getitems__.
    assert set(ds[3]) == {"input_ids", "labels", "attention_mask", "position_ids", "document_ids"}
    dl = DataLoader(ds, batch_size=len(idx), sampler=idx, collate_fn=ds.collate)
    got = next(iter(dl))
    assert all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(batch[k])) for k in batch)


class TinyCausalLM(torch.nn.Module):
    """Two attention layers with learned positions (taken from position_ids), float64."""

    def __init__(self, vocab, dim=32, heads=4, max_len=512):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(vocab, dim, dtype=torch.float64)
        self.pos = torch.nn.Embedding(max_len, dim, dtype=torch.float64)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim, dtype=torch.float64) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab, dtype=torch.float64)
        self.heads = heads

    def forward(self, input_ids, position_ids, attn=None):
        """attn(q, k, v) -> output; default: plain causal attention over the whole row."""
        attn = attn or (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = self.tok(input_ids) + self.pos(position_ids)
        B, L, D = x.shape
        for lin in self.qkv:
            q, k, v = (t.view(B, L, self.heads, -1).transpose(1, 2) for t in lin(x).chunk(3, -1))
            x = x + attn(q, k, v).transpose(1, 2).reshape(B, L, D)
        return self.head(x)


@torch.no_grad()
def _flex_logits(vocab, ids, pos, doc):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it runs uncompiled (eager, CPU)
        from torch.nn.attention.flex_attention import flex_attention

        bm = flex_block_mask(doc)
        return TinyCausalLM(vocab)(ids, pos, lambda q, k, v: flex_attention(q, k, v, block_mask=bm))


@torch.no_grad()  # FlexAttention has no backward on CPU; forward equality is the claim
def test_packed_logits_equal_each_document_alone(dev_packed, dev_bestfit):
    """Each segment of a row (a document, or its piece; a bestfit row's padding is one more)
    gets the logits it would get alone: SDPA with the block mask, and FlexAttention; for packed
    and for bestfit data, as stored and in a repacked epoch (one child process for all)."""
    import multiprocessing as mp

    runs = []
    for out, repack in ((dev_packed, False), (dev_bestfit, False), (dev_packed, True), (dev_bestfit, True)):
        ds = MemmapChunkDataset(out, document_masking=True, repack=repack, seed=5)
        ds.set_epoch(3 if repack else 0)
        idx = [i for i in range(len(ds)) if len(ds.document_starts(i)) >= 2][:3]  # rows holding several documents
        batch = ds.collate(ds.__getitems__(idx))
        assert len(idx) == 3 and len(batch["cu_seqlens"]) > len(idx) + 3
        runs.append((ds.seq_len, batch, TinyCausalLM(int(batch["input_ids"].max()) + 1)))
    with mp.get_context("spawn").Pool(1) as child:  # eager FlexAttention takes ~400 MB: not in pytest's process
        flexes = [child.apply(_flex_logits, (model.head.out_features, b["input_ids"], b["position_ids"],
                                             b["document_ids"])) for _, b, model in runs]
    for (L, batch, model), flex in zip(runs, flexes):
        ids, pos, doc = batch["input_ids"], batch["position_ids"], batch["document_ids"]
        mask = block_causal_mask(doc)
        packed = model(ids, pos, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        plain = model(ids, pos)  # the padded path: attends across documents
        cu = batch["cu_seqlens"].tolist()
        crossed = 0
        for a, z in zip(cu[:-1], cu[1:]):
            r, a0, z0 = a // L, a % L, a % L + (z - a)
            alone = model(ids[r, a0:z0][None], torch.arange(z - a)[None])[0]
            assert torch.allclose(packed[r, a0:z0], alone, atol=1e-10), (r, a0, z0)
            assert torch.allclose(flex[r, a0:z0], alone, atol=1e-10), (r, a0, z0)
            crossed += not torch.allclose(plain[r, a0:z0], alone, atol=1e-6)
        assert crossed > 0  # without the mask, documents after the first in a row see earlier ones


def test_document_masking_needs_packed_data(dev_document):
    from helixtok.format.errors import DatasetError

    with pytest.raises(DatasetError, match="need packed or bestfit data"):
        MemmapChunkDataset(dev_document, document_masking=True)


HF_PACKED = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
  ids, pos, cu, L = torch.load(src)
  out = {}
  with torch.no_grad():
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=int(ids.max()) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L,
                          attn_implementation=impl)
        model = LlamaForCausalLM(cfg).double().eval()
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # training setup: no cache
        alone = [model(input_ids=ids[:, a:z], position_ids=torch.arange(z - a)[None]).logits[0]
                 for a, z in zip(cu[:-1], cu[1:])]
        plain = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        out[impl] = (packed, alone, plain)
  torch.save(out, dst)
"""


def test_hf_transformers_packed_path_keeps_documents_apart(dev_packed, dev_bestfit, tmp_path):
    """The HF way: the batch flattened to (1, B x L) with position_ids and no attention_mask; a
    tiny Llama (transformers, CPU, sdpa and eager) then gives each document its logits alone, for
    packed and bestfit data.  Runs in a child process (one for both): importing transformers would
    cost pytest ~150 MB it keeps."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (it is in the [test] extra)")
    args, cus, pads = [], [], []
    for name, out in (("packed", dev_packed), ("bestfit", dev_bestfit)):
        ds = MemmapChunkDataset(out, document_masking=True)
        idx = [i for i in range(len(ds)) if len(ds.document_starts(i)) >= 2][:2]
        batch = ds.collate(ds.__getitems__(idx))
        cus.append(batch["cu_seqlens"].tolist())
        pads.append(batch["labels"].reshape(-1) == -100)
        torch.save((batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1), cus[-1], ds.seq_len),
                   tmp_path / f"{name}.in.pt")
        args += [str(tmp_path / f"{name}.in.pt"), str(tmp_path / f"{name}.out.pt")]
    r = subprocess.run([sys.executable, "-c", HF_PACKED, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, cu, pad in zip(("packed", "bestfit"), cus, pads):
        for impl, (packed, alone, plain) in torch.load(tmp_path / f"{name}.out.pt").items():
            for (a, z), lone in zip(zip(cu[:-1], cu[1:]), alone):
                # A bestfit chunk's padding is a segment of its own that no loss reads (labels -100):
                # eager attention over a run of one repeated id differs there by ~1e-8.
                if not pad[a:z].all():
                    assert torch.allclose(packed[a:z], lone, atol=1e-9), (name, impl, a, z)
            assert not torch.allclose(plain[cu[1]:cu[2]], packed[cu[1]:cu[2]], atol=1e-6)  # the mask mattered


@pytest.mark.parametrize("packing", ["packed", "bestfit"])
def test_collating_single_samples_gives_the_batchs_cu_seqlens_as_the_dataloader_does(dev_packed, dev_bestfit, packing):
    """ds.collate([ds[i], ds[j]]) carries cu_seqlens and max_seqlen equal to those of the same
    batch through __getitems__ (the DataLoader path); issue 41: the first dropped them."""
    import torch

    ds = MemmapChunkDataset(dev_packed if packing == "packed" else dev_bestfit, document_masking=True)
    idx = [0, 5, len(ds) - 1]
    one_by_one, batched = ds.collate([ds[i] for i in idx]), ds.collate(ds.__getitems__(idx))
    assert sorted(one_by_one) == sorted(batched) and "cu_seqlens" in one_by_one
    for k in batched:
        assert torch.equal(torch.as_tensor(one_by_one[k]), torch.as_tensor(batched[k])), k
