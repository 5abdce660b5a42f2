"""Writes a Hugging Face llama folder with random bf16 weights (config.json + model.safetensors),
for serving runs on a machine that cannot download a model. Usage: synthetic_hf.py DIR
[--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 --vocab 49152]. Needs torch.
"""
import argparse
import json
import os
import struct

import torch

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--heads", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--ffn", type=int, default=8192)
ap.add_argument("--vocab", type=int, default=49152)
a = ap.parse_args()
os.makedirs(a.dir, exist_ok=True)
hd = a.hidden // a.heads
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": a.hidden, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
    "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "vocab_size": a.vocab,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
json.dump(config, open(os.path.join(a.dir, "config.json"), "w"), indent=1)

shapes = {"model.embed_tokens.weight": (a.vocab, a.hidden), "model.norm.weight": (a.hidden,),
          "lm_head.weight": (a.vocab, a.hidden)}
for i in range(a.layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (a.hidden,), p + "post_attention_layernorm.weight": (a.hidden,),
        p + "self_attn.q_proj.weight": (a.heads * hd, a.hidden),
        p + "self_attn.k_proj.weight": (a.kv_heads * hd, a.hidden),
        p + "self_attn.v_proj.weight": (a.kv_heads * hd, a.hidden),
        p + "self_attn.o_proj.weight": (a.hidden, a.heads * hd),
        p + "mlp.gate_proj.weight": (a.ffn, a.hidden), p + "mlp.up_proj.weight": (a.ffn, a.hidden),
        p + "mlp.down_proj.weight": (a.hidden, a.ffn),
    })
header, offset = {}, 0
for name, shape in shapes.items():
    n = 2
    for d in shape:
        n *= d
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
g = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
with open(os.path.join(a.dir, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=g.device) * 0.02).to(torch.bfloat16).cpu()
        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
print(a.dir, offset / 1e9, "GB")
