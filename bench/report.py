"""The benchmark's Markdown table and PNG chart.

    >>> row = {"label": "kvserve serve", "output_tok_s": 40.0, "ttft_p50": 1.5, "ttft_p99": 2.0,
    ...        "tpot_p50": 0.1, "tpot_p99": 0.2, "itl_p50": 0.1, "itl_p99": 0.3, "e2e_p50": 8.0,
    ...        "e2e_p99": 9.0, "errors": 0, "requests": 16, "peak_rss": 900 << 20}
    >>> print(markdown_table([row], baseline="kvserve serve").splitlines()[2])
    | kvserve serve | 40.0 | 1.00x | 1500 / 2000 | 100 / 200 | 100 / 300 | 8.00 / 9.00 | 0/16 | 900 |

A label that repeats (a target run twice, the second warm) is compared as its last run:

    >>> later = {**row, "output_tok_s": 80.0}
    >>> [line.split(" | ")[2] for line in markdown_table([row, later], "kvserve serve").splitlines()[2:]]
    ['0.50x', '1.00x']
"""

from __future__ import annotations

from pathlib import Path

def publish(text: str, out: str | None) -> None:
    """Print a benchmark's page, and write it to ``out`` when given."""
    print(text)
    if out:
        Path(out).write_text(text)


HEADER = ("| server | output tok/s | vs baseline | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
          "| ITL p50 / p99 (ms) | E2E p50 / p99 (s) | errors | peak RSS (MiB) |")


def _ms(row: dict, name: str) -> str:
    a, b = row.get(f"{name}_p50"), row.get(f"{name}_p99")
    return "-" if a is None else f"{a * 1000:.0f} / {b * 1000:.0f}"


def markdown_table(rows: list[dict], baseline: str | None = None) -> str:
    base = next((r["output_tok_s"] for r in reversed(rows) if r["label"] == baseline), None)
    lines = [HEADER, "|" + "---|" * 9]
    for r in rows:
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        e2e = "-" if r.get("e2e_p50") is None else f"{r['e2e_p50']:.2f} / {r['e2e_p99']:.2f}"
        rss = "-" if r.get("peak_rss") is None else f"{r['peak_rss'] / 2**20:.0f}"
        lines.append(f"| {r['label']} | {r['output_tok_s']:.1f} | {ratio} | {_ms(r, 'ttft')} | "
                     f"{_ms(r, 'tpot')} | {_ms(r, 'itl')} | {e2e} | {r['errors']}/{r['requests']} | {rss} |")
    return "\n".join(lines)


def write_chart(rows: list[dict], path: Path, title: str) -> bool:
    """Bars of output tokens/s and TTFT p50 per server; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [r["label"].replace("kvserve serve --kv-scheme ", "kvserve\n").replace("kvserve serve", "kvserve\n")
              .replace("mlx_lm.server", "mlx_lm.server\n") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar(labels, [r["output_tok_s"] for r in rows], color="#3b7dd8")
    left.set_title("aggregate output tokens/s (higher is better)")
    right.bar(labels, [(r.get("ttft_p50") or 0) for r in rows], color="#d8843b")
    right.set_title("time to first token p50, s (lower is better)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
