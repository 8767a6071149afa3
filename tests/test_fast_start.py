"""The compiled step's start (train/fit/compile_step.py), on CPU with inductor's C++ backend.

What is covered:
    even_chunk: as few chunks as the budget allows, of one shape when a nearby count divides the slots
    the `regions` step (the trunk one graph, the loss's chunk compiled once and looped) equals the eager step
        (loss, metrics, gradients) on a tiny drafter whose loss takes 4 chunks, with 2 graphs in all: the chunk
        is compiled once for 4 chunks (the `step` scope unrolls them inside its one graph)
    compile artifacts: a process saves them after compiling; a new process with empty inductor caches loads them
        (checked) and builds nothing; a damaged or truncated file, one written by another torch or for another
        step, or an unreadable record is ignored with a note and never handed to torch
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.train.drafter.loss import even_chunk

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent


def test_even_chunk():
    assert even_chunk(4 * 512 * 15, 1766) == 1536  # the Qwen3-8B shape: 20 chunks of one shape
    assert even_chunk(8 * 512 * 15, 5461) == 5120  # the GPU recipe: 12
    assert even_chunk(96, 256) == 96  # one chunk
    assert even_chunk(72, 5) == 4  # 18 chunks: 15, 16 and 17 do not divide 72
    assert even_chunk(97, 10) == 10  # a prime: even chunks, the last shorter (10 x 9 + 7)
    for n in range(1, 300):
        for most in (1, 7, 64, 1000):
            c = even_chunk(n, most)
            assert 1 <= c <= max(most, 1) and -(-n // c) <= -(-n // most) + 3, (n, most, c)


@pytest.mark.slow
@pytest.mark.cxx
def test_regions_step_equals_eager_and_compiles_the_chunk_once(monkeypatch):
    import dflash.train.drafter.loss as loss
    from dflash.train.fit.compile_step import compile_step
    from dflash.train.fit.compile_check import compile_count
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

    torch._dynamo.reset()
    monkeypatch.setattr(loss, "ce_chunk", lambda vocab, budget_bytes=0: 12)  # 2 rows x 8 anchors x 3 slots: 4 x 12
    cfg = DrafterConfig.named("tiny", num_layers=1, vocab_size=1000, mask_token_id=999)
    model = DFlashDrafter(cfg, attn_impl="sdpa")
    model.reset_parameters(seed=0)
    torch.manual_seed(0)
    model.set_target_head(torch.randn(1000, 64) * 0.02, torch.randn(1000, 64) * 0.02)
    R, T, N = 2, 64, 8
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(R, T, 2 * 64, generator=g), torch.randint(0, 999, (R, T), generator=g),
            torch.ones(R, T, dtype=torch.uint8), torch.ones(R, T, dtype=torch.int32), torch.rand(R, T, generator=g),
            N, 7.0)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(fn):
        loss_, met = fn(*args)
        loss_.backward()
        grads = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return loss_.detach(), met, grads

    ref_loss, ref_met, ref_grads = run(model.forward_train)
    assert loss.even_chunk(R * N * 3, loss.ce_chunk(1000)) == 12  # the loss runs 4 chunks of 12 slots
    before = compile_count()
    got_loss, got_met, got_grads = run(compile_step(model, "regions", cuda=False))
    assert compile_count() - before == 2  # the trunk and the chunk: the chunk was compiled once for all 4
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for k in ("tau", "slot_acc", "weight", "blocks"):
        torch.testing.assert_close(got_met[k], ref_met[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    step = compile_step(model, "regions", cuda=False)  # another step function of the same model: no new graph
    run(step)
    assert compile_count() - before == 2


# A process that compiles a small function through CompileArtifacts: load before compiling, save after; prints
# what it did and inductor's cache counters as one JSON line.
COMPILE_ONCE = """
import json, sys, torch
from dflash.train.fit.compile_step import CompileArtifacts, cache_counters
art = CompileArtifacts(sys.argv[1], {"what": sys.argv[2]})
loaded = art.load()
f = torch.compile(lambda x: torch.nn.functional.silu(x) * x.sum(-1, keepdim=True), dynamic=False, fullgraph=True)
y = f(torch.ones(4, 8))
saved = art.save() if not art.loaded else ""
print(json.dumps({"loaded": loaded, "saved": saved, **cache_counters(), "y": float(y.sum())}))
"""


def _compile_once(tmp_path: Path, artifacts: Path, what: str, name: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"),
               TRITON_CACHE_DIR=str(tmp_path / f"triton-{name}"))  # empty caches: a fresh machine
    p = subprocess.run([PY, "-c", COMPILE_ONCE, str(artifacts), what], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_compile_artifacts_round_trip(tmp_path):
    art = tmp_path / "artifacts"
    first = _compile_once(tmp_path, art, "step-a", "1")  # fresh: builds, saves
    assert first["loaded"].startswith("no compile artifacts") and first["fx_graph_cache_miss"] >= 1, first
    assert first["saved"].startswith("saved compile artifacts"), first
    bins = list(art.glob("*.bin"))
    assert len(bins) == 1 and bins[0].with_suffix(".json").exists()
    rec = json.loads(bins[0].with_suffix(".json").read_text())
    assert rec["bytes"] == bins[0].stat().st_size and len(rec["sha256"]) == 64 and rec["env"]["torch"] == torch.__version__

    warm = _compile_once(tmp_path, art, "step-a", "2")  # a new process, empty caches, the artifacts: nothing built
    assert warm["loaded"].startswith("loaded compile artifacts") and "checked" in warm["loaded"], warm
    assert warm["fx_graph_cache_hit"] >= 1 and warm["fx_graph_cache_miss"] == 0, warm
    assert warm["y"] == first["y"]


def test_compile_artifacts_that_do_not_check_out_are_never_loaded(tmp_path, monkeypatch):
    """Another step, a damaged or truncated file, another torch: a note, and torch's loader is never called."""
    from dflash.train.fit.compile_step import CompileArtifacts

    art = tmp_path / "artifacts"
    saved = CompileArtifacts(str(art), {"what": "step-a"})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled state " * 1000, None))
    assert saved.save().startswith("saved compile artifacts")
    loads = []
    from torch.compiler._cache import CacheInfo

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loads.append(data) or CacheInfo())
    assert CompileArtifacts(str(art), {"what": "step-a"}).load().startswith("loaded compile artifacts")
    assert loads == [b"compiled state " * 1000]  # what was saved is what is loaded
    loads.clear()

    assert CompileArtifacts(str(art), {"what": "step-b"}).load().startswith("no compile artifacts")  # its own key
    assert CompileArtifacts(None, {"what": "step-a"}).load() == "compile artifacts off"
    data_path, rec_path = saved.paths
    data = bytearray(open(data_path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # damaged in place, same size
    open(data_path, "wb").write(bytes(data))
    assert "ignored: checksum mismatch" in CompileArtifacts(str(art), {"what": "step-a"}).load()
    open(data_path, "wb").write(bytes(data[:100]))  # truncated
    assert "ignored: 100 bytes, its record says 15000" in CompileArtifacts(str(art), {"what": "step-a"}).load()
    rec = json.loads(open(rec_path).read())
    rec["env"]["torch"] = "0.0.0"  # written by another torch
    open(rec_path, "w").write(json.dumps(rec))
    assert "ignored: written with torch '0.0.0'" in CompileArtifacts(str(art), {"what": "step-a"}).load()
    open(rec_path, "w").write("{not json")
    assert "is damaged" in CompileArtifacts(str(art), {"what": "step-a"}).load()
    assert loads == []
