"""Writes llama_cpp_goldens.json: token ids llama.cpp gives for a corpus of texts, per model.

The oracle is llama.cpp's own `llama-tokenize` (vocab-only load, `common_tokenize`), built from the
llama.cpp tree vendored in the PyPI sdist of llama-cpp-python 0.3.36:
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   (or take the sdist tarball)
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build --target llama-tokenize
Run: python gen_goldens.py <path/to/llama-tokenize> <gemma.gguf> <smollm2.gguf>
"""
import json, os, subprocess, sys, tempfile

TEXTS = [
    "",
    "The capital of France is",
    "Paris is the capital of",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello   world   ",
    "  leading and trailing  ",
    "line one\nline two\n\nline four\n\n\n",
    "tab\tseparated\tvalues",
    "\n",
    " ",
    "   ",
    "In 2024, costs were $1,234.56!",
    "3.14159265358979 and 1e-10 and 0xFF and 007",
    "I'm sure you've seen they'll do it; we'd've known. It's 'quoted'.",
    "DON'T SHOUT, it'S fine",
    "naïve café résumé — “smart quotes” … ½ ² Ⅻ",
    "日本語のテキストと中文文本",
    "Emoji: 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
    "مرحبا بالعالم",
    "हिन्दी में लिखा गया पाठ",
    "Привет, мир! Ёлка.",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "def f(x):\n\treturn x**2  # square\n",
    "<html><body class=\"a\">Hi</body></html>",
    "a\u00a0b\u2003c\u3000d",
    "control \u0001\u0002 bytes \u007f",
    "\U0001F600\U00010348\U0002A6D6",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<bos>text<eos> and <|endoftext|> and <unused0>",
    "<start_of_turn><end_of_turn><start_of_turn>",
    "x<|im_start|>y<|im_end|>z",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "a" * 40,
    "!!!???...,,,;;;:::",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "  \n  \n\t \r\n",
]

def tokenize(binary, model, text, parse_special):
    with tempfile.NamedTemporaryFile("wb", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        args = [binary, "-m", model, "-f", path, "--ids", "--log-disable", "--no-bos", "--no-escape"]
        if not parse_special:
            args.append("--no-parse-special")
        out = subprocess.run(args, capture_output=True, check=True).stdout.decode()
        return json.loads(out.strip().splitlines()[-1])
    finally:
        os.unlink(path)

binary, gemma, smol = sys.argv[1:4]
goldens = {}
for name, model in (("gemma3-270m", gemma), ("smollm2-135m", smol)):
    cases = []
    for text in TEXTS:
        cases.append({"text": text, "parseSpecial": True, "ids": tokenize(binary, model, text, True)})
    for text in TEXTS[29:34]:
        cases.append({"text": text, "parseSpecial": False, "ids": tokenize(binary, model, text, False)})
    goldens[name] = cases
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "llama_cpp_goldens.json"), "w") as f:
    json.dump(goldens, f, ensure_ascii=False, indent=0)
print(sum(len(c) for c in goldens.values()), "cases")
