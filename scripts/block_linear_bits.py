#!/usr/bin/env python3
"""Bits per block-linear weight, counted the same way for GGUF files and EXL3 folders: everything a
format stores for the transformer blocks' linear weights (q, k, v, o, gate, up, down: GGUF blocks
with their scales; EXL3 trellis + suh + svh + codebook marker) over the model's own count of those
weights (no padding). The embedding and the head are reported beside, as each format stores them.

    scripts/block_linear_bits.py FILE.gguf|EXL3_FOLDER ...
prints one line per path: path, block-linear bits per weight, embedding MB, head MB, file MB.
No third-party packages: the GGUF tensor table and safetensors headers are read directly."""
import json, os, re, struct, sys

# ggml type -> (bytes per block, values per block)
GGML = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
        9: (36, 32), 10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256),
        15: (292, 256), 16: (66, 256), 17: (74, 256), 18: (98, 256), 19: (50, 256), 20: (18, 32),
        21: (110, 256), 22: (56, 256), 23: (136, 256), 29: (8, 1), 30: (2, 1)}
GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|attn_qkv|ffn_gate|ffn_up|ffn_down)\.weight$")
HF_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.")


def gguf_tensors(path):
    f = open(path, "rb")
    u32 = lambda: struct.unpack("<I", f.read(4))[0]
    u64 = lambda: struct.unpack("<Q", f.read(8))[0]
    s = lambda: f.read(u64()).decode("utf-8", "replace")
    size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t):
        if t in size:
            f.seek(size[t], 1)
        elif t == 8:
            s()
        elif t == 9:
            et, n = u32(), u64()
            if et in size:
                f.seek(size[et] * n, 1)
            else:
                for _ in range(n):
                    skip(et)
        else:
            raise ValueError(f"GGUF value type {t}")

    assert f.read(4) == b"GGUF", path
    u32()
    nt, nkv = u64(), u64()
    for _ in range(nkv):
        s()
        skip(u32())
    out = []
    for _ in range(nt):
        name = s()
        dims = [u64() for _ in range(u32())]
        ty = u32()
        u64()
        n = 1
        for d in dims:
            n *= d
        bb, bv = GGML[ty]
        out.append((name, n, n // bv * bb))
    return out


def gguf(path):
    lin_bits = lin_n = emb = head = 0
    for name, n, nbytes in gguf_tensors(path):
        if GGUF_LINEAR.search(name):
            lin_bits += 8 * nbytes
            lin_n += n
        elif name == "token_embd.weight":
            emb = nbytes
        elif name == "output.weight":
            head = nbytes
    return lin_bits / lin_n, emb, head


def folder(path):
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg = cfg.get("text_config", cfg)
    h, ff, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    lin_n = L * (2 * nh * hd * h + 2 * kv * hd * h + 3 * ff * h)
    lin_bits = emb = head = 0
    for fn in sorted(os.listdir(path)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(path, fn), "rb") as f:
            hdr = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, t in hdr.items():
            if name == "__metadata__":
                continue
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
            if HF_LINEAR.match(name):
                lin_bits += 8 * nbytes
            elif name.startswith("model.embed_tokens."):
                emb += nbytes
            elif name.startswith("lm_head."):
                head += nbytes
    return lin_bits / lin_n, emb, head


def size(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


for p in sys.argv[1:]:
    bits, emb, head = folder(p) if os.path.isdir(p) else gguf(p)
    print(f"{p}\t{bits:.3f} bits/block-linear weight\tembedding {emb / 1e6:.1f} MB\thead {head / 1e6:.1f} MB\tweights {size(p) / 1e6:.1f} MB")
