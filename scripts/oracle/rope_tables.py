#!/usr/bin/env python3
"""RoPE fixtures from mlx: for every variant mlx-lm builds, the frequency table it computes and
the vectors its rope module produces, which `crates/trellm/tests/rope_tables.rs` requires trellm
to reproduce bit for bit.

Writes tests/fixtures/rope/<name>.json:
  {"oracle": "mlx-lm X, mlx Y, CPU", "name", "builder": "initialize_rope" | "phi3" | "nope",
   "args": {...the builder's inputs...}, "head_dim",
   "freqs": [float32 bits] or null        (the module's `_freqs`, where it has one),
   "cases": [{"offset", "len", "input": [float32 bits], "output": [float32 bits]}]}
Each case runs the module on x of shape [1, 1, len, head_dim] at `offset` (positions
offset..offset+len). The first case's input is a pattern of unit vectors, so its output holds
mlx's cos and sin themselves; the others are seeded random normals.

Run (from the repository root, CPU only, a second):
    /tmp/oracle/bin/python scripts/oracle/rope_tables.py [--out tests/fixtures/rope]
"""
import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import phi3
from mlx_lm.models.rope_utils import initialize_rope

LONG = [1.0 + 0.25 * i for i in range(16)]  # 16 pairs: head_dim 32

VARIANTS = [
    # name, builder, args, head_dim
    ("default", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False, "scaling": None, "max_positions": 2048}, 32),
    ("default-traditional", "initialize_rope",
     {"dims": 32, "base": 500000.0, "traditional": True, "scaling": None, "max_positions": None}, 32),
    ("partial", "initialize_rope",
     {"dims": 16, "base": 10000.0, "traditional": False, "scaling": None, "max_positions": None}, 40),
    ("linear", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False,
      "scaling": {"type": "linear", "factor": 3.0}, "max_positions": 2048}, 32),
    ("dynamic", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False,
      "scaling": {"type": "dynamic", "factor": 2.5}, "max_positions": 64}, 32),
    ("llama3", "initialize_rope",
     {"dims": 64, "base": 500000.0, "traditional": False,
      "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
      "max_positions": 131072}, 64),
    ("llama3-small-context", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": True,
      "scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                  "high_freq_factor": 8.0, "original_max_position_embeddings": 256},
      "max_positions": 1024}, 32),
    ("yarn", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False,
      "scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 32, "beta_slow": 1},
      "max_positions": 2048}, 32),
    ("deepseek_yarn", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": True,
      "scaling": {"type": "deepseek_yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
      "max_positions": 163840}, 48),
    ("telechat3-yarn", "initialize_rope",
     {"dims": 32, "base": 1000000.0, "traditional": False,
      "scaling": {"rope_type": "telechat3-yarn", "factor": 8.0,
                  "original_max_position_embeddings": 8192, "mscale": 0.8},
      "max_positions": 65536}, 32),
    ("longrope", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False,
      "scaling": {"type": "longrope", "original_max_position_embeddings": 4096,
                  "short_factor": [1.0] * 16, "long_factor": LONG},
      "max_positions": 131072}, 32),
    ("proportional", "initialize_rope",
     {"dims": 32, "base": 10000.0, "traditional": False,
      "scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0},
      "max_positions": None}, 32),
    ("phi3-su", "phi3",
     {"hidden_size": 128, "num_attention_heads": 4, "partial_rotary_factor": 1.0,
      "rope_theta": 10000.0, "max_position_embeddings": 131072,
      "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su", "short_factor": [1.0] * 16, "long_factor": LONG}}, 32),
    ("phi3-partial-longrope", "phi3",
     {"hidden_size": 128, "num_attention_heads": 2, "partial_rotary_factor": 0.5,
      "rope_theta": 250000.0, "max_position_embeddings": 32768,
      "original_max_position_embeddings": 8192,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": LONG[::-1]}},
     64),
    ("phi3-plain", "phi3",
     {"hidden_size": 128, "num_attention_heads": 4, "partial_rotary_factor": 0.75,
      "rope_theta": 10000.0, "max_position_embeddings": 4096,
      "original_max_position_embeddings": 4096, "rope_scaling": None}, 32),
    ("nope", "nope", {}, 32),
]

# (offset, len): the first uses unit vectors; positions reach past every context length above
# (dynamic's 64 included, so its base changes between cases).
CASES = [(0, 4), (7, 1), (60, 8), (1000, 2), (40000, 2), (140000, 1)]


def bits(a) -> list:
    return np.asarray(a, dtype=np.float32).reshape(-1).view(np.uint32).tolist()


def build(builder, a):
    if builder == "initialize_rope":
        return initialize_rope(a["dims"], a["base"], a["traditional"], a["scaling"],
                               a["max_positions"])
    if builder == "phi3":
        cfg = {"model_type": "phi3", "num_hidden_layers": 1, "intermediate_size": 8,
               "rms_norm_eps": 1e-5, "vocab_size": 8, **a}
        return phi3.Attention(phi3.ModelArgs.from_dict(cfg)).rope
    if builder == "nope":
        return lambda x, offset=0: x
    raise ValueError(builder)


def unit_pattern(n, d):
    """Even rows: 1 in the first half (each half-split pair's x1); odd rows: 1 at even indices
    (each traditional pair's x1). Where a pair is (1, 0) the output is exactly (cos, sin)."""
    x = np.zeros((n, d), np.float32)
    for t in range(n):
        if t % 2 == 0:
            x[t, : d // 2] = 1.0
        else:
            x[t, 0::2] = 1.0
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/rope")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(4)
    for name, builder, args, head_dim in VARIANTS:
        rope = build(builder, args)
        freqs = getattr(rope, "_freqs", None)
        cases = []
        for i, (offset, n) in enumerate(CASES):
            x = unit_pattern(n, head_dim) if i == 0 else \
                rng.standard_normal((n, head_dim)).astype(np.float32)
            y = rope(mx.array(x)[None, None], offset=offset)
            y = np.array(y.astype(mx.float32)).reshape(n, head_dim)
            cases.append({"offset": offset, "len": n, "input": bits(x), "output": bits(y)})
        doc = {"oracle": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, CPU",
               "name": name, "builder": builder, "args": args, "head_dim": head_dim,
               "freqs": None if freqs is None else bits(freqs), "cases": cases}
        (out / f"{name}.json").write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        print(f"{name}: {len(cases)} cases, freqs {'yes' if freqs is not None else 'no'}")


if __name__ == "__main__":
    main()
