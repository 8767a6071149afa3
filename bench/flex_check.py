"""Which piece of the compiled training graph departs from eager? Attention (flex), its block mask, or the loss.

    python bench/flex_check.py                    # Qwen3-8B shape, one drafter layer, on the GPU
    python bench/flex_check.py --shape demo

Every variant is compared with an independent float32 reference: the same layer(s) through SDPA with the
dense boolean mask (`attn="sdpa"`), which shares no kernel with flex_attention. Reported per variant:
relative error of the layer output and of the gradients w.r.t. its input, the context and each weight.

  eager      flex_block_mask built eagerly (compiled create_block_mask), the compiled flex kernel called eagerly
  c_inmask   one torch.compile graph: block mask built in the graph, flex in the graph (what `dflash train` does)
  c_argmask  one torch.compile graph with flex in it; the block mask built eagerly and passed in
  c_contig   as c_inmask, with q, k, v made contiguous before flex_attention
  c_rope     as c_inmask, with the RoPE tables computed inside the graph from the positions
  c_layers   as c_rope, through all the drafter's layers sharing one block mask in one graph
Also: make_blocks compiled vs eager, the block masks (partial and full blocks) built in a graph vs eagerly, and
the chunked loss compiled vs eager (against float32).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dflash.train.blocks as MB  # noqa: E402
import dflash.train.loss as ML  # noqa: E402
import dflash.train.model as M  # noqa: E402
from bench.common import hardware  # noqa: E402
from bench.compile_check import ALL_SHAPES, batches, build  # noqa: E402


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def block_dense(t) -> torch.Tensor:
    """BlockMask tuple -> [B, H, nq, nkv] int8: 1 partial block, 2 full block (order of indices ignored)."""
    kv_num, kv_idx, full_num, full_idx = t[0], t[1], t[2], t[3]
    B, H, nq = kv_num.shape
    nkv = kv_idx.shape[-1]
    out = torch.zeros(B, H, nq, nkv, dtype=torch.int8, device=kv_num.device)
    ar = torch.arange(nkv, device=kv_num.device)
    for num, idx, val in ((kv_num, kv_idx, 1), (full_num, full_idx, 2)):
        if num is None:
            continue
        valid = ar[None, None, None, :] < num[..., None]
        src = torch.where(valid, torch.full_like(idx, val, dtype=torch.int8), torch.zeros_like(idx, dtype=torch.int8))
        out.scatter_add_(-1, idx.long().clamp(max=nkv - 1), src)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--variants", default="c_inmask,c_rope,c_layers",
                    help="comma list of eager, c_inmask, c_argmask, c_contig, c_rope, c_layers (see above)")
    ap.add_argument("--device", default="cuda", help="cuda (flex's backward does not run on CPU)")
    ap.add_argument("--attn", default="flex", help="attention of the variants: flex, or sdpa (a smoke run on CPU)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = a.device
    shape = ALL_SHAPES[a.shape]
    _, T, rows, anchors, block, layers = shape
    model, dcfg = build(shape, dev, "flex")
    hid, ids, lm, doc, scores = batches(shape, dcfg, 1, dev)[0]
    ids, doc = ids.long(), doc.long()
    res = {"hardware": hardware(), "torch": torch.__version__, "shape": a.shape}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)

    blocks = MB.make_blocks(ids, lm, doc, scores, anchors, block, dcfg.mask_token_id)
    N = anchors
    g = torch.Generator(device=dev).manual_seed(3)
    x0 = torch.randn(rows, N * block, dcfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    ctx0 = torch.randn(rows, T, dcfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    dout = torch.randn(rows, N * block, dcfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    def run(layers_, dtype, impl, fn_kind, rope_in_graph=False):
        """Output and grads (input, context, weights) of the given drafter layers, run as the model runs them."""
        x = x0.detach().to(dtype, copy=True).requires_grad_(True)
        ctx = ctx0.detach().to(dtype, copy=True).requires_grad_(True)
        ctx_cos, ctx_sin = M.rope_cos_sin(model.inv_freq, blocks.ctx_positions, dtype)
        q_cos, q_sin = M.rope_cos_sin(model.inv_freq, blocks.positions.view(rows, N * block), dtype)

        def body(x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, anchors_, tokens, adoc, cpos, pos, doc_, mask=None):
            if rope_in_graph:  # the tables from the positions, inside the graph (as forward_train does)
                ctx_cos, ctx_sin = M.rope_cos_sin(model.inv_freq, cpos, x.dtype)
                q_cos, q_sin = M.rope_cos_sin(model.inv_freq, pos.reshape(pos.shape[0], -1), x.dtype)
            if mask is None:
                b = MB.Blocks(anchors_, None, tokens, pos, None, None, cpos, adoc)
                mask = (MB.flex_block_mask if impl == "flex" else MB.dense_block_mask)(b, doc_, None)
            for layer_ in layers_:
                x = model._layer(layer_, x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, mask)
            return x

        args = (x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, blocks.anchors, blocks.tokens, blocks.anchor_doc,
                blocks.ctx_positions, blocks.positions, doc)
        saved = model.attn_impl
        model.attn_impl = impl
        try:
            if fn_kind == "eager":
                out = body(*args)
            elif fn_kind == "c_argmask":
                mask = MB.flex_block_mask(blocks, doc, None)
                out = torch.compile(body, dynamic=False, fullgraph=True)(*args, mask=mask)
            else:
                out = torch.compile(body, dynamic=False, fullgraph=True)(*args)
        finally:
            model.attn_impl = saved
        out.backward(dout.to(dtype))
        grads = {"x": x.grad, "ctx": ctx.grad}
        for i, layer_ in enumerate(layers_):
            for n, p in layer_.named_parameters():
                if p.grad is not None:
                    grads[f"{i}.{n}"] = p.grad.clone()
                    p.grad = None
        return out.detach(), grads

    # the block layout (anchors, positions, labels): compiled vs eager
    bargs = (ids, lm, doc, scores, anchors, block, dcfg.mask_token_id)
    cb = torch.compile(MB.make_blocks, dynamic=False, fullgraph=True)(*bargs)
    res["blocks_differ"] = {f: int((getattr(blocks, f) != getattr(cb, f)).sum())
                            for f in ("anchors", "anchor_valid", "tokens", "positions", "labels", "label_valid",
                                      "ctx_positions", "anchor_doc")}
    print("blocks", json.dumps(res["blocks_differ"]), flush=True)
    save()

    # the loss: compiled vs eager, against float32
    gh = torch.Generator(device=dev).manual_seed(4)
    h0 = model.norm(torch.randn(rows, N, block - 1, dcfg.hidden_size, generator=gh, device=dev).to(torch.bfloat16))
    out = {}
    for name, dt, comp in (("fp32", torch.float32, False), ("eager", torch.bfloat16, False), ("compiled", torch.bfloat16, True)):
        h = h0.detach().to(dt).requires_grad_(True)
        f = torch.compile(ML.chunked_block_loss, dynamic=False, fullgraph=True) if comp else ML.chunked_block_loss
        loss, met = f(h, model.lm_head_weight.to(dt), blocks, 7.0)
        loss.backward()
        out[name] = (float(loss.detach()), h.grad.float())
    res["loss"] = {k: {"loss": v[0], "d_h": rel(v[1], out["fp32"][1])} for k, v in out.items()}
    print("loss", json.dumps(res["loss"]), flush=True)
    save()

    # the block masks: built inside a graph vs eagerly
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    eager_mask = MB.flex_block_mask(blocks, doc, None)

    def in_graph(anchors_, tokens, adoc, cpos, pos, doc_):
        m = MB.flex_block_mask(MB.Blocks(anchors_, None, tokens, pos, None, None, cpos, adoc), doc_, None)
        return tuple(getattr(m, f) for f in fields)

    tg = torch.compile(in_graph, dynamic=False, fullgraph=True)(blocks.anchors, blocks.tokens, blocks.anchor_doc,
                                                                blocks.ctx_positions, blocks.positions, doc)
    te = tuple(getattr(eager_mask, f) for f in fields)
    kv_e, kv_g = block_dense(te[:4]), block_dense(tg[:4])
    q_e, q_g = block_dense(te[4:8]), block_dense(tg[4:8])
    res["mask"] = {"kv_blocks_differ": int((kv_e != kv_g).sum()), "q_blocks_differ": int((q_e != q_g).sum()),
                   "kv_partial": int((kv_e == 1).sum()), "kv_full": int((kv_e == 2).sum()),
                   "q_vs_kv_transpose_differ_eager": int((q_e != kv_e.transpose(-1, -2)).sum()),
                   "q_vs_kv_transpose_differ_graph": int((q_g != kv_g.transpose(-1, -2)).sum()),
                   "block_size": list(eager_mask.BLOCK_SIZE)}
    print("mask", json.dumps(res["mask"]), flush=True)
    save()

    # the layers: float32 SDPA references (one layer, all layers), then the variants
    refs = {}

    def reference(n):
        if n not in refs:
            l32 = [copy.deepcopy(layer).float() for layer in model.layers[:n]]
            try:
                refs[n] = (*run(l32, torch.float32, "sdpa", "eager"), "float32 sdpa, dense mask")
            except torch.OutOfMemoryError:  # fall back on eager bf16 flex: only graph-vs-eager differences show
                torch.cuda.empty_cache()
                refs[n] = (*run(list(model.layers[:n]), torch.bfloat16, "flex", "eager"), "eager bf16 flex")
        return refs[n]

    res["variants"] = {}
    for v in a.variants.split(","):
        n = len(model.layers) if v == "c_layers" else 1
        kind = {"eager": "eager", "c_rope": "c_inmask", "c_layers": "c_inmask", "c_contig": "c_inmask"}.get(v, v)
        saved_attend = M.attend
        if v == "c_contig":
            def attend_contig(q, k, v_, mask, impl, _f=saved_attend):
                return _f(q.contiguous(), k.contiguous(), v_.contiguous(), mask, impl)
            M.attend = attend_contig
        t0 = time.perf_counter()
        try:
            ref_out, ref_g, ref_name = reference(n)
            out, gr = run(list(model.layers[:n]), torch.bfloat16, a.attn, kind, rope_in_graph=v in ("c_rope", "c_layers"))
            r = {"layers": n, "reference": ref_name, "out": rel(out, ref_out),
                 **{f"d_{k}": rel(gr[k], ref_g[k]) for k in ref_g}, "s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - a variant that fails is a finding too
            r = {"error": repr(e)[-1500:]}
        finally:
            M.attend = saved_attend
            torch._dynamo.reset()
        res["variants"][v] = r
        print(v, json.dumps(r), flush=True)
        save()

if __name__ == "__main__":
    main()
