"""The compiled target forward of extraction (extract/compiled.py) and its first-batch check, on CPU.

Covered: compiled = eager in float32 on the tiny Qwen3 target, per captured layer, and the check passes with
its float32 floor; a deliberately wrong compiled forward (one captured layer off by 5%) is caught by the check
inside a real `run_extract` with compile="on", which says so in its summary, continues eagerly, and writes the
same cache bit for bit as a compile="off" run; a compile that raises also falls back to eager.
"""

from __future__ import annotations

import pytest
import torch

import dflash.extract.compiled as ec
import dflash_cache
from dflash.extract.run import ExtractConfig, run_extract
from dflash.extract.target import PackedTarget
from tests.tiny import chat_rows, make_tiny_target, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cx")
    return make_tiny_target(str(d / "t")), write_jsonl(str(d / "chats.jsonl"), chat_rows(40, seed=2)), d


def _batch(R=2, T=64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (R, T), generator=g)
    doc = torch.ones(R, T, dtype=torch.long)
    doc[:, 40:] = 2
    doc[1, 60:] = 0
    pos = torch.cat([torch.arange(40), torch.arange(T - 40)]).expand(R, T).contiguous()
    return ids, pos, doc


@pytest.mark.cxx
def test_compiled_equals_eager_float32(tiny):
    target = PackedTarget(tiny[0], [1, 3, 5], device="cpu", dtype=torch.float32, attn="sdpa")
    runner, report = ec.compiled_or_eager(target, _batch())
    assert report["compiled"] and report["passed"] and isinstance(runner, ec.CompiledTarget), report
    assert report["reference"] == "eager (float32 target)" and report["tolerance"] == [ec.FLOOR] * 3
    assert max(report["err_compiled_vs_ref"]) < 1e-5
    ids, pos, doc = _batch()
    a, b = torch.zeros(2, 64, 192), torch.zeros(2, 64, 192)
    torch.testing.assert_close(runner.run(ids, pos, doc, a), target.run(ids, pos, doc, b), rtol=1e-5, atol=1e-5)
    assert bool((a[doc == 0] == 0).all())


class _WrongCompiled:
    """Stands in for a mis-compiled graph: the eager forward with the second captured layer scaled by 1.05."""

    def __init__(self, target, mode=None):
        self.target = target

    def run(self, ids, pos, doc, out):
        self.target.run(ids, pos, doc, out)
        H = self.target.hidden_size
        out[..., H:2 * H] *= 1.05
        return out


def _broken_compile(target, mode=None):
    raise RuntimeError("inductor exploded")


@pytest.mark.parametrize("make", [_WrongCompiled, _broken_compile])
def test_a_wrong_compiled_forward_is_caught_and_the_run_continues_eagerly(tiny, tmp_path, monkeypatch, make, capsys):
    path, data, _ = tiny
    common = dict(target=path, data=data, seq_len=256, rows_per_shard=4, batch_rows=2, layers=[1, 3],
                  writer_threads=2, progress=False, tokenize_cache="off", device="cpu")
    eager = run_extract(ExtractConfig(out=str(tmp_path / "eager"), compile="off", **common))
    assert eager["compile"]["compiled"] is False
    real = ec.compiled_or_eager
    monkeypatch.setattr(ec, "compiled_or_eager", lambda t, b, mode=None: real(t, b, mode, make=make))
    res = run_extract(ExtractConfig(out=str(tmp_path / "checked"), compile="on", **common))
    c = res["compile"]
    assert c["compiled"] is False and c["passed"] is False
    if make is _WrongCompiled:
        assert "layer 3" in c["why"] and c["err_compiled_vs_ref"][1] == pytest.approx(0.05, rel=1e-3)
        assert c["err_compiled_vs_ref"][0] < 1e-6
    else:
        assert "inductor exploded" in c["why"]
    assert "running eagerly" in capsys.readouterr().out
    a, b = dflash_cache.open(str(tmp_path / "eager")), dflash_cache.open(str(tmp_path / "checked"))
    assert a.complete and b.complete and sorted(a.commits) == sorted(b.commits)
    for s in a.commits:
        assert a.commits[s]["crc32"] == b.commits[s]["crc32"], f"shard {s} differs from the eager run's"


@pytest.mark.cxx
def test_flex_attention_runs_outside_the_compiled_graph(tiny):
    """With the flex document mask, the compiled target keeps each layer's attention out of its graph (one graph
    break per layer: HF's own flex call, as in eager) and still equals eager in float32; the eager path through
    the same model is unchanged by the switch."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    target = PackedTarget(tiny[0], [1, 3, 5], device="cpu", dtype=torch.float32, attn="flex")
    ids, pos, doc = _batch()
    before = target.run(ids, pos, doc, torch.zeros(2, 64, 192)).clone()
    torch._dynamo.reset()
    counters.clear()
    runner, report = ec.compiled_or_eager(target, (ids, pos, doc))
    assert report["compiled"] and report["passed"], report
    assert runner.split_attention and target.model.config._attn_implementation == ec.SPLIT_ATTN
    layers = target.model.config.num_hidden_layers
    assert counters["stats"]["unique_graphs"] >= layers + 1, dict(counters["stats"])
    assert max(report["err_compiled_vs_ref"]) < 1e-5
    torch.testing.assert_close(runner.run(ids, pos, doc, torch.zeros(2, 64, 192)), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.run(ids, pos, doc, torch.zeros(2, 64, 192)), before, rtol=0, atol=0)
    # the whole-graph variant (bench/extract.py --variants whole4) is one graph
    target.model.config._attn_implementation = "flex_attention"
    torch._dynamo.reset()
    counters.clear()
    whole = ec.CompiledTarget(target, split_attention=False)
    torch.testing.assert_close(whole.run(ids, pos, doc, torch.zeros(2, 64, 192)), before, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.cxx
def test_capture_hooks_compile_nothing_with_split_attention(tiny):
    """With attention outside the graph every layer is its own frame, and so would be each capture hook,
    specialised on its layer index (on the H200 the five hooks ran into dynamo's recompile limit). They run
    behind torch.compiler.disable: capturing three layers compiles no more graphs than capturing one."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    graphs = {}
    for layers in ([1], [1, 3, 5]):
        target = PackedTarget(tiny[0], layers, device="cpu", dtype=torch.float32, attn="flex")
        torch._dynamo.reset()
        counters.clear()
        runner, report = ec.compiled_or_eager(target, _batch())
        assert report["compiled"] and report["passed"], report
        ref = target.run(*_batch(), torch.zeros(2, 64, 64 * len(layers)))
        for _ in range(2):
            torch.testing.assert_close(runner.run(*_batch(), torch.zeros(2, 64, 64 * len(layers))), ref,
                                       rtol=1e-5, atol=1e-5)
        graphs[len(layers)] = counters["stats"]["unique_graphs"]
    assert graphs[3] == graphs[1], graphs


def test_compile_workers_are_stopped_after_the_first_batch(tiny, tmp_path, monkeypatch):
    """Inductor's compile worker pool (a real one, two workers) is shut down by the extraction's release, and
    the extraction calls that release once, after its first batch."""
    import torch._inductor.async_compile as ac
    import torch._inductor.config as ic

    import dflash.extract.run as er

    with ic.patch(compile_threads=2):  # (inductor's own patch: its config module restores itself)
        ac.AsyncCompile.warm_pool()
        assert len(ac._pool_set) == 1
        er._release_compile_workers()
        assert len(ac._pool_set) == 0

    calls = []
    real = er._release_compile_workers
    monkeypatch.setattr(er, "_release_compile_workers", lambda: calls.append(1) or real())
    path, data, _ = tiny
    res = run_extract(ExtractConfig(target=path, data=data, out=str(tmp_path / "c"), seq_len=256, rows_per_shard=4,
                                    batch_rows=2, layers=[1, 3], writer_threads=2, progress=False,
                                    tokenize_cache="off", device="cpu", compile="off"))
    assert res["rows"] >= 4 and calls == [1]
