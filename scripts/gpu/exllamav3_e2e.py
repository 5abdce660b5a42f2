#!/usr/bin/env python3
"""exllamav3 1.6.5 end to end on a Llama-3.1-8B-shaped EXL3 model, for issue 14's same-run comparison
with `trellm bench --device cuda --shape llama-3.1-8b --exl3 mul1:K`.

Runs on the GPU machine (torch there; exllamav3's wheel carried and installed as
scripts/gpu/prep_exllamav3_peer.sh prepares it, its extension built on first import). Writes the model
folder once per K under --dir, in the layout our quantizer writes and exllamav3 loads (per projection
`trellis` int16 [k/16][n/16][16 K], `suh`/`svh` fp16 and the `mul1` marker): random trellis words
(every word is a valid code), random-sign scales, fp16 embeddings and unit norms, the head at 6 bits;
a word-level tokenizer of the 128256 ids (the jobs take ids, the tokenizer is only loaded). Then,
through exllamav3's own Cache (fp16), Generator and greedy Jobs, as our bench measures:
- prefill of `--n-prompt` tokens (one job, one new token; time to the first token),
- batch-1 decode of `--n-gen` tokens after a `--context`-token prompt (tokens after the first, over
  the time after the first),
- S_TG at each B of `--batch` (B jobs of `--context` tokens, `--n-gen` each, all tokens over the
  time after every job's first).
One JSON line per measurement to stdout (and --out).

usage: python3 scripts/gpu/exllamav3_e2e.py --bits 3 [--dir /tmp/ex3-8b] [--batch 8,32] [--start-after FILE]
"""

import argparse, json, os, struct, sys, time

import torch

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 32, 8, 128, 128256
MUL1_MULTIPLIER = 0x83DCD12D - (1 << 32)  # the marker tensor's value, as an i32


def write_safetensors(path, tensors):
    """tensors: list of (name, torch tensor) written in the safetensors layout."""
    kinds = {torch.float16: "F16", torch.int16: "I16", torch.int32: "I32", torch.float32: "F32"}
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors:
        b = t.contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": kinds[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(path + ".tmp", path)


def exl3_linear(prefix, k, n, bits, gen):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), dtype=torch.int32, generator=gen)
    sign = lambda m: (torch.randint(0, 2, (m,), generator=gen) * 2 - 1).to(torch.float16)
    scale = lambda m: (sign(m) * (0.5 + torch.rand(m, generator=gen)).to(torch.float16) / 64)
    return [
        (prefix + ".trellis", trellis.to(torch.int16)),
        (prefix + ".suh", scale(k)),
        (prefix + ".svh", scale(n)),
        (prefix + ".mul1", torch.tensor(MUL1_MULTIPLIER, dtype=torch.int32)),
    ]


def make_model(d, bits):
    if os.path.exists(os.path.join(d, "done")):
        return
    os.makedirs(d, exist_ok=True)
    gen = torch.Generator().manual_seed(bits)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "torch_dtype": "float16",
        "quantization_config": {"quant_method": "exl3", "version": "synthetic", "bits": bits, "head_bits": 6,
                                "out_scales": "always", "codebook": "mul1"},
    }
    json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=1)
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(VOCAB)}, "unk_token": "t0"}}
    json.dump(tok, open(os.path.join(d, "tokenizer.json"), "w"))
    json.dump({"bos_token": "t0", "eos_token": "t1"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    write_safetensors(os.path.join(d, "model-embed.safetensors"), [
        ("model.embed_tokens.weight", (torch.rand(VOCAB, HIDDEN, generator=gen) - 0.5).to(torch.float16)),
        ("model.norm.weight", torch.ones(HIDDEN, dtype=torch.float16)),
    ] + exl3_linear("lm_head", HIDDEN, VOCAB, 6, gen))
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        t = [(p + "input_layernorm.weight", torch.ones(HIDDEN, dtype=torch.float16)),
             (p + "post_attention_layernorm.weight", torch.ones(HIDDEN, dtype=torch.float16))]
        for name, k, n in [("self_attn.q_proj", HIDDEN, q), ("self_attn.k_proj", HIDDEN, kv),
                           ("self_attn.v_proj", HIDDEN, kv), ("self_attn.o_proj", q, HIDDEN),
                           ("mlp.gate_proj", HIDDEN, INTER), ("mlp.up_proj", HIDDEN, INTER),
                           ("mlp.down_proj", INTER, HIDDEN)]:
            t += exl3_linear(p + name, k, n, bits, gen)
        write_safetensors(os.path.join(d, f"model-layer{l:02d}.safetensors"), t)
    open(os.path.join(d, "done"), "w").write("ok\n")


def emit(out, **kw):
    line = json.dumps(kw)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def run_jobs(gen_, Job, prompts, n_gen):
    """Enqueues one greedy job per prompt; returns (time to every job's first token, total time,
    tokens after each job's first)."""
    for i, ids in enumerate(prompts):
        gen_.enqueue(Job(input_ids=ids, max_new_tokens=n_gen, identifier=i, stop_conditions=[]))
    t0 = time.perf_counter()
    first, counts, t_first = set(), [0] * len(prompts), None
    while gen_.num_remaining_jobs():
        for r in gen_.iterate():
            if r.get("stage") != "streaming":
                continue
            i = r["identifier"]
            n = len(r.get("token_ids", torch.empty(0)).flatten()) if "token_ids" in r else 1
            if i not in first:
                first.add(i)
                n -= 1
                if len(first) == len(prompts):
                    t_first = time.perf_counter()
            counts[i] += max(n, 0)
    torch.cuda.synchronize()
    return t_first - t0, time.perf_counter() - t0, sum(counts)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--dir", default="/tmp/ex3-8b")
    ap.add_argument("--n-prompt", type=int, default=2048)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--start-after", default="",
                    help="wait (after its extension build and the model load) until this file exists, so a "
                         "run started beside another engine's measures alone")
    a = ap.parse_args()
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer

    d = os.path.join(a.dir, f"mul1-{a.bits}")
    t = time.perf_counter()
    make_model(d, a.bits)
    emit(a.out, what="folder", bits=a.bits, seconds=round(time.perf_counter() - t, 1))
    config = Config.from_directory(d)
    model = Model.from_config(config)
    batches = [int(b) for b in a.batch.split(",") if b]
    most = max(batches + [1])
    cache = Cache(model, max_num_tokens=max(a.n_prompt + 256, most * (a.context + a.n_gen + 256)),
                  max_batch_size=most)
    model.load()
    tokenizer = Tokenizer.from_config(config)
    gen_ = Generator(model, cache, tokenizer, max_batch_size=most, max_chunk_size=2048)
    emit(a.out, what="loaded", bits=a.bits)
    while a.start_after and not os.path.exists(a.start_after):
        time.sleep(0.5)
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(2, VOCAB, (1, n), generator=g)
    run_jobs(gen_, Job, [prompt(64)], 8)  # warm-up
    for rep in range(a.reps):
        t_first, _, _ = run_jobs(gen_, Job, [prompt(a.n_prompt)], 1)
        emit(a.out, what="prefill", bits=a.bits, rep=rep, n_prompt=a.n_prompt,
             tok_s=round(a.n_prompt / t_first, 1))
        t_first, total, n = run_jobs(gen_, Job, [prompt(a.context)], a.n_gen)
        emit(a.out, what="decode", bits=a.bits, rep=rep, context=a.context, tokens=n,
             tok_s=round(n / (total - t_first), 2))
        for b in batches:
            t_first, total, n = run_jobs(gen_, Job, [prompt(a.context) for _ in range(b)], a.n_gen)
            emit(a.out, what="batched", bits=a.bits, rep=rep, b=b, context=a.context, tokens=n,
                 s_tg=round(n / (total - t_first), 1))


if __name__ == "__main__":
    sys.exit(main())
