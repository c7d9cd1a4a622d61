"""Which grammar engine should constrain the server's JSON output: llguidance, xgrammar or
outlines-core? Over a corpus of JSON schemas, per engine: does it compile each schema, accept
its valid documents and reject its invalid ones; how long a compile takes; and what the
next-token mask costs per decoding step, for one row and for a batch of rows (filled one
after another in one thread, and through the engine's batched API where it has one).

Each engine is driven through a valid document of each schema (``json.dumps`` with ", " and
": ", tokenized by the model's tokenizer): each step fills a bitmask of the allowed tokens
(timed), checks that the next token of the document is allowed, and feeds that token to the
engine.

Its own venv (xgrammar needs torch, which the server must not depend on):

    python3 -m venv /tmp/genv
    /tmp/genv/bin/pip install llguidance outlines-core transformers tokenizers numpy jsonschema
    /tmp/genv/bin/pip install --no-deps xgrammar apache-tvm-ffi   # skips triton (GPU kernels)
    /tmp/genv/bin/pip install pydantic typing-extensions torch  # xgrammar imports torch; CPU-only will do

Run, with a folder holding the model's tokenizer.json (the default model as kvserve converts it);
it prints markdown:

    /tmp/genv/bin/python bench/grammar_engines.py --tokenizer /tmp/smollm2

The server does not use it; the tests' doctest sweep only imports it (the engines themselves
are imported when it runs).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np

SEPARATORS = (", ", ": ")
# The server's llguidance options (JSON_OPTIONS in server/engine/grammar.py), copied: this
# script runs outside the server's venv. The other engines get the same separators.
LLG_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def obj(props: dict, required=None, **extra) -> dict:
    """An object schema; every property required unless said otherwise."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **extra}


def typed(name: str, **extra) -> dict:
    return {"type": name, **extra}


STR, INT, NUM, BOOL = typed("string"), typed("integer"), typed("number"), typed("boolean")
SKU = typed("string", pattern="^[A-Z]{3}-[0-9]{4}$")
UUID = "123e4567-e89b-12d3-a456-426614174000"
SHAPES = [obj({"kind": {"const": "circle"}, "radius": NUM}, additionalProperties=False),
          obj({"kind": {"const": "rect"}, "w": NUM, "h": NUM}, additionalProperties=False)]
LINE = obj({"description": STR, "quantity": typed("integer", minimum=1), "unit_price": typed("number", minimum=0)},
           additionalProperties=False)
LEAF = {"value": 4, "children": []}
SUMMARY = ("Three engines constrain the same JSON schemas; the page reports coverage, compile time "
           "and the cost of a next-token mask per decoding step, alone and in a batch.")

# (name, schema, valid documents (the first is the one driven for the mask timings), invalid
# documents). A str is used verbatim; anything else goes through json.dumps.
CASES = [
    ("flat_person", obj({"name": STR, "age": typed("integer", minimum=0, maximum=150), "active": BOOL,
                         "role": {"enum": ["admin", "user", "guest"]}}, additionalProperties=False),
     [{"name": "Ada Lovelace", "age": 36, "active": True, "role": "admin"}],
     [{"name": "Ada", "age": 36, "active": True, "role": "root"}]),
    ("nested_address", obj({"name": STR, "address": obj({"street": STR, "city": STR,
                                                        "zip": typed("string", pattern="^[0-9]{5}$")})}),
     [{"name": "Grace Hopper", "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22201"}}],
     [{"name": "Grace", "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "2220"}}]),
    ("array_bounds", obj({"tags": typed("array", items=STR, minItems=1, maxItems=3)}),
     [{"tags": ["fast", "cheap", "good"]}], [{"tags": []}, {"tags": ["a", "b", "c", "d"]}]),
    ("string_pattern", obj({"sku": SKU, "phone": typed("string", pattern="^\\+[1-9][0-9]{7,14}$")}),
     [{"sku": "ABC-1234", "phone": "+4915112345678"}], [{"sku": "AB-1234", "phone": "+4915112345678"}]),
    ("formats", obj({"day": typed("string", format="date"), "email": typed("string", format="email"),
                     "id": typed("string", format="uuid"), "at": typed("string", format="date-time")}),
     [{"day": "2024-02-29", "email": "ada@example.org", "id": UUID, "at": "2024-02-29T13:45:00Z"}],
     [{"day": "2024-02-29", "email": "not-an-email", "id": UUID, "at": "2024-02-29T13:45:00Z"}]),
    ("any_of", obj({"value": {"anyOf": [STR, INT, typed("null")]}}),
     [{"value": 42}, {"value": None}, {"value": "x"}], [{"value": True}]),
    ("one_of_shapes", obj({"shape": {"oneOf": SHAPES}}),
     [{"shape": {"kind": "rect", "w": 2.5, "h": 4}}], [{"shape": {"kind": "circle", "w": 1}}]),
    ("refs_defs", {"$defs": {"item": obj({"sku": SKU, "qty": typed("integer", minimum=1)})},
                   **obj({"order_id": STR, "items": typed("array", items={"$ref": "#/$defs/item"}, minItems=1)})},
     [{"order_id": "A-17", "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 1}]}],
     [{"order_id": "A-17", "items": [{"sku": "ABC-1234"}]}]),
    ("additional_false", obj({"id": INT, "note": STR}, required=["id"], additionalProperties=False),
     [{"id": 7, "note": "hello"}, {"id": 7}], [{"id": 7, "extra": "x"}]),
    ("numeric_bounds", obj({"percent": typed("integer", minimum=0, maximum=100), "count": typed("integer", minimum=10),
                            "temp": typed("number", exclusiveMinimum=-273.15, maximum=1000)}),
     [{"percent": 85, "count": 12, "temp": 21.5}],
     [{"percent": 101, "count": 12, "temp": 21.5}, {"percent": 5, "count": 9, "temp": 21.5}]),
    ("tool_call_args", obj({"location": typed("string", description="City and country"),
                            "unit": typed("string", enum=["celsius", "fahrenheit"]),
                            "days": typed("integer", minimum=1, maximum=14), "include_hourly": BOOL},
                           required=["location"], additionalProperties=False),
     [{"location": "Paris, France", "unit": "celsius", "days": 3}, {"location": "Oslo"}],
     [{"location": "Paris", "days": 30}]),
    ("invoice", obj({"currency": {"enum": ["EUR", "USD"]}, "lines": typed("array", items=LINE, minItems=1,
                     maxItems=20), "total": typed("number", minimum=0)}, additionalProperties=False),
     [{"currency": "EUR", "lines": [{"description": "Widget", "quantity": 3, "unit_price": 9.99},
                                    {"description": "Gadget, large", "quantity": 1, "unit_price": 120}],
       "total": 149.97}],
     [{"currency": "EUR", "lines": [{"description": "Widget", "quantity": 0, "unit_price": 9.99}], "total": 0}]),
    ("bounded_text", obj({"title": typed("string", maxLength=80),
                          "summary": typed("string", minLength=20, maxLength=300)}),
     [{"title": "Grammar engines compared on a small CPU server", "summary": SUMMARY}],
     [{"title": "x" * 81, "summary": "long enough to pass the minimum"}, {"title": "t", "summary": "too short"}]),
    ("map_of_numbers", typed("object", additionalProperties=NUM), [{"apples": 3, "pears": 0.5}],
     [{"apples": "three"}]),
    ("unicode_string", obj({"name": STR}), [{"name": "Zoë Ω 東京"}, '{"name": "Zo\\u00eb"}'],
     ['{"name": "Zo\\u00e"}']),
    ("recursive_ref", obj({"value": INT, "children": typed("array", items={"$ref": "#"})}),
     [{"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": [LEAF]}]}],
     [{"value": 1, "children": [{"children": []}]}]),
    ("unique_items", obj({"ids": typed("array", items=INT, uniqueItems=True)}), [{"ids": [3, 1, 2]}],
     [{"ids": [1, 1]}]),
    ("string_lengths", obj({"code": typed("string", minLength=3, maxLength=8)}),
     [{"code": "abc12"}], [{"code": "ab"}, {"code": "abcdefghi"}]),
    ("const_value", obj({"version": {"const": "v1"}, "data": STR}),
     [{"version": "v1", "data": "x"}], [{"version": "v2", "data": "x"}]),
    ("lookahead_pattern", obj({"password": typed("string", pattern="^(?=.*[0-9])[a-z0-9]{8,}$")}),
     [{"password": "hunter2abc"}], [{"password": "abcdefgh"}]),
]


def dump(doc) -> str:
    # ensure_ascii=False: a model writes non-ASCII text as UTF-8 (the \\u form is a probe apart)
    return doc if isinstance(doc, str) else json.dumps(doc, separators=SEPARATORS, ensure_ascii=False)


def allowed(bits: np.ndarray, token: int) -> np.ndarray:
    """Per row of an int32 bitmask (bit t%32 of word t//32, in all three engines): is token allowed."""
    return (bits[:, token >> 5].view(np.uint32) >> np.uint32(token & 31)) & 1 == 1


def byte_vocab(hf) -> dict[bytes, list[int]]:
    """Each non-special token's bytes, as outlines-core takes a vocabulary. The tokenizer is
    byte-level BPE: each character of a token stands for one byte (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_of = {chr(b): b for b in printable}
    byte_of.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    special = set(hf.all_special_ids) | set(hf.added_tokens_decoder)
    vocab: dict[bytes, list[int]] = {}
    for text, token in hf.get_vocab().items():
        if token not in special:
            vocab.setdefault(bytes(byte_of[c] for c in text), []).append(token)
    return vocab


class Engine:
    """What the measurements call; each engine maps its own API onto it (one row: one matcher)."""

    name = package = ""
    batched = True  # has a batched API (fill_rows), which spreads the rows over threads

    def fill_loop(self, rows, bits):  # one row after another, in this thread
        for i, row in enumerate(rows):
            self.fill(row, bits, i)

    def accepts(self, compiled, tokens: list[int]) -> bool:
        row = self.row(compiled)
        return all(self.consume(row, t) for t in tokens) and self.accepting(row)


class Llguidance(Engine):
    name = package = "llguidance"

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.llg, self.lnp = llguidance, lnp
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, schema):
        # The server's path per request: schema -> grammar text -> matcher (it has no cache).
        text = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=LLG_OPTIONS)
        matcher = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def row(self, compiled): return compiled.deep_copy()
    def fill(self, row, bits, i): self.lnp.fill_next_token_bitmask(row, bits, i)
    def consume(self, row, token) -> bool: return row.consume_token(token)
    def accepting(self, row) -> bool: return row.is_accepting()

    def fill_rows(self, rows, bits):
        self.lnp.fill_next_token_bitmask_par(self.executor, [(r, i) for i, r in enumerate(rows)], bits)


class Xgrammar(Engine):
    name = package = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import xgrammar

        self.xgr, self.eos = xgrammar, eos
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
        # Single-threaded and uncached compiles, so that repeats measure the work (a cache hit
        # is a lookup); the batched masks get as many threads as llguidance's.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)

    def row(self, compiled): return self.xgr.GrammarMatcher(compiled)
    def fill(self, row, bits, i): row.fill_next_token_bitmask(bits, i)  # a numpy array will do: no torch
    def fill_rows(self, rows, bits): self.batch.batch_fill_next_token_bitmask(rows, bits)
    def consume(self, row, token) -> bool: return row.accept_token(token)
    def accepting(self, row) -> bool: return row.accept_token(self.eos)  # only when complete


class OutlinesCore(Engine):
    name, package, batched = "outlines-core", "outlines_core", False

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        self.vocabulary = outlines_core.Vocabulary(eos, byte_vocab(hf))

    def compile(self, schema):
        # Its default whitespace "[ ]?" allows ", " and ": " (and "," and ":"); the Index
        # holds the allowed tokens of every state of the schema's regex.
        return self.oc.Index(self.to_regex(json.dumps(schema)), self.vocabulary)

    def row(self, compiled): return self.oc.Guide(compiled)
    def fill(self, row, bits, i): row.write_mask_into(bits[i].ctypes.data, bits.shape[1], 4)
    def accepting(self, row) -> bool: return row.is_finished()

    def consume(self, row, token) -> bool:
        try:
            row.advance(token, return_tokens=False)
            return True
        except ValueError:  # no transition for this token
            return False


ENGINES = [Llguidance, Xgrammar, OutlinesCore]


def ms(fn, *args) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn(*args)
    return value, (time.perf_counter() - start) * 1e3


def modes(engine, rows: int) -> dict[str, tuple[int, object]]:
    """The timed ways to fill masks: key -> (rows, fill(matchers, bits)); see mode_titles."""
    out = {"one": (1, lambda matchers, bits: engine.fill(matchers[0], bits, 0)), "loop": (rows, engine.fill_loop)}
    return {**out, "batch": (rows, engine.fill_rows)} if engine.batched else out


def mode_titles(rows: int, threads: int) -> dict[str, str]:
    return {"one": "1 row", "loop": f"{rows} rows, one after another in one thread",
            "batch": f"{rows} rows, batched API with {threads} threads (outlines-core has none)"}


def drive(engine, compiled, tokens: list[int], rows: int, fill, vocab_size: int) -> tuple[list[float], str]:
    """Mask each step of ``tokens`` for ``rows`` rows at once: µs per step, and '' or what broke."""
    matchers = [engine.row(compiled) for _ in range(rows)]
    bits = np.zeros((rows, (vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for step, token in enumerate(tokens):
        start = time.perf_counter_ns()
        fill(matchers, bits)
        times.append((time.perf_counter_ns() - start) / 1e3)
        if not allowed(bits, token).all():
            return times, f"masks token {step} of the valid doc"
        if not all(engine.consume(m, token) for m in matchers):
            return times, f"refuses token {step} of the valid doc"
    return times, ""


def measure(engine, tokenizer, args) -> dict:
    """Everything about one engine, per case name."""
    results = {}
    for name, schema, good, bad in CASES:
        try:
            compiled, first = ms(engine.compile, schema)
            median = statistics.median(ms(engine.compile, schema)[1] for _ in range(args.runs))
        except Exception as exc:  # the engine's own reason is the coverage result
            results[name] = {"error": " ".join(str(exc).split())[:90].replace("|", "\\|")}
            continue
        encoded = [tokenizer.encode(dump(d), add_special_tokens=False) for d in (*good, *bad)]
        res = {"first_ms": first, "median_ms": median, "tokens": len(encoded[0]),
               "good_ok": [engine.accepts(compiled, t) for t in encoded[: len(good)]],
               "bad_rejected": [not engine.accepts(compiled, t) for t in encoded[len(good):]]}
        gc.disable()  # a collection inside a timed mask is Python's cost, not the engine's
        for key, (rows, fill) in modes(engine, args.rows).items():
            res[key] = []
            for _ in range(args.repeats):
                times, res[f"broke_{key}"] = drive(engine, compiled, encoded[0], rows, fill, args.vocab)
                res.setdefault(f"first_mask_{key}", times[0])  # lazy engines pay here: apart
                res[key] += times[1:]
        gc.enable()
        results[name] = res
    return results


def coverage(res: dict) -> str:
    if "error" in res:
        return f"error: {res['error']}"
    notes = [res["broke_one"]] if res["broke_one"] else []
    for key, what in (("good_ok", "refuses valid doc"), ("bad_rejected", "accepts invalid doc")):
        if not all(res[key]):
            notes.append(f"{what} {', '.join(str(i) for i, ok in enumerate(res[key]) if not ok)}")
    return "; ".join(notes) or "ok"


def fmt(value: float, digits: int = 1) -> str:
    return "–" if value != value else f"{value:,.{digits}f}"


def mean_p99(values: list[float]) -> str:
    return f"{fmt(statistics.fmean(values))} / {fmt(float(np.percentile(values, 99)))}" if values else "–"


def table(title: str, head: list[str], rows: list[list]) -> list[str]:
    return ["", f"### {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def tables(results: dict[str, dict], rows: int, threads: int) -> str:
    names, cases = list(results), [c[0] for c in CASES]
    cell = {(e, c): results[e][c] for e in names for c in cases}
    out = table("Coverage (ok: compiles, accepts every valid doc, rejects every invalid one, never masks the "
                "driven doc's next token; docs numbered from 0)", ["schema", *names],
                [[c, *(coverage(cell[e, c]) for e in names)] for c in cases])
    out += table("Compile ms: first in the process / median of the repeats", ["schema", *names],
                 [[c, *("–" if "error" in cell[e, c] else f"{fmt(cell[e, c]['first_ms'], 2)} / "
                        f"{fmt(cell[e, c]['median_ms'], 2)}" for e in names)] for c in cases])
    tokens = {c: next((cell[e, c]["tokens"] for e in names if "tokens" in cell[e, c]), "–") for c in cases}
    for key, how in mode_titles(rows, threads).items():
        out += table(f"Mask µs per step, {how}: mean / p99 (first mask of each doc left out)",
                     ["schema", "tokens", *names],
                     [[c, tokens[c], *(mean_p99(cell[e, c].get(key, [])) for e in names)] for c in cases])
    return "\n".join(out + summary(results, rows, threads))


def summary(results: dict[str, dict], rows: int, threads: int) -> list[str]:
    """Totals per engine; timings pooled over the schemas every engine passed (the same work)."""
    common = [c for c, *_ in CASES if all(coverage(results[e][c]) == "ok" for e in results)]
    if not common:
        return ["", "(no schema passed in every engine: no summary)"]
    lines = []
    for e, res in results.items():
        ok, compiled = sum(coverage(x) == "ok" for x in res.values()), sum("error" not in x for x in res.values())
        pool = {k: [x for c in common for x in res[c].get(k, [])] for k in mode_titles(rows, threads)}
        compile_ms = statistics.median(res[c]["median_ms"] for c in common)
        first = statistics.fmean(res[c]["first_mask_one"] for c in common)
        lines.append([e, f"{ok} / {compiled} / {len(res)}", fmt(compile_ms, 2), fmt(first),
                      *map(mean_p99, pool.values())])
    return table(f"Summary; timings over the {len(common)} schemas every engine passed ({', '.join(common)})",
                 ["engine", "schemas ok / compiled / all", "compile ms (median of medians)", "first mask µs (mean)",
                  "mask µs 1 row: mean / p99", f"{rows} rows, loop: mean / p99", f"{rows} rows, batched: mean / p99"],
                 lines)


def check_corpus() -> None:
    """The corpus itself must be right: jsonschema judges every document."""
    import jsonschema

    for name, schema, good, bad in CASES:
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())

        def valid(doc) -> bool:
            try:
                return validator.is_valid(json.loads(dump(doc)))
            except ValueError:  # not JSON at all
                return False

        assert all(map(valid, good)) and not any(map(valid, bad)), name


def wait_for_quiet(max_load: float, max_wait_s: float) -> str:
    """Other processes on a 2-core machine skew the timings: wait until the 1-minute load is low."""
    deadline = time.time() + max_wait_s
    while os.getloadavg()[0] >= max_load and time.time() < deadline:
        print(f"load {os.getloadavg()[0]:.2f} >= {max_load}: waiting", file=sys.stderr)
        time.sleep(60)
    return " ".join(open("/proc/loadavg").read().split()[:3])


def xgrammar_without_torch() -> str:
    """What importing xgrammar raises where torch is not installed (torch is hidden here)."""
    probe = ("import sys\nclass Hide:\n def find_spec(self, name, path=None, target=None):\n"
             "  if name.split('.')[0] == 'torch': raise ModuleNotFoundError(\"No module named 'torch'\")\n"
             "sys.meta_path.insert(0, Hide())\nimport xgrammar\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if run.returncode == 0:
        return "imports"
    where = re.findall(r'site-packages/(xgrammar/[^"]+)", line (\d+)', run.stderr)
    return f"`{run.stderr.strip().splitlines()[-1]}`" + (" at {}:{}".format(*where[-1]) if where else "")


def installed_mb(*packages: str) -> str:
    """Installed size (from the wheels' RECORD): the dependency weight an engine brings."""
    try:
        return f"{sum(f.size or 0 for p in packages for f in metadata.distribution(p).files or []) / 1e6:.1f} MB"
    except metadata.PackageNotFoundError as exc:
        return f"{exc} not installed"


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    system = f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    return f"{cpu}, {os.cpu_count()} cores, {system}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (and tokenizer_config.json)")
    ap.add_argument("--vocab", type=int, default=49152, help="the model's vocabulary (logits) size")
    ap.add_argument("--runs", type=int, default=5, help="compiles after the first, per schema")
    ap.add_argument("--repeats", type=int, default=10, help="passes over each document for the mask timings")
    ap.add_argument("--rows", type=int, default=8, help="rows of the batched measurement")
    ap.add_argument("--threads", type=int, default=2, help="threads of the batched mask APIs")
    ap.add_argument("--max-load", type=float, default=0.7, help="wait until the 1-minute load is below this")
    ap.add_argument("--max-wait", type=float, default=1200, help="seconds to wait for that, at most")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    check_corpus()
    load = wait_for_quiet(args.max_load, args.max_wait)
    print(f"- machine: {machine()}\n- load average at start (1/5/15 min): {load}\n"
          f"- command: `{sys.executable} {' '.join(sys.argv)}`\n"
          f"- tokenizer: {args.tokenizer} (vocabulary {args.vocab}, eos {tokenizer.eos_token_id})\n"
          f"- importing xgrammar without torch: {xgrammar_without_torch()}")
    head = ["engine", "version", "installed size (package and what it needs)", "tokenizer setup ms"]
    results, lines = {}, []
    for cls in ENGINES:
        if cls.name in args.engines.split(","):
            engine, setup = ms(cls, tokenizer, args.vocab, tokenizer.eos_token_id, args.threads)
            deps = {"xgrammar": ("xgrammar", "apache-tvm-ffi", "torch")}.get(cls.name, (cls.package,))
            lines.append([cls.name, metadata.version(cls.package), f"{installed_mb(*deps)} ({' + '.join(deps)})",
                          f"{setup:.0f}"])
            results[cls.name] = measure(engine, tokenizer, args)
    print("\n".join(table("Engines", head, lines)))
    print(tables(results, args.rows, args.threads))
    print(f"\n- load average at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
