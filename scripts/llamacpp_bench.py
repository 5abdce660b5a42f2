#!/usr/bin/env python3
"""llama.cpp's pp/tg speed on a GGUF file, measured the way llama-bench does, through
llama-cpp-python: ppN = N prompt tokens in one batch from an empty context, tgN = N tokens
decoded one at a time from an empty context; one warm-up run, then the median of R runs.

Usage: llamacpp_bench.py MODEL.gguf [--threads T] [-p 512] [-n 128] [-r 5]
Prints one JSON object: {"pp_tok_s": ..., "tg_tok_s": ..., ...}.
"""
import argparse, json, statistics, time

import llama_cpp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    a = ap.parse_args()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.n_prompt + a.n_gen + 16, n_batch=max(a.n_prompt, 1),
                          n_ubatch=max(a.n_prompt, 1), n_threads=a.threads, n_threads_batch=a.threads,
                          use_mmap=True, verbose=False)
    vocab = llm.n_vocab()
    tokens = [(i * 2654435761 + 7) % vocab for i in range(a.n_prompt)]
    bos = llm.token_bos()
    pp, tg = [], []
    for rep in range(a.repetitions + 1):
        if a.n_prompt:
            llm.reset()
            llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            t = time.perf_counter()
            llm.eval(tokens)
            dt = time.perf_counter() - t
            if rep:
                pp.append(a.n_prompt / dt)
        if a.n_gen:
            llm.reset()
            llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            tok = bos
            t = time.perf_counter()
            for _ in range(a.n_gen):
                llm.eval([tok])
                tok = int(llm.scores[llm.n_tokens - 1].argmax())
            dt = time.perf_counter() - t
            if rep:
                tg.append(a.n_gen / dt)
    print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "threads": a.threads,
                      "n_prompt": a.n_prompt, "n_gen": a.n_gen, "repetitions": a.repetitions,
                      "pp_tok_s": statistics.median(pp) if pp else None,
                      "tg_tok_s": statistics.median(tg) if tg else None}))


if __name__ == "__main__":
    main()
