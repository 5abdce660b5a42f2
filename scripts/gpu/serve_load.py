"""Concurrent streaming /v1/completions clients (Python's standard library only: the GPU machine
has no pip) against `trellm serve`, prompts given as token ids (a model without a tokenizer).
Usage: serve_load.py PORT [--clients 64] [--requests 2] [--prompt-len 128] [--max-tokens 128]
Prints one JSON object: one stream's generated tokens/s (alone), the aggregate with all clients
at once, the ratio, and whether every request generated max_tokens tokens.
"""
import argparse
import http.client
import json
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("port", type=int)
ap.add_argument("--clients", type=int, default=64)
ap.add_argument("--requests", type=int, default=2)
ap.add_argument("--prompt-len", type=int, default=128)
ap.add_argument("--max-tokens", type=int, default=128)
a = ap.parse_args()


def one(seed):
    prompt = [(seed * 7919 + j * 104729) % 40000 + 100 for j in range(a.prompt_len)]
    body = json.dumps({"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:200]}")
    tokens = 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line[6:] == b"[DONE]":
            break
        v = json.loads(line[6:])
        if v.get("usage"):
            tokens = v["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - t0


one(0)  # warm-up
alone = [one(1000 + i) for i in range(3)]
single = sum(t for t, _ in alone) / sum(s for _, s in alone)
results, errors = [], []


def client(c):
    for r in range(a.requests):
        try:
            results.append(one(c * a.requests + r))
        except Exception as e:
            errors.append(repr(e))


threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.perf_counter() - t0
generated = sum(t for t, _ in results)
print(json.dumps({
    "clients": a.clients, "requests": len(results), "errors": errors[:3],
    "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
    "all_full_length": all(t == a.max_tokens for t, _ in results),
    "single_stream_tok_s": round(single, 1), "aggregate_tok_s": round(generated / wall, 1),
    "ratio": round(generated / wall / single, 2), "wall_s": round(wall, 2),
}))
