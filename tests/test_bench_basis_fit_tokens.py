"""bench/basis_fit_tokens.py (BENCHMARKS.md "Cache size": how many tokens a basis is fitted on) on a tiny target:
a real bf16 extraction, bases fitted as the extraction fits them (on fit_rows of three rows in four), each measured on
the fourth rows; the figures are the projection's, so they can be checked against the features themselves."""

import json

import numpy as np
import torch

from bench import basis_fit_tokens
from tests.tiny import chat_rows, make_tiny_target, write_jsonl


def test_basis_fit_tokens_fits_as_the_extraction_does_and_measures_held_out_rows(tmp_path, monkeypatch):
    import dflash_cache
    from dflash_cache.basis import SecondMoment, fit, fit_rows

    target = make_tiny_target(tmp_path / "target", hidden=32)
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(60, seed=3))
    out = tmp_path / "r.json"
    rep = basis_fit_tokens.main(["--target", target, "--data", data, "--conversations", "60", "--seq-len", "128",
                                 "--ranks", "8,16", "--fit-tokens", "256,1024", "--workdir", str(tmp_path / "w"),
                                 "--json", str(out)])
    assert json.loads(out.read_text())["results"] == rep["results"]
    assert not (tmp_path / "w" / "cache-bf16").exists()  # removed after the run
    assert [(r["fit_tokens"], r["rank"]) for r in rep["results"]] == [(256, 8), (256, 16), (1024, 8), (1024, 16)]
    n_rows = rep["rows"]
    assert n_rows >= 8 and rep["plan_rows"] == n_rows - n_rows // 4

    # the figures for (1024, 16) again, from the same cache kept this time, by the module's own rules
    monkeypatch.setenv("DFLASH_BENCH_KEEP", "1")
    basis_fit_tokens.main(["--target", target, "--data", data, "--conversations", "60", "--seq-len", "128",
                           "--ranks", "16", "--fit-tokens", "1024", "--workdir", str(tmp_path / "w")])
    cache = dflash_cache.open(str(tmp_path / "w" / "cache-bf16"))
    width = len(cache.layer_ids) * 32
    plan = [i for i in range(len(cache)) if i % 4 != 3]
    rows = [plan[j] for j in fit_rows(len(plan), 128, 1024)]
    assert len(rows) == 8 == rep["results"][2]["fit_rows"]
    m = SecondMoment(width)
    for i in rows:
        m.add(cache[i]["hidden"][:, :width], cache[i]["doc_ids"] != 0)
    assert m.tokens == rep["results"][2]["real_fit_tokens"]
    p = torch.from_numpy(fit(m.m.numpy(), 16, 32)[0]).double()
    x = torch.cat([cache[i]["hidden"][cache[i]["doc_ids"] != 0].double()[:, :width] for i in range(3, len(cache), 4)])
    err = ((x @ p.T @ p - x).norm(dim=1) / x.norm(dim=1)).numpy()
    r = rep["results"][3]
    assert abs(r["median"] - np.median(err)) < 1e-3 and abs(r["p90"] - np.quantile(err, 0.9)) < 1e-3
    assert 0.0 < r["energy_kept"] < 1.0 and len(r["per_layer_median"]) == len(cache.layer_ids)
    # more directions keep more of the held-out tokens
    assert rep["results"][3]["median"] < rep["results"][2]["median"]
    assert rep["results"][3]["energy_kept"] > rep["results"][2]["energy_kept"]
