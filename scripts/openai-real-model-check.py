"""OpenAI's Python client against `skainet-kv serve` on a real model (docs/server.md, "A real model").

Usage: openai-real-model-check.py WARM_URL COLD_URL TOOLS_JSON
  WARM_URL: a server with prefix caching; COLD_URL: the same model with --prefix-cache-mb 0.
Prints each answer and check; any failure raises (exit status 1).
"""

import json
import sys
import time

import openai

WARM, COLD, TOOLS_FILE = sys.argv[1:4]
TOOLS = json.load(open(TOOLS_FILE))
SYSTEM = "You are a phone assistant. Call a tool when the request asks for one."
warm = openai.OpenAI(base_url=WARM + "/v1", api_key="unused", max_retries=0, timeout=600)
cold = openai.OpenAI(base_url=COLD + "/v1", api_key="unused", max_retries=0, timeout=600)
model = warm.models.list().data[0].id


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


# A streamed chat.
t = time.time()
stream = warm.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France? One sentence."}],
    max_tokens=32, stream=True)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
print(f"streamed ({time.time() - t:.1f} s): {text!r}")
check("streamed chat has text", len(text.strip()) > 0)

# Tool calls: the same system prompt and tools each time, so every request after the first
# starts from the cached catalog; each answer compared with the cold server's, id for id.
# The last under tool_choice "required": a call the grammar guarantees (SmolLM2-135M left to
# choose often answers in text, docs/tool-calling.md).
asks = [("Turn off the kitchen lights.", "auto"), ("Set an alarm for 7 am.", "auto"), ("Call Anna.", "required")]
for i, (ask, choice) in enumerate(asks):
    args = dict(model=model, tools=TOOLS, tool_choice=choice, max_tokens=96, extra_body={"return_token_ids": True},
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}])
    t = time.time()
    w = warm.chat.completions.create(**args)
    warm_s = time.time() - t
    t = time.time()
    c = cold.chat.completions.create(**args)
    cold_s = time.time() - t
    calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in (w.choices[0].message.tool_calls or [])]
    cached = w.usage.prompt_tokens_details.cached_tokens
    print(f"{ask!r}: calls {calls} text {w.choices[0].message.content!r}; prompt {w.usage.prompt_tokens} ids, "
          f"{cached} cached; warm {warm_s:.2f} s (timings {w.model_extra['timings']}), cold {cold_s:.2f} s")
    check("answer equals the cold server's id for id",
          w.choices[0].model_extra["token_ids"] == c.choices[0].model_extra["token_ids"])
    check("calls parse", all(isinstance(a, dict) for _, a in calls))
    if i > 0:
        check("the catalog came from the prefix cache", cached > 0, w.usage)
    if choice == "required":
        check("a required call is made", len(calls) >= 1 and w.choices[0].finish_reason == "tool_calls", w)
print("real model: all checks passed")
