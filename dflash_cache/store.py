"""Byte-level access to a cache's zarr store, and the chunk codecs.

Hot paths (shard writes, row reads) move whole chunks: we encode/decode them ourselves in worker
threads (blosc and zstd release the GIL) and put/get the encoded bytes at zarr's own chunk keys,
so the result is an ordinary zarr v3 array while the throughput is that of the codec, not of zarr's
per-call machinery. Local directories use plain file I/O with atomic replace (like zarr's
LocalStore); any other URL goes through zarr's fsspec store.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import uuid
import zlib
from typing import Any

import numcodecs
import numcodecs.blosc
import numpy as np

from .format import CODECS, CacheError

PARTIAL = ".partial"  # suffix of a file being written (renamed into place when complete)

# We parallelise across chunks ourselves; blosc's own thread pool would oversubscribe the cores.
numcodecs.blosc.use_threads = False
BLOSC_HEADER = 16  # version, versionlz, flags, typesize, nbytes (u32), blocksize (u32), cbytes (u32)


def zarr_compressors(codec: str, typesize: int = 2):
    from zarr.codecs import BloscCodec, ZstdCodec

    if codec == "none":
        return None
    if codec == "lz4":
        return BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=typesize)
    if codec == "blosc-zstd":
        return BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=typesize)
    if codec == "zstd":
        return ZstdCodec(level=1)
    raise CacheError(f"unknown codec {codec!r} (one of {list(CODECS)})")


class Codec:
    """Encodes/decodes one chunk's raw bytes exactly as zarr's codec pipeline would."""

    def __init__(self, name: str, typesize: int):
        self.name = name
        if name == "none":
            self._c = None
        elif name == "lz4":
            self._c = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=0)
        elif name == "blosc-zstd":
            self._c = numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE, blocksize=0)
        elif name == "zstd":
            self._c = numcodecs.Zstd(level=1)
        else:
            raise CacheError(f"unknown codec {name!r} (one of {list(CODECS)})")
        self.typesize = typesize

    def encode(self, arr: np.ndarray):
        """The chunk's stored bytes (bytes, or a byte memoryview of `arr` itself when not compressing)."""
        arr = np.ascontiguousarray(arr)
        if self._c is None:
            return memoryview(arr).cast("B")
        return bytes(self._c.encode(arr))

    def decode(self, data: bytes, out: np.ndarray) -> np.ndarray:
        """Decode into `out` (contiguous, right dtype and size)."""
        if not out.flags.c_contiguous:
            raise ValueError("decode target must be C-contiguous")
        if self.name in ("lz4", "blosc-zstd"):
            check_blosc_header(data, out.nbytes)
        if self._c is None:
            if len(data) != out.nbytes:
                raise ValueError(f"raw chunk has {len(data)} bytes, expected {out.nbytes}")
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
            return out
        flat = out.reshape(-1)
        res = self._c.decode(data, out=flat)
        if res is not flat and np.asarray(res).nbytes != out.nbytes:
            raise ValueError("decoded chunk has the wrong size")
        if res is not flat:
            flat.view(np.uint8)[:] = np.frombuffer(np.asarray(res).tobytes(), dtype=np.uint8)
        return out


def check_blosc_header(data: bytes, nbytes: int) -> None:
    """c-blosc trusts the sizes in a chunk's header: a truncated chunk would be decoded from memory past
    its end (garbage, or a crash). Check them first."""
    if len(data) < BLOSC_HEADER:
        raise ValueError(f"blosc chunk of {len(data)} bytes is shorter than its header")
    raw, _, stored = struct.unpack_from("<III", data, 4)
    if stored != len(data):
        raise ValueError(f"blosc chunk has {len(data)} bytes, its header says {stored} (truncated or overwritten)")
    if raw != nbytes:
        raise ValueError(f"blosc chunk decodes to {raw} bytes, expected {nbytes}")


def crc32(arr: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) & 0xFFFFFFFF


def is_url(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


class Store:
    """put/get/list/delete of keys under a cache root; local or through zarr's fsspec store."""

    def __init__(self, path: str):
        path = str(path)
        self.url = path
        self.local = not is_url(path)
        if self.local:
            self.root = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
            self._zstore = None
        else:
            from zarr.storage import FsspecStore

            self.root = path.rstrip("/")
            self._zstore = FsspecStore.from_url(path, read_only=False)

    # -- zarr's view of it (for creating groups/arrays with zarr's own metadata writer)
    def zarr_store(self):
        if self.local:
            from zarr.storage import LocalStore

            return LocalStore(self.root)
        return self._zstore

    def _sync(self, coro):
        from zarr.core.sync import sync

        return sync(coro)

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def root_is_file(self) -> bool:
        return self.local and os.path.exists(self.root) and not os.path.isdir(self.root)

    def exists_root(self) -> bool:
        if self.local:
            return os.path.isdir(self.root)
        return self.get("zarr.json") is not None or bool(self.list_dir(""))

    def put(self, key: str, data) -> None:
        """Write one key atomically (a reader sees the old bytes or the new, never a torn file)."""
        where = self._p(key) if self.local else f"{self.root}/{key}"
        try:
            self._put(key, data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise CacheError(f"disk full while writing {where}: free some space or write the cache elsewhere") from e
            raise CacheError(f"cannot write {where}: {e.strerror or e}") from e

    def _put(self, key: str, data) -> None:
        if self.local:
            p = self._p(key)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            tmp = f"{p}.{uuid.uuid4().hex}{PARTIAL}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, p)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            return
        from zarr.core.buffer import default_buffer_prototype

        self._sync(self._zstore.set(key, default_buffer_prototype().buffer.from_bytes(bytes(data))))

    def get(self, key: str) -> bytes | None:
        if self.local:
            try:
                with open(self._p(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
            except IsADirectoryError:
                raise CacheError(f"{self._p(key)} is a directory where dflash keeps a file (not written by dflash): "
                                 "move it away") from None
        from zarr.core.buffer import default_buffer_prototype

        buf = self._sync(self._zstore.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """Read `key` into the writable byte buffer `buf` if it fits; return its size (None: no such key).

        A key larger than `buf` is not read: grow the buffer to the size returned and call again. Local
        files are read straight into `buf`: no allocation, no extra copy.
        """
        if not self.local:
            data = self.get(key)
            if data is None:
                return None
            if len(data) <= len(buf):
                buf[:len(data)] = data
            return len(data)
        try:
            f = open(self._p(key), "rb", buffering=0)
        except FileNotFoundError:
            return None
        with f:
            n = os.fstat(f.fileno()).st_size
            if n > len(buf):
                return n
            done = 0
            while done < n:
                got = f.readinto(buf[done:n])
                if not got:
                    raise OSError(f"{self._p(key)} shrank while being read")
                done += got
            return n

    def get_json(self, key: str) -> dict[str, Any] | None:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None  # torn or garbage metadata reads as absent (a crash mid-write)

    def list_dir(self, prefix: str) -> list[str]:
        """Immediate children names under prefix (files and directories)."""
        if self.local:
            try:
                return sorted(os.listdir(self._p(prefix) if prefix else self.root))
            except FileNotFoundError:
                return []

        async def collect():
            return [k async for k in self._zstore.list_dir(prefix)]

        return sorted(self._sync(collect()))

    def list_entries(self, prefix: str) -> list[tuple[str, bool]]:
        """Immediate children under prefix as (name, is a directory), sorted by name. On an object store a
        "directory" is a prefix that has keys under it."""
        if self.local:
            try:
                with os.scandir(self._p(prefix) if prefix else self.root) as it:
                    return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return list_children(self.list_keys(prefix), prefix)

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key (file) under prefix, recursively (one listing on an object store)."""
        if self.local:
            base = self._p(prefix) if prefix else self.root
            return sorted(os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/")
                          for d, _, files in os.walk(base) for f in files)

        async def collect():
            return [k async for k in self._zstore.list_prefix(f"{prefix}/" if prefix else "")]

        return sorted(self._sync(collect()))

    def delete_prefix(self, prefix: str) -> None:
        """Delete the key or the directory of keys `prefix` (nothing if absent)."""
        if self.local:
            p = self._p(prefix)
            if os.path.isfile(p) or os.path.islink(p):
                os.unlink(p)
            else:
                shutil.rmtree(p, ignore_errors=True)
            return
        self._sync(self._zstore.delete_dir(prefix))

    def size_bytes(self, prefix: str = "") -> int:
        """Bytes stored under prefix (what the cache costs on disk)."""
        if self.local:
            base = self._p(prefix) if prefix else self.root
            total = 0
            for d, _, files in os.walk(base):
                for f in files:
                    try:
                        total += os.path.getsize(os.path.join(d, f))
                    except OSError:
                        pass
            return total

        async def collect():
            n = 0
            async for k in self._zstore.list_prefix(prefix):
                n += await self._zstore.getsize(k)
            return n

        return self._sync(collect())


def list_children(keys: list[str], prefix: str) -> list[tuple[str, bool]]:
    """(name, is a directory) of the immediate children of `prefix` among `keys` (all keys under it), sorted."""
    children: dict[str, bool] = {}
    skip = len(prefix) + 1 if prefix else 0
    for key in keys:
        name, sep, _ = key[skip:].partition("/")
        children[name] = children.get(name, False) or bool(sep)
    return sorted(children.items())
