"""The on-disk contract of a dflash hidden-state cache (format versions 1 to 4).

A cache is a zarr v3 hierarchy (a local directory or any fsspec URL):

    CACHE/zarr.json                       root group; attributes = the cache metadata (below)
    CACHE/shards/zarr.json                group; its attributes record the root's attributes as written, with
                                          their fingerprint (a changed root is named and restored from it)
    CACHE/shards/000017/zarr.json         one shard = one group; its attribute "dflash_commit" is
                                          written LAST and is what makes the shard exist
    CACHE/shards/000017/input_ids         int32   [R_s, T]       chunks [R_s, T]
    CACHE/shards/000017/loss_mask         uint8   [R_s, T]       1 on supervised (assistant) tokens
    CACHE/shards/000017/doc_ids           int32   [R_s, T]       1, 2, ... per packed document; 0 = padding
    CACHE/shards/000017/hidden            uint16  [R_s, T, K*H]  bf16 bits of the K captured layers,
                                                                 concatenated; chunks [1, C, K*H]
    CACHE/shards/000017/hidden_scales     (quantised caches only, below)  chunks [1, C, S]

Hidden dtype (root attribute "hidden_dtype"; `dflash extract --hidden-dtype bf16|fp8|fp4`):
    bfloat16       hidden uint16 [R_s, T, K*H] = the bf16 bits. Format version 1 (what every bf16 cache is).
    float8_e4m3fn  hidden uint8 [R_s, T, K*H] = e4m3 bytes; hidden_scales float32 [R_s, T, K], one scale per
                   token and captured layer. Format version 2.
    fp4_e2m1       hidden uint8 [R_s, T, K*H/2] = e2m1 codes, two per byte (element 2i in the low nibble);
                   hidden_scales float16 [R_s, T, K*H/32], one scale per 32 channels. Format version 2.
                   Experimental.
    In both quantised formats the value of channel j of token t of row r is
        fp8:  value = e4m3(hidden[r, t, j]) * hidden_scales[r, t, j // H]
        fp4:  value = e2m1(nibble j % 2 of hidden[r, t, j // 2]) * hidden_scales[r, t, j // 32]
    and the root attribute "hidden_scaling" spells this out (element encoding, group size, formula) for a
    plain zarr client; quant.py has the rules that make the bytes and the error bounds they guarantee.
    Padding (and any all-zero group) has scale 0 and zero bytes: values exactly 0.

The target's last hidden state (root attribute "last_hidden": true; `dflash extract --last-hidden`; format version
3, which older readers refuse rather than read its last layer as a context layer): the last entry of layer_ids is
the target's last layer, L-1, stored after the target's final norm (what its LM head reads: the target's logits are
LM head @ those H channels), as the last H channels of `hidden`; the K context layers come first. It costs H values
more per token (bf16: 2H bytes, fp8: H bytes + one float32 scale). Caches without the attribute read as before.

The context features on their own basis (root attribute "basis", a record; `dflash extract --basis-rank R`; format
version 4): `hidden` holds z = P x, R values per token instead of K*H (then, with last_hidden, the H channels of the
last hidden state as they are), and the root array `basis` holds P, float32 [R, K*H]; basis.py has the rules. In fp8
the scale group is R (one scale per token), or gcd(R, H) with last_hidden: root attribute hidden_scaling.group_size.

Every array is a plain zarr array (any zarr client reads it). Row r of shard s is global row
s * rows_per_shard + r; the last shard may hold fewer rows. Rows are exactly T tokens; padding
tokens have doc_id 0, loss_mask 0 and all-zero hidden states (true zeros cost nothing compressed).

The commit record carries, per array, the CRC-32 of every chunk's raw (decoded, little-endian)
bytes (hidden_scales included), so `verify` detects truncated, corrupted or swapped files; and its shard index
("shard") and the fingerprint of the root it was written under ("root": root_digest), so a shard directory moved
to another index or copied from another cache is caught too. A shard without a commit record
does not exist: a crashed writer leaves nothing that looks complete, and a rerun redoes it.
A resumed or repeated extraction writes the same bytes; what legitimately differs between runs is the root's
info.run (batch size, world size, time; also in its record in shards/zarr.json) and each commit record's
"writer" and "time".

Metadata damage is not data damage: each array's zarr.json is exactly what array_layout (+ writer.array_json)
makes from the root's spec, and the root's attributes are recorded in shards/zarr.json; `verify --repair`
rewrites damaged metadata from those and un-commits only shards whose records or chunks are bad.

The layout helpers at the end of this file (chunk_key, group_json, read_root, committed_shards, array_layout,
root_record) are where the
writer, the reader and inspect find things in the hierarchy; none of them imports another for the layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import quant

Store = Any  # a dflash_cache.store.Store (store.py imports this module, so it is not imported here)

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 4  # the newest this code reads and writes; bf16 caches are still written as version 1, quantised
# ones as 2; 3 = a cache that holds the target's last hidden state (last_hidden); 4 = features on a basis (basis.py)
COMMIT_KEY = "dflash_commit"
SHARDS = "shards"

# name -> (numpy dtype, zarr dtype string)
SMALL_ARRAYS = {"input_ids": "int32", "loss_mask": "uint8", "doc_ids": "int32"}
HIDDEN = "hidden"
SCALES = "hidden_scales"
ARRAYS = (*SMALL_ARRAYS, HIDDEN)
HIDDEN_DTYPES = quant.HIDDEN_DTYPES  # bfloat16, float8_e4m3fn, fp4_e2m1 (stored as above)
CODECS = ("none", "lz4", "zstd", "blosc-zstd")


class CacheError(Exception):
    """Base class: every error the cache raises for bad input or a bad cache."""


class CacheNotFoundError(CacheError):
    pass


class NotACacheError(CacheError):
    pass


class CacheVersionError(CacheError):
    pass


class CacheMismatchError(CacheError):
    """The cache was written with other settings than the ones asked for."""

    def __init__(self, field: str, cached: Any, wanted: Any, path: str = "", hint: str = ""):
        self.field, self.cached, self.wanted = field, cached, wanted
        where = f" at {path}" if path else ""
        msg = f"cache{where} does not match: field '{field}' is {cached!r} in the cache but {wanted!r} was asked for"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class CacheCorruptError(CacheError):
    pass


class CacheIncompleteError(CacheError):
    pass


def shard_key(index: int) -> str:
    return f"{SHARDS}/{index:06d}"


def pick_chunk_tokens(seq_len: int, row_bytes: int, target_bytes: int = 8 << 20) -> int:
    """Largest divisor of T whose hidden chunk [1, C, *] of row_bytes per token stays under target_bytes."""
    limit = max(1, target_bytes // max(1, row_bytes))
    return max(d for d in range(1, seq_len + 1) if seq_len % d == 0 and d <= limit)


@dataclass
class CacheSpec:
    """The structural fields every cache has (the rest of the metadata is free-form `info`)."""

    seq_len: int
    hidden_size: int
    layer_ids: list[int]
    num_rows: int
    rows_per_shard: int
    hidden_dtype: str = "bfloat16"
    codec: str = "lz4"
    hidden_chunk_tokens: int = 0  # 0 = choose (pick_chunk_tokens)
    info: dict[str, Any] = field(default_factory=dict)
    last_hidden: bool = False  # layer_ids[-1] is the target's last layer, after its final norm (module docstring)
    # the features on their own basis (basis.py): the root's "basis" record ({} = none: K*H features as they are)
    basis: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.layer_ids = [int(i) for i in self.layer_ids]
        for name in ("seq_len", "hidden_size", "rows_per_shard"):
            if int(getattr(self, name)) <= 0:
                raise CacheError(f"cache spec: {name} must be positive, got {getattr(self, name)}")
        if self.num_rows < 0:
            raise CacheError(f"cache spec: num_rows must be >= 0, got {self.num_rows}")
        if not self.layer_ids:
            raise CacheError("cache spec: layer_ids is empty")
        if self.last_hidden and len(self.layer_ids) < 2:
            raise CacheError("cache spec: last_hidden needs the context layers and the last layer in layer_ids")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise CacheError(f"cache spec: hidden_dtype {self.hidden_dtype!r} is not one of {list(HIDDEN_DTYPES)}")
        why = quant.check_shape(self.hidden_dtype, self.hidden_size)
        if why:
            raise CacheError(f"cache spec: hidden_dtype {self.hidden_dtype}: {why}")
        if self.codec not in CODECS:
            raise CacheError(f"cache spec: codec {self.codec!r} is not one of {list(CODECS)}")
        if self.basis:
            R = self.basis.get("rank")
            width = len(self.context_layer_ids) * self.hidden_size
            if not (isinstance(R, int) and not isinstance(R, bool) and 1 <= R <= width):
                raise CacheError(f"cache spec: basis.rank {R!r} must be an integer in [1, {width}] (K*H)")
            if self.basis.get("width") != width:
                raise CacheError(f"cache spec: basis.width {self.basis.get('width')!r} is not the context features' "
                                 f"width {width} (K*H)")
            if self.hidden_dtype not in (quant.BF16, quant.FP8):
                raise CacheError(f"cache spec: features on a basis are stored as bfloat16 or float8_e4m3fn, not "
                                 f"{self.hidden_dtype}")
        if not self.hidden_chunk_tokens:
            self.hidden_chunk_tokens = pick_chunk_tokens(self.seq_len, self.hidden_bytes_per_token)
        if self.seq_len % self.hidden_chunk_tokens:
            raise CacheError(
                f"cache spec: hidden_chunk_tokens={self.hidden_chunk_tokens} must divide seq_len={self.seq_len}"
            )

    @property
    def row_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def quantized(self) -> bool:
        return quant.is_quantized(self.hidden_dtype)

    @property
    def format_version(self) -> int:
        return 4 if self.basis else 3 if self.last_hidden else 2 if self.quantized else 1

    @property
    def basis_rank(self) -> int:
        """R, the width of the stored context features on their own basis (0: none, K*H features as they are)."""
        return int(self.basis.get("rank", 0)) if self.basis else 0

    @property
    def feature_width(self) -> int:
        """Channels of a stored row as values (before fp4 packing): K*H, or R (+ H of a last hidden state)."""
        if not self.basis_rank:
            return self.row_width
        return self.basis_rank + (self.hidden_size if self.last_hidden else 0)

    @property
    def scale_group(self) -> int:
        """Channels per scale of an fp8 cache: H (one per layer), or on a basis all R of a token (one scale), with a
        last hidden state gcd(R, H) (no scale spans z and the last hidden state)."""
        if not self.basis_rank:
            return self.hidden_size
        return math.gcd(self.basis_rank, self.hidden_size) if self.last_hidden else self.basis_rank

    @property
    def context_layer_ids(self) -> list[int]:
        """The captured layers a drafter reads as its context: all of them, but the last when it is last_hidden."""
        return self.layer_ids[:-1] if self.last_hidden else list(self.layer_ids)

    @property
    def stored_width(self) -> int:
        """Last dimension of the stored `hidden` array (K*H, or K*H/2 for fp4)."""
        return quant.stored_width(self.hidden_dtype, self.feature_width)

    @property
    def scale_width(self) -> int:
        """Last dimension of `hidden_scales` (0: the cache has none)."""
        return quant.scale_width(self.hidden_dtype, self.feature_width // self.scale_group, self.feature_width)

    @property
    def hidden_storage(self) -> tuple[str, str | None]:
        """(zarr/numpy dtype of `hidden`, of `hidden_scales` or None)."""
        return quant.stored_dtypes(self.hidden_dtype)

    @property
    def hidden_bytes_per_token(self) -> int:
        """Raw (uncompressed) bytes of hidden + scales per token."""
        h, s = self.hidden_storage
        return self.stored_width * np.dtype(h).itemsize + (self.scale_width * np.dtype(s).itemsize if s else 0)

    @property
    def num_shards(self) -> int:
        return -(-self.num_rows // self.rows_per_shard)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first global row, number of rows) of a shard."""
        if not 0 <= shard < self.num_shards:
            raise CacheError(f"shard {shard} is out of range: the cache has {self.num_shards} shards")
        start = shard * self.rows_per_shard
        return start, min(self.rows_per_shard, self.num_rows - start)

    def chunks_per_row(self) -> int:
        return self.seq_len // self.hidden_chunk_tokens

    def to_metadata(self) -> dict[str, Any]:
        meta = {"format": FORMAT_NAME, "format_version": self.format_version}
        d = asdict(self)
        info = d.pop("info")
        if not d["last_hidden"]:  # caches without it keep the attributes they always had
            del d["last_hidden"]
        if not d["basis"]:
            del d["basis"]
        meta.update(d)
        if self.quantized:
            meta["hidden_scaling"] = quant.scaling_metadata(self.hidden_dtype, self.scale_group)
        meta["num_layers"] = len(self.layer_ids)
        meta["num_shards"] = self.num_shards
        meta["info"] = info
        return json.loads(json.dumps(meta))  # plain JSON types only

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "CacheSpec":
        """The spec recorded in a cache's root attributes. A missing field or one of the wrong type raises
        CacheCorruptError naming it (the metadata was edited or damaged), never a KeyError or TypeError."""
        def field_of(name: str, kind: str) -> Any:
            if name not in meta:
                raise CacheCorruptError(f"root metadata has no field '{name}'")
            v = meta[name]
            ok = (isinstance(v, int) and not isinstance(v, bool) if kind == "int" else
                  isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
                  if kind == "ints" else isinstance(v, str))
            if not ok:
                want = {"int": "an integer", "ints": "a list of integers", "str": "a string"}[kind]
                raise CacheCorruptError(f"root metadata field '{name}' is {v!r}, not {want}")
            return v

        kinds = {"seq_len": "int", "hidden_size": "int", "layer_ids": "ints", "num_rows": "int", "rows_per_shard": "int",
                 "hidden_dtype": "str", "codec": "str", "hidden_chunk_tokens": "int"}
        info = meta.get("info")
        if info is not None and not isinstance(info, dict):
            raise CacheCorruptError(f"root metadata field 'info' is {type(info).__name__}, not an object")
        last = meta.get("last_hidden", False)
        if not isinstance(last, bool):
            raise CacheCorruptError(f"root metadata field 'last_hidden' is {last!r}, not true or false")
        basis = meta.get("basis", {})
        if not isinstance(basis, dict):
            raise CacheCorruptError(f"root metadata field 'basis' is {basis!r}, not an object")
        try:
            return cls(**{k: field_of(k, kind) for k, kind in kinds.items()}, info=dict(info or {}), last_hidden=last,
                       basis=dict(basis))
        except CacheCorruptError:
            raise
        except CacheError as e:  # a value no writer writes (e.g. hidden_chunk_tokens 0 or not dividing seq_len)
            raise CacheCorruptError(f"root metadata: {e}") from None


def commit_problems(spec: CacheSpec, shard: int, rec: Any, root: str | None = None) -> list[str]:
    """What is wrong with a shard's commit record: [] when it has the rows and every checksum it must have, and
    was written as this shard of this cache. `root` is the cache's root_digest; a record carries it (and its shard
    index), so a shard directory moved to another index or copied from another cache is caught (records written
    before these fields existed lack them and are not checked for them)."""
    if not isinstance(rec, dict):
        return ["commit record: not a JSON object"]
    if "shard" in rec and rec["shard"] != shard:
        return [f"commit record: written as shard {rec['shard']!r}, found at shard {shard} (a moved or swapped shard)"]
    if root is not None and "root" in rec and rec["root"] != root:
        return [f"commit record: written for another cache (root digest {rec['root']!r}, this cache's is {root!r}): "
                "a shard copied from another cache, or the root metadata was changed"]
    _, rows = spec.shard_rows(shard)
    if rec.get("rows") != rows:
        return [f"commit record: says {rec.get('rows')!r} rows, the plan says {rows}"]
    crcs = rec.get("crc32")
    if not isinstance(crcs, dict):
        return ["commit record: no crc32 table"]
    want = {**{name: 1 for name in SMALL_ARRAYS}, HIDDEN: rows * spec.chunks_per_row()}
    if spec.quantized:
        want[SCALES] = rows * spec.chunks_per_row()
    problems = []
    for name, n in want.items():
        got = crcs.get(name)
        have = len(got) if isinstance(got, list) else 0
        if have != n:
            problems.append(f"commit record: crc32[{name!r}] has {have} entries, expected {n}")
        elif not all(isinstance(c, int) and 0 <= c < 1 << 32 for c in got):
            problems.append(f"commit record: crc32[{name!r}] holds values that are not CRC-32s")
    return problems


def lookup(meta: dict[str, Any], dotted: str) -> Any:
    """meta['a']['b'] for 'a.b'; also looks under 'info' so callers need not know where a field lives."""
    for root in (meta, meta.get("info") or {}):
        node: Any = root
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return node
    raise KeyError(dotted)


def check_expectations(meta: dict[str, Any], expect: dict[str, Any] | None, path: str = "", hint: str = "") -> None:
    """Raise CacheMismatchError naming the first field whose cached value differs from what is expected."""
    for key, wanted in (expect or {}).items():
        try:
            cached = lookup(meta, key)
        except KeyError:
            cached = None
        norm = lambda v: json.loads(json.dumps(v))  # tuples == lists, ints == ints
        if norm(cached) != norm(wanted):
            raise CacheMismatchError(key, cached, wanted, path, hint)


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts or bytes."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, (bytes, bytearray, memoryview)) else json.dumps(p, sort_keys=True).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ layout
# Where things are in the zarr hierarchy, shared by the writer, the reader and inspect.

SMALL_CODEC = "zstd"  # token ids / masks / doc ids: tiny, and zstd shrinks them ~5-20x


def group_json(attributes: dict[str, Any]) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}, indent=1).encode()


def chunk_key(array_path: str, coords: tuple[int, ...]) -> str:
    return f"{array_path}/c/" + "/".join(str(c) for c in coords)


ROOT_RECORD = "dflash_root"  # shards/zarr.json attributes: the root's attributes as written when the cache was made
ROOT_RECORD_DIGEST = "dflash_root_digest"  # ... and their fingerprint (tells a damaged record from a damaged root;
# over every attribute, info.run included: volatile like it, as README's kill -9 guarantee lists)
VOLATILE_ROOT_FIELDS = ("run",)  # info.run: the run that created the cache (time, world size, batch rows)


def array_layout(spec: CacheSpec, name: str, rows: int) -> tuple[tuple[int, ...], tuple[int, ...], str, str, dict, int]:
    """(shape, chunks, dtype, codec, attributes, typesize) of array `name` of a shard of `rows` rows: what the
    writer creates and verify expects (writer.array_json turns it into the array's zarr.json)."""
    T, C = spec.seq_len, spec.hidden_chunk_tokens
    hdt, sdt = spec.hidden_storage
    if name in SMALL_ARRAYS:
        return (rows, T), (rows, T), SMALL_ARRAYS[name], SMALL_CODEC, {}, 2
    if name == HIDDEN:
        W = spec.stored_width
        return ((rows, T, W), (1, C, W), hdt, spec.codec, {"dtype": spec.hidden_dtype, "layer_ids": spec.layer_ids},
                np.dtype(hdt).itemsize)
    if name == SCALES and sdt is not None:
        S = spec.scale_width
        return (rows, T, S), (1, C, S), sdt, SMALL_CODEC, {"hidden_dtype": spec.hidden_dtype}, 2
    raise CacheError(f"a {spec.hidden_dtype} cache has no array {name!r}")


def shard_arrays(spec: CacheSpec) -> tuple[str, ...]:
    return (*ARRAYS, SCALES) if spec.quantized else ARRAYS


def stable_root(attrs: dict[str, Any]) -> dict[str, Any]:
    """The root attributes without the volatile info.run (identical for every run that writes one cache)."""
    out = dict(attrs)
    if isinstance(out.get("info"), dict):
        out["info"] = {k: v for k, v in out["info"].items() if k not in VOLATILE_ROOT_FIELDS}
    return out


def root_digest(attrs: dict[str, Any]) -> str:
    """What each commit record carries as "root": the fingerprint of the root attributes it was written under."""
    return fingerprint(stable_root(attrs))


def root_record_json(attrs: dict[str, Any]) -> bytes:
    """shards/zarr.json: the shards group, whose attributes record the root attributes (and their fingerprint)
    as they were written, so that a changed or damaged root zarr.json is told from damaged shards and restored."""
    return group_json({ROOT_RECORD: attrs, ROOT_RECORD_DIGEST: fingerprint(attrs)})


def load_json(store: Store, key: str) -> tuple[Any, str]:
    """(document, "") or (None, why): 'missing', 'not valid JSON', 'a JSON list, not an object' and the like."""
    raw = store.get(key)
    if raw is None:
        return None, "missing"
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "empty" if not raw.strip() else "not valid JSON"
    if not isinstance(doc, dict):
        kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(doc), "null")
        return None, f"a JSON {kind}, not an object"
    return doc, ""


def attributes_of(doc: Any) -> dict[str, Any] | None:
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return attrs if isinstance(attrs, dict) else None


def root_record(store: Store) -> tuple[dict[str, Any] | None, str]:
    """(the recorded root attributes, "") when shards/zarr.json holds an intact record, else (None, why):
    'absent' (a cache written before records existed, or mid-creation) or what is damaged."""
    doc, why = load_json(store, f"{SHARDS}/zarr.json")
    if doc is None:
        return None, "absent" if why == "missing" else f"damaged: {SHARDS}/zarr.json is {why}"
    attrs = attributes_of(doc)
    if attrs is None or ROOT_RECORD not in attrs:
        return None, "absent"
    rec, digest = attrs.get(ROOT_RECORD), attrs.get(ROOT_RECORD_DIGEST)
    if not isinstance(rec, dict) or digest != fingerprint(rec):
        return None, f"damaged: the record in {SHARDS}/zarr.json does not match its digest"
    return rec, ""


def root_changes(attrs: Any, recorded: dict[str, Any], limit: int = 4) -> list[str]:
    """How root attributes differ from the recorded ones, field by field ("attribute 'seq_len' is 32, recorded 16")."""
    if not isinstance(attrs, dict):
        return [f"its attributes are {'missing' if attrs is None else type(attrs).__name__}"]
    a, b = flatten(attrs), flatten(recorded)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    out = [f"attribute '{k}' " + ("was removed" if k not in a else f"is {a[k]!r}" + (
        ", not recorded" if k not in b else f", recorded {b[k]!r}")) for k in keys[:limit]]
    return out + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


_ABSENT = object()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (dotted field names, as errors name them)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_root(store: Store, check_record: bool = True) -> dict[str, Any]:
    """The root metadata of a cache, with clear errors for what is not one.

    check_record: a root whose attributes differ from the intact record in shards/zarr.json (root_record_json),
    or that is unreadable while the record is intact, raises CacheCorruptError naming the changed fields and how
    to restore them (`dflash cache verify --repair`). `verify` reads with check_record=False to report it itself.
    """
    if store.root_is_file():
        raise NotACacheError(f"{store.url} is not a dflash cache: it is a file, not a directory")
    if not store.exists_root():
        raise CacheNotFoundError(f"no cache at {store.url}: the path does not exist")
    doc, why = load_json(store, "zarr.json")
    attrs = attributes_of(doc)
    recorded = root_record(store)[0] if check_record else None
    if recorded is not None and attrs != recorded:
        changes = "; ".join(root_changes(attrs, recorded)) if doc is not None else why
        raise CacheCorruptError(
            f"cache {store.url}: its root metadata zarr.json was changed or damaged since the cache was made ({changes}); "
            f"the shards are not affected: `dflash cache verify {store.url} --repair` restores it from its record in "
            f"{SHARDS}/zarr.json")
    if doc is None:
        raise NotACacheError(f"{store.url} is not a dflash cache: its zarr.json is {why}")
    attrs = attrs or {}
    if attrs.get("format") != FORMAT_NAME:
        raise NotACacheError(f"{store.url} is a zarr store but not a dflash cache (no format '{FORMAT_NAME}' in its attributes)")
    v = attrs.get("format_version")
    if not isinstance(v, int) or v > FORMAT_VERSION:
        raise CacheVersionError(
            f"{store.url} was written in cache format version {v}; this dflash reads versions <= {FORMAT_VERSION}: upgrade dflash"
        )
    try:
        CacheSpec.from_metadata(attrs)
    except CacheCorruptError as e:
        raise CacheCorruptError(f"cache {store.url}: zarr.json: {e}; `dflash cache verify {store.url}` tells more") from None
    return attrs


def committed_shards(store: Store, num_shards: int) -> dict[int, Any]:
    """shard index -> commit record, for every committed shard (index < num_shards, named as shard_key names it).

    A shard whose group zarr.json is unreadable is not committed: its record, with the checksums, is lost.
    The record itself is returned as found (commit_problems says whether it is usable)."""
    out = {}
    for name in store.list_dir(SHARDS):
        if not (name.isdigit() and name == f"{int(name):06d}" and int(name) < num_shards):
            continue
        attrs = attributes_of(load_json(store, f"{SHARDS}/{name}/zarr.json")[0])
        if attrs is not None and attrs.get(COMMIT_KEY) is not None:
            out[int(name)] = attrs[COMMIT_KEY]
    return out
