"""``kvserve bench`` end to end: real servers (kvserve and mlx_lm.server) on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

from servers import ServerProcess


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.server.cli", "bench", *args],
                          capture_output=True, text=True, timeout=600)


def test_bench_drives_a_running_server_and_counts_its_tokens(tiny_model_dir, tmp_path):
    proc = ServerProcess(tiny_model_dir, "--cache-dir", str(tmp_path)).wait_ready()
    try:
        result = _bench("--url", proc.base_url, "--concurrency", "3", "--requests", "5",
                        "--prompt-tokens", "30", "--max-tokens", "9", "--json")
    finally:
        assert proc.stop() == 0
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert (row["requests"], row["errors"], row["output_tokens"]) == (5, 0, 45)
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] <= row["e2e_p99"]
    assert row["output_tok_s"] == 45 / row["wall_s"]


def test_bench_runs_kvserve_and_the_mlx_lm_peer_in_one_run(tiny_model_dir, tmp_path):
    out = tmp_path / "report"
    result = _bench("--model", str(tiny_model_dir), "--target", "kvserve:--kv-scheme turbo0v4",
                    "--target", "mlx_lm:", "--concurrency", "2", "--requests", "3",
                    "--prompt-tokens", "20", "--max-tokens", "6", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)
    assert [r["label"] for r in rows] == ["kvserve serve --kv-scheme turbo0v4", "mlx_lm.server"]
    assert all(r["errors"] == 0 and r["output_tokens"] > 0 for r in rows)
    report = out.with_suffix(".md").read_text()
    assert "| kvserve serve --kv-scheme turbo0v4 |" in report and "| mlx_lm.server | " in report
    assert "1.00x" in report  # the last target is the baseline
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
