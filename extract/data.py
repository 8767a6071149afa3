"""Chat data for extraction: tokenise conversations with the target's chat template and a loss mask that is 1
exactly on what the assistant produces. Loading a dataset and normalising its rows live in dflash.core.chat (eval
needs them too); their names are re-exported here.

    ds = load_chat_dataset("chats.jsonl", max_samples=10_000)
    chat_tok = ChatTokenizer(tokenizer)                       # the target's tokenizer + chat template
    data = tokenize_dataset(ds, chat_tok, seq_len=4096, source="chats.jsonl")
    print(data.summary())                                     # counts: used / truncated / skipped
    data.docs[i]                                              # (int32 ids, uint8 loss mask), one per kept row

Every problem with the input raises DataError with a message that names the file, the row (0-based index in
the dataset) and the field. Nothing is dropped silently: skipped and truncated conversations are counted.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dflash.core.chat import (
    REGENERATE_META,
    ROLES,
    DataError,
    iter_row_batches,
    load_chat_dataset,
    row_messages,
    to_messages,
)
from dflash.core.io import short_hash


# ----------------------------------------------------------------------------------------------------------------
# chat template -> text, supervised character spans -> tokens, loss mask

_SENTINEL = "\ue000DFLASH\ue001"  # private-use characters: never in real data, untouched by trim/strip filters


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _drop_after_last_assistant(messages: Sequence[Mapping]) -> list:
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return list(messages[: last + 1])


def template_text(chat_template: str | None) -> str | None:
    """--chat-template: a template, or the path of a file holding one (read)."""
    if chat_template is not None and "{" not in chat_template and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    return chat_template


class ChatTokenizer:
    """The target's tokenizer plus its chat template, producing (input_ids, loss_mask) for a conversation.

    loss_mask is 1 exactly on the tokens the assistant produces: each assistant turn's content plus the template's
    end-of-turn text after it (ChatML: "<|im_end|>\\n"); 0 on system/user turns and assistant headers
    ("<|im_start|>assistant\\n"), and on assistant turns with "weight": 0 (context only, as in OpenAI's fine-tuning
    format; `dflash regenerate --turns last` marks the answers it keeps from the data so).

    Method: for assistant turn i, its supervised character span in render(messages) is
    [len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i+1]))), where both renders must
    be prefixes of the full render. The full text is tokenised once (offsets) and a token is supervised when its
    characters overlap a span.

    Templates that rewrite history (e.g. Qwen3 drops the <think> block of assistant turns that are no longer the
    last): a turn whose own render is not a prefix of the full render is located in the full render by its content
    followed by the template's end-of-turn text (found by rendering the turn with a sentinel content). If that
    fails too, DataError explains.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None, chat_template: str | None = None):
        name = _tokenizer_name(tokenizer)
        chat_template = template_text(chat_template)
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(template, Mapping):  # named templates: the default one
            template = template.get("default")
        if not template:
            raise DataError(f"tokenizer of {name} has no chat template; pass --chat-template FILE")
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(f"tokenizer of {name} is a slow tokenizer ({type(tokenizer).__name__}) without offset "
                            "mappings; a fast tokenizer is needed (a tokenizer.json, or use_fast=True)")
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.fingerprint = chat_template_fingerprint(template, self.chat_template_kwargs)
        self._fast_render = self._compile_fast_render()

    # -- rendering ---------------------------------------------------------------------------------------------
    def _slow_render(self, messages, add_generation_prompt):
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template, **self.chat_template_kwargs)

    def _compile_fast_render(self):
        """apply_chat_template costs ~3x the bare jinja render; render the compiled template directly when that
        gives the same text (checked on a probe conversation), else fall back to apply_chat_template."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.chat_template)
            context = {**self.tokenizer.special_tokens_map, **self.chat_template_kwargs}

            def render(messages, add_generation_prompt):
                return compiled.render(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **context)

            probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U 1"},
                     {"role": "assistant", "content": "A 1"}, {"role": "user", "content": "U 2"},
                     {"role": "assistant", "content": " A 2\n"}]
            for msgs, gen in ((probe, False), (probe[1:], False), (probe[:4], True), (probe[1:2], True)):
                if render(msgs, gen) != self._slow_render(msgs, gen):
                    return None
            return render
        except Exception:
            return None

    def render(self, messages, add_generation_prompt: bool = False, where: str = "conversation") -> str | None:
        """The template's text for `messages` (None for an empty list, which templates cannot render)."""
        if not messages:
            return None
        try:
            if self._fast_render is not None:
                return self._fast_render(messages, add_generation_prompt)
            return self._slow_render(messages, add_generation_prompt)
        except Exception as e:  # jinja raise_exception (e.g. "roles must alternate"), template bugs
            raise DataError(f"{where}: the chat template of {self.name} failed on this conversation: "
                            f"{type(e).__name__}: {e}") from e

    def _turn_span(self, full: str, messages: list, i: int, lo: int, where: str) -> tuple[int, int]:
        gen = self.render(messages[:i], True, where)
        own = self.render(messages[: i + 1], False, where)
        start = len(gen) if gen is not None and full.startswith(gen) else None
        end = len(own) if full.startswith(own) else None
        if start is None or end is None:
            # The template renders this turn (or what precedes it) differently once other messages follow.
            sentinel = [*messages[:i], {"role": "assistant", "content": _SENTINEL}]
            probe = self.render(sentinel, False, where)
            post = probe[probe.rfind(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in probe else None
            content = messages[i]["content"]
            found = None
            if post is not None:
                for text in dict.fromkeys((content, content.strip())):
                    needle = text + post
                    if not needle:
                        continue
                    if end is not None:
                        p = end - len(needle) if full[lo:end].endswith(needle) else -1
                    else:
                        p = full.find(needle, start if start is not None else lo)
                    if p >= 0:
                        found = (p, p + len(needle))
                        break
            if found is None:
                which = (f"render(messages[:{i}], add_generation_prompt=True)" if start is None
                         else f"render(messages[:{i + 1}])")
                raise DataError(
                    f"{where}: cannot find assistant turn messages[{i}] in the rendered conversation: the chat "
                    f"template of {self.name} rewrites history ({which} is not a prefix of the render of the whole "
                    f"conversation: the template renders earlier turns differently once later messages follow), "
                    f"and the turn's content followed by its end-of-turn text {post!r} does not appear in it either")
            if start is None:
                start = found[0]
            if end is None:
                end = found[1]
        if not lo <= start <= end <= len(full):
            raise DataError(f"{where}: assistant turn messages[{i}] renders at characters [{start}, {end}), which "
                            f"is out of order (previous turn ended at {lo}); the chat template of {self.name} "
                            "does not render conversations incrementally")
        return start, end

    def render_spans(self, messages, where: str = "conversation") -> tuple[str, list[tuple[int, int]]] | None:
        """(text, supervised character spans) for a conversation, messages after the last assistant turn dropped;
        None when it has no assistant turn."""
        messages = _drop_after_last_assistant(messages)
        if not messages:
            return None
        full = self.render(messages, False, where)
        spans, lo = [], 0
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start, end = self._turn_span(full, messages, i, lo, where)
                if m.get("weight", 1) != 0:  # weight 0: an answer kept as context only (OpenAI's convention)
                    spans.append((start, end))
                lo = end
        return full, spans

    # -- tokenising --------------------------------------------------------------------------------------------
    def tokenize_texts(self, texts: list[str], spans: list[list[tuple[int, int]]]):
        """Tokenise rendered texts in one batched call; yields (int32 ids, uint8 mask) per text."""
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True,
                             return_attention_mask=False, return_token_type_ids=False,
                             padding=False, truncation=False)
        for ids, offsets, text_spans in zip(enc["input_ids"], enc["offset_mapping"], spans):
            ids = np.asarray(ids, dtype=np.int32)
            mask = np.zeros(len(ids), dtype=bool)
            if len(ids):
                off = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64,
                                  count=2 * len(ids)).reshape(len(ids), 2)
                for s, e in text_spans:
                    mask |= (off[:, 0] < e) & (off[:, 1] > s)
            yield ids, mask.astype(np.uint8)

    def encode(self, messages) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of one conversation (messages after the last assistant turn dropped)."""
        rendered = self.render_spans(messages)
        if rendered is None:
            return [], []
        text, spans = rendered
        ids, mask = next(self.tokenize_texts([text], [spans]))
        return ids.tolist(), mask.tolist()


# ----------------------------------------------------------------------------------------------------------------
# fingerprints


def tokenizer_fingerprint(tokenizer) -> str:
    """Short stable hash of what the tokenizer does: its serialized backend (vocab, merges, normalizer,
    pre-tokenizer, added tokens; not transient truncation/padding state) and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        body = json.dumps(spec, sort_keys=True, ensure_ascii=False)
    else:  # slow tokenizer: the vocabulary
        body = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    special = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    return short_hash(body + "\0" + special)


def chat_template_fingerprint(template: str, kwargs: dict | None) -> str:
    """Short stable hash of a chat template and the keyword arguments it is rendered with."""
    return short_hash(json.dumps({"chat_template": template, "kwargs": kwargs or {}}, sort_keys=True, default=repr))


# ----------------------------------------------------------------------------------------------------------------
# a whole dataset


@dataclass
class TokenizedData:
    """Kept conversations as (int32 ids, uint8 loss mask), in dataset order, plus the counts of what was kept,
    truncated and skipped. total = used + skipped_no_assistant + skipped_too_long_prompt; truncated <= used."""

    docs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)  # dataset row of each doc
    total: int = 0
    used: int = 0
    truncated: int = 0  # longer than seq_len: cut to seq_len tokens (and still used)
    skipped_no_assistant: int = 0  # no assistant turn, or no supervised token
    skipped_too_long_prompt: int = 0  # every supervised token lies beyond seq_len
    tokens: int = 0  # sum of kept lengths
    supervised_tokens: int = 0
    seq_len: int = 0
    shortest_prompt: int | None = None  # shortest prompt prefix among skipped_too_long_prompt rows

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.docs]

    def counts(self) -> dict:
        return {k: getattr(self, k) for k in ("total", "used", "truncated", "skipped_no_assistant",
                                               "skipped_too_long_prompt", "tokens", "supervised_tokens")}

    def summary(self) -> str:
        return (f"{self.total} conversations: {self.used} used ({self.truncated} truncated to {self.seq_len} tokens), "
                f"{self.skipped_no_assistant} skipped (no assistant tokens), {self.skipped_too_long_prompt} skipped "
                f"(prompt longer than {self.seq_len} tokens); {self.tokens} tokens, "
                f"{self.supervised_tokens} supervised")


def tokenize_dataset(ds, chat_tok: ChatTokenizer, seq_len: int, source: str, progress: bool = True,
                     batch_size: int = 256, first_row: int = 0, allow_empty: bool = False) -> TokenizedData:
    """Normalise, render and tokenise every row (tokenizer calls batched by `batch_size`), cut to seq_len tokens.

    Rows without an assistant turn (or without a supervised token) and rows whose supervised tokens all fall
    beyond seq_len are skipped and counted. If nothing is usable, DataError says why (unless allow_empty: a part
    of a dataset, see extract/tokenize_cache.py). `first_row`: the dataset row of ds[0] (errors and
    sample_index name rows of the whole dataset).
    """
    from tqdm.auto import tqdm

    if int(seq_len) < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    seq_len = int(seq_len)
    out = TokenizedData(seq_len=seq_len)
    shortest_prompt = None  # shortest prompt prefix (tokens before the first supervised one) among too-long rows
    total = len(ds) if hasattr(ds, "__len__") else None
    bar = tqdm(total=total, desc=f"tokenizing {os.path.basename(str(source)) or source}", unit="conv",
               disable=not progress or not sys.stderr.isatty(), dynamic_ncols=True)
    row = int(first_row)
    try:
        for batch in iter_row_batches(ds, source, batch_size=batch_size):
            texts, spans, rows = [], [], []
            for example in batch:
                where = f"{source}, row {row}"
                rendered = chat_tok.render_spans(to_messages(example, row, source), where)
                if rendered is None:
                    out.skipped_no_assistant += 1
                else:
                    texts.append(rendered[0])
                    spans.append(rendered[1])
                    rows.append(row)
                row += 1
            if texts:
                for r, (ids, mask) in zip(rows, chat_tok.tokenize_texts(texts, spans)):
                    if not mask.any():
                        out.skipped_no_assistant += 1
                        continue
                    if len(ids) > seq_len:
                        first = int(np.argmax(mask))
                        if first >= seq_len:
                            out.skipped_too_long_prompt += 1
                            shortest_prompt = first if shortest_prompt is None else min(shortest_prompt, first)
                            continue
                        ids, mask = ids[:seq_len].copy(), mask[:seq_len].copy()
                        out.truncated += 1
                    out.docs.append((ids, mask))
                    out.sample_index.append(r)
                    out.tokens += len(ids)
                    out.supervised_tokens += int(mask.sum())
            bar.update(len(batch))
    finally:
        bar.close()
    out.total = row - int(first_row)
    out.used = len(out.docs)
    out.shortest_prompt = shortest_prompt
    if not allow_empty:
        check_usable(out, source)
    return out


def check_usable(out: TokenizedData, source: str) -> None:
    """DataError saying why, when no conversation of the dataset could be used."""
    if out.used:
        return
    if out.total == 0:
        raise DataError(f"{source} has no rows")
    if out.skipped_too_long_prompt:
        raise DataError(
            f"{source}: no usable conversation: in all {out.skipped_too_long_prompt} conversations with assistant "
            f"tokens the prompt is longer than seq_len={out.seq_len} (shortest prompt prefix: {out.shortest_prompt} "
            f"tokens before the first assistant token; {out.skipped_no_assistant} more rows have no assistant "
            f"tokens); raise seq_len above {out.shortest_prompt}")
    raise DataError(f"{source}: no usable conversation: none of the {out.total} rows has an assistant turn "
                    "with supervised tokens")


def data_fingerprint(tokenized: TokenizedData) -> str:
    """Short stable hash of the kept documents' ids and loss masks, in order."""
    return short_hash(chunk for ids, mask in tokenized.docs
                      for chunk in (np.array(len(ids), dtype="<i8").tobytes(),
                                    np.ascontiguousarray(ids, dtype="<i4").tobytes(),
                                    np.ascontiguousarray(mask, dtype=np.uint8).tobytes()))
