"""Fuzz a running server with schemathesis, generating requests from its own ``/openapi.json``.

Every operation is fuzzed in schemathesis' positive mode (bodies the schema accepts) and
negative mode (bodies it refuses: wrong types, out-of-range values, missing fields). Each
response is checked for three things, and ``/health`` after every case:

- no status >= 500;
- every 4xx body is exactly the OpenAI error shape ``{"error": {message, type, param, code}}``;
- the status is one the server documents (200, 400, 401, 404, 405, 413, 429, 431).

In positive mode the ``model`` field is set to ``"default"``, or nearly every case would stop
at 404 before sampling; the negative mode and the malformed corpus cover that field.

Example (against a server already running on port 8000, 2,000 cases in all):
    python bench/fuzz.py --base-url http://127.0.0.1:8000 --cases 200 --out docs/benchmarks/fuzz.md
or, to start a server on the default model itself:
    python bench/fuzz.py --cases 200

    >>> FuzzReport(cases=3, statuses={200: 2, 400: 1}).passed
    True
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}
DOCUMENTED = {200, 400, 401, 404, 405, 413, 429, 431}


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)  # status >= 500
    bad_shapes: list[str] = field(default_factory=list)  # 4xx outside the OpenAI shape
    undocumented: list[str] = field(default_factory=list)  # a status not in DOCUMENTED
    health_failures: list[str] = field(default_factory=list)  # /health not 200 after a case
    per_operation: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not (self.server_errors or self.bad_shapes or self.undocumented or self.health_failures)

    def markdown(self) -> str:
        rows = "\n".join(f"| `{op}` | {n} |" for op, n in sorted(self.per_operation.items()))
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return (f"| operation (mode) | cases |\n| --- | ---: |\n{rows}\n\n"
                f"- cases: **{self.cases}** in {self.seconds:.0f} s; statuses: {statuses}\n"
                f"- responses >= 500: **{len(self.server_errors)}**\n"
                f"- 4xx outside the OpenAI error shape: **{len(self.bad_shapes)}**\n"
                f"- undocumented statuses: **{len(self.undocumented)}**\n"
                f"- `/health` not 200 after a case: **{len(self.health_failures)}**\n")


def shape_problem(status: int, text: str, anthropic: bool = False) -> str | None:
    """Why an error body is not the OpenAI shape (with ``anthropic``: Anthropic's), or None.

    >>> shape_problem(400, '{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}')
    >>> shape_problem(422, '{"detail": []}')
    'no error object'
    >>> shape_problem(400, '{"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}', True)
    """
    try:
        body = json.loads(text)
    except ValueError:
        return "not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "no error object"
    if anthropic and (body.get("type") != "error" or set(error) != {"type", "message"}):
        return f"not Anthropic's error shape: keys {sorted(body)} / {sorted(error)}"
    if not anthropic and set(error) != ERROR_KEYS:
        return f"error keys {sorted(error)}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return "message or type not a non-empty string"
    return None


def check_response(report: FuzzReport, label: str, status: int, text: str, sent: str = "") -> None:
    report.cases += 1
    report.statuses[status] = report.statuses.get(status, 0) + 1
    where = f"{label} {sent[:300]} -> {status}: {text[:200]}"
    if status >= 500:
        report.server_errors.append(where)
    if status not in DOCUMENTED:
        report.undocumented.append(where)
    anthropic = label.startswith("POST /v1/messages")  # Anthropic's routes answer in its shape
    if status >= 400 and (problem := shape_problem(status, text, anthropic)):
        report.bad_shapes.append(f"{where} ({problem})")


def fuzz(base_url: str, cases: int, *, seed: int = 0, api_key: str | None = None,
         log=lambda line: None) -> FuzzReport:
    """Run up to ``cases`` examples per operation and mode; returns the counts."""
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from schemathesis.generation import GenerationMode

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)
    report, started = FuzzReport(), time.monotonic()
    client = httpx.Client(base_url=base_url, headers=headers, timeout=120)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{operation.method.upper()} {operation.path} ({mode.value})"
            before = report.cases

            @hypothesis.settings(max_examples=cases, database=None, deadline=None, derandomize=False,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.generate], print_blob=False)
            @hypothesis.seed(seed)
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = "default"
                response = _send(case, base_url, headers)
                check_response(report, label, response.status_code, response.text or "", _sent(case))
                health = client.get("/health")
                if health.status_code != 200:
                    report.health_failures.append(f"{label}: /health {health.status_code}")

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # no parameters: nothing to get wrong
                continue
            report.per_operation[label] = report.cases - before
            log(f"{label}: {report.per_operation[label]} cases, {len(report.server_errors)} 5xx so far")
    report.seconds = time.monotonic() - started
    client.close()
    return report


def _sent(case) -> str:
    """The request body, for the report (what to replay when a case fails)."""
    try:
        return json.dumps(case.body, ensure_ascii=True) if case.body is not None else ""
    except (TypeError, ValueError):
        return repr(case.body)


def _send(case, base_url: str, headers: dict[str, str]):
    """The case as schemathesis built it (method, path, query, headers, body)."""
    return case.call(base_url=base_url, headers=headers or None, timeout=120)


def _start_server(model: str | None, log):
    """A server whose generations stay short (max_tokens 16 by default, at most 64), so the
    positive cases, which really sample, take seconds rather than minutes."""
    import tempfile

    from kvserve.bench.targets import Running, Target

    config = Path(tempfile.mkdtemp(prefix="kvserve-fuzz-")) / "fuzz.toml"
    config.write_text("[engine]\nmax_tokens = 16\nmax_tokens_limit = 64\n")
    log(f"starting kvserve serve --config {config}")
    return Running(Target("kvserve", ("--config", str(config))), model, timeout=900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (default: start one on the default model)")
    parser.add_argument("--cases", type=int, default=200, help="examples per operation and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="model for the server this script starts (default: the default model)")
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    server = None
    if args.base_url is None:
        server = _start_server(args.model, log)
    try:
        report = fuzz(args.base_url or server.base_url, args.cases, seed=args.seed,
                      api_key=args.api_key, log=log)
    finally:
        code = server.stop() if server else 0
    text = report.markdown()
    for name in ("server_errors", "bad_shapes", "undocumented", "health_failures"):
        for line in getattr(report, name)[:10]:
            text += f"\n    {name}: {line}"
    if server is not None:
        text += f"\n- server exit code after SIGTERM: {code}\n"
    print(text)
    if args.out:
        command = " ".join(["python bench/fuzz.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(f"# Fuzzing with schemathesis\n\n`{command}`\n\n{text}\n")
    return 0 if report.passed and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
