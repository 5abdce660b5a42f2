#!/usr/bin/env python3
"""Regenerates tests/fixtures/gguf-tiny: each tiny family fixture of tests/fixtures/tiny converted to
GGUF by llama.cpp's own converter (convert_hf_to_gguf.py, --outtype f32), a few of them quantized by
llama-quantize, and llama.cpp's own outputs on those files (tokenizer ids, chat-template renderings,
greedy ids with top logprobs) recorded from llama-server into llama_cpp.json.

The tiny fixtures have no tokenizer; this script trains a small one per family (vocabulary <= 256,
the converter pads the rest): SentencePiece for the gemma and llama-style folders, byte-level BPE
for the others. The converter recognises a BPE pre-tokenizer by the hash of its ids on a test
text, which no new vocabulary can match; as llama.cpp's convert_hf_to_gguf_update.py does for a new
model, we register our vocabulary's hash under the pre-tokenizer name we give it.

Needs torch, transformers, sentencepiece, tokenizers (the converter's requirements) and the
llama.cpp tools of shared/peers (build_llamacpp_tools.sh). CI does not run this; it reads the
committed files.

    python3 scripts/gguf_fixtures/make.py --llama-cpp PREFIX/src/.../vendor/llama.cpp --bin PREFIX/bin
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests/fixtures/tiny"
OUT = ROOT / "tests/fixtures/gguf-tiny"

# Text the tokenizers are trained on: English with digits, contractions, punctuation and
# whitespace runs, so the pre-tokenizers' differences show.
CORPUS = """The quick brown fox jumps over the lazy dog. It's 12:45 and we've got 3 apples, 42 pears
and 1234567 grains of rice! She said: "I'll be there at 9." They're here; you'd know.
In 1999, the price was $3.50 -- now it's $12.99?  Tabs\tand  double  spaces   matter.
Hello world, hello World, HELLO WORLD. A model reads tokens; a tokenizer makes them.
def add(a, b):
    return a + b  # code, too
The capital of France is Paris. The history of the Roman Empire spans 1500 years.
""" * 4

# family fixture -> (tokenizer kind, BPE pre-tokenizer name or None)
FAMILIES = {
    "llama": ("spm", None),
    "llama-untied": ("spm", None),
    "llama-rope-linear-bias": ("spm", None),
    "llama-rope-llama3": ("bpe", "llama-bpe"),
    "mistral": ("spm", None),
    "qwen2": ("bpe", "qwen2"),
    "qwen3": ("bpe", "qwen2"),
    "gemma": ("spm-gemma", None),
    "gemma2": ("spm-gemma", None),
    "gemma3": ("spm-gemma", None),
    # llama.cpp's phi3 vocabulary needs <s>, </s>, <unk> and <|endoftext|> (as Phi-3's has).
    "phi3": ("spm-phi3", None),
    "olmo2": ("bpe", "dbrx"),
    "granite": ("bpe", "refact"),
    "smollm3": ("bpe", "llama-bpe"),
    "starcoder2": ("bpe", "starcoder"),
}

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA2_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# Quantized files: (fixture, types). Rows of 64 values: K-quants (256-value blocks) fall back
# to llama-quantize's substitutes for every tensor, so only 32-value block types apply as asked.
QUANTIZED = [("llama", ["Q8_0", "Q4_0", "Q5_1"]), ("qwen2", ["Q8_0", "Q4_1"])]

TOKENIZE_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's 12:45 and we've got 3 apples, 1234567 grains!",
    "  double  spaces\tand tabs\n\nnew lines",
    "<|im_start|>user\nHi<|im_end|>",
    "<start_of_turn>user\nHi<end_of_turn>",
]
CHATS = [
    [{"role": "user", "content": "Hello world"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And the capital of France?"},
    ],
]
PROMPTS = [[7, 170, 167, 34, 70], [1, 2, 3, 200, 100, 50, 25, 12]]
N_PREDICT = 16
N_PROBS = 10


def train_spm(dirp: Path, kind: str):
    gemma = kind == "spm-gemma"
    import sentencepiece as spm

    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    specials = {"spm-gemma": ["<start_of_turn>", "<end_of_turn>"], "spm-phi3": ["<|endoftext|>"]}.get(kind, [])
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_prefix=str(dirp / "tokenizer"),
        vocab_size=250,
        model_type="bpe",
        character_coverage=1.0,
        hard_vocab_limit=False,
        control_symbols=specials,
        minloglevel=2,
        **ids,
    )
    (dirp / "tokenizer.vocab").unlink()
    cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": GEMMA_CHAT if gemma else LLAMA2_CHAT,
        "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer",
    }
    (dirp / "tokenizer_config.json").write_text(json.dumps(cfg))


def train_bpe(dirp: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=specials, initial_alphabet=[], show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tok.save(str(dirp / "tokenizer.json"))
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML,
        "tokenizer_class": "GPT2Tokenizer",
    }
    (dirp / "tokenizer_config.json").write_text(json.dumps(cfg))


def convert(llama_cpp: Path, src: Path, out: Path, pre: str | None):
    # Registers our vocabulary's hash (see the module docstring), then runs the converter as is.
    wrapper = f"""
import sys, runpy
sys.path.insert(0, {str(llama_cpp)!r}); sys.path.insert(1, {str(llama_cpp / 'gguf-py')!r})
import conversion.base as base
pre = {pre!r}
if pre is not None:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py", {str(src)!r}, "--outtype", "f32", "--outfile", {str(out)!r}]
runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name="__main__")
"""
    subprocess.run([sys.executable, "-c", wrapper], check=True, stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def record(bin_dir: Path, gguf: Path) -> dict:
    """llama.cpp's tokenizer ids, chat renderings and greedy runs on one file, from llama-server."""
    port = free_port()
    srv = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
         # f32 KV cache (its default is f16); a context past phi3's original 4096 so that
         # llama.cpp takes the long RoPE factors, as mlx-lm always does.
         "-t", "1", "-c", "8192", "-ctk", "f32", "-ctv", "f32", "--jinja", "-np", "1", "--no-warmup"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                if srv.poll() is not None:
                    raise RuntimeError(f"llama-server cannot load {gguf}")
                time.sleep(0.1)
        out = {"tokenize": [], "chat": [], "greedy": []}
        for t in TOKENIZE_TEXTS:
            for add_special in (False, True):
                try:
                    r = post(port, "/tokenize", {"content": t, "add_special": add_special, "parse_special": True})
                except urllib.error.HTTPError:
                    # llama.cpp fails on a character a SentencePiece vocabulary without byte
                    # tokens lacks (our 256-token ones have none); such texts are not compared.
                    continue
                out["tokenize"].append({"text": t, "add_special": add_special, "ids": r["tokens"]})
        for msgs in CHATS:
            r = post(port, "/apply-template", {"messages": msgs})
            out["chat"].append({"messages": msgs, "prompt": r["prompt"]})
        for p in PROMPTS:
            r = post(port, "/completion", {
                "prompt": p, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1, "n_probs": N_PROBS,
                "cache_prompt": False, "ignore_eos": True, "samplers": ["top_k"], "post_sampling_probs": False,
            })
            steps = [{"id": s["id"], "top": [[t["id"], t["logprob"]] for t in s["top_logprobs"]]}
                     for s in r["completion_probabilities"]]
            out["greedy"].append({"prompt_ids": p, "ids": [s["id"] for s in steps], "steps": steps})
        return out
    finally:
        srv.terminate()
        srv.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the vendored llama.cpp tree")
    ap.add_argument("--bin", type=Path, required=True, help="folder with llama-quantize, llama-server")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    recorded = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, pre) in FAMILIES.items():
            d = Path(tmp) / name
            d.mkdir()
            for f in ("config.json", "model.safetensors"):
                shutil.copy(TINY / name / f, d / f)
            if kind.startswith("spm"):
                train_spm(d, kind)
            else:
                train_bpe(d)
            out = OUT / f"{name}.f32.gguf"
            convert(args.llama_cpp, d, out, pre)
            print(f"{out.relative_to(ROOT)}: {out.stat().st_size} bytes", file=sys.stderr)
            recorded[f"{name}.f32.gguf"] = record(args.bin, out)
        for name, types in QUANTIZED:
            for ty in types:
                out = OUT / f"{name}.{ty}.gguf"
                subprocess.run([str(args.bin / "llama-quantize"), str(OUT / f"{name}.f32.gguf"), str(out), ty, "1"],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                print(f"{out.relative_to(ROOT)}: {out.stat().st_size} bytes", file=sys.stderr)
                recorded[out.name] = record(args.bin, out)
    meta = {"llama_cpp": "llama-server of shared/peers (llama.cpp 0c1e57098), 1 thread, f32 KV cache, greedy, top logprobs",
            "files": recorded}
    (OUT / "llama_cpp.json").write_text(json.dumps(meta) + "\n")


if __name__ == "__main__":
    main()
