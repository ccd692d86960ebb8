"""One llama.cpp run (llama-cpp-python) on given token ids, measured as `skainet-kv bench`
measures: the prefix prefilled `repeat` times (median), then greedy decode of `new` tokens after
it (median step), then a short prompt fed from position 0 `repeat` times (median time to its first
token), then each utterance (`UTTERANCE_IDS`, `;`-separated) after the prefix's state loaded
(`load_state` + eval of the utterance: median time to its first token, as the bench's restore +
chunk call; measured last, after peak RSS is read: saving the state raised llama.cpp's peak RSS
by ~1.5 GB on Gemma 3 270M), then the greedy ids after a text prompt (`check_ids`: to compare
with skainet-kv's on text, where the next token is rarely a near-tie, unlike after the bench's
spread-out ids). Prints one JSON object; peak RSS is this process's (Python and numpy included:
about `python_baseline_mb`).

Usage: python run_llama.py MODEL.gguf PREFIX_IDS PROMPT_IDS CHECK_IDS [NEW] [REPEAT] [UTTERANCE_IDS]
       (ids: 1,2,3; utterances: 1,2;3,4)
"""

import json
import os
import resource
import statistics
import sys
import time

import numpy as np


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> None:
    model = sys.argv[1]
    prefix = [int(x) for x in sys.argv[2].split(",")]
    prompt = [int(x) for x in sys.argv[3].split(",")]
    check = [int(x) for x in sys.argv[4].split(",")]
    new = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    repeat = int(sys.argv[6]) if len(sys.argv) > 6 else 3
    utterances = [[int(x) for x in u.split(",")] for u in sys.argv[7].split(";") if u] if len(sys.argv) > 7 else []
    baseline = rss_mb()

    from llama_cpp import Llama, __version__

    threads = os.cpu_count() or 1
    # The context skainet-kv's sessions have (max_positions 2048); the rest at llama.cpp's defaults.
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)

    n_vocab = llm.n_vocab()

    def argmax() -> int:
        # Greedy: the largest logit of the last position, lowest id on ties (as the graphs' argmax),
        # read in place (`Llama.eval` keeps no logits unless logits_all).
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        return int(np.argmax(logits))

    prefill = []
    for _ in range(repeat):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prefix)
        token = argmax()
        prefill.append((time.perf_counter() - t) * 1e3)

    ids, steps = [token], []
    while len(ids) < new:
        t = time.perf_counter()
        llm.eval([ids[-1]])
        ids.append(argmax())
        steps.append((time.perf_counter() - t) * 1e3)

    llm.reset()
    llm.eval(check)
    check_ids = [argmax()]
    while len(check_ids) < new:
        llm.eval([check_ids[-1]])
        check_ids.append(argmax())

    first = []
    for _ in range(repeat):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        argmax()
        first.append((time.perf_counter() - t) * 1e3)

    # Read before the prefix's state is saved: the copy would count in llama.cpp's peak RSS.
    peak_rss = rss_mb()
    after_restore = []
    if utterances:
        llm.reset()
        llm.eval(prefix)
        prefix_state = llm.save_state()
    for utterance in utterances:
        t = time.perf_counter()
        llm.load_state(prefix_state)
        llm.eval(utterance)
        argmax()
        after_restore.append((time.perf_counter() - t) * 1e3)

    print(json.dumps({
        "llama_cpp_python": __version__,
        "threads": threads,
        "prefix_tokens": len(prefix),
        "prefix_prefill_ms": statistics.median(prefill),
        "decode_ms_per_token": statistics.median(steps),
        "prompt_tokens": len(prompt),
        "prompt_first_token_ms": statistics.median(first),
        "restored_first_token_ms": statistics.median(after_restore) if after_restore else None,
        "ids": ids,
        "check_ids": check_ids,
        "peak_rss_mb": peak_rss,
        "python_baseline_mb": baseline,
    }))


if __name__ == "__main__":
    main()
