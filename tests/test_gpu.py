"""GPU paths (skipped without CUDA): flex attention, CUDA streams + pinned buffers, CUDA-graph steps."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, os.path.dirname(__file__))
from tiny import chat_rows, make_tiny_target, write_jsonl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    target = make_tiny_target(str(d / "target"), arch="qwen3", num_layers=6, hidden=64)
    data = write_jsonl(str(d / "chats.jsonl"), chat_rows(120, seed=3))
    return d, target, data


def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "dflash", *args], cwd=ROOT, capture_output=True, text=True, env=e)


def test_flex_drafter_matches_sdpa_with_gradients():
    from dflash.train.drafter.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig.named("tiny", block_size=8)
    m = DFlashDrafter(cfg).cuda().float()
    m.set_target_head(torch.randn(512, 64) * 0.3, torch.randn(512, 64) * 0.3)
    R, T = 2, 256
    hidden = torch.randn(R, T, 128, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 500, (R, T), device="cuda")
    doc = torch.ones(R, T, dtype=torch.long, device="cuda")
    doc[:, 100:] = 2
    doc[:, 240:] = 0
    lm = (doc > 0).to(torch.uint8)
    lm[:, :20] = 0
    sc = torch.rand(R, T, device="cuda")
    out = {}
    for impl in ("sdpa", "flex"):
        m.attn_impl = impl
        m.zero_grad(set_to_none=True)
        fwd = torch.compile(m.forward_train, dynamic=False) if impl == "flex" else m.forward_train
        loss, _ = fwd(hidden, ids, lm, doc, sc, 32)
        loss.backward()
        out[impl] = (loss.detach(), m.fc.weight.grad.clone())
    assert torch.allclose(out["flex"][0], out["sdpa"][0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(out["flex"][1], out["sdpa"][1], rtol=1e-3, atol=1e-5)


def test_extract_on_gpu_matches_cpu(assets):
    import dflash_cache

    d, target, data = assets
    for dev, attn in (("cuda", "flex"), ("cuda", "sdpa"), ("cpu", "sdpa")):
        r = _cli("extract", "--target", target, "--data", data, "--out", str(d / f"c-{dev}-{attn}"), "--seq-len", "256",
                 "--rows-per-shard", "4", "--batch-rows", "2", "--device", dev, "--attn", attn,
                 "--dtype", "float32" if dev == "cpu" else "bfloat16")
        assert r.returncode == 0, r.stderr[-3000:]
    ref = dflash_cache.open(str(d / "c-cpu-sdpa"))
    for name in ("c-cuda-flex", "c-cuda-sdpa"):
        c = dflash_cache.open(str(d / name))
        assert len(c) == len(ref)
        assert dflash_cache.verify(str(d / name)).ok
        for i in range(0, len(c), 7):
            a, b = c[i], ref[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["doc_ids"], b["doc_ids"])
            x, y = a["hidden"].float(), b["hidden"].float()
            assert (x - y).norm() / y.norm() < 0.05, (name, i)
            assert (x[b["doc_ids"] == 0] == 0).all()


def test_compiled_cuda_graph_training_matches_eager(assets):
    d, target, data = assets
    cache = str(d / "c-cuda-flex")
    if not os.path.exists(cache):
        pytest.skip("needs the extraction test's cache")
    runs = {}
    for comp in ("off", "on"):
        out = str(d / f"run-{comp}")
        r = _cli("train", "--cache", cache, "--target", target, "--out", out, "--max-steps", "12", "--log-every", "1",
                 "--drafter-layers", "2", "--block-size", "4", "--num-anchors", "32", "--batch-rows", "2",
                 "--param-dtype", "float32", "--compile", comp, "--lr", "1e-3", "--no-progress", "--overwrite")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[comp] = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
        summ = json.load(open(os.path.join(out, "summary.json")))
        assert summ["recompiles_after_warmup"] == 0
    e, c = torch.tensor(runs["off"]), torch.tensor(runs["on"])
    assert torch.allclose(e, c, rtol=2e-3, atol=2e-3), (e, c)


def test_pinned_batches_release_and_reuse(assets):
    import dflash_cache

    d, _, _ = assets
    cache = str(d / "c-cuda-flex")
    if not os.path.exists(cache):
        pytest.skip("needs the extraction test's cache")
    c = dflash_cache.open(cache)
    seen = []
    for b in c.batches(2, pin_memory=True, prefetch=2):
        assert b["hidden"].is_pinned()
        x = b["hidden"].cuda(non_blocking=True)
        torch.cuda.synchronize()
        b.release()
        seen += b["row_index"][b["row_valid"]].tolist()
        assert x.shape[0] == 2
    assert sorted(seen) == list(range(len(c)))


def test_eval_on_gpu(assets):
    d, target, data = assets
    run = str(d / "run-on")
    if not os.path.exists(os.path.join(run, "final")):
        pytest.skip("needs the training test's drafter")
    out = str(d / "eval.json")
    r = _cli("eval", "--target", target, "--drafter", os.path.join(run, "final"), "--data", data, "--max-prompts", "4",
             "--max-new-tokens", "24", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.load(open(out))
    assert rep["device"].startswith("cuda") and rep["dtype"] == "bfloat16"
    assert 1.0 <= rep["dflash"]["tau"] <= 4.0 and 1.0 <= rep["ngram"]["tau"] <= 4.0
    assert 0.0 <= rep["dflash"]["output_match_rate"] <= 1.0
    assert rep["draft_graph"] == "graph"  # the default on a GPU: captured, and its first draft equals the eager one
    out32 = str(d / "eval32.json")
    r = _cli("eval", "--target", target, "--drafter", os.path.join(run, "final"), "--data", data, "--max-prompts", "4",
             "--max-new-tokens", "24", "--dtype", "float32", "--json", out32)
    assert r.returncode == 0, r.stderr[-3000:]
    rep32 = json.load(open(out32))
    assert rep32["draft_graph"] == "graph" and rep32["dflash"]["outputs_identical"] == 4  # lossless through the graph


def test_graph_captured_decoding_equals_eager_decoding(assets):
    """The static decoder's CUDA-graph replays give the eager (uncaptured) call's logits, and graph decoding gives
    the eager HF engine's tokens, greedy and sampled, in float32 (regenerate and prompts) and the HF loop's through
    eval's StaticTarget."""
    from dflash.core.static_decode import StaticDecoder
    from dflash.core.target import load_causal_lm
    from dflash.extract.generation.generate import generate
    from dflash.train.evaluate.decode import NgramProposer, greedy, speculative
    from dflash.train.evaluate.verify import StaticTarget, Target

    _, target, _ = assets
    m = load_causal_lm(target, device=torch.device("cuda:0"), dtype=torch.float32).eval()
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (4, 40), generator=g).cuda()
    # uncaptured, captured (both with the fused layers, a GPU's default) and captured with the HF modules' layers
    decs = [StaticDecoder(m, slots=4, max_len=64, layer_ids=[1, 3], bucket=16, graphs=on, fused=fused)
            for on, fused in ((False, None), (True, None), (True, False))]
    assert [d.fused for d in decs] == [True, True, False]
    for d in decs:
        d.prefill(ids[:, :20], torch.arange(4, device="cuda"))
    for t in range(20, 40):  # spans of 32 then 48 columns
        start = torch.full((4,), t, dtype=torch.long, device="cuda")
        (a, ha), (b, hb), (c, hc) = (d.step(ids[:, t:t + 1], start, t + 1) for d in decs)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hc, hb, atol=1e-4, rtol=1e-4)
    assert decs[1].captures >= 2 and not decs[0].captures  # two buckets of 16 columns were crossed
    prompts = [ids[i, :n].tolist() for i, n in enumerate((5, 17, 30, 9))]
    for kw in ({}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}):
        eager = generate(m, prompts, eos_ids=set(), max_new_tokens=24, batch_size=4, engine="eager", **kw)
        graph = generate(m, prompts, eos_ids=set(), max_new_tokens=24, batch_size=4, engine="static", **kw)
        assert [r.tokens for r in graph] == [r.tokens for r in eager], kw
    st, ht = StaticTarget(m, [1, 3], max_len=300, block_size=4), Target(m, [1, 3])
    # every step shape captured before decoding (eval, outside its timings): 304 columns round up to two 256-column
    # spans, each with the 1-token step and the 4-token verify
    assert st.prepare() == 4
    captured = st.dec.captures
    for p in prompts:
        assert greedy(st, p, 24, set()).tokens == greedy(ht, p, 24, set()).tokens
        assert speculative(st, NgramProposer(4, 3), p, 24, set()).tokens == greedy(ht, p, 24, set()).tokens
    assert st.dec.captures == captured


def test_varlen_batched_steps_on_the_gpu_equal_the_spanned_ones(assets):
    """On a GPU in bf16, a batched one-token step reads each row's own columns with flash attention's
    variable-length kernel (the default where it runs): captured in a CUDA graph, fused, it gives the spanned step's
    logits and hidden states for rows of very unequal lengths whose slots hold stale columns past them."""
    import random

    from dflash.core import static_decode as sd
    from dflash.core.static_decode import StaticDecoder
    from dflash.core.target import load_causal_lm

    _, target, _ = assets
    m = load_causal_lm(target, device=torch.device("cuda:0"), dtype=torch.bfloat16).eval()
    V, n = m.config.vocab_size, 24
    rng = random.Random(5)
    lens = [rng.randrange(1, 300) for _ in range(n)]
    ids = torch.randint(3, V, (n, max(lens)), generator=torch.Generator().manual_seed(1)).cuda()
    decs = [StaticDecoder(m, slots=n, max_len=384, layer_ids=[1, 3], bucket=64, varlen=on) for on in (None, False)]
    assert decs[0].varlen and decs[0].varlen_step(n, 1) and decs[0].fused and not decs[1].varlen
    for d in decs:
        d.prefill(torch.randint(3, V, (n, 310), device="cuda"), torch.arange(n, device="cuda"))
        d.prefill(ids, torch.arange(n, device="cuda"), torch.tensor(lens, device="cuda"))
    pos = torch.tensor(lens, device="cuda")
    for t in range(40):  # crosses span buckets
        step = torch.randint(3, V, (n, 1), generator=torch.Generator().manual_seed(t)).cuda()
        (a, ha), (b, hb) = (d.step(step, pos, int(pos.max()) + 1) for d in decs)
        torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=5e-2)
        torch.testing.assert_close(ha.float(), hb.float(), atol=6e-2, rtol=5e-2)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
        pos = pos + 1
    assert decs[0].captures >= 2 and decs[0].varlen_kernel in sd.VARLEN_KERNELS
    for kernel in sd.VARLEN_KERNELS:  # both kernels run on this GPU and agree with the plain attention
        assert sd._varlen_check(kernel, torch.device("cuda:0"), torch.bfloat16, 64, 3, 3), kernel
        assert sd._varlen_check(kernel, torch.device("cuda:0"), torch.float16, 128, 4, 2), kernel
    print({k: sd._varlen_time(k, torch.device("cuda:0"), torch.bfloat16, 64, 3, 3) for k in sd.VARLEN_KERNELS})


def test_dflash2_draft_step_in_a_cuda_graph_drafts_as_the_eager_one(assets):
    """DFlash2Proposer(graph=True): StaticDraft2's step, the selector's greedy pass included, captured once as one
    CUDA graph and replayed (graph_status "graph"); every draft of a decoding is the eager step's, in float32, and
    decoding stays lossless."""
    import random

    from dflash.core.target import load_causal_lm
    from dflash.train.evaluate.decode import greedy, speculative
    from dflash.train.drafter.dflash2 import DFlash2Drafter
    from dflash.train.evaluate.dflash2_drafting import DFlash2Proposer
    from dflash.train.drafter.model import DrafterConfig
    from dflash.train.evaluate.verify import Target
    from tests.test_dflash2_decoding import recording

    _, target, _ = assets
    dev = torch.device("cuda:0")
    m = load_causal_lm(target, device=dev, dtype=torch.float32).eval()
    V = m.config.vocab_size
    cfg = DrafterConfig.from_target(m.config, num_layers=2, layer_ids=[1, 3], block_size=4, mask_token_id=V - 1,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                    arch="dflash2", selector_rank=8, selector_top_k=4)
    d = DFlash2Drafter(cfg)
    d.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # convolutions and selector away from their identity / small start: they count
        for name, p in d.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(p + 0.5 * torch.randn(p.shape, generator=g))
    d = d.to(dev).eval()
    d.set_target_head(m.get_input_embeddings().weight, m.get_output_embeddings().weight)
    t = Target(m, [1, 3])
    rng = random.Random(0)
    for n in (3, 17):
        p = [rng.randrange(3, V - 1) for _ in range(n)]
        eager, eager_drafts = recording(DFlash2Proposer(d, 128))
        graph, graph_drafts = recording(DFlash2Proposer(d, 128, graph=True))
        ref = greedy(t, p, 32, set()).tokens
        assert speculative(t, eager, p, 32, set()).tokens == ref
        assert speculative(t, graph, p, 32, set()).tokens == ref
        assert graph.graph_status == "graph" and graph.static.graph is not None
        assert graph_drafts == eager_drafts and len(graph_drafts) > 3


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "gpt_oss"])
def test_hybrid_packed_rows_on_gpu_equal_each_conversation_alone(tmp_path, family):
    """On the GPU (flex document masks per attention kind; flash-linear-attention's varlen delta rule where it is
    installed), every conversation of a packed row equals it run alone through transformers' own model on the GPU,
    float32; the compiled forward passes its check against eager."""
    from tiny import make_tiny_family
    from test_hybrid_targets import errors_by_position, packed_rows, reference_model

    from dflash.extract.compiled import compiled_or_eager
    from dflash.extract.target import PackedTarget

    path = make_tiny_family(str(tmp_path / family), family, num_layers=6, sliding_window=24)
    docs, plan, arrays = packed_rows()
    layer_ids = list(range(6))
    target = PackedTarget(path, layer_ids, device="cuda", dtype=torch.float32, attn="flex")
    t = {k: torch.from_numpy(v).long().cuda() for k, v in arrays.items()}
    out = torch.zeros(*arrays["input_ids"].shape, 6 * 64, device="cuda")
    target.run(t["input_ids"], t["position_ids"], t["doc_ids"], out)
    ref = reference_model(path, family).cuda()
    errs = errors_by_position(out.cpu(), arrays, plan, docs, ref, layer_ids, device="cuda")
    assert max(errs.values()) < 5e-3, errs
    runner, report = compiled_or_eager(target, (t["input_ids"], t["position_ids"], t["doc_ids"]))
    assert report["passed"], report


def test_hybrid_captured_steps_equal_the_eager_ones_and_the_hf_forward(tmp_path):
    """A Qwen3.5 hybrid in float32 (dflash/core/static_hybrid.py): one-token steps of 4 rows at their own positions
    and a 16-token verify with per-row accept, replayed as CUDA graphs, give the uncaptured decoder's logits and
    states and the HF forward's logits (a capture's warm-up must not advance the recurrent states); eval's
    StaticTarget with partial acceptances and the slot engine decode the target's greedy tokens. (The HF forward
    runs flash-linear-attention's chunked kernel where it is installed, whose float32 dots may be TF32: hence its
    looser tolerance.)"""
    from tiny import make_tiny_family
    from test_hybrid_decoding import Oracle, prompts_of
    from test_hybrid_static import long_memory
    from workload import hf_greedy

    from dflash.core.static import static_decoder
    from dflash.core.target import load_causal_lm
    from dflash.extract.generation.generate import generate
    from dflash.train.evaluate.decode import speculative
    from dflash.train.evaluate.verify import StaticTarget

    path = long_memory(make_tiny_family(str(tmp_path / "qwen3_5"), "qwen3_5", num_layers=4, seed=7), "qwen3_5")
    m = load_causal_lm(path, device=torch.device("cuda:0"), dtype=torch.float32).eval()
    V = m.config.vocab_size
    ids = torch.randint(3, V, (4, 80), generator=torch.Generator().manual_seed(0)).cuda()
    eager, graph = (static_decoder(m, slots=4, max_len=96, layer_ids=[1, 3], bucket=16, graphs=on, max_q=16)
                    for on in (False, True))
    lens = torch.tensor([5, 17, 30, 9], device="cuda")
    for d in (eager, graph):
        d.prefill(ids[:, :30], torch.arange(4, device="cuda"), lens)

    def hf(r, n):
        with torch.inference_mode():
            return m(input_ids=ids[r:r + 1, :n]).logits[0]

    pos = lens.clone()
    for _ in range(12):  # one-token steps, then the same shapes replayed
        step = ids.gather(1, pos[:, None])
        (a, ha), (b, hb) = (d.step(step, pos, int(pos.max()) + 1) for d in (eager, graph))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hb, ha, atol=1e-5, rtol=1e-5)
        for r in range(4):
            torch.testing.assert_close(b[r, 0], hf(r, int(pos[r]) + 1)[-1], atol=2e-3, rtol=2e-3)
        pos += 1
    for rnd in range(2):  # 16-token verifies (recorded), each row keeping its own share
        block = ids.gather(1, pos[:, None] + torch.arange(16, device="cuda"))
        (a, _), (b, _) = (d.step(block, pos, int(pos.max()) + 16) for d in (eager, graph))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        keep = torch.tensor([1, 16, 7, 3], device="cuda") if rnd == 0 else torch.tensor([12, 2, 16, 5], device="cuda")
        for d in (eager, graph):
            d.accept(keep, n=4)
        torch.testing.assert_close(graph.rec, eager.rec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph.conv, eager.conv, atol=1e-5, rtol=1e-5)
        pos += keep
        step = ids.gather(1, pos[:, None])
        b, _ = graph.step(step, pos, int(pos.max()) + 1)
        eager.step(step, pos, int(pos.max()) + 1)
        for r in range(4):
            torch.testing.assert_close(b[r, 0], hf(r, int(pos[r]) + 1)[-1], atol=2e-3, rtol=2e-3)
        pos += 1
    assert graph.captures >= 3 and not eager.captures
    p = prompts_of([11], seed=1)[0]
    ref = hf_greedy(m, p, 40)
    st = StaticTarget(m, [1, 3], max_len=64, block_size=16)
    assert st.prepare() > 0 and st.attention == "static-graph"
    dec = speculative(st, Oracle(p, ref, [0, 2, 1, 3], V), p, 36, set())
    assert dec.tokens == ref[:36] and min(dec.accept_lengths) < 16
    prompts = [ids[i, :n].tolist() for i, n in enumerate((5, 17, 30, 9))]
    static = generate(m, prompts, eos_ids=set(), max_new_tokens=24, batch_size=2, refill=1, engine="static")
    assert [r.tokens for r in static] == [hf_greedy(m, q, 24) for q in prompts]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_eval_decodes_a_hybrid_in_cuda_graphs_by_default(tmp_path, family, capsys):
    """--target-graph left unset, `eval` on a GPU decodes a Qwen3.5 hybrid through its static decoder in CUDA graphs
    (no line about the eager decoder), every float32 output the target's own; Qwen3.5-MoE stays on the eager path
    and its one line says why."""
    from tiny import make_tiny_family
    from test_hybrid_decoding import drafter_for

    from dflash.core.target import load_causal_lm
    from dflash.train.drafter.checkpoint import save_drafter
    from dflash.train.evaluate.eval import EvalConfig, run_eval

    path = make_tiny_family(str(tmp_path / family), family, num_layers=4)
    drafter = str(tmp_path / "drafter")
    save_drafter(drafter_for(load_causal_lm(path, dtype=torch.float32), seed=3), drafter, dtype=torch.float32)
    data = write_jsonl(str(tmp_path / "eval.jsonl"), chat_rows(3, seed=4))
    rep = run_eval(EvalConfig(target=path, drafter=drafter, data=data, max_prompts=2, max_new_tokens=12,
                              warmup_prompts=0, device="cuda", dtype="float32", progress=False))
    for k in ("dflash", "ngram"):
        assert rep[k]["outputs_identical"] == 2, k
    said = [ln for ln in capsys.readouterr().out.splitlines() if "the eager decoder" in ln]
    if family == "qwen3_5":
        assert rep["target_graph"] and rep["target_attention"] == "static-graph" and not said, said
    else:
        assert not rep["target_graph"]
        assert said == ["eval: linear_attention layers: the eager decoder (no CUDA graphs: decoder layers of type "
                        "Qwen3_5MoeDecoderLayer)"], said
