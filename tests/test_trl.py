"""TRL's dataset forms (issue 63.5): prompt/completion rows, conversational and text, built with
--chat are the ids and completion masks TRL's own SFTTrainer preparation gives the same rows (its
code from its package, run in a child process), whatever the template's spans; rows of another
form are counted with what they are and what to pass."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helixtok.pipeline.builder import build
from helixtok.pipeline.chat import ChatEncoder, load_spec
from helixtok.pipeline.config import BuildConfig

from test_chat import QWEN, TEMPLATES, _documents, real_conversations


def _trl_prepared(folder: str, template: str, rows: list[dict]) -> list[tuple[list, list]]:
    """TRL's SFTTrainer preparation of `rows` (completion_only_loss, its default for prompt/completion
    rows; no truncation): (input_ids, 1 where labels train) each -- in a child process."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(Path(folder) / "tokenizer.json"),
        **{k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token")})
    tok.chat_template = template
    trainer = SFTTrainer.__new__(SFTTrainer)  # its preparation alone: no model
    trainer._tokenizer, trainer.chat_template, trainer.completion_only_loss = tok, None, True
    args = SFTConfig(output_dir=str(Path(folder) / "unused"), report_to=[], use_cpu=True, bf16=False,
                     max_length=None, dataset_num_proc=None)
    datasets.disable_progress_bars()
    got = trainer._prepare_dataset(datasets.Dataset.from_list(rows), tok, args, False, None, "train")
    return [(list(r["input_ids"]), [int(x != -100) for x in r["labels"]]) for r in got]


def _rows(dev_docs: list[str]) -> tuple[list[dict], list[dict]]:
    """Conversational prompt/completion rows (real text: a conversation less its last answer, and that
    answer) and text ones (a paragraph cut in two)."""
    convs = real_conversations(dev_docs, 30, seed=11)
    chat = [{"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in convs]
    rng = random.Random(5)
    paras = [p.strip() for t in dev_docs for p in t.split("\n\n") if len(p.strip()) > 80]
    text = []
    for p in rng.sample(paras, 30):
        cut = rng.randint(10, len(p) - 10)
        text.append({"prompt": p[:cut], "completion": p[cut:]})
    text.append({"prompt": "Say it.", "completion": "Done<|im_end|>"})  # (ends with EOS: none appended)
    return chat, text


def _trl_both(folder: str, template: str, forms: list[list[dict]]) -> list[tuple[list, list]]:
    """_trl_prepared of each form's rows (TRL prepares one form a dataset), one after the other."""
    return [x for rows in forms for x in _trl_prepared(folder, template, rows)]


def test_prompt_completion_rows_are_what_trl_prepares(tmp_path, dev_docs, apart):
    """Conversational rows as JSON lines and text rows as Parquet (row groups of 8) in one build."""
    chat, text = _rows(dev_docs)
    corpus = tmp_path / "c"
    corpus.mkdir()
    with gzip.open(corpus / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in chat)
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in text], "completion": [r["completion"] for r in text]}),
                   corpus / "b.parquet", row_group_size=8)
    # Qwen3's own template (no {% generation %} span) with --loss completion, built; and TRL's training
    # one under the default --loss assistant, encoded: a prompt/completion row trains its completion under both.
    own, training = json.loads((QWEN / "tokenizer_config.json").read_text())["chat_template"], \
        (TEMPLATES / "qwen3_training.jinja").read_text()
    wants = apart.submit(_trl_both_templates, str(QWEN), [own, training], [chat, text]).result()
    out = str(tmp_path / "out")
    build(str(corpus), out, str(QWEN / "tokenizer.json"), BuildConfig(
        seq_len=4096, packing="bestfit", workers=2, unit_bytes=16 << 10,
        chat=load_spec(str(QWEN), None, "completion", False, "messages")))
    got = _documents(out)
    assert len(got) == len(wants[0]) == len(chat) + len(text)
    assert [i for i, (g, w) in enumerate(zip(got, wants[0])) if g != w] == []
    assert all(0 < sum(m) < len(m) for _, m in got)
    from tokenizers import Tokenizer

    spec = load_spec(str(QWEN), str(TEMPLATES / "qwen3_training.jinja"), "assistant", False, "messages")
    enc = ChatEncoder(spec, Tokenizer.from_file(str(QWEN / "tokenizer.json")), 4096, np.uint32)
    rows = chat + text
    assert [i for i, (r, w) in enumerate(zip(rows, wants[1]))
            if (lambda e: (e.ids.tolist(), e.mask.tolist()))(enc.encode(r)) != w] == []


def _trl_both_templates(folder: str, templates: list[str], forms: list[list[dict]]) -> list[list]:
    return [_trl_both(folder, t, forms) for t in templates]


def test_rows_of_another_form_say_what_they_are(tmp_path, dev_docs):
    corpus = tmp_path / "c"
    corpus.mkdir()
    chat, _ = _rows(dev_docs)
    rows = chat[:5] + [{"text": "plain text"}, {"conversations": [{"from": "human", "value": "hi"}]},
                       {"prompt": "no completion"}, {"prompt": "x", "completion": [{"role": "assistant"}]}]
    (corpus / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    spec = load_spec(str(QWEN), None, "completion", False, "messages")
    build(str(corpus), out, str(QWEN / "tokenizer.json"), BuildConfig(seq_len=4096, workers=1, chat=spec))
    m = json.loads(Path(out, "manifest.json").read_text())
    skipped = m["skipped"]["not_a_conversation"]
    assert skipped["count"] == 4 and m["splits"]["train"]["documents"] == 5
    said = " | ".join(skipped["examples"])
    for line, what in [(6, "a text row ('text'): build it without --chat"),
                       (7, "ShareGPT 'conversations' rows (from/value): write them as 'messages'"),
                       (8, "a 'prompt' without a 'completion'"),
                       (9, "'prompt' and 'completion' are neither both text nor both lists of messages")]:
        assert f"a.jsonl:{line} (no 'messages' field ({what}" in said or f"a.jsonl:{line} ({what}" in said, said


def _recipe(args: list[str]) -> dict:
    """scripts/recipe_trl_sft.py's main(args), in a child process (TRL and a model's heap stay there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_trl_sft", Path(__file__).parents[1] / "scripts" /
                                                  "recipe_trl_sft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(args)


def test_to_hf_rows_are_the_builds_documents_and_sft_trainer_trains_on_them(tmp_path, dev_docs, apart):
    """Issue 63.7: helixtok.to_hf(OUT) is one row per stored conversation (its ids and mask), written
    once; TRL's own SFTTrainer trains on it without tokenizing, its labels exactly the build's mask
    (scripts/recipe_trl_sft.py), and packs it; a text build's rows are its documents."""
    import helixtok
    from helixtok.format.errors import DatasetError
    from test_chat import llama_style_tokenizer

    folder = llama_style_tokenizer(tmp_path / "tok", dev_docs[:200])
    corpus = tmp_path / "c"
    corpus.mkdir()
    convs = real_conversations(dev_docs, 40, seed=13)
    (corpus / "a.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = str(tmp_path / "out")
    build(str(corpus), out, str(folder), BuildConfig(seq_len=2048, workers=1, chat=load_spec(
        str(folder), None, "assistant", False, "messages", date="2026-01-01")))
    cache = str(tmp_path / "hf")
    ds = helixtok.to_hf(out, cache_dir=cache)
    assert [(r["input_ids"], r["assistant_masks"]) for r in ds] == _documents(out)
    [file] = os.listdir(cache)
    stamp = os.stat(os.path.join(cache, file)).st_mtime_ns
    assert len(helixtok.to_hf(out, cache_dir=cache)) == len(ds)  # the same file, not written again
    assert os.listdir(cache) == [file] and os.stat(os.path.join(cache, file)).st_mtime_ns == stamp
    got = apart.submit(_recipe, [out, "-t", str(folder), "--steps", "3"]).result()
    assert got["steps"] == 3 and got["labels_are_the_mask"] is True and got["rows"] == len(ds)
    assert apart.submit(_recipe, [out, "-t", str(folder), "--steps", "2", "--packing"]).result()["steps"] == 2
    # A text build: its documents (EOS included), no mask column; document packing is refused.
    text, doc = str(tmp_path / "text"), str(tmp_path / "doc")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text(dev_docs[0])
    (tmp_path / "t" / "b.txt").write_text(dev_docs[1])
    build(str(tmp_path / "t"), text, str(folder), BuildConfig(seq_len=64, workers=1))
    rows = helixtok.to_hf(text, cache_dir=cache)
    assert rows.column_names == ["input_ids"] and len(rows) == 2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = json.loads(Path(text, "manifest.json").read_text())["tokenizer"]["eos_id"]
    assert rows[0]["input_ids"] == tok.encode(dev_docs[0]).ids + [eos]
    build(str(tmp_path / "t"), doc, str(folder), BuildConfig(seq_len=64, workers=1, packing="document"))
    with pytest.raises(DatasetError, match="keep no boundary between documents; helixtok repack"):
        helixtok.to_hf(doc, cache_dir=cache)


def test_a_prompt_completion_row_needs_no_span_whatever_the_loss(dev_docs):
    """Review: a prompt/completion row's mask is where its prompt ends, so no span is derived for it:
    under Qwen3's own template (which renders earlier turns otherwise once later ones follow, so a
    whole multi-turn conversation gets no derived mask) --loss assistant builds every row exactly as
    --loss completion does (it refused the multi-turn ones)."""
    from tokenizers import Tokenizer

    chat, _ = _rows(dev_docs)
    assert sum(len(r["prompt"]) > 2 for r in chat) > 5  # (earlier assistant turns in the prompts)
    tok = Tokenizer.from_file(str(QWEN / "tokenizer.json"))
    got = {}
    for loss in ("assistant", "completion"):
        enc = ChatEncoder(load_spec(str(QWEN), None, loss, False, "messages"), tok, 1 << 20, np.uint32)
        got[loss] = [enc.encode(r) for r in chat]
        assert not any(isinstance(e, str) for e in got[loss]), [e for e in got[loss] if isinstance(e, str)][:1]
    assert [(e.ids.tolist(), e.mask.tolist()) for e in got["assistant"]] == \
        [(e.ids.tolist(), e.mask.tolist()) for e in got["completion"]]
