"""Content fingerprint of a target's weights: digests of the tensor bytes, not of file names and sizes.

A fine-tune or another checkpoint of the same run has the same config, file names and sizes; only the
bytes differ. So the fingerprint is a digest per tensor, read straight from the file:

    safetensors   each tensor's bytes, located by the file header's data_offsets (no torch, no copy)
    GGUF          each tensor's bytes, located by the gguf reader's data_offset / n_bytes
    .bin / .pt    one digest per file (pickles have no cheap tensor index)

A tensor's digest is sha256 over the sha256 digests of its consecutive 16 MiB pieces (a one-level
tree), so that one large tensor (an embedding of 1.2 GB) is hashed by many threads at once: the tree
digest of dflash.core.io.tree_digests (pieces read with os.preadv and hashed in a thread pool; both
release the GIL). Digests are 32 hex characters (128 bits).

    fp = fingerprint("path/to/target")          # WeightsFingerprint
    fp.as_dict()  ->  {"scheme": ..., "digest": <combined>, "tensors": {name: digest}, "roles": {...}}

`roles` names the tensors `dflash train` takes from the target: `embedding` and `lm_head` (the same
tensor for a tied head). `dflash extract` records the whole fingerprint in the cache's root attributes
(info.weights) and refuses to resume into a cache whose fingerprint differs; `dflash train` hashes only
the role tensors of its --target and compares them with what the cache recorded (compare_roles).
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable

from dflash.core.errors import DflashError
from dflash.core.io import DIGEST_CHARS, Extent, default_threads, short_hash, tree_digests  # noqa: F401

SCHEME = "sha256-tree-16MiB-v1"
PIECE = 16 << 20  # the scheme's piece size (a test may lower it: read at call time)

EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
                   "token_embd.weight")
LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "output.weight")


class WeightsError(DflashError):
    """Weights that cannot be fingerprinted, or that differ from what a cache recorded."""


@dataclass
class WeightsFingerprint:
    scheme: str
    digest: str  # over every tensor's (name, digest), in name order
    tensors: dict[str, str]  # tensor name (or file name for .bin/.pt) -> digest
    roles: dict[str, str] = field(default_factory=dict)  # "embedding"/"lm_head" -> tensor name
    bytes_hashed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "digest": self.digest, "tensors": dict(sorted(self.tensors.items())),
                "roles": dict(self.roles)}


# ------------------------------------------------------------------------------------------------ where the bytes are


def safetensors_extents(path: str) -> list[Extent]:
    """Every tensor of one .safetensors file, from its JSON header (8-byte little-endian length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise WeightsError(f"cannot read the safetensors header of {path}: {e}") from e
    base = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        out.append(Extent(name, path, base + int(begin), int(end) - int(begin)))
    return out


def gguf_extents(path: str) -> list[Extent]:
    """Every tensor of a GGUF file, from the gguf reader's tensor table (the file is memory-mapped, not read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        return [Extent(t.name, path, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    except Exception as e:  # noqa: BLE001 - any failure to parse is a bad target file
        raise WeightsError(f"cannot read the tensor table of GGUF file {path}: {e}") from e


def weight_files(path: str) -> tuple[str, list[str]]:
    """(kind, files) of a target: kind is safetensors, gguf or pickle. A .gguf path or a directory."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", [path]
        raise WeightsError(f"target {path} is a file but not a .gguf file")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):  # the files HF loads (not e.g. a consolidated.safetensors copy beside them)
        try:
            with open(index) as f:
                return "safetensors", sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise WeightsError(f"cannot read {index}: {e}") from e
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return "safetensors", [os.path.join(path, "model.safetensors")]
    for kind, pattern in (("safetensors", "*.safetensors"), ("gguf", "*.gguf")):
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return kind, files
    files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith((".bin", ".pt", ".pth")))
    if files:
        return "pickle", files
    raise WeightsError(f"target {path} holds no weight files (*.safetensors, *.gguf, *.bin, *.pt)")


def extents(path: str) -> tuple[str, list[Extent]]:
    """(kind, extents) of every tensor in the target (a file-wide extent per pickle file)."""
    kind, files = weight_files(path)
    if kind == "safetensors":
        return kind, [e for f in files for e in safetensors_extents(f)]
    if kind == "gguf":
        if len(files) > 1:
            raise WeightsError(f"target {path} holds {len(files)} .gguf files: name one")
        return kind, gguf_extents(files[0])
    return kind, [Extent(os.path.basename(f), f, 0, os.path.getsize(f)) for f in files]


def find_roles(names: Iterable[str], tied: bool | None = None) -> dict[str, str]:
    """embedding / lm_head tensor names among `names`; a missing head is the embedding (a tied head)."""
    names = set(names)
    roles = {}
    emb = next((n for n in EMBEDDING_NAMES if n in names), None)
    head = next((n for n in LM_HEAD_NAMES if n in names), None)
    if emb:
        roles["embedding"] = emb
        roles["lm_head"] = head if head and tied is not True else emb
    return roles


# ------------------------------------------------------------------------------------------------ hashing
# (dflash.core.io.tree_digests: the pieces of every extent hashed in a thread pool)


def combined_digest(tensors: dict[str, str]) -> str:
    return short_hash(json.dumps(sorted(tensors.items())), chars=DIGEST_CHARS)


def fingerprint(path: str, names: Iterable[str] | None = None, *, threads: int | None = None,
                tied: bool | None = None) -> WeightsFingerprint:
    """The content fingerprint of the target at `path` (a model directory or a .gguf file).

    names: hash only these tensors (those that exist); the combined digest then covers only them.
    tied: the config's tie_word_embeddings (a tied head is the embedding even if a head tensor is stored).
    """
    kind, exts = extents(path)
    seen = {}
    for e in exts:
        if e.name in seen:
            raise WeightsError(f"target {path}: tensor {e.name} is stored twice ({seen[e.name]} and {e.file})")
        seen[e.name] = e.file
    roles = find_roles(seen, tied) if kind != "pickle" else {}
    if names is not None:
        wanted = set(names)
        exts = [e for e in exts if e.name in wanted]
    try:
        tensors = tree_digests(exts, threads, piece=PIECE)
    except OSError as e:
        raise WeightsError(f"cannot read target weights: {e}") from e
    return WeightsFingerprint(SCHEME, combined_digest(tensors), tensors, roles, sum(e.size for e in exts))


# ------------------------------------------------------------------------------------------------ comparing


def compare_full(recorded: dict, current: WeightsFingerprint) -> str | None:
    """None when two whole fingerprints agree, else what differs (the first differing tensor, by name)."""
    if recorded.get("scheme") != current.scheme:
        return f"fingerprint scheme {recorded.get('scheme')!r} != {current.scheme!r}"
    if recorded.get("digest") == current.digest:
        return None
    a, b = recorded.get("tensors", {}), current.tensors
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"tensor {name} is in the cache's target only"
        if name not in a:
            return f"tensor {name} is in this target only"
        if a[name] != b[name]:
            n = sum(1 for k in set(a) & set(b) if a[k] != b[k])
            return f"tensor {name} differs (sha256 {a[name][:12]}... vs {b[name][:12]}...; {n} of {len(a)} tensors differ)"
    return "combined digest differs"


def check_roles(recorded: dict | None, target: str, cache: str, *, tied: bool | None = None,
                threads: int | None = None) -> str:
    """Check the tensors `dflash train` takes from --target (embedding, LM head) against the cache's record.

    Returns a note for the user when the check could not be done (a cache written before fingerprints were
    recorded, or a .bin/.pt target hashed per file: then every file is hashed and compared), "" when it passed.
    Raises WeightsError, one line naming the cache, the target and the tensor, on a mismatch.
    """
    if not recorded:
        return (f"note: the cache {cache} records no content fingerprint of its target's weights (written by an "
                f"older dflash); cannot check that --target {target} has the same embedding and LM head")
    roles = recorded.get("roles") or {}
    if recorded.get("scheme") != SCHEME:
        return f"note: the cache {cache} records weights fingerprint scheme {recorded.get('scheme')!r}; not checked"
    if not roles:  # per-file digests: compare everything
        diff = compare_full(recorded, fingerprint(target, threads=threads))
        if diff:
            raise WeightsError(f"the cache {cache} was extracted from other weights than --target {target}: {diff}")
        return ""
    _, exts = extents(target)
    mine = find_roles({e.name for e in exts}, tied)
    if not mine:
        raise WeightsError(f"--target {target}: no embedding tensor found (looked for {', '.join(EMBEDDING_NAMES)})")
    fp = fingerprint(target, names=set(mine.values()), threads=threads, tied=tied)
    for role in ("embedding", "lm_head"):
        want = recorded.get("tensors", {}).get(roles.get(role, ""))
        have = fp.tensors.get(mine.get(role, ""))
        if want is None:
            continue
        if want != have:
            raise WeightsError(
                f"the cache {cache} was extracted from other weights than --target {target}: the {role} "
                f"({mine[role]}) differs (cache sha256 {want[:12]}..., target {(have or 'missing')[:12]}...); "
                "train with the target the cache was extracted from")
    return ""
