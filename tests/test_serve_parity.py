"""Train = serve: the drafter is trained on what it is served, in float32 on a tiny Qwen3 target.

A drafter trained on one distribution and served on another gets a worse tau while every other test stays
green. Two things must hold for the same text:

1. Context features. The hidden states that `dflash eval` captures while it decodes with a KV cache
   (train/evaluate/verify.py Target.forward with capture) equal those the extraction writes to the cache: through a
   real `dflash extract` (stored as bf16) and through the extraction's packed forward
   (extract/target.py PackedTarget.run, float32), for documents of several lengths, decoded token by token
   and block by block (blocks of random accepted lengths, the rest of each block rejected and cropped from
   the KV cache, as speculative decoding does).
2. Drafter inputs. In real speculative decoding (train/evaluate/decode.py speculative + train/evaluate/drafting.py
   DFlashProposer), every block the drafter drafts -- its tokens, its positions, the context before the anchor
   (length and positions) -- is the block training builds for that anchor (DFlashDrafter.prepare), and the drafter's loss on the
   served logits equals the training loss for that anchor computed from the extraction's features. The
   texts are the target's own greedy continuations of prompts of 3 lengths, packed in one row.

Tolerances: (1) against the bf16 cache, bf16 rounding: |served - stored| <= 2^-8 |served| + 1e-6 (round to
nearest moves a value by at most 2^-9 relative; float32 noise can move the rounding to the next bf16
value); against PackedTarget in float32, 1e-4 absolute (measured ~1e-6: masked SDPA over a packed row vs
cached decoding sum in other orders). (2) 1e-4 relative on the loss, the same float32 reassociation.
"""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner

import dflash_cache
from dflash.cli import main as cli_main
from dflash.core.target import load_causal_lm, load_tokenizer
from dflash.extract.target import PackedTarget
from dflash.train.evaluate.decode import speculative
from dflash.train.evaluate.drafting import DFlashProposer
from dflash.train.evaluate.verify import Target, crop_cache
from dflash.train.drafter.loss import slot_weights
from dflash.train.drafter.model import DFlashDrafter, DrafterConfig
from tests.tiny import _text, make_tiny_target, write_jsonl
from tests.workload import hf_greedy

BLOCK = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = make_tiny_target(root / "target")
    rng = random.Random(7)  # conversations of spread-out lengths, all shorter than a row
    rows = [{"messages": [{"role": "user", "content": _text(rng, 1, 3)},
                          {"role": "assistant", "content": _text(rng, n, n)}]} for n in (1, 4, 9, 15, 22)]
    data = write_jsonl(root / "chat.jsonl", rows)
    r = CliRunner().invoke(cli_main, ["extract", "--target", target, "--data", data, "--out", str(root / "cache"),
                                      "--seq-len", "256", "--rows-per-shard", "8", "--no-progress"])
    assert r.exit_code == 0, r.output
    cache = dflash_cache.open(str(root / "cache"))
    model = load_causal_lm(target).eval()
    return {"target": target, "cache": cache, "model": model, "layer_ids": cache.layer_ids}


def documents(cache, n_docs: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(length, token ids, stored hidden as float32) of documents of spread-out lengths."""
    docs = []
    for i in range(len(cache)):
        row = cache[i]
        for d in row["doc_ids"].unique().tolist():
            if d == 0:
                continue
            sel = row["doc_ids"] == d
            docs.append((int(sel.sum()), row["input_ids"][sel].long(), row["hidden"][sel].float()))
    docs.sort(key=lambda x: x[0])
    pick = [docs[round(j * (len(docs) - 1) / (n_docs - 1))] for j in range(n_docs)]
    assert len({p[0] for p in pick}) == n_docs, [p[0] for p in pick]
    return pick


def served_token_by_token(t: Target, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    t.reset()
    hs = [t.forward(ids[None, :prompt], 0, hidden=True)[1]]
    for i in range(prompt, len(ids)):
        hs.append(t.forward(ids[None, i:i + 1], i, hidden=True)[1])
    return torch.cat(hs, 1)[0]


def served_block_by_block(t: Target, ids: torch.Tensor, prompt: int, vocab: int, seed: int) -> torch.Tensor:
    """As speculative decoding feeds the target: a block of BLOCK tokens at pos whose first `keep` are
    accepted (the rest are wrong drafts), the KV cache cropped to pos + keep."""
    rng = random.Random(seed)
    t.reset()
    hs = [t.forward(ids[None, :prompt], 0, hidden=True)[1]]
    pos = prompt
    while pos < len(ids):
        keep = min(rng.randint(1, BLOCK), len(ids) - pos)
        block = torch.cat([ids[pos:pos + keep], (ids[pos + keep:pos + BLOCK] + 1 + rng.randrange(5)) % vocab])
        block = torch.cat([block, torch.full((BLOCK - len(block),), 5)])  # wrong drafts past the end
        _, h = t.forward(block[None], pos, hidden=True)
        hs.append(h[:, :keep])
        crop_cache(t.cache, pos + keep)
        pos += keep
    assert t.cache.get_seq_length() == len(ids)
    return torch.cat(hs, 1)[0]


def packed_features(target: str, layer_ids, docs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One packed row of the documents through the extraction's forward: (ids, positions, doc ids, hidden)."""
    ids = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), j + 1) for j, d in enumerate(docs)])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    pt = PackedTarget(target, layer_ids)
    out = torch.empty(1, ids.shape[1], len(layer_ids) * pt.hidden_size)
    pt.run(ids, pos, doc_ids, out)
    return ids, pos, doc_ids, out


def test_served_context_features_equal_the_extracted_ones(world):
    t = Target(world["model"], world["layer_ids"])
    V = world["model"].config.vocab_size
    docs = documents(world["cache"], 3)
    _, _, _, packed = packed_features(world["target"], world["layer_ids"], [d[1] for d in docs])
    off = 0
    for j, (n, ids, stored) in enumerate(docs):
        ref = packed[0, off:off + n]
        off += n
        for prompt in (1, n // 3, n - 1):
            for how, served in (("token by token", served_token_by_token(t, ids, prompt)),
                                ("block by block", served_block_by_block(t, ids, prompt, V, seed=n + prompt))):
                what = f"document of {n} tokens, prompt {prompt}, {how}"
                assert served.shape == stored.shape, what
                err = (served - stored).abs() - (2 ** -8 * served.abs() + 1e-6)
                assert float(err.max()) <= 0, f"{what}: differs from the cache beyond bf16 rounding"
                assert float((served - ref).abs().max()) <= 1e-4, f"{what}: differs from PackedTarget.run"


def test_the_drafter_sees_in_decoding_what_training_shows_it(world):
    model, target, layer_ids = world["model"], world["target"], world["layer_ids"]
    tok = load_tokenizer(target)
    cfg = DrafterConfig.from_target(model.config, num_layers=1, layer_ids=layer_ids, block_size=BLOCK,
                                    mask_token_id=len(tok))
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(seed=3)
    drafter.set_target_head(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    drafter.eval()
    w = slot_weights(BLOCK, 7.0)[1:]

    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(n)] for n in (3, 11, 29)]
    texts, gens = [], []
    for p in prompts:  # the target's own continuation: speculative decoding follows it exactly
        g = hf_greedy(model, p, 14)
        texts.append(torch.tensor(p + g))
        gens.append(g)
    ids, pos, doc_ids, hidden = packed_features(target, layer_ids, texts)
    loss_mask = torch.zeros_like(ids, dtype=torch.uint8)
    starts = torch.cumsum(torch.tensor([0] + [len(x) for x in texts]), 0).tolist()
    for j, p in enumerate(prompts):
        loss_mask[0, starts[j] + len(p):starts[j + 1]] = 1  # the continuation is supervised, as an answer

    records = []
    draft_block = drafter.draft_block

    def spy(cache, block_ids, positions):
        logits = draft_block(cache, block_ids, positions)
        records.append({"block": block_ids[0].clone(), "positions": positions[0].clone(), "ctx_len": cache.length,
                        "ctx_pos": cache.pos[0, :cache.length].clone(), "logits": logits[0].clone()})
        return logits

    drafter.draft_block = spy
    checked = 0
    for j, (p, g) in enumerate(zip(prompts, gens)):
        records.clear()
        dec = speculative(Target(model, layer_ids), DFlashProposer(drafter, 256), p, len(g), set())
        assert dec.tokens == g
        seq = p + g
        for r in records:
            a = int(r["positions"][0])  # the anchor: the last confirmed token
            # serving: block [seq[a], MASK...] at a..a+B-1, context = exactly the positions before a
            assert r["block"].tolist() == [seq[a]] + [cfg.mask_token_id] * (BLOCK - 1)
            assert r["positions"].tolist() == list(range(a, a + BLOCK))
            assert r["ctx_len"] == a and r["ctx_pos"].tolist() == list(range(a))
            if not (len(p) <= a and a + BLOCK - 1 < len(seq)):
                continue  # training only anchors where the whole block is supervised text here
            scores = torch.zeros(ids.shape, dtype=torch.float32)
            scores[0, starts[j] + a] = 1.0
            blocks, _ = drafter.prepare(ids, loss_mask, doc_ids, scores, 1)
            assert bool(blocks.anchor_valid[0, 0]) and int(blocks.anchors[0, 0]) == starts[j] + a
            assert blocks.tokens[0, 0].tolist() == r["block"].tolist()
            assert blocks.positions[0, 0].tolist() == r["positions"].tolist()
            assert bool(blocks.label_valid[0, 0, 1:].all())
            with torch.no_grad():
                train_loss, _ = drafter.forward_train(hidden, ids, loss_mask, doc_ids, scores, 1, 7.0)
            labels = torch.tensor(seq[a + 1:a + BLOCK])
            ce = torch.nn.functional.cross_entropy(r["logits"].float(), labels, reduction="none")
            serve_loss = float((ce * w).sum() / w.sum())
            assert float(train_loss) == pytest.approx(serve_loss, rel=1e-4), (j, a)
            checked += 1
    assert checked >= 20, checked
