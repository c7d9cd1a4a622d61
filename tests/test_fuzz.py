"""Schemathesis against the server's own OpenAPI schema: a CI-sized run (about 200 cases).

``bench/fuzz.py`` runs the same checks longer (``--cases 250`` gives over 2,000 cases).
"""

from __future__ import annotations

import pytest

from servers import ServerProcess

pytest.importorskip("schemathesis")

CASES = 75  # per operation and mode: 2 POST routes x 2 modes x 75, plus the 3 GET routes


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    # Short generations keep the positive cases (which really sample) within the CI budget.
    config = tmp_path_factory.mktemp("config") / "fuzz.toml"
    config.write_text("[engine]\nmax_tokens = 8\nmax_tokens_limit = 64\n")
    proc = ServerProcess(tiny_model_dir, "--config", str(config),
                         "--cache-dir", str(tmp_path_factory.mktemp("cache")))
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


def test_schemathesis_finds_no_5xx_and_only_openai_shaped_errors(fuzz_server):
    from kvserve.bench.fuzz import fuzz

    report = fuzz(fuzz_server.base_url, CASES, seed=1234)
    print(report.markdown())
    assert report.server_errors == [] and report.bad_shapes == []
    assert report.undocumented == [] and report.health_failures == []
    for route in ("/v1/chat/completions", "/v1/completions"):
        for mode in ("positive", "negative"):
            assert report.per_operation[f"POST {route} ({mode})"] == CASES
    assert report.cases >= 4 * CASES + 3
    # Both kinds of answer were exercised: real completions and refusals.
    assert report.statuses.get(200, 0) >= 20 and report.statuses.get(400, 0) >= 2 * CASES
    assert fuzz_server.proc.poll() is None  # alive after every case
