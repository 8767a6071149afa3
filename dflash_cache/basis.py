"""Features on their own basis: a cache that stores z = P·x (R numbers per token) instead of x (K·H).

A drafter reads the target's K·H context features only through one linear map without bias
(`fc: Linear(K·H -> H)`, train/drafter/model.py), so the features can be stored on a fixed basis of R directions:

    z = P x                 P: float32 [R, K·H] (rows orthonormal), x: the K context layers of a token, concatenated
    fc(x) ~ fc'(z)          a drafter trained on z learns fc': [H, R]; at export fc = fc' P is exact for the features
                            the drafter saw (it only ever saw P x), so engines read a drafter of the usual layout

P holds the top R eigenvectors of the uncentred second moment M = sum_t x_t x_t^T over real (non-padding) tokens,
accumulated in float64: the directions that keep the most of the features' energy sum_t ||x_t||^2. Uncentred, so
fc' P needs no bias (a centred basis would need the mean added back). Each eigenvector's sign is fixed (its
largest-magnitude component positive) so that one M gives one P. The energy a basis keeps, overall and per
captured layer, follows from M and P alone: with P's eigenvalues lambda_r, the energy of channel j lost by the
projection x -> P^T P x is M_jj - sum_r lambda_r P_rj^2.

In a cache (format.py, format version 4; older readers refuse it):

    CACHE/basis/zarr.json, CACHE/basis/c/0/0   float32 [R, K·H], one chunk (zstd): P
    root attribute "basis"                     the record below: rank, width, digest of P's bytes, the fit, energy
    shards/*/hidden                            [R_s, T, R] (+ H channels of the target's last hidden state, stored
                                               as it is, with `--last-hidden`: it feeds the LM head, not fc)

The record (and so P's digest) is part of the root attributes, hence of the cache's identity: every commit record
carries the root's digest, a resumed extraction must match it, and `dflash train` refuses a --val-cache on
another basis naming the field `basis.digest`.

Which tokens fit P (`dflash extract --basis-rank R`): the real tokens of `fit_rows(num_rows, T, fit_tokens)`,
rows spread evenly over the extraction's plan (the packer orders rows longest conversations first, so the first
rows alone would be a biased sample). The plan is identical on every rank; rank 0 fits P and writes it to the
cache root before the other ranks open the cache, and they (and a resumed extraction, and a trainer following the
cache) read it from there, so every shard of a cache is on one P.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .format import CacheCorruptError, CacheError, chunk_key
from .store import Codec, Store

if TYPE_CHECKING:
    import torch

BASIS = "basis"  # the root array holding P
FIT_TOKENS = 65536  # the default number of row tokens (real and padding) the fit reads; `extract --basis-fit-tokens`
# (the held-out projection error has settled by then at K*H = 2,880: BENCHMARKS.md, "Cache size")
_CODEC = "zstd"


class BasisError(CacheError):
    """A basis that cannot be fitted, stored or read as asked."""


def fit_rows(num_rows: int, seq_len: int, fit_tokens: int) -> list[int]:
    """The rows of the plan whose real tokens fit the basis: m = min(num_rows, ceil(fit_tokens / T)) rows spread
    evenly, row floor(i * num_rows / m) for i < m (the same list on every rank and every run)."""
    if num_rows <= 0:
        return []
    m = min(num_rows, max(1, -(-int(fit_tokens) // int(seq_len))))
    return sorted({i * num_rows // m for i in range(m)})


class SecondMoment:
    """Accumulates M = sum x x^T (float64) over the real tokens of feature batches, on the batches' device."""

    def __init__(self, width: int, device: "torch.device | str" = "cpu"):
        import torch

        self.width = int(width)
        self.m = torch.zeros(self.width, self.width, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: "torch.Tensor", real: "torch.Tensor | None" = None) -> None:
        """x [..., width] (any float dtype); real: a boolean mask of x's leading shape (None: every token)."""
        x = x.reshape(-1, x.shape[-1])[:, : self.width]
        if real is not None:
            x = x[real.reshape(-1).to(x.device)]
        x = x.to(self.m.dtype)
        self.m.addmm_(x.T, x)
        self.tokens += int(x.shape[0])


def fit(moment: np.ndarray, rank: int, layer_width: int) -> tuple[np.ndarray, dict[str, Any]]:
    """(P float32 [rank, D], energy figures) from a second moment M [D, D]: P's rows are M's top `rank`
    eigenvectors (float64 eigh; signs fixed). layer_width: H, for the energy kept per captured layer."""
    m = np.asarray(moment, dtype=np.float64)
    D = m.shape[0]
    if not 1 <= rank <= D:
        raise BasisError(f"basis rank {rank} must lie in [1, {D}] (the features' width K·H)")
    # eigh reads one triangle: M (a sum of x x^T) needs no symmetrised copy, which at the 8B shape (K*H = 20,480) is
    # 3.4 GB of the fit's peak host memory (BENCHMARKS.md, "Cache size")
    vals, vecs = np.linalg.eigh(m, UPLO="L")  # ascending
    top = np.argsort(vals)[::-1][:rank]
    lam, p = np.clip(vals[top], 0.0, None), vecs[:, top].T.copy()  # [R], [R, D]
    idx = np.abs(p).argmax(axis=1)
    p *= np.where(p[np.arange(rank), idx] < 0, -1.0, 1.0)[:, None]
    return p.astype(np.float32), energy(m, p, lam, layer_width)


def energy(m: np.ndarray, p: np.ndarray, lam: np.ndarray, layer_width: int) -> dict[str, Any]:
    """The fraction of the features' energy sum ||x||^2 that P keeps, overall and per layer of layer_width channels
    (module docstring: channel j loses M_jj - sum_r lambda_r P_rj^2)."""
    diag = np.diag(m)
    kept = (lam[:, None] * p.astype(np.float64) ** 2).sum(axis=0)
    total = float(diag.sum())
    per_layer = []
    for k in range(diag.shape[0] // layer_width):
        sl = slice(k * layer_width, (k + 1) * layer_width)
        d = float(diag[sl].sum())
        per_layer.append(round(float(kept[sl].sum()) / d, 6) if d > 0 else 1.0)
    return {"energy": round(float(lam.sum()) / total, 6) if total > 0 else 1.0, "energy_per_layer": per_layer}


def digest(p: np.ndarray) -> str:
    """The fingerprint of a basis: sha256 of its float32 little-endian bytes and shape (16 hex digits)."""
    a = np.ascontiguousarray(p, dtype="<f4")
    h = hashlib.sha256(repr(a.shape).encode())
    h.update(a.tobytes())
    return h.hexdigest()[:16]


def record(p: np.ndarray, fit_info: dict[str, Any]) -> dict[str, Any]:
    """The root attribute "basis" of a cache on basis p (fit_info: how it was fitted and what it keeps)."""
    return {"rank": int(p.shape[0]), "width": int(p.shape[1]), "digest": digest(p), "array": BASIS,
            "dtype": "float32", "uncentred": True,
            "formula": "z[r, t, :rank] = basis @ x[r, t] (x: the context layers of token t, concatenated); a drafter's "
                       "fc' [H, rank] on z is fc = fc' @ basis [H, width] on x",
            **fit_info}


def array_layout(p_shape: tuple[int, int]) -> tuple:
    """The arguments of writer.array_json (zarr's own metadata) for the basis array of this shape."""
    return tuple(p_shape), tuple(p_shape), "float32", _CODEC, {"dflash": "basis of the stored features"}, 4


def write(store: Store, p: np.ndarray, zarr_json: bytes) -> None:
    """Write P into the cache root (its chunk, then its zarr.json: writer.array_json(*array_layout(shape))). Called
    before the root's zarr.json is."""
    a = np.ascontiguousarray(p, dtype="<f4")
    store.put(chunk_key(BASIS, (0, 0)), Codec(_CODEC, 4).encode(a))
    store.put(f"{BASIS}/zarr.json", zarr_json)


def read(store: Store, rec: dict[str, Any], where: str = "") -> np.ndarray:
    """P of the cache whose root record is `rec`, checked against the record's shape and digest
    (CacheCorruptError naming the file otherwise)."""
    where = where or store.url
    try:
        shape = (int(rec["rank"]), int(rec["width"]))
        want = str(rec["digest"])
    except (KeyError, TypeError, ValueError):
        raise CacheCorruptError(f"cache {where}: root metadata field 'basis' is {rec!r}, not a basis record") from None
    key = chunk_key(BASIS, (0, 0))
    raw = store.get(key)
    if raw is None:
        raise CacheCorruptError(f"cache {where}: {key} (the basis of its features) is missing")
    out = np.empty(shape, dtype="<f4")
    try:
        Codec(_CODEC, 4).decode(raw, out)
    except Exception as e:  # noqa: BLE001 - any decoding failure is damage
        raise CacheCorruptError(f"cache {where}: {key} (the basis) cannot be decoded ({e})") from None
    if digest(out) != want:
        raise CacheCorruptError(f"cache {where}: {key} (the basis) does not match the digest 'basis.digest' "
                                f"{want!r} in its root metadata: damaged or replaced")
    return out


def project(x: "torch.Tensor", p: "torch.Tensor", context_width: int) -> "torch.Tensor":
    """Stored features of x [..., W] (W = context_width, + H of a last hidden state kept as it is): [..., R (+H)],
    float32, computed in float32 (p: float32 [R, context_width] on x's device)."""
    import torch

    z = torch.matmul(x[..., :context_width].float(), p.T)
    if x.shape[-1] > context_width:
        z = torch.cat([z, x[..., context_width:].float()], dim=-1)
    return z

