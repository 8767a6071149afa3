"""`dflash extract --basis-rank R | --basis-from CACHE`: the basis the context features are stored on.

Where a cache's basis P comes from (dflash_cache/basis.py has what P is and how it is stored):

  1. an existing cache at --out (a resumed extraction): its own P, read from its root, never fitted again; asking
     for another rank, or (--basis-from) another basis, is a CacheMismatchError naming `basis.rank` or
     `basis.digest`, as any other changed setting is;
  2. --basis-from CACHE: that cache's P and its record (so both caches carry the same digest and `dflash train`
     takes one as the other's --val-cache); it must be of the same target (config hash), hidden size and context
     layers, and --basis-rank, if given, must be its rank;
  3. --basis-rank R: fitted by rank 0, from the frozen target's features of `basis.fit_rows` (rows spread evenly over
     the plan, --basis-fit-tokens row tokens): eager forwards, the uncentred second moment in float64 on the
     device, its top R eigenvectors. Rank 0 writes P to the cache root before the other ranks open the cache;
     they read it there (resolve_on_rank), so every rank projects with the same bytes.

Projection happens on the device, in float32, right after each forward and before fp8 quantisation
(dflash_cache.basis.project); the last hidden state of --last-hidden is kept as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import dflash_cache
from dflash.core.target import TargetError
from dflash_cache import basis as basis_mod
from dflash_cache.format import CacheMismatchError

from dflash.extract.pack import materialize


def resolve_on_main(cfg, existing: dict | None, *, width: int, hidden_size: int, layer_ids: list[int],
                    config_hash: str | None, fit) -> tuple[np.ndarray | None, dict[str, Any]]:
    """(P or None, the root's basis record or {}) on rank 0, by the rules of the module docstring. `existing`: the
    root attributes of the cache at --out (None: a new cache or --overwrite); `fit()` fits P on this target."""
    source = _from_cache(cfg, width=width, hidden_size=hidden_size, layer_ids=layer_ids,
                         config_hash=config_hash) if cfg.basis_from else None
    wanted_rank = source[1]["rank"] if source else cfg.basis_rank
    if existing is not None:
        have = existing.get("basis") or {}
        if int(have.get("rank", 0) or 0) != int(wanted_rank or 0):
            raise CacheMismatchError("basis.rank", have.get("rank"), wanted_rank or None, cfg.out,
                                     "this run's settings differ from the existing cache; pass --overwrite to replace it")
        if have and source and have.get("digest") != source[1]["digest"]:
            raise CacheMismatchError("basis.digest", have.get("digest"), source[1]["digest"], cfg.out,
                                     f"--basis-from {cfg.basis_from} holds another basis than the one this cache was "
                                     "extracted on; pass --overwrite to replace it")
        if have:  # a resumed extraction keeps its P
            return dflash_cache.Cache(cfg.out, allow_incomplete=True).basis(), dict(have)
    if source is not None:
        return source
    if not cfg.basis_rank:
        return None, {}
    if cfg.basis_rank > width:
        raise TargetError(f"--basis-rank {cfg.basis_rank}: at most the context features' width K*H = {width}")
    return fit()


def resolve_on_rank(out: str) -> tuple[np.ndarray | None, dict[str, Any]]:
    """A rank other than 0, after rank 0 created or checked the cache: P as rank 0 wrote it, from the root."""
    c = dflash_cache.open(out, allow_incomplete=True)
    return c.basis(), dict(c.spec.basis)


def basis_source(cfg):
    """The --basis-from cache, open, after what can be told without the target: it is a cache, it has a basis, of the
    --basis-rank asked if one is (a TargetError naming the flag otherwise). `extract` asks before any work."""
    try:
        src = dflash_cache.open(cfg.basis_from, allow_incomplete=True)
    except dflash_cache.CacheError as e:
        raise TargetError(f"--basis-from {cfg.basis_from}: {e}") from None
    if not src.spec.basis:
        raise TargetError(f"--basis-from {cfg.basis_from}: that cache stores its features as they are (no 'basis' "
                          "in its root metadata): give a cache extracted with --basis-rank")
    rank = dict(src.spec.basis)["rank"]
    if cfg.basis_rank and cfg.basis_rank != rank:
        raise TargetError(f"--basis-rank {cfg.basis_rank}: --basis-from {cfg.basis_from} has a basis of rank "
                          f"{rank} (leave --basis-rank out, or give that rank)")
    return src


def _from_cache(cfg, *, width, hidden_size, layer_ids, config_hash) -> tuple[np.ndarray, dict[str, Any]]:
    src = basis_source(cfg)
    rec = dict(src.spec.basis)
    theirs = ((src.metadata.get("info") or {}).get("target") or {}).get("config_hash")
    for name, a, b in (("hidden_size", src.hidden_size, hidden_size), ("layer_ids", src.context_layer_ids, layer_ids),
                       ("info.target.config_hash", theirs, config_hash), ("basis.width", rec.get("width"), width)):
        if a != b:
            raise TargetError(f"--basis-from {cfg.basis_from}: field '{name}' is {a!r} there but {b!r} in this "
                              "extraction: a basis is shared only between caches of one target and one set of layers")
    return src.basis(), rec


def fit_basis(target, plan, docs, seq_len: int, pad_id: int, batch_rows: int, dev: torch.device, *, width: int,
              stored_layers: int, hidden_size: int, rank: int, fit_tokens: int) -> tuple[np.ndarray, dict[str, Any]]:
    """P and its record from the target's features over basis.fit_rows of the plan (module docstring)."""
    rows = basis_mod.fit_rows(len(plan), seq_len, fit_tokens)
    moment = basis_mod.SecondMoment(width, dev)
    out = torch.empty(max(1, batch_rows), seq_len, stored_layers * hidden_size, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for k in range(0, len(rows), batch_rows):
            part = [materialize(plan, docs, seq_len, pad_id, r, r + 1) for r in rows[k:k + batch_rows]]
            ids, pos, doc = (torch.from_numpy(np.concatenate([a[name] for a in part]).astype(np.int64)).to(dev)
                             for name in ("input_ids", "position_ids", "doc_ids"))
            buf = out[: len(part)]
            target.run(ids, pos, doc, buf)
            moment.add(buf[..., :width], doc != 0)
    if moment.tokens < rank:
        raise TargetError(f"--basis-rank {rank}: the fit saw only {moment.tokens} real tokens (--basis-fit-tokens "
                          f"{fit_tokens}): a basis of rank R needs at least R tokens; raise --basis-fit-tokens")
    p, energy = basis_mod.fit(moment.m.cpu().numpy(), rank, hidden_size)
    return p, basis_mod.record(p, {
        "fit_tokens": moment.tokens, "fit_rows": len(rows),
        "fit_rule": f"real tokens of rows floor(i * num_rows / m), i < m = min(num_rows, ceil({fit_tokens} / T))",
        **energy})
