"""How the CPU extensions are built (``kernels/cpu_build.py``): once per machine however many
processes start together, nanobind's source compiled once for every extension.

A stand-in compiler (``CXX``) logs each call and writes its ``-o`` file, so these cases pin
which compiles run without spending a real compiler's minute; the real build is what every
test of the CPU kernels loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_CXX = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    args = sys.argv[1:]
    with open(os.environ["CXX_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
    if "-march=native" in args and os.environ.get("CXX_NO_NATIVE"):
        sys.exit("unrecognized option -march=native")
    if "-c" in args:
        time.sleep(0.3)  # two builds started together overlap here
    with open(args[args.index("-o") + 1], "w") as out:
        out.write("built")
    """)

BUILD = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from kvserve.kernels import cpu_build
    print(cpu_build._build(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
    """)


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX.format(python=sys.executable))
    cxx.chmod(0o755)
    log = tmp_path / "cxx.log"
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("CXX_LOG", str(log))
    return log


def _source(folder: Path, name: str) -> Path:
    folder.mkdir(exist_ok=True)
    source = folder / f"{name}.cpp"
    source.write_text(f"// {name}\n")
    return source


def _build(*names: str, folder: Path, cache: Path) -> list[str]:
    """Build each extension in its own process, all started together; their libraries."""
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, name, str(_source(folder, name)), str(cache)],
                              stdout=subprocess.PIPE, text=True) for name in names]
    outs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * len(procs)
    return outs


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _compiled(log: Path) -> list[str]:
    """The source file of each compile that succeeded or was the last tried."""
    return [Path(args[args.index("-c") + 1]).name for args in _calls(log) if "-c" in args]


def test_processes_starting_together_build_an_extension_once(fake_cxx, tmp_path):
    cache = tmp_path / "cache"
    first, second = _build("kvs_a", "kvs_a", folder=tmp_path / "src", cache=cache)
    assert first == second and Path(first).read_text() == "built"
    assert sorted(_compiled(fake_cxx)) == ["kvs_a.cpp", "nb_combined.cpp"]
    links = [args for args in _calls(fake_cxx) if "-shared" in args]
    assert len(links) == 1 and any(a.endswith("nb_combined.o") for a in links[0])


def test_a_second_extension_links_the_nanobind_object_the_first_compiled(fake_cxx, tmp_path):
    cache = tmp_path / "cache"
    _build("kvs_a", folder=tmp_path / "src", cache=cache)
    _build("kvs_b", folder=tmp_path / "src", cache=cache)
    compiled = _compiled(fake_cxx)
    assert sorted(compiled[:2]) == ["kvs_a.cpp", "nb_combined.cpp"] and compiled[2:] == ["kvs_b.cpp"]
    objects = [a for args in _calls(fake_cxx) if "-shared" in args for a in args if a.endswith("nb_combined.o")]
    assert len(objects) == 2 and objects[0] == objects[1] and str(cache) in objects[0]
    # Built before: a third start compiles nothing.
    calls = len(_calls(fake_cxx))
    _build("kvs_a", "kvs_b", folder=tmp_path / "src", cache=cache)
    assert len(_calls(fake_cxx)) == calls


def test_a_compiler_without_march_native_builds_for_the_baseline(fake_cxx, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX_NO_NATIVE", "1")
    _build("kvs_a", folder=tmp_path / "src", cache=tmp_path / "cache")
    compiles = [args for args in _calls(fake_cxx) if "-c" in args]
    assert sorted("-march=native" in args for args in compiles) == [False, False, True, True]


def test_a_failing_compile_names_the_source_and_leaves_no_library(fake_cxx, tmp_path, monkeypatch):
    bad = tmp_path / "bad-cxx"
    bad.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('error: expected ; before }}')\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    cache = tmp_path / "cache"
    source = _source(tmp_path / "src", "kvs_a")
    proc = subprocess.run([sys.executable, "-c", BUILD, "kvs_a", str(source), str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "failed on kvs_a.cpp: error: expected ; before }" in proc.stderr
    assert not [p for p in cache.rglob("*") if p.suffix in (".so", ".o")]
