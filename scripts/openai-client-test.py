"""OpenAI's Python client against `skainet-kv serve` (run by crates/server/tests/openai_client.rs).

Usage: openai-client-test.py WARM_URL COLD_URL BUSY_URL TOOLS_JSON
  WARM_URL  a server with prefix caching; COLD_URL the same model without (the reference for
  exact answers); BUSY_URL one session and a queue of one (for 429 and the disconnect).
Each check prints one line; any failure raises (exit status 1).
"""

import concurrent.futures
import json
import sys
import time
import urllib.request

import openai

WARM, COLD, BUSY, TOOLS_FILE = sys.argv[1:5]
TOOLS = json.load(open(TOOLS_FILE))
SYSTEM = "You control a smart home. Answer briefly."


def client(url):
    # No retries: a 429 must reach the test, not be retried away.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def messages(user):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return json.load(r)


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


warm, cold, busy = client(WARM), client(COLD), client(BUSY)
model = warm.models.list().data[0].id
check("models.list names the model", model == "tiny-gemma3:7", model)

# A streamed chat: the pieces make the non-streamed answer; usage arrives in the last chunk.
whole = warm.chat.completions.create(model=model, messages=messages("Hello there."), max_tokens=24)
stream = warm.chat.completions.create(
    model=model,
    messages=messages("Hello there."),
    max_tokens=24,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, finish, usage = [], [], None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish.append(c.finish_reason)
check("streamed chat equals the whole answer", "".join(pieces) == whole.choices[0].message.content,
      f"{pieces!r} vs {whole.choices[0].message.content!r}")
check("one finish reason", len(finish) == 1, finish)
check("usage in the stream", usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage)

# A tool call the client parses: name among the tools, arguments a JSON object.
names = {t["function"]["name"] for t in TOOLS}
r = warm.chat.completions.create(
    model=model, messages=messages("Set a timer for ten minutes."), tools=TOOLS, tool_choice="required", max_tokens=96
)
call = r.choices[0].message.tool_calls[0]
check("tool call parses", call.function.name in names and isinstance(json.loads(call.function.arguments), dict),
      call)
check("finish reason tool_calls", r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason)
stream = warm.chat.completions.create(
    model=model,
    messages=messages("Turn on the kitchen lights."),
    tools=TOOLS,
    tool_choice={"type": "function", "function": {"name": "set_lights"}},
    max_tokens=96,
    stream=True,
)
calls = [tc for chunk in stream for c in chunk.choices for tc in (c.delta.tool_calls or [])]
check("streamed tool call", len(calls) == 1 and calls[0].function.name == "set_lights"
      and isinstance(json.loads(calls[0].function.arguments), dict), calls)

# The same system prompt and tools again: restored from the prefix cache, the answer identical to
# a server that caches nothing.
def ids(c, user):
    r = c.chat.completions.create(
        model=model, messages=messages(user), tools=TOOLS, max_tokens=48, extra_body={"return_token_ids": True}
    )
    return r, r.choices[0].model_extra["token_ids"]


before = metrics(WARM)["prefix_cache"]["hits"]
hit, hit_ids = ids(warm, "Dim the bedroom to 30 percent.")
_, cold_ids = ids(cold, "Dim the bedroom to 30 percent.")
cached = hit.usage.prompt_tokens_details.cached_tokens
check("second request with the same tools starts from a snapshot", cached > 0, hit.usage)
check("its answer equals the cold server's id for id", hit_ids == cold_ids, f"{hit_ids} vs {cold_ids}")
check("timings say what the hit saved", hit.model_extra["timings"]["cached_tokens"] == cached
      and hit.model_extra["timings"]["saved_ms_estimate"] > 0, hit.model_extra["timings"])
check("metrics count the hit", metrics(WARM)["prefix_cache"]["hits"] > before)

# Concurrent requests through one client (its connection pool).
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(
        lambda i: warm.chat.completions.create(model=model, messages=messages(f"Request {i}."), max_tokens=8),
        range(6),
    ))
check("concurrent requests all answered", all(r.choices[0].finish_reason in ("stop", "length") for r in results))

# Oversized and malformed requests: typed errors from the client.
try:
    warm.chat.completions.create(model=model, messages=messages("x" * 2_000_000), max_tokens=8)
    raise AssertionError("an oversized request was answered")
except openai.APIStatusError as e:
    check("oversized request is 413", e.status_code == 413 and e.body["code"] == "request_too_large", e)
for bad, code in [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_messages"),
    ({"messages": messages("hi"), "n": 2}, "unsupported_n"),
    ({"messages": messages("hi"), "max_tokens": 10**6}, "invalid_max_tokens"),
    ({"messages": messages("hi"), "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "invalid_tool_choice"),
]:
    try:
        warm.chat.completions.create(model=model, **bad)
        raise AssertionError(f"{bad} was answered")
    except openai.BadRequestError as e:
        check(f"malformed request refused ({code})", e.body["code"] == code, e)
check("server still answers", warm.chat.completions.create(model=model, messages=messages("ok?"), max_tokens=4).id)

# A full queue: one answer running, one waiting, the next refused with 429; then the streaming
# client leaves, decoding stops and the waiting request gets the session. The tiny fixture can
# finish the long answer (900 tokens, the client reading none of them) before a loaded machine
# has queued the others: such an attempt proves nothing either way and runs again; a request
# answered beyond a full queue while the long answer still ran fails at once.
LONG = {"max_tokens": 900, "extra_body": {"ignore_eos": True}}


def long_answer_done(completed_before):
    return metrics(BUSY)["requests"]["completed"] > completed_before


def full_queue_and_disconnect():
    """True once every check ran; False when the long answer ended before they could."""
    before = metrics(BUSY)["requests"]
    running = busy.chat.completions.create(model=model, messages=messages("A long story."), stream=True, **LONG)
    next(iter(running))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: busy.chat.completions.create(model=model, messages=messages("Next."), max_tokens=4))
        t = time.time()
        while metrics(BUSY)["queue"]["depth"] < 1:
            if long_answer_done(before["completed"]):
                running.close()
                waiting.result()
                return False
            assert time.time() - t < 20, "the second request never queued"
            time.sleep(0.02)
        try:
            busy.chat.completions.create(model=model, messages=messages("Third."), max_tokens=4)
            if long_answer_done(before["completed"]):
                running.close()
                waiting.result()
                return False
            raise AssertionError("a request beyond the queue was answered")
        except openai.RateLimitError as e:
            check("a full queue answers 429", e.status_code == 429 and e.body["code"] == "queue_full", e)
        running.close()
        t = time.time()
        while metrics(BUSY)["requests"]["cancelled"] <= before["cancelled"]:
            if long_answer_done(before["completed"]):
                waiting.result()
                return False
            assert time.time() - t < 20, "the stream was not cancelled"
            time.sleep(0.02)
        m = metrics(BUSY)["requests"]
        check("disconnect cancels decoding", m["cancelled_after_tokens"] - before["cancelled_after_tokens"] < 900, m)
        check("the waiting request is answered", waiting.result().choices[0].finish_reason in ("stop", "length"))
    return True


for attempt in range(1, 6):
    if full_queue_and_disconnect():
        break
    print(f"..  attempt {attempt}: the long answer ended before the queue filled; again")
else:
    raise AssertionError("the long answer ended before the queue filled in 5 attempts")
print("openai client: all checks passed")
