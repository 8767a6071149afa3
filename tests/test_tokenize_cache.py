"""Tokenising once, in parallel, cached on disk (extract/tokenize_cache.py), against the serial tokenize_dataset.

Covered: 2 worker processes give the same documents, sample indices, counts, data fingerprint and packing as
the serial path; the entry is written once and a second call (another rank, a rerun) reads it without
tokenising; another seq_len is another entry; an error in a worker names the global row; "no usable
conversation" is still an error; the in-memory parallel path (no cache) equals the serial one too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import dflash.extract.tokenize_cache as tc
from dflash.core.chat import DataError, load_chat_dataset
from dflash.extract.data import ChatTokenizer, data_fingerprint, tokenize_dataset
from dflash.extract.pack import pack
from tests.tiny import chat_rows, make_tiny_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    rows = chat_rows(120, seed=3)
    rows[7] = {"messages": [{"role": "user", "content": "no answer here"}]}  # skipped: no assistant turn
    path = write_jsonl(str(d / "chats.jsonl"), rows)
    return d, path, load_chat_dataset(path), ChatTokenizer(make_tiny_tokenizer())


def _same(a, b):
    assert len(a.docs) == len(b.docs) and a.counts() == b.counts()
    for (i1, m1), (i2, m2) in zip(a.docs, b.docs):
        assert i1.dtype == i2.dtype and m1.dtype == m2.dtype
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(m1, m2)
    assert list(a.sample_index) == list(b.sample_index)
    assert list(a.lengths) == list(b.lengths)
    assert data_fingerprint(a) == data_fingerprint(b)


@pytest.mark.parametrize("seq_len", [64, 4096])
def test_cached_parallel_equals_serial_and_is_reused(setup, tmp_path, monkeypatch, seq_len):
    d, path, ds, chat_tok = setup
    serial = tokenize_dataset(ds, chat_tok, seq_len, path, progress=False)
    assert serial.skipped_no_assistant >= 1 and (seq_len > 64 or serial.truncated > 0)
    cache = str(tmp_path / "tok-cache")
    par = tc.tokenize_cached(ds, chat_tok, seq_len, path, cache, workers=2, progress=False)
    _same(serial, par)
    assert par.fingerprint == data_fingerprint(serial)
    assert pack(par.lengths, seq_len) == pack(serial.lengths, seq_len)
    entries = [e for e in os.listdir(cache) if not e.startswith(".")]
    assert len(entries) == 1 and not [e for e in os.listdir(cache) if e.startswith(".")], "one entry, no temp left"

    def no_work(*a, **k):
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(tc, "tokenize_parallel", no_work)
    again = tc.tokenize_cached(ds, chat_tok, seq_len, path, cache, workers=2, progress=False)
    _same(serial, again)


def test_other_settings_are_other_entries(setup, tmp_path):
    d, path, ds, chat_tok = setup
    cache = str(tmp_path / "c")
    tc.tokenize_cached(ds, chat_tok, 64, path, cache, workers=2, progress=False)
    tc.tokenize_cached(ds, chat_tok, 128, path, cache, workers=2, progress=False)
    tc.tokenize_cached(ds.select(range(50)), chat_tok, 128, path, cache, workers=2, progress=False)
    assert len(os.listdir(cache)) == 3


def test_uncached_parallel_equals_serial(setup):
    d, path, ds, chat_tok = setup
    _same(tokenize_dataset(ds, chat_tok, 256, path, progress=False),
          tc.tokenize_cached(ds, chat_tok, 256, path, None, workers=2, progress=False))


def test_worker_error_names_the_global_row(tmp_path):
    rows = chat_rows(60, seed=1)
    rows[47] = {"messages": "not a list"}
    path = write_jsonl(str(tmp_path / "bad.jsonl"), rows)
    ds, chat_tok = load_chat_dataset(path), ChatTokenizer(make_tiny_tokenizer())
    with pytest.raises(DataError, match="row 47"):
        tokenize_dataset(ds, chat_tok, 256, path, progress=False)
    with pytest.raises(DataError, match="row 47"):
        tc.tokenize_cached(ds, chat_tok, 256, path, str(tmp_path / "c"), workers=2, progress=False)
    assert not [e for e in os.listdir(tmp_path / "c") if not e.startswith(".")] if (tmp_path / "c").exists() else True


def test_no_usable_conversation_is_still_an_error(setup, tmp_path):
    d, path, ds, chat_tok = setup
    with pytest.raises(DataError, match="no usable conversation"):
        tc.tokenize_cached(ds, chat_tok, 4, path, str(tmp_path / "c"), workers=2, progress=False)
