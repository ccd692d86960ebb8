"""Writes llama_cpp_pre_goldens.json: the ids llama.cpp gives with the `qwen2` and `llama-bpe`
pre-tokenizers, for the corpus of gen_goldens.py plus seeded random strings of the characters
where the splits differ (digits of several scripts, contractions in both cases, \\r \\n and other
whitespace, letters, marks, punctuation, emoji).

No real Qwen or Llama 3 GGUF is within reach here, so the vocabulary is SmolLM2-135M's (byte-level
BPE) with `tokenizer.ggml.pre` renamed: what the test pins is the split and the merges' use, which
is what the pre-tokenizer name selects in llama.cpp. SmolLM2's own merges never join digits (its
pre-tokenizer splits each), so EXTRA_TOKENS/EXTRA_MERGES add digit runs (what tells `\p{N}` from
`\p{N}{1,3}`) and whole words no merge reaches (what tells llama.cpp's `ignore_merges`, Llama 3's,
from merging); the JSON carries them so the Rust test rewrites the same vocabulary. The oracle is llama.cpp as vendored in
llama-cpp-python 0.3.36 (`Llama(..., vocab_only=True).tokenize`, i.e. `llama_tokenize`), the
install scripts/bench-vs-llamacpp.sh makes in .tools/llama-cpp; the GGUF is rewritten with the
`gguf` package (.tools/venv).
Run: .tools/llama-cpp/venv/bin/python gen_pre_goldens.py <SmolLM2-135M-Instruct.Q4_1.gguf>
     (it calls .tools/venv/bin/python for the rewrite)
"""
import json, os, random, subprocess, sys, tempfile

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.abspath(os.path.join(here, "../../../.."))
TEXTS = [
    "",
    "The capital of France is",
    "Hello world",
    " Hello world",
    "Hello   world   ",
    "  leading and trailing  ",
    "line one\nline two\n\nline four\n\n\n",
    "tab\tseparated\tvalues",
    "In 2024, costs were $1,234.56!",
    "3.14159265358979 and 1e-10 and 0xFF and 007 and 1234567",
    "I'm sure you've seen they'll do it; we'd've known. It's 'quoted'.",
    "DON'T SHOUT, IT'S FINE, WE'LL SEE, THEY'RE, I'VE, HE'D",
    "naïve café résumé — “smart quotes” … ½ ² Ⅻ ٣٤٥",
    "日本語のテキストと中文文本",
    "Emoji: 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
    "Привет, мир! Ёлка.",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "def f(x):\n\treturn x**2  # square\r\n",
    "a\u00a0b\u2003c\u3000d \u0085e",
    "  \n  \n\t \r\n",
    "!!!???...,,,;;;:::\n\n",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "<tool_call>\n{\"name\": \"set_timer\", \"arguments\": {\"minutes\": 10}}\n</tool_call>",
]
EXTRA_MERGES = ["1 2", "12 3", "0 1", "01 9", "٣ ٤", "4 5", "45 6"]
EXTRA_TOKENS = ["12", "123", "01", "019", "٣٤", "45", "456", "Ġzzqq", "zzqq", "Ġqqzz9"]
TEXTS += ["12312 0190 1234567 ٣٤٣٤ 456456", " zzqq zzqq zzqqzzqq", "zzqq qqzz9 12zzqq"]
ALPHABET = list("aZé日ß'sStTrReEvVlLmMdD012345619٣٤²Ⅻ !.,-\"\t\n\r") + ["\u00a0", "\u3000", "\u0301", "😀", "  ", "\r\n", " zzqq", "zzqq"]
rng = random.Random(2026_12_05)
RANDOM = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24))) for _ in range(300)]

src = sys.argv[1]
import llama_cpp

goldens = {"extraTokens": EXTRA_TOKENS, "extraMerges": EXTRA_MERGES}
for pre in ("qwen2", "llama-bpe"):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{pre}.gguf")
        subprocess.run([os.path.join(root, ".tools/venv/bin/python"), "-c", f"""
import gguf, sys
r = gguf.GGUFReader({src!r})
w = gguf.GGUFWriter({path!r}, r.fields["general.architecture"].contents())
for name, f in r.fields.items():
    if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.ggml.pre"):
        continue
    t = f.types[0]
    v = f.contents()
    if name == "tokenizer.ggml.tokens":
        v = v + {EXTRA_TOKENS!r}
    elif name == "tokenizer.ggml.merges":
        v = v + {EXTRA_MERGES!r}
    elif name == "tokenizer.ggml.token_type":
        v = v + [1] * {len(EXTRA_TOKENS)}
    elif name == "tokenizer.ggml.scores":
        v = v + [0.0] * {len(EXTRA_TOKENS)}
    if t == gguf.GGUFValueType.ARRAY:
        w.add_key_value(name, v, t, sub_type=f.types[-1])
    else:
        w.add_key_value(name, v, t)
w.add_string("tokenizer.ggml.pre", {pre!r})
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"""], check=True)
        model = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        goldens[pre] = [
            {"text": t, "ids": model.tokenize(t.encode("utf-8"), add_bos=False, special=False)}
            for t in TEXTS + RANDOM
        ]
with open(os.path.join(here, "llama_cpp_pre_goldens.json"), "w") as f:
    json.dump(goldens, f, ensure_ascii=False, indent=0)
print({k: len(v) for k, v in goldens.items()})
