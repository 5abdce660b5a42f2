"""Concurrent streaming clients against an OpenAI-compatible server (trellm serve or llama-server),
through the official `openai` package.

Usage: load_clients.py BASE_URL MODEL [--clients 64] [--requests 2] [--max-tokens 32]
                       [--prompts 16] [--check]

First each distinct prompt runs alone, twice (the first run warms caches; the second is the
reference text and the single-stream speed). Then CLIENTS clients each send REQUESTS streaming
requests one after another, all clients at once. Prints one JSON object: single-stream and
aggregate generated tokens/s, their ratio, time-to-first-token percentiles, and the requests
whose text differs from the same prompt run alone. With --check, exits 1 on any failed request
or differing text.
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

import openai

TOPICS = [
    "the ocean", "a lighthouse keeper", "the moon", "a lost dog", "a small village",
    "the first snow", "a clockmaker", "a dragon", "the desert", "an old library",
    "a train journey", "a robot", "the rain forest", "a violinist", "a mountain climb",
    "a secret garden", "a city at night", "a fisherman", "the northern lights", "a bakery",
]


def prompt(i):
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


async def one(client, model, i, max_tokens):
    """One streamed greedy request: (text, completion tokens, ttft seconds, total seconds)."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    tokens = None
    stream = await client.chat.completions.create(
        model=model, messages=prompt(i), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
    total = time.perf_counter() - t0
    return "".join(parts), tokens or 0, ttft if ttft is not None else total, total


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    # llama-server closes idle keep-alive connections, which the client may already be reusing:
    # the official client's own retries (2 by default) cover that race.
    ap.add_argument("--retries", type=int, default=0)
    a = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=a.base + "/v1", api_key="unused", max_retries=a.retries,
                                timeout=600)
    alone, single_tokens, single_time = {}, 0, 0.0
    for i in range(a.prompts):
        await one(client, a.model, i, a.max_tokens)
        text, n, _, total = await one(client, a.model, i, a.max_tokens)
        alone[i] = text
        single_tokens += n
        single_time += total

    results = []

    async def run_client(c):
        for r in range(a.requests):
            i = (c * a.requests + r) % a.prompts
            try:
                results.append((i, *await one(client, a.model, i, a.max_tokens)))
            except Exception as e:  # a failed request is reported, not raised
                results.append((i, None, 0, 0.0, 0.0, repr(e)))

    t0 = time.perf_counter()
    await asyncio.gather(*(run_client(c) for c in range(a.clients)))
    wall = time.perf_counter() - t0
    failed = [r[-1] for r in results if r[1] is None]
    ok = [r for r in results if r[1] is not None]
    differ = [{"prompt": i, "alone": alone[i], "loaded": text}
              for (i, text, *_rest) in ok if text != alone[i]]
    generated = sum(r[2] for r in ok)
    single = single_tokens / single_time
    aggregate = generated / wall
    ttfts = [r[3] for r in ok]
    out = {
        "clients": a.clients, "requests": len(results), "max_tokens": a.max_tokens,
        "single_stream_tok_s": round(single, 1), "aggregate_tok_s": round(aggregate, 1),
        "ratio": round(aggregate / single, 2), "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(pct(ttfts, 99), 3) if ttfts else None,
        "failed": failed[:5], "n_failed": len(failed),
        "differ": differ[:5], "n_differ": len(differ),
    }
    print(json.dumps(out))
    if a.check and (failed or differ):
        sys.exit(1)


asyncio.run(main())
