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
    """Prompts sized by the server's own count, or by ``--model``'s tokenizer when it names
    a model directory, whose path is then no model name the requests could carry."""
    proc = ServerProcess(tiny_model_dir, "--cache-dir", str(tmp_path)).wait_ready()
    run = ("--url", proc.base_url, "--concurrency", "3", "--requests", "5", "--prompt-tokens", "30",
           "--max-tokens", "9", "--json")
    try:
        counted, sized = _bench(*run), _bench(*run, "--model", str(tiny_model_dir))
    finally:
        assert proc.stop() == 0
    assert counted.returncode == 0 and sized.returncode == 0, counted.stderr + sized.stderr
    assert "prompt sizes counted by the server" in counted.stderr
    assert "prompt sizes counted by the server" not in sized.stderr
    for result in (counted, sized):
        (row,) = json.loads(result.stdout)
        assert (row["requests"], row["errors"], row["output_tokens"]) == (5, 0, 45)  # the warm-up apart
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


def test_a_baseline_no_target_bears_is_refused_before_any_run(capsys):
    from kvserve.bench.cli import main

    assert main(["--target", "kvserve:", "--target", "mlx_lm:", "--baseline", "mlx_lm"]) == 2
    assert capsys.readouterr().err.strip() == ("kvserve bench: --baseline 'mlx_lm' is none of the targets' "
                                               "labels: kvserve serve, mlx_lm.server")


def test_llama_targets_serve_the_gguf_the_model_came_from(default_model_dir, tmp_path):
    """``llama:`` targets run llama-server on the GGUF the model directory was converted
    from (so both compute with the same weights), with this machine's cores unless told;
    without a binary the run stops before starting anything."""
    from pathlib import Path

    from kvserve.bench.cli import source_gguf
    from kvserve.bench.targets import LlamaServer, Target

    gguf = source_gguf(default_model_dir)
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.read_bytes()[:4] == b"GGUF"
    cmd = Target.parse("llama:-np 8 -ctk q4_0").command(default_model_dir, 9, LlamaServer(Path("/x/llama-server"), gguf))
    assert cmd[:3] == ["/x/llama-server", "-m", str(gguf)] and cmd[-6:] == ["-t", cmd[-5], "-np", "8", "-ctk", "q4_0"]
    assert "-t" not in Target.parse("llama:-t 1").command(None, 9, LlamaServer(Path("b"), gguf))[:-2]
    result = _bench("--model", str(default_model_dir), "--target", "llama:-np 2", "--requests", "1")
    assert result.returncode != 0 and "--llama-server PATH" in result.stderr
