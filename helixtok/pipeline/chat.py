"""Conversations -> the model's chat template rendered (as transformers renders it) -> ids and a per-token loss mask.

One conversation is rendered into one string, which is tokenized once: no seam between
messages where BPE merges could differ from the model's own tokenization.  Which tokens train
comes from the template's `{% generation %}` ... `{% endgeneration %}` spans (character ranges
of the rendered string, recorded while it renders); a token trains when it overlaps one, the
rule of transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime
from types import BuiltinMethodType, MethodType

from ..format import limits
from ..format.errors import ConfigError
from .longdoc import NESTED, SURROGATE


class RenderBound(Exception):
    """A conversation's rendering ran past its time or size bound (limits.RENDER_SECONDS,
    RENDER_CHARS): a hostile template or row is skipped (counted), never a hang or a heap's worth."""

# completion: prompt/completion rows' completion trains (TRL's completion_only_loss), any template;
# a prompt/completion row trains its completion under assistant and last too.
LOSSES = ("assistant", "all", "last", "completion")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_COMMENT = re.compile(r"\{#.*?#\}", re.S)  # a comment naming the tag is not a span
# Markers around special-token strings found in a conversation's own strings (noncharacters:
# never in interchange text; a conversation holding one is skipped, counted).
OPEN, CLOSE = "\ufdd0", "\ufdd1"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them
_DICT_NAMES = frozenset(dir(dict))


@dataclass(frozen=True)
class ChatSpec:
    """What decides a chat build's bytes besides the tokenizer: the template and the options."""

    template: str
    loss: str = "assistant"
    truncate: bool | str = False  # True: cut at seq_len tokens; "turns": drop the earliest exchanges
    field: str = "messages"
    # The tokenizer's special-token strings a template may use (bos_token, eos_token, ...).
    token_strings: tuple[tuple[str, str], ...] = ()
    # The day the template's strftime_now() renders (YYYY-MM-DD, at 00:00:00): part of the plan, so
    # the bytes do not follow the wall clock.  "": not chosen yet (the build pins it: builder.py).
    date: str = ""
    # --chat-kwargs: more variables for the template (enable_thinking, ...), as JSON with sorted keys
    # (a row's own `chat_template_kwargs` object adds to and overrides them).
    kwargs: str = ""
    # --chat-split turns: a conversation of k assistant turns gives k samples, each rendered up to
    # and including its turn, only that turn trained (what the model sees at inference).
    split_turns: bool = False

    def __post_init__(self) -> None:
        if self.date:
            check_date(self.date)
        object.__setattr__(self, "kwargs", canonical_kwargs(self.kwargs) if self.kwargs else "")
        if self.truncate == "tokens":  # the command line's word for the flag's meaning
            object.__setattr__(self, "truncate", True)
        if self.truncate not in (False, True, "turns"):
            raise ConfigError(f"--truncate takes tokens or turns, got {self.truncate!r}")

    def to_json(self) -> dict:
        import hashlib

        return {"template_sha256": hashlib.sha256(self.template.encode()).hexdigest(), "loss": self.loss,
                "truncate": self.truncate, "field": self.field, "token_strings": dict(self.token_strings),
                "date": self.date, **({"kwargs": json.loads(self.kwargs)} if self.kwargs else {}),
                **({"split": "turns"} if self.split_turns else {})}


RESERVED = ("messages", "tools", "documents", "add_generation_prompt")  # what the build itself passes
ROW_KWARGS = "chat_template_kwargs"  # a row's own template variables, as datasets ship them


def canonical_kwargs(text: str | dict) -> str:
    """--chat-kwargs as given (a JSON object of template variables, or a dict from Python), in the
    form a plan compares."""
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError as e:
        raise ConfigError(f"--chat-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}' ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'; got {text!r}")
    if bad := sorted(set(value) & set(RESERVED)):
        raise ConfigError(f"--chat-kwargs may not set {bad[0]!r}: the build passes {', '.join(RESERVED)} itself")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def check_date(date: str) -> str:
    """A --chat-date as given, if it is a YYYY-MM-DD date."""
    try:
        if len(date) != 10:
            raise ValueError
        datetime.strptime(date, "%Y-%m-%d")
    except (TypeError, ValueError):
        raise ConfigError(f"--chat-date must be a date as YYYY-MM-DD, got {date!r}") from None
    return date


def _token_string(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def load_spec(tokenizer: str, template_file: str | None, loss: str, truncate: bool | str, field_name: str,
              date: str = "", kwargs: str | dict = "", split_turns: bool = False) -> ChatSpec:
    """The template from --chat-template, else `chat_template` of the tokenizer_config.json beside
    the tokenizer (one without `{% generation %}` spans: ChatEncoder derives them)."""
    folder = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(os.path.abspath(tokenizer))
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg_path}: not readable JSON ({e}); fix it or pass --chat-template") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{cfg_path}: not a JSON object; fix it or pass --chat-template")
    if template_file:
        try:
            with open(template_file, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise ConfigError(f"--chat-template {template_file}: cannot read it ({e.strerror})") from None
        where = f"--chat-template {template_file}"
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not isinstance(template, str) or not template.strip():
            raise ConfigError(f"{tokenizer}: no chat_template in {cfg_path}; pass --chat-template FILE.jinja")
        where = cfg_path
    if loss not in LOSSES:
        raise ConfigError(f"--loss {loss}: give one of {', '.join(LOSSES)}")
    # A template without {% generation %} spans: the assistant's tokens are derived from its own
    # renderings, conversation by conversation, where they prove it (ChatEncoder.derived_spans).
    strings = tuple(sorted((k, s) for k, v in config.items() if k.endswith("_token") and (s := _token_string(v))))
    compile_template(template, where)  # a syntax error is said now, once, not per worker
    return ChatSpec(template=template, loss=loss, truncate=truncate, field=field_name, token_strings=strings,
                    date=check_date(date) if date else "", kwargs=kwargs, split_turns=split_turns)


# --------------------------------------------------------------------------- rendering

def compile_template(template: str, where: str = "the chat template", date: str = ""):
    """The template compiled in a sandbox with transformers' settings and globals; strftime_now()
    renders `date` at 00:00:00 (the build's pinned day), or the wall clock where none is given."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: records the span the body renders to."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            rv = caller()
            rec = self.environment.recording
            if rec is not None:
                pos, spans = rec  # pos[0]: characters rendered before this block (a sum per span was quadratic)
                spans.append((pos[0], pos[0] + len(rv)))
            return rv

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template may not set {name!r} on a namespace")

    fixed = (str, list, dict, LoopContext, Namespace)  # the types whose verdicts are reused

    class Sandbox(ImmutableSandboxedEnvironment):
        """The sandbox transformers renders in, its answers reused where they cannot change.

        `message.role` on a plain dict is looked up directly: the sandbox's own path for it
        (getattr fails, then obj[attr], no check) costs an exception and half of a conversation's
        rendering.  Other attributes of str, list, dict, the loop and a namespace get the
        sandbox's verdict on (type, name) once: it depends on nothing else (the name, and the
        type's mutability); what the sandbox wraps (str.format, or a method a template stored in
        a namespace) always goes through it.  Calls of str, list and dict builtin methods go
        straight to them: the sandbox's callable check and the context's argument injection look
        for attributes such methods never have."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.verdicts: dict[tuple[type, str], bool] = {}

        def getattr(self, obj, attribute):
            kind = type(obj)
            if kind is dict and type(attribute) is str and attribute not in _DICT_NAMES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            if kind in fixed and type(attribute) is str and attribute not in ("format", "format_map"):
                try:
                    value = getattr(obj, attribute)
                except AttributeError:
                    return super().getattr(obj, attribute)
                safe = self.verdicts.get((kind, attribute))
                if safe is None:
                    safe = self.verdicts[kind, attribute] = self.is_safe_attribute(obj, attribute, value)
                if safe and (kind is not Namespace or type(value) not in (MethodType, BuiltinMethodType)):
                    return value
            return super().getattr(obj, attribute)

        intercepted_binops = frozenset(("*", "+", "**"))

        def call_binop(self, context, operator, left, right):
            # What grows without a call: repeated or doubled strings and lists, huge powers.
            if operator == "**" and isinstance(right, int) and abs(right) > 64 and not (
                    isinstance(left, int) and abs(left) <= 1):
                raise RenderBound(f"a power of {right} in the template")
            size = None  # the result's length, known before it is made
            if operator == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)):
                size = len(left) + len(right)
            elif operator == "*" and isinstance(left, (str, list)) and isinstance(right, int):
                size = len(left) * right
            elif operator == "*" and isinstance(right, (str, list)) and isinstance(left, int):
                size = len(right) * left
            if size is not None and size > limits.RENDER_CHARS:
                raise RenderBound(f"its output passed {limits.RENDER_CHARS:,} characters")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
            if time.monotonic() > __self.deadline:  # a loop can only run long calling something (range)
                raise RenderBound(f"it took over {limits.RENDER_SECONDS:g} s")
            if type(__obj) is BuiltinMethodType and type(__obj.__self__) in (str, list, dict):
                # What Context.call does for them: they take no context, raise no StopIteration.
                kwargs.pop("_loop_vars", None)
                kwargs.pop("_block_vars", None)
                return __obj(*args, **kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.recording = None
    env.deadline = float("inf")
    env.filters["tojson"] = tojson
    day = datetime.strptime(date, "%Y-%m-%d") if date else None
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: (day or datetime.now()).strftime(f),
                       namespace=Namespace, dict=lambda *a, **k: dict(*a, **k))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{where}: template syntax error on line {e.lineno}: {e.message}") from None


def _plain(value, strings: list):
    """JSON values only (what a JSON line or a Parquet row gives), as the template sees them; every
    string among them, keys included (a tool call's arguments are rendered with theirs), appended
    to `strings`."""
    import numpy as np

    kind = type(value)
    if kind is str:
        strings.append(value)
        return value
    if value is None or kind in (int, float, bool):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            strings.append(k := str(k))
            out[k] = _plain(v, strings)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, strings) for v in value]
    if isinstance(value, np.generic):
        return _plain(value.item(), strings)
    if isinstance(value, np.ndarray):
        return [_plain(v, strings) for v in value.tolist()]
    value = str(value)
    strings.append(value)
    return value


def prompt_completion(record, field_name: str) -> tuple | str | None:
    """A TRL prompt/completion row (a record without the messages field that has "prompt" and
    "completion"): ("text", prompt, completion) for strings, ("messages", the prompt's row, the whole
    row) for message lists (each a record with the messages field, its tools and kwargs kept), why
    it cannot be read, or None for any other row."""
    if not isinstance(record, dict) or field_name in record or "prompt" not in record or "completion" not in record:
        return None
    p, c = record["prompt"], record["completion"]
    if isinstance(p, str) and isinstance(c, str):
        return "text", p, c
    p, c = (x.tolist() if hasattr(x, "tolist") else x for x in (p, c))
    if isinstance(p, (list, tuple)) and isinstance(c, (list, tuple)) and c:
        rest = {k: v for k, v in record.items() if k not in ("prompt", "completion")}
        return "messages", {**rest, field_name: list(p)}, {**rest, field_name: [*p, *c]}
    return "'prompt' and 'completion' are neither both text nor both lists of messages"


def conversation(record, field_name: str, strings: list | None = None) -> tuple[list, list | None] | str:
    """(messages, tools) of a row as the template gets them, or why it is not a conversation;
    the strings among their values appended to `strings`."""
    import numpy as np

    strings = [] if strings is None else strings

    if not isinstance(record, dict):
        return "not a JSON object"
    if field_name not in record:
        return f"no {field_name!r} field ({_row_form(record)})"
    msgs = record.get(field_name)
    if isinstance(msgs, np.ndarray):
        msgs = msgs.tolist()
    if not isinstance(msgs, (list, tuple)) or not msgs:
        return f"{field_name!r} is not a list of messages" if msgs is None or not isinstance(msgs, (list, tuple)) \
            else f"{field_name!r} is empty"
    out = []
    for m in _plain(msgs, strings):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"a message of {field_name!r} is not an object with a 'role'"
        m = {k: v for k, v in m.items() if v is not None}  # as transformers: a None field is absent
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    tools = _plain(record.get("tools"), strings)
    if isinstance(tools, str):  # a Parquet column of JSON text
        strings.pop()
        try:
            tools = _plain(json.loads(tools), strings)
        except ValueError:
            return "'tools' is not JSON"
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "'tools' is not a list of objects"
    return out, tools or None


def derived_spans(compiled, messages: list, tools, variables: dict, text: str, last_only: bool = False
                  ) -> list[tuple[int, int]] | str:
    """The assistant spans of a conversation rendered (`text`) by a template without {% generation %}
    tags, from the template's own renderings: for assistant message j, the conversation up to it
    with the generation prompt (P) and up to and including it (Q).  Where Q is a prefix of the whole
    rendering and P a prefix of Q, the span is [len(P), len(Q)): what the model writes after the
    generation prompt, through its end of turn and what Q adds after it; any other conversation
    (the template renders an earlier turn otherwise once later ones follow) gets why (counted, not
    guessed).  The renderings together are bounded as one is (RENDER_CHARS).
    last_only: the last assistant message's span alone (--chat-split turns: each sample's turn is its
    last, which a template that rewrites earlier turns still renders as it will at inference)."""
    spans, budget = [], limits.RENDER_CHARS
    last = max((j for j, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for j, m in enumerate(messages):
        if m.get("role") != "assistant" or (last_only and j != last):
            continue
        p, _ = render(compiled, messages[:j], tools, variables, True)
        q, _ = render(compiled, messages[: j + 1], tools, variables, False)
        budget -= len(p) + len(q)
        if budget < 0:
            raise RenderBound(f"deriving its assistant tokens rendered over {limits.RENDER_CHARS:,} characters")
        start, end = len(p), len(q)
        if not (text.startswith(q) and q.startswith(p) and end > start):
            return (f"the template renders assistant message {j + 1} otherwise once later messages follow (it has no "
                    "{% generation %} span to mark it): which tokens train is not derivable; give --chat-split "
                    "turns (a sample per turn) or a training template with the spans (trl/chat_templates/"
                    "*_training.jinja)")
        spans.append((start, end))
    return spans


def _row_form(record: dict) -> str:
    """What a row that is not a conversation looks like, and what to pass for it."""
    if isinstance(record.get("text"), str):
        return "a text row ('text'): build it without --chat"
    if isinstance(record.get("conversations"), (list, tuple)):
        return "ShareGPT 'conversations' rows (from/value): write them as 'messages' (role/content)"
    if "prompt" in record:
        return "a 'prompt' without a 'completion'"
    return "--text-field names the messages' field"


def render(compiled, messages: list, tools, variables: dict, generation_prompt: bool = False
           ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its generation spans (character ranges), with add_generation_prompt
    as given (a prompt/completion row's prompt alone: True); `variables`: the tokenizer's *_token
    strings and the template kwargs, as transformers passes them."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = [0]
    env = compiled.environment
    env.recording = (pos, spans)
    env.deadline = deadline = time.monotonic() + limits.RENDER_SECONDS
    try:
        for b in compiled.generate(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=generation_prompt, **variables):
            blocks.append(b)
            pos[0] += len(b)
            if pos[0] > limits.RENDER_CHARS:
                raise RenderBound(f"its output passed {limits.RENDER_CHARS:,} characters")
            if time.monotonic() > deadline:
                raise RenderBound(f"it took over {limits.RENDER_SECONDS:g} s")
    finally:
        env.recording = None
        env.deadline = float("inf")
    return "".join(blocks), spans


def _mark(value, pattern: re.Pattern):
    """Every special-token string inside a conversation's own strings, keys included, wrapped in OPEN/CLOSE."""
    if isinstance(value, str):
        return pattern.sub(lambda m: OPEN + m.group(0) + CLOSE, value)
    if isinstance(value, dict):
        return {_mark(k, pattern): _mark(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v, pattern) for v in value]
    return value


def _unmark(text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """The rendered text without markers, its spans moved to match, and the ranges that were
    marked (special-token strings from the conversation's own text: encoded as text)."""
    import numpy as np

    keep = np.fromiter((c not in (OPEN, CLOSE) for c in text), bool, len(text))
    before = np.concatenate(([0], np.cumsum(keep)))  # kept characters before each position
    ranges, opened = [], None
    for i, c in enumerate(text):
        if c == OPEN:
            opened = i
        elif c == CLOSE and opened is not None:
            ranges.append((int(before[opened]), int(before[i])))
            opened = None
    clean = "".join(c for c, k in zip(text, keep) if k)
    return clean, [(int(before[a]), int(before[b])) for a, b in spans], ranges


# --------------------------------------------------------------------------- tokens and mask

def loss_mask(offsets, spans: list[tuple[int, int]], loss: str):
    """1 where a token trains: under "assistant", a token overlapping a generation span
    (transformers' rule: token_end > span_start and token_start < span_end); "last": the last
    span only; "all": every token."""
    import numpy as np

    n = len(offsets)
    if loss == "all":
        return np.ones(n, np.uint8)
    mask = np.zeros(n, np.uint8)
    chosen = spans[-1:] if loss == "last" else spans
    starts, ends = offsets[:, 0], offsets[:, 1]
    if not chosen or not n:
        return mask
    if (np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all():
        # Tokens in text order (as a tokenizer gives them): each span's tokens are one run, found by
        # two binary searches, the runs marked through a difference array -- linear in a
        # conversation's turns (a mask per span over every token was quadratic: 100,000 turns ran minutes).
        a, b = np.asarray(chosen, np.int64).T
        i, j = np.searchsorted(ends, a, "right"), np.searchsorted(starts, b, "left")
        keep = j > i
        d = np.zeros(n + 1, np.int64)
        np.add.at(d, i[keep], 1)
        np.add.at(d, j[keep], -1)
        return (np.cumsum(d[:n]) > 0).astype(np.uint8)
    for a, b in chosen:
        mask[(ends > a) & (starts < b)] = 1
    return mask


@dataclass
class Encoded:
    ids: object  # np.ndarray of the build's dtype
    mask: object  # np.ndarray of uint8
    text: str  # the rendered conversation (its UTF-8 decides the val split)
    truncated: bool = False  # cut to seq_len (--truncate)
    dropped_turns: int = 0  # earliest exchanges dropped to fit (--truncate turns)
    whole: str | None = None  # --chat-split turns: the whole conversation's rendering (its split's hash)
    too_long: bool = False  # longer than seq_len and not cut: the caller drops it, counted


@dataclass(frozen=True)
class Vocabulary:
    """What a chat build reads of a tokenizer.json, from its JSON alone (no Tokenizer loaded: a
    process on the fast path never loads one): the special tokens (content -> id), and for a
    byte-level BPE each id's UTF-8 length and whether it normalises to NFC."""

    specials: dict  # str -> int, the added tokens marked special
    byte_lens: object  # np.ndarray of int64 by id; None for another kind of tokenizer (offsets then from tokenizers)
    nfc: bool = False

    @classmethod
    def of(cls, tokenizer_json: str | bytes) -> Vocabulary:
        cfg = json.loads(tokenizer_json)
        added = cfg.get("added_tokens") or []
        specials = {t["content"]: t["id"] for t in added if t.get("special")}
        got = _byte_lengths(cfg, added)
        return cls(specials, *(got if got is not None else (None, False)))

    @classmethod
    def specials_of(cls, tok) -> Vocabulary:
        """The special tokens of a loaded Tokenizer, no byte lengths (what rendering needs alone)."""
        return cls({t.content: tok.token_to_id(t.content) for t in tok.get_added_tokens_decoder().values()
                    if t.special}, None)


def _byte_lengths(cfg: dict, added: list) -> tuple[object, bool] | None:
    """(UTF-8 bytes of each id's text, NFC) for a byte-level BPE -- each character of its vocabulary
    stands for one byte; an added token is its content -- or None for another kind of tokenizer."""
    import numpy as np
    from tokenizers import pre_tokenizers

    model = cfg.get("model") or {}

    def has(node, kind: str) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == kind:
            return True
        return any(has(x, kind) for x in node.get("pretokenizers") or node.get("decoders") or [])

    norm = cfg.get("normalizer")
    kinds = [norm.get("type")] if isinstance(norm, dict) and norm.get("type") != "Sequence" else \
        [x.get("type") for x in (norm or {}).get("normalizers", [])]
    if model.get("type") != "BPE" or not has(cfg.get("pre_tokenizer"), "ByteLevel") or \
            not has(cfg.get("decoder"), "ByteLevel") or any(k != "NFC" for k in kinds):
        return None
    vocab = model.get("vocab") or {}
    if any(t.get("lstrip") or t.get("rstrip") for t in added):  # such a token takes in spaces beside it
        return None
    if not set("".join(vocab)) <= set(pre_tokenizers.ByteLevel.alphabet()):
        return None
    lens = np.zeros(max([*vocab.values(), *(t["id"] for t in added), 0]) + 1, np.int64)
    lens[np.fromiter(vocab.values(), np.int64, len(vocab))] = np.fromiter(map(len, vocab), np.int64, len(vocab))
    for t in added:
        lens[t["id"]] = len(t["content"].encode("utf-8"))
    return lens, "NFC" in kinds


def _trained(messages: list, spans: list, last_only: bool) -> list | str:
    """The spans less those of the turns a row says not to train (axolotl's and open-instruct's
    field), span k being assistant message k -- only where the template gave one span each;
    last_only: the spans are the last message's alone (its own "train" the caller judged)."""
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if last_only:
        assistants = assistants[-1:]
    off = {k for k, m in enumerate(assistants) if m.get("train") is False or m.get("weight") == 0}
    if off and len(spans) != len(assistants):
        return (f"sets 'train': false on a message, but the template marked {len(spans)} spans for its "
                f"{len(assistants)} assistant messages: which turn is which is unknown")
    return [s for k, s in enumerate(spans) if k not in off]


class ChatEncoder:
    """Renders and tokenizes conversations.  Ids: the build's backend (`ids_fn`, exact as checked)
    on the pieces between the template's special tokens; token offsets: each id's byte length
    (byte-level BPE), else tokenizers' own offsets.  `tok`: a tokenizers.Tokenizer, or a function
    that loads one, called the first time one is needed (the fast path never needs it); `vocab`:
    the tokenizer's Vocabulary where the caller has it (read once per build, not per process)."""

    def __init__(self, spec: ChatSpec, tok, seq_len: int, dtype, ids_fn=None, vocab: Vocabulary | None = None):
        import numpy as np

        self.spec, self._tok, self.L, self.dtype = spec, tok, seq_len, np.dtype(dtype)
        self.compiled = compile_template(spec.template, date=spec.date)
        # No {% generation %} span in the template: each assistant turn's span derived from renderings.
        self.derive = not GENERATION_TAG.search(_COMMENT.sub("", spec.template))
        # transformers: the special tokens' strings, then the kwargs (which win)
        self.variables = {**dict(spec.token_strings), **(json.loads(spec.kwargs) if spec.kwargs else {})}
        if vocab is None:
            vocab = Vocabulary.of(self.tok.to_str()) if ids_fn is not None else Vocabulary.specials_of(self.tok)
        specials = sorted(vocab.specials, key=len, reverse=True)
        self.special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.special_ids = vocab.specials
        self.joiner = next(c for c in map(chr, range(0x110000)) if not any(c in t for t in specials))
        # The fast path: ids from ids_fn(texts) -> (flat ids, lengths), offsets from byte lengths.
        self.ids_fn = ids_fn
        self.byte_lens, self.nfc = (vocab.byte_lens, vocab.nfc) if ids_fn is not None else (None, False)

    @property
    def tok(self):
        if not hasattr(self._tok, "encode"):  # a function that loads it
            self._tok = self._tok()
        return self._tok

    def samples(self, record) -> list[Encoded] | str:
        """A row's samples: the conversation (encode()), or with --chat-split turns one per assistant
        message, rendered up to it with only its span trained (a turn marked "train": false gives
        none); every sample's split is the whole conversation's (none leaks into the other)."""
        if not self.spec.split_turns or prompt_completion(record, self.spec.field) is not None:
            got = self.encode(record)
            return got if isinstance(got, str) else [got]
        whole = self.rendered(record, want_spans=False)  # (its text: the samples' split)
        if isinstance(whole, str):
            return whole
        msgs = list(record[self.spec.field])
        out = []
        for j, m in enumerate(msgs):
            if not (isinstance(m, dict) and m.get("role") == "assistant") or m.get("train") is False or \
                    m.get("weight") == 0:
                continue
            got = self.encode({**record, self.spec.field: msgs[: j + 1]}, last_only=True)
            if isinstance(got, str):
                return got
            got.whole = whole[0]
            out.append(got)
        return out

    def encode(self, record, last_only: bool = False) -> Encoded | str:
        """One row: its ids and mask, or why it is not a conversation (a reason the caller counts).
        Longer than seq_len: dropped (too_long); --truncate: cut to its first seq_len tokens;
        --truncate turns: its earliest exchanges dropped until it fits (turns()).  last_only: only
        the last generation span trains."""
        got = self._encoded(record, last_only)
        if isinstance(got, str):
            return got
        ids, mask, text = got
        if len(ids) > self.L:
            if self.spec.truncate == "turns":
                return self.turns(record, text, last_only) or Encoded(ids, mask, text, too_long=True)
            if not self.spec.truncate:
                return Encoded(ids, mask, text, too_long=True)
            return Encoded(ids[: self.L].astype(self.dtype), mask[: self.L], text, truncated=True)
        return Encoded(ids.astype(self.dtype), mask, text)

    def turns(self, record: dict, text: str, last_only: bool = False) -> Encoded | None:
        """The conversation less its fewest earliest exchanges (a user message and what follows it up
        to the next; system messages before the first stay) that fits in seq_len, each candidate
        rendered by the template itself (found by bisection: fewer exchanges never render longer),
        keeping at least its last exchange; None when even that does not fit.  `text`: the whole
        conversation's rendering (its split is the whole conversation's)."""
        msgs = record.get(self.spec.field)
        if not isinstance(msgs, (list, tuple)):  # (a prompt/completion row: never cut by turns)
            return None
        starts = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"]
        if len(starts) < 2:
            return None
        head = [m for m in msgs[: starts[0]] if isinstance(m, dict) and m.get("role") == "system"]
        lo, hi, best = 1, len(starts) - 1, None  # exchanges dropped
        while lo <= hi:
            d = (lo + hi) // 2
            got = self._encoded({**record, self.spec.field: head + list(msgs[starts[d]:])}, last_only)
            if not isinstance(got, str) and len(got[0]) <= self.L:
                best, hi = (d, got), d - 1
            else:
                lo = d + 1
        if best is None:
            return None
        d, (ids, mask, _) = best
        return Encoded(ids.astype(self.dtype), mask, text, dropped_turns=d)

    def _encoded(self, record, last_only: bool = False, generation_prompt: bool = False, want_spans: bool = True
                 ) -> tuple | str:
        """(ids, mask, rendered text) of a row, whatever their length, or why it is not a conversation
        (want_spans False: its ids and text alone are wanted; the mask is then no span's)."""
        import numpy as np

        pc = prompt_completion(record, self.spec.field) if not generation_prompt else None
        if pc is not None:
            return self._prompt_completion(pc)
        got = self.rendered(record, generation_prompt, last_only, want_spans)
        if isinstance(got, str):
            return got
        text, spans, ranges = got
        if last_only:
            spans = spans[-1:]
        fast = self._encode_fast(text, spans, ranges) if self.byte_lens is not None else None
        if fast is not None:
            ids, mask = fast
        else:
            if ranges:
                ids, offsets = self._encode_pieces(text, ranges)
            else:
                enc = self.tok.encode(text, add_special_tokens=False)
                ids, offsets = np.asarray(enc.ids, np.int64), np.asarray(enc.offsets, np.int64).reshape(-1, 2)
            mask = loss_mask(offsets, spans, self.spec.loss)
        return ids, mask, text

    def _prompt_completion(self, pc) -> tuple | str:
        """A prompt/completion row as TRL's SFTTrainer tokenizes it: the prompt alone (conversational:
        rendered with the generation prompt; text: tokenized with the tokenizer's own special tokens)
        and prompt + completion (text: the EOS string appended unless it ends with it), the mask 1 from
        where the two first differ (trl.data_utils.common_prefix_length) to the end; --loss all: 1 everywhere."""
        import numpy as np

        if isinstance(pc, str):
            return pc
        if pc[0] == "text":
            _, prompt, completion = pc
            eos = dict(self.spec.token_strings).get("eos_token")
            if eos and not completion.endswith(eos):
                completion += eos
            text = prompt + completion
            if SURROGATE.search(text):
                return "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text"
            a = np.asarray(self.tok.encode(prompt).ids, np.int64)
            ids = np.asarray(self.tok.encode(text).ids, np.int64)
        else:
            _, prompt_row, whole_row = pc
            got = self._encoded(prompt_row, generation_prompt=True, want_spans=False)
            if isinstance(got, str):
                return got
            a = got[0]
            got = self._encoded(whole_row, want_spans=False)  # (the mask is the prompt's end: no span needed)
            if isinstance(got, str):
                return got
            ids, _, text = got
        n = min(len(a), len(ids))
        differ = np.flatnonzero(a[:n] != ids[:n])
        start = int(differ[0]) if len(differ) else n
        mask = np.ones(len(ids), np.uint8)
        if self.spec.loss != "all":
            mask[:start] = 0
        return ids, mask, text

    def pieces(self, record) -> list[str]:
        """The text a row's ids are made from, between the template's special tokens (what the
        backend check samples: the pieces a chat build hands its backend)."""
        pc = prompt_completion(record, self.spec.field)
        if pc is not None and not isinstance(pc, str):
            if pc[0] == "text":  # (tokenized by tokenizers itself: nothing of it goes to the backend)
                return []
            record = pc[2]
        got = self.rendered(record, want_spans=False)
        if isinstance(got, str):
            return []
        text, _, ranges = got
        return [text[a:b] for a, b, special in self._split(text, ranges) if not special]

    def rendered(self, record, generation_prompt: bool = False, last_only: bool = False, want_spans: bool = True
                 ) -> tuple[str, list, list] | str:
        """(rendered text, generation spans, ranges of the conversation's own special-token
        strings) of a row, or why it is not a conversation.  want_spans False: the text is all that
        is wanted (no span derived, no "train" field judged; spans [])."""
        import jinja2

        strings: list[str] = []
        try:
            conv = conversation(record, self.spec.field, strings)
        except RecursionError:  # a row nested deeper than its walk can follow: a bad row, counted
            return NESTED
        if isinstance(conv, str):
            return conv
        messages, tools = conv
        row = record.get(ROW_KWARGS) if isinstance(record, dict) else None
        if row is not None:
            row = _plain(row, strings)
            if not isinstance(row, dict):
                return f"{ROW_KWARGS!r} is not an object"
            if bad := sorted(set(row) & set(RESERVED)):
                return f"{ROW_KWARGS!r} sets {bad[0]!r}, which the build passes itself"
        # One search over the strings joined by a character no special token holds: a token is
        # found in one of them, never across two.
        joined = self.joiner.join(strings)
        if SURROGATE.search(joined):  # no UTF-8 holds it: the template's text could not be encoded
            return "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text"
        marked = self.special is not None and self.special.search(joined) is not None
        if marked and _NONCHAR.search(joined):
            return "holds U+FDD0/U+FDD1 beside a special-token string"
        if marked:
            messages, tools = _mark(messages, self.special), _mark(tools, self.special)
            row = _mark(row, self.special)
        try:
            variables = {**self.variables, **row} if row else self.variables
            text, spans = render(self.compiled, messages, tools, variables, generation_prompt)
            derived = want_spans and self.derive and not generation_prompt and self.spec.loss in ("assistant", "last")
            if derived:
                spans = derived_spans(self.compiled, messages, tools, variables, text, last_only)
                if isinstance(spans, str):
                    return spans
        except RenderBound as e:
            return f"the template's rendering was stopped: {e}"
        except jinja2.TemplateError as e:
            return f"the template refused it: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as e:
            return f"the template failed on it: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        spans = _trained(messages, spans, derived and last_only) if want_spans else []
        if isinstance(spans, str):
            return spans
        if marked:
            return _unmark(text, spans)
        return text, spans, []

    def _split(self, text: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """text as consecutive (start, end, is a special token) pieces, cut at the template's own
        special tokens (not those of `ranges`: the conversation's own strings), which is where the
        tokenizer itself cuts its input (its added vocabulary splits the input there)."""
        inside = set(ranges)
        out, pos = [], 0
        for m in self.special.finditer(text) if self.special is not None else ():
            if (m.start(), m.end()) in inside:
                continue
            if m.start() > pos:
                out.append((pos, m.start(), False))
            out.append((m.start(), m.end(), True))
            pos = m.end()
        if len(text) > pos:
            out.append((pos, len(text), False))
        return out

    def _encode_fast(self, text: str, spans, ranges):
        """(ids, mask) with ids from ids_fn over the pieces between the template's special tokens
        and the mask from byte offsets (a token's bytes overlapping a span's: the same tokens as
        character offsets mark); None where it cannot be exact (text an NFC normaliser would
        change, or byte lengths that do not add up to the text's)."""
        import unicodedata

        import numpy as np

        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        split = self._split(text, ranges)
        pieces = [text[a:b] for a, b, special in split if not special]
        flat, lens = self.ids_fn(pieces) if pieces else (np.empty(0, np.int64), np.empty(0, np.int64))
        flat, ends = np.asarray(flat, dtype=np.int64), np.cumsum(lens)
        parts, k = [], 0
        for a, b, special in split:
            if special:
                parts.append(np.array([self.special_ids[text[a:b]]], np.int64))
            else:
                parts.append(flat[ends[k] - lens[k]: ends[k]])
                k += 1
        ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
        if len(ids) and int(ids.max()) >= len(self.byte_lens):
            return None
        lens = self.byte_lens[ids]
        tok_end = np.cumsum(lens)
        ascii_only = text.isascii()  # then a character's offset is its byte offset
        if (tok_end[-1] if len(ids) else 0) != (len(text) if ascii_only else len(text.encode("utf-8"))):
            return None
        if not ascii_only:
            spans = [(len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))) for a, b in spans]
        return ids, loss_mask(np.stack([tok_end - lens, tok_end], axis=1), spans, self.spec.loss)

    def _encode_pieces(self, text: str, ranges: list[tuple[int, int]]):
        """Encode text whose `ranges` are special-token strings of the conversation's own: those
        are text, the template's are special tokens.  The text is cut only at the template's
        special tokens, which is where the tokenizer itself cuts (its added vocabulary splits
        the input there): each piece between is encoded whole, with special strings as text."""
        import numpy as np

        ids, offs = [], []
        self.tok.encode_special_tokens = True
        try:
            for a, b, special in self._split(text, ranges):
                if special:
                    ids.append(self.special_ids[text[a:b]])
                    offs.append((a, b))
                else:
                    enc = self.tok.encode(text[a:b], add_special_tokens=False)
                    ids.extend(enc.ids)
                    offs.extend((s + a, e + a) for s, e in enc.offsets)
        finally:
            self.tok.encode_special_tokens = False
        return np.asarray(ids, np.int64), np.asarray(offs, np.int64).reshape(-1, 2)


_NONCHAR = re.compile(f"[{OPEN}{CLOSE}]")
