#!/usr/bin/env python3
"""tg128 of trellm against llama.cpp's llama-bench on a quantized GGUF of every family trellm reads
from GGUF (issue 11), on this machine, same file, same threads.

For each family: a random-weight Hugging Face model of a realistic small size (hidden 768,
intermediate 2048, 12 layers, 12 heads / 4 KV heads, head dim 64; ~75M parameters) made from the
family's tiny fixture config (tests/fixtures/tiny/FAMILY/config.json) with every family-specific
switch kept (biases, soft-caps, sliding windows, tied or untied head, rope scaling, multipliers,
no-rope layers, ...), weights seeded normal(0, 0.02) (norm weights left at their defaults), a
small tokenizer trained as scripts/gguf_fixtures/make.py does (its functions, imported); then
llama.cpp's own convert_hf_to_gguf.py (f32, through make.py's convert() with its pre-tokenizer
registration) and llama-quantize to Q4_K_M. Then a correctness smoke (`trellm generate
--prompt-ids 1,2,3 -m 8`) and tg128: `trellm bench` and `llama-bench`, alternating, ROUNDS times
each, best of each kept (the machine is shared: other load only ever slows a run down).

The vocabulary stays small (the trained tokenizer's 256 tokens), so the output head costs little
next to a real model's: these numbers measure the transformer blocks.

Run with the converter's Python (torch, transformers, sentencepiece, tokenizers), e.g.

    /tmp/gguf-conv-venv/bin/python scripts/bench_families.py \\
        --llama-cpp /work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp --bin /work/peers/bin

Env: ROUNDS=2 THREADS=2 NGEN=128. Models go to --work (default /tmp/trellm-bench-families) and are
reused when present (--rebuild makes them again); never commit them.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts/gguf_fixtures"))
import make  # noqa: E402  (scripts/gguf_fixtures/make.py: tokenizers and the converter wrapper)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
            "granite", "smollm3", "starcoder2"]
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4)
HEAD_DIM = 64
QTYPE = "Q4_K_M"


def scaled_config(family: str) -> dict:
    cfg = json.loads((make.TINY / family / "config.json").read_text())
    old_heads = cfg["num_attention_heads"]
    old_head_dim = cfg.get("head_dim", cfg["hidden_size"] // old_heads)
    cfg.update(SHAPE)
    if "head_dim" in cfg:
        cfg["head_dim"] = HEAD_DIM
    if cfg.get("query_pre_attn_scalar") is not None:
        # Gemma 2/3 scale queries by 1/sqrt(query_pre_attn_scalar); their releases use head_dim.
        cfg["query_pre_attn_scalar"] = HEAD_DIM
    if "layer_types" in cfg:
        # gemma3: the fixture's pattern (every n-th layer full attention) over the new depth;
        # gemma-3-270m's window (the fixture's 8 is a test size).
        n = cfg["sliding_window_pattern"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                              for i in range(cfg["num_hidden_layers"])]
        cfg["sliding_window"] = 512
    rs = cfg.get("rope_scaling")
    if isinstance(rs, dict) and "long_factor" in rs:
        # phi3 longrope: one factor per rotated pair; each fixture factor repeated.
        rot = int(HEAD_DIM * cfg.get("partial_rotary_factor", 1.0))
        old = len(rs["long_factor"])
        rep = (rot // 2) // old
        assert rep * old == rot // 2, (rot, old, old_head_dim)
        for k in ("long_factor", "short_factor"):
            rs[k] = [f for f in rs[k] for _ in range(rep)]
    return cfg


def make_hf(family: str, d: Path, seed: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(scaled_config(family), indent=2))
    cfg = AutoConfig.from_pretrained(d)
    if getattr(cfg, "pad_token_id", None) is not None and cfg.pad_token_id >= cfg.vocab_size:
        cfg.pad_token_id = None  # Phi3Config's default pad id (32000) is past the small vocabulary
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 or name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(d, safe_serialization=True)
    # save_pretrained rewrites config.json from the config object; keep it (the converter reads it).
    kind, _ = make.FAMILIES[family]
    if kind.startswith("spm"):
        make.train_spm(d, kind)
    else:
        make.train_bpe(d)
    return n_params


def last_line(text: str) -> str:
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def run(cmd, timeout=900, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def tensor_types(trellm: Path, f: Path) -> str:
    r = run([trellm, "info", f], timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"trellm info: {last_line(r.stderr)}")
    m = re.search(r"^tensor types\s+(.*)$", r.stdout, re.M)
    return m.group(1).strip() if m else "?"


def bench_trellm(trellm: Path, f: Path, threads: int, ngen: int) -> float:
    r = run([trellm, "bench", "--model", f, "--threads", threads, "--n-prompt", 0, "--n-gen", ngen, "--json"])
    if r.returncode != 0:
        raise RuntimeError(f"trellm bench: {last_line(r.stderr)}")
    return json.loads(last_line(r.stdout))["tg_tok_s"]


def bench_llama(bin_dir: Path, f: Path, threads: int, ngen: int) -> float:
    r = run([bin_dir / "llama-bench", "-m", f, "-t", threads, "-p", 0, "-n", ngen, "-o", "json"])
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench: {last_line(r.stderr)}")
    rows = json.loads(r.stdout)
    return max(x["avg_ts"] for x in rows if x["n_gen"] == ngen)


def llama_greedy(bin_dir: Path, f: Path, prompt: list, n: int, threads: int) -> list:
    """llama.cpp's greedy ids on FILE after PROMPT, up to an end-of-generation token as trellm's (llama-server /completion, f32 KV cache; a context
    past phi3's original 4096 so that llama.cpp takes the long RoPE factors, as trellm does)."""
    import urllib.request

    port = make.free_port()
    srv = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(f), "--host", "127.0.0.1", "--port", str(port),
                            "-t", str(threads), "-c", "8192", "-ctk", "f32", "-ctv", "f32", "-np", "1", "--no-warmup"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                if srv.poll() is not None:
                    raise RuntimeError(f"llama-server cannot load {f.name}")
                time.sleep(0.1)
        r = make.post(port, "/completion", {
            "prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "ignore_eos": False, "samplers": ["top_k"], "n_probs": 1})
        return [s["id"] for s in r["completion_probabilities"]]
    finally:
        srv.terminate()
        srv.wait()


def family(args, fam: str, trellm: Path, rounds: int, threads: int, ngen: int) -> dict:
    res = {"family": fam, "qtype": QTYPE, "threads": threads, "n_gen": ngen, "rounds": rounds}
    q = args.work / f"{fam}.{QTYPE}.gguf"
    stage = "make"
    try:
        if args.rebuild or not q.exists():
            hf = args.work / f"{fam}-hf"
            f32 = args.work / f"{fam}.f32.gguf"
            shutil.rmtree(hf, ignore_errors=True)
            res["hf_params"] = make_hf(fam, hf, args.seed)
            stage = "convert"
            _, pre = make.FAMILIES[fam]
            make.convert(args.llama_cpp, hf, f32, pre)
            stage = "quantize"
            r = run([args.bin / "llama-quantize", f32, q, QTYPE, threads])
            if r.returncode != 0:
                raise RuntimeError(f"llama-quantize: {last_line(r.stderr)}")
            fallbacks = sorted(set(re.findall(r"falling back to (\S+)", r.stdout + r.stderr)))
            if fallbacks:
                res["quantize_fallbacks"] = fallbacks
            if not args.keep:
                shutil.rmtree(hf)
                f32.unlink()
        res["file_bytes"] = q.stat().st_size
        stage = "info"
        res["tensor_types"] = tensor_types(trellm, q)
        stage = "generate"
        r = run([trellm, "generate", "--model", q, "--threads", threads, "--prompt-ids", "1,2,3", "-m", 8],
                timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"trellm generate: {last_line(r.stderr)}")
        res["generate"] = last_line(r.stdout)[:120]
        # Greedy ids against llama.cpp's on the same file (random weights: near-ties can differ).
        r = run([trellm, "generate", "--model", q, "--threads", threads, "--prompt-ids", "1,2,3", "-m", 8,
                 "--temp", 0, "--json", "--logprobs", 2], timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"trellm generate --temp 0: {last_line(r.stderr)}")
        g = json.loads(r.stdout.splitlines()[0])
        res["greedy_trellm"] = g["ids"]
        res["greedy_llama"] = llama_greedy(args.bin, q, [1, 2, 3], 8, threads)
        res["greedy_same"] = res["greedy_trellm"] == res["greedy_llama"]
        if not res["greedy_same"]:
            # trellm's top-2 logprob margin at the first step where the two differ (a near-tie?)
            pairs = zip(g["ids"], res["greedy_llama"])
            i = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(g["ids"]), len(res["greedy_llama"])))
            top = g["logprobs"][i] if i < len(g["logprobs"]) else []
            res["first_diff"] = {"step": i, "trellm_top2": top,
                                 "margin": round(top[0][1] - top[1][1], 5) if len(top) > 1 else None}
        stage = "bench"
        ours, peer = [], []
        res["load_before"] = round(os.getloadavg()[0], 2)
        for _ in range(rounds):
            ours.append(bench_trellm(trellm, q, threads, ngen))
            peer.append(bench_llama(args.bin, q, threads, ngen))
        res["load_after"] = round(os.getloadavg()[0], 2)
        res["trellm_tg"] = [round(x, 2) for x in ours]
        res["llama_tg"] = [round(x, 2) for x in peer]
        res["trellm_best"] = round(max(ours), 2)
        res["llama_best"] = round(max(peer), 2)
        res["ratio"] = round(max(ours) / max(peer), 3)
    except Exception as e:  # a family that fails is a finding: keep its stage and error line
        msg = str(e)
        if isinstance(e, subprocess.CalledProcessError):
            msg = f"{e.cmd[0] if isinstance(e.cmd, list) else e.cmd}: exit {e.returncode}"
        res["error"] = f"{stage}: {last_line(msg) or type(e).__name__}"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path,
                    default=Path("/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp"),
                    help="the vendored llama.cpp tree (convert_hf_to_gguf.py)")
    ap.add_argument("--bin", type=Path, default=Path("/work/peers/bin"), help="llama-bench, llama-quantize")
    ap.add_argument("--trellm", type=Path, default=Path(os.environ.get("TRELLM_BIN", "/tmp/trellm-bench")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/trellm-bench-families"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rebuild", action="store_true", help="make the models again even if present")
    ap.add_argument("--keep", action="store_true", help="keep the HF folders and f32 GGUFs")
    ap.add_argument("families", nargs="*", default=FAMILIES)
    ap.add_argument("--summarize", action="store_true",
                    help="only print the table of WORK/results.tTHREADS.jsonl, all runs' rounds pooled per family")
    args = ap.parse_args()
    if args.summarize:
        res = merged(args.work / f"results.t{int(os.environ.get('THREADS', 2))}.jsonl")
        for r in res:
            print(json.dumps(r))
        table(res, res[0]["n_gen"] if res else 128)
        return
    rounds = int(os.environ.get("ROUNDS", 2))
    threads = int(os.environ.get("THREADS", 2))
    ngen = int(os.environ.get("NGEN", 128))
    args.work.mkdir(parents=True, exist_ok=True)
    jsonl = args.work / f"results.t{threads}.jsonl"
    results = []
    for fam in args.families:
        t0 = time.time()
        r = family(args, fam, args.trellm, rounds, threads, ngen)
        r["seconds"] = round(time.time() - t0, 1)
        results.append(r)
        line = json.dumps(r)
        print(line, flush=True)
        with jsonl.open("a") as f:
            f.write(line + "\n")
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {threads} threads, tg{ngen}, best of {rounds} rounds each "
          f"(alternating), load average now {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    table(results, ngen)


def merged(path: Path) -> list:
    """Every record of results.jsonl, one per family: the rounds of all runs pooled, best of each kept
    (a family's error is shown only when no run of it succeeded)."""
    by, errors = {}, {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        fam = r["family"]
        if "error" in r:
            errors[fam] = r
        elif fam not in by:
            by[fam] = dict(r)
        else:
            m = by[fam]
            m.update({k: v for k, v in r.items() if k.startswith(("greedy", "first_diff", "generate"))})
            if r.get("greedy_same", False):
                m.pop("first_diff", None)
            for k in ("trellm_tg", "llama_tg"):
                m[k] = m[k] + r[k]
            m["rounds"] += r["rounds"]
            m["load_before"] = min(m["load_before"], r["load_before"])
            m["load_after"] = max(m["load_after"], r["load_after"])
            m["trellm_best"], m["llama_best"] = max(m["trellm_tg"]), max(m["llama_tg"])
            m["ratio"] = round(m["trellm_best"] / m["llama_best"], 3)
    out = {**errors, **by}
    return [out[f] for f in FAMILIES if f in out] + [v for k, v in out.items() if k not in FAMILIES]


def table(results: list, ngen: int):
    print(f"| family | file | tensor types | trellm tg{ngen} tok/s | llama.cpp tg{ngen} tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in results:
        size = f"{r['file_bytes'] / 2**20:.1f} MiB" if "file_bytes" in r else "-"
        if "error" in r:
            print(f"| {r['family']} | {size} | {r.get('tensor_types', '-')} | **{r['error']}** | | |")
        else:
            print(f"| {r['family']} | {size} | {r['tensor_types']} | {r['trellm_best']:.1f} | "
                  f"{r['llama_best']:.1f} | **{r['ratio']:.2f}x** |")


if __name__ == "__main__":
    main()
