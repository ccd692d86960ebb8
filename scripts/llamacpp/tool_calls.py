"""llama.cpp (llama-cpp-python) doing skainet-kv's tool-call job on the same token ids: the tool
catalog's prefix evaluated once and its state saved, then per request: the state restored, the
request's ids evaluated, greedy decoding under a GBNF grammar of the same calls until the call
closes, the call parsed and validated. Prints one JSON object shaped like `skainet-kv tool-eval
--json` (`outcomes[].request/ids/tool_calls/call_ms`), so `tool-eval --explain-against` reads it.

The ids, the stop ids and the call format come from `skainet-kv tool-eval --print-ids` (IDS.json):
llama.cpp is fed ids, never text, so both runtimes see identical tokens. The GBNF is written here
from the same catalog, rule for rule as `crates/constrain/src/grammar.rs` writes its Lark grammar:
the same keys in the same order, the same separators and no free whitespace, strings of at most
64 characters where the schema sets no maxLength, the same integer ranges, one call per answer.

Greedy under the grammar the way llama.cpp's own common sampler does it (common/sampling.cpp, the
path of llama-cli and llama-server): the unconstrained argmax is checked against the grammar
alone, and only when the grammar rejects it is the grammar applied to the whole vocabulary and
the argmax taken again. The state is saved and restored with llama.cpp's C API
(`llama_state_get_data`/`llama_state_set_data`): `Llama.save_state` would also copy
llama-cpp-python's score buffer (n_batch x vocab floats, 512 MiB for a 262,144-id vocabulary),
which is the binding's cost, not llama.cpp's.

Usage: python tool_calls.py MODEL.gguf IDS.json CATALOG.json [MAX_NEW]
"""

import ctypes
import json
import os
import re
import statistics
import sys
import time

import numpy as np

DEFAULT_MAX_STRING = 64  # constrain::grammar::DEFAULT_MAX_STRING


# ---- GBNF from the catalog (mirrors crates/constrain/src/grammar.rs) -------------------------


def lit(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def digits_same_len(a: str, b: str) -> list:
    """Patterns (lists of GBNF atoms) matching the decimal numbers a..b, both of one length."""
    if a == b:
        return [[lit(a)]]
    if len(a) == 1:
        return [[f"[{a}-{b}]"]]
    if a[0] == b[0]:
        return [[lit(a[0])] + p for p in digits_same_len(a[1:], b[1:])]
    out, first, last = [], int(a[0]), int(b[0])
    if set(a[1:]) != {"0"}:
        out += [[lit(a[0])] + p for p in digits_same_len(a[1:], "9" * (len(a) - 1))]
        first += 1
    mid_last = last if set(b[1:]) == {"9"} else last - 1
    if first <= mid_last:
        out.append([f"[{first}-{mid_last}]"] + ["[0-9]"] * (len(a) - 1))
    if set(b[1:]) != {"9"}:
        out += [[lit(b[0])] + p for p in digits_same_len("0" * (len(b) - 1), b[1:])]
    return out


def int_range(lo: int, hi: int) -> str:
    """A GBNF alternative of the integers lo..hi (0 <= lo), written without leading zeros."""
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            alts += [" ".join(p) for p in digits_same_len(str(a).zfill(n), str(b))]
    return "(" + " | ".join(alts) + ")"


JSON_CHAR = '([^"\\\\\\x00-\\x1F\\x7F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}))'
INTEGER = '("-"? ("0" | [1-9] [0-9]*))'
NUMBER = INTEGER + ' ("." [0-9]+)? ([eE] [-+]? [0-9]+)?'


class Gbnf:
    def __init__(self, functiongemma: bool):
        self.rules = []
        self.next = 0
        self.fg = functiongemma

    def fresh(self, stem: str) -> str:
        self.next += 1
        return f"{stem}{self.next}"

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name} ::= {body}")
        return name

    def number(self, schema: dict, ty: str) -> str:
        if ty == "boolean":
            return '("true" | "false")'
        if ty == "null":
            return '"null"'
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if ty == "integer" and lo is not None and hi is not None and 0 <= lo <= hi:
            return int_range(int(lo), int(hi))
        return INTEGER if ty == "integer" else NUMBER

    def string(self, schema: dict) -> str:
        lo = schema.get("minLength", 0)
        hi = max(schema.get("maxLength", DEFAULT_MAX_STRING), lo)
        if self.fg:
            # No `<` inside: an `<escape>` ends the string, as the parser reads it.
            return f'"<escape>" [^<]{{{lo},{hi}}} "<escape>"'
        return f'"\\"" {JSON_CHAR}{{{lo},{hi}}} "\\""'

    def constant(self, v) -> str:
        if self.fg:
            if isinstance(v, str):
                return lit(f"<escape>{v}<escape>")
            return lit(json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false"))
        return lit(json.dumps(v, ensure_ascii=False))

    def value(self, schema: dict) -> str:
        if "enum" in schema:
            return self.rule(self.fresh("v"), " | ".join(self.constant(v) for v in schema["enum"]))
        if "const" in schema:
            return self.rule(self.fresh("v"), self.constant(schema["const"]))
        types = schema.get("type", ["string", "number", "boolean", "object", "array", "null"])
        types = [types] if isinstance(types, str) else types
        alts = []
        for ty in types:
            if ty == "string":
                alts.append(self.string(schema))
            elif ty in ("integer", "number", "boolean", "null"):
                alts.append(self.number(schema, ty))
            elif ty == "object":
                alts.append(f'"{{" {self.args(schema) or ""} "}}"')
            elif ty == "array":
                item = self.value(schema.get("items", {}))
                sep = '","' if self.fg else '", "'
                if schema.get("minItems", 0) > 0:
                    alts.append(f'"[" {item} ({sep} {item})* "]"')
                else:
                    alts.append(f'"[" ({item} ({sep} {item})*)? "]"')
        return self.rule(self.fresh("v"), " | ".join(alts))

    def args(self, schema: dict):
        """The `key:value,...` (FunctionGemma: keys sorted) or `"key": value, ...` (JSON: keys in
        the schema's order, as llguidance's %json writes them) inside an object's braces."""
        props = list(schema.get("properties", {}).items())
        if not props:
            return None
        if self.fg:
            props.sort(key=lambda kv: kv[0])
        required = set(schema.get("required", []))
        n = len(props)
        req = [k in required for k, _ in props]
        sep = '","' if self.fg else '", "'
        kv = [
            (lit(f"{k}:") if self.fg else lit(json.dumps(k) + ": ")) + " " + self.value(s)
            for k, s in props
        ]
        stem = self.fresh("o")
        optional_from = lambda i: not any(req[i:])

        def tail(i):
            if i == n:
                return ""
            return f"{stem}r{i}?" if optional_from(i) else f"{stem}r{i}"

        for i in reversed(range(n)):
            r_alts = [f"{sep} {kv[i]} {tail(i + 1)}"]
            f_alts = [f"{kv[i]} {tail(i + 1)}"]
            if not req[i] and i + 1 < n:
                r_alts.append(f"{stem}r{i + 1}")
                f_alts.append(f"{stem}f{i + 1}")
            self.rule(f"{stem}r{i}", " | ".join(f"({a})" for a in r_alts))
            self.rule(f"{stem}f{i}", " | ".join(f"({a})" for a in f_alts))
        return f"{stem}f0?" if optional_from(0) else f"{stem}f0"


def gbnf(style: str, tools: list, choice: str) -> str:
    callable_ = [t for t in tools if choice in ("auto", "required") or t["name"] == choice]
    if not callable_:
        raise SystemExit(f"the tool choice {choice!r} leaves no tool")
    if choice == "auto":
        raise SystemExit("tool choice auto (a call or text) is not written as GBNF here: use required or a name")
    fg = style.startswith("FunctionGemma")
    g = Gbnf(fg)
    if fg:
        alts = [f'{lit("call:" + t["name"] + "{")} {g.args(t["parameters"]) or ""} "}}"' for t in callable_]
        g.rule("fn", " | ".join(f"({a})" for a in alts))
        root = 'root ::= "<start_function_call>" fn "<end_function_call>"'
    else:
        alts = []
        for t in callable_:
            args = g.args(t["parameters"])
            obj = f'"{{" {args or ""} "}}"' if args else '"{}"'
            alts.append(f'{lit(json.dumps({"name": t["name"]})[:-1] + ", " + json.dumps("arguments") + ": ")} {obj} "}}"')
        g.rule("item", " | ".join(f"({a})" for a in alts))
        if style == "HermesList":
            root = 'root ::= "<tool_call>[" item "]</tool_call>"'
        else:
            root = 'root ::= "<tool_call>\\n" item "\\n</tool_call>"'
    return "\n".join([root] + g.rules) + "\n"


# ---- parsing and validation (what tokenizer::tools does on our side) --------------------------


def parse_functiongemma(text: str):
    m = re.search(r"<start_function_call>call:([A-Za-z0-9_.-]+)\{", text)
    if not m:
        return None
    pos = m.end()

    def value(i):
        if text.startswith("<escape>", i):
            j = text.index("<escape>", i + 8)
            return text[i + 8 : j], j + 8
        if text[i] == "{":
            return obj(i + 1)
        if text[i] == "[":
            items, i = [], i + 1
            while text[i] != "]":
                v, i = value(i)
                items.append(v)
                if text[i] == ",":
                    i += 1
            return items, i + 1
        m2 = re.compile(r"-?[0-9.eE+-]+|true|false|null").match(text, i)
        if not m2:
            raise ValueError(f"no value at {i}")
        word = m2.group(0)
        return json.loads(word), m2.end()

    def obj(i):
        out = {}
        while text[i] != "}":
            m2 = re.compile(r"([A-Za-z0-9_]+):").match(text, i)
            if not m2:
                raise ValueError(f"no key at {i}")
            out[m2.group(1)], i = value(m2.end())
            if text[i] == ",":
                i += 1
        return out, i + 1

    arguments, end = obj(pos)
    if not text.startswith("<end_function_call>", end) and end != len(text):
        raise ValueError("text after the arguments")
    return {"name": m.group(1), "arguments": arguments}


def parse_hermes(text: str):
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if not m:
        return None
    value = json.loads(m.group(1))
    if isinstance(value, list):
        if not value:
            return None
        value = value[0]
    args = value["arguments"]
    return {"name": value["name"], "arguments": json.loads(args) if isinstance(args, str) else args}


def valid(value, schema) -> bool:
    if "enum" in schema and value not in schema["enum"]:
        return False
    ty = schema.get("type")
    if ty == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if ty == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if ty == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ty == "boolean":
        return isinstance(value, bool)
    if ty == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(k in props and valid(v, props[k]) for k, v in value.items())
        )
    return True


# ---- the run ---------------------------------------------------------------------------------


def main() -> None:
    model_path, ids_path, catalog_path = sys.argv[1:4]
    max_new = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    spec = json.load(open(ids_path))
    tools = [t.get("function", t) for t in json.load(open(catalog_path))]
    grammar_text = gbnf(spec["call_style"], tools, spec["tool_choice"])
    fg = spec["call_style"].startswith("FunctionGemma")
    close = b"<end_function_call>" if fg else b"</tool_call>"
    parse = parse_functiongemma if fg else parse_hermes
    stops = set(spec["stop_ids"])

    # OpenMP's default spin-wait makes llama.cpp's two threads wait for each other's time slice
    # on a shared 2-core machine: at load 14, a step took 5.6 s spinning against 64 ms passive
    # (the same 128-token prefix, SmolLM2 BF16). Passive is llama.cpp's better setting here.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import llama_cpp
    from llama_cpp import Llama, __version__

    threads = os.cpu_count() or 1
    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    t = time.perf_counter()
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar_text.encode(), b"root")
    if not sampler:
        raise SystemExit("llama.cpp refused the GBNF grammar:\n" + grammar_text)
    grammar_ms = (time.perf_counter() - t) * 1e3

    prefix = spec["prefix_ids"]
    t = time.perf_counter()
    llm.reset()
    llm.eval(prefix)
    prefill_ms = (time.perf_counter() - t) * 1e3
    size = llama_cpp.llama_state_get_size(ctx)
    state = (ctypes.c_uint8 * size)()
    saved = llama_cpp.llama_state_get_data(ctx, state, size)

    cand = np.zeros(n_vocab, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True))
    cand["id"] = np.arange(n_vocab, dtype=np.int32)
    one = llama_cpp.llama_token_data(0, 0.0, 0.0)
    one_arr = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
    full_arr = llama_cpp.llama_token_data_array(
        cand.ctypes.data_as(llama_cpp.llama_token_data_p), n_vocab, -1, False
    )

    def pick() -> tuple:
        """Greedy under the grammar (lowest id on ties, as np.argmax and the graphs); whether the
        whole vocabulary had to be masked."""
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        best = int(np.argmax(logits))
        one.id, one.logit, one.p = best, float(logits[best]), 0.0
        one_arr.size, one_arr.selected = 1, -1
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(one_arr))
        if one.logit != float("-inf"):
            return best, False
        cand["logit"] = logits
        full_arr.selected = -1
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(full_arr))
        return int(np.argmax(cand["logit"])), True

    outcomes = []
    for req in spec["requests"]:
        llama_cpp.llama_sampler_reset(sampler)
        started = time.perf_counter()
        if llama_cpp.llama_state_set_data(ctx, state, saved) != saved:
            raise SystemExit("llama_state_set_data failed")
        llm.n_tokens = len(prefix)
        restore_ms = (time.perf_counter() - started) * 1e3
        llm.eval(req["ids"])
        out, text, masked, call_ms = [], b"", 0, None
        while len(out) < max_new:
            token, full = pick()
            masked += full
            if token in stops:
                break
            llama_cpp.llama_sampler_accept(sampler, token)
            out.append(token)
            text += llm.detokenize([token], special=True)
            if close in text[-64:]:
                call_ms = (time.perf_counter() - started) * 1e3
                break
            llm.eval([token])
        output = text.decode("utf-8", errors="replace")
        try:
            call = parse(output)
            error = None if call else "no call"
        except (ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            call, error = None, f"{type(e).__name__}: {e}"
        ok = call is not None and any(
            t["name"] == call["name"] and valid(call["arguments"], t["parameters"]) for t in tools
        )
        total_ms = (time.perf_counter() - started) * 1e3
        outcomes.append({
            "request": req["request"],
            "ids": out,
            "output": output,
            "tool_calls": [call] if call else [],
            "parse_error": error,
            "parsed_and_valid": ok,
            "call_ms": total_ms if ok and call_ms is not None else None,
            "total_ms": total_ms,
            "restore_ms": restore_ms,
            "tokens": len(out),
            "full_masks": masked,
        })
    calls = [o["call_ms"] for o in outcomes if o["call_ms"] is not None]
    q = lambda v, p: sorted(v)[round((len(v) - 1) * p)] if v else None
    print(json.dumps({
        "runtime": "llama.cpp",
        "llama_cpp_python": __version__,
        "model_file": os.path.basename(model_path),
        "threads": threads,
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "grammar_ms": grammar_ms,
        "prefix_tokens": len(prefix),
        "prefix_prefill_ms": prefill_ms,
        "state_bytes": saved,
        "call_ms_median": q(calls, 0.5),
        "call_ms_p90": q(calls, 0.9),
        "restore_ms_median": statistics.median(o["restore_ms"] for o in outcomes),
        "parse_and_validate": sum(o["parsed_and_valid"] for o in outcomes),
        "requests": len(outcomes),
        "gbnf": grammar_text,
        "outcomes": outcomes,
    }))


if __name__ == "__main__":
    main()
