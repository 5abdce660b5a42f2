#!/usr/bin/env python3
"""Writes the reference fixtures for the block types beyond the two cached models' own
(tests/fixtures/gguf_quant_types): Q5_1, Q2_K, Q3_K, Q5_K, Q8_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S.

Reference = gguf-python's `gguf.quants.dequantize` (a numpy port of ggml's reference
dequantizers). gguf-python has no Q8_K; its reference here is the format's definition
(`d * q`, f32 times int8, one rounding) in numpy.

Real samples come from GGUFs that llama.cpp's llama-quantize wrote from a real model
(`make_quant_ggufs.sh`); synthetic ones are seeded random blocks with edge-case scales. Run with
a Python that has `gguf` and `numpy`:

    crates/quant/scripts/make_quant_ggufs.sh $BIN SmolLM2-135M-Instruct.Q4_1.gguf \\
        wikitext-2-raw-test.raw /tmp/qggufs
    python3 crates/quant/scripts/gguf_quant_types_fixture.py --ggufs /tmp/qggufs

Output (little-endian): index.json, and per sample <id>.raw (block bytes as stored) and <id>.f32
(the reference's decoding). The index also holds each sampled tensor's whole-tensor hash, which
tests/reference_quant_types.rs checks when TRELLM_QUANT_GGUFS points at the GGUF folder.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
from collections import Counter

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

# In this order: each file's own type is sampled from it before a later file's fallbacks.
FILES = [
    "smollm2.Q5_1.gguf",
    "smollm2.IQ4_NL.gguf",
    "smollm2.Q5_K_S.gguf",
    "smollm2.Q3_K_S.gguf",
    "smollm2.Q2_K.gguf",
    "smollm2.IQ4_XS.gguf",
    "smollm2.IQ3_S.gguf",
    "smollm2.IQ3_XXS.gguf",
    "smollm2.IQ2_M.gguf",
    "smollm2.IQ2_XS.gguf",
    "smollm2.IQ2_XXS.gguf",
]
NEW = [T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q8_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S,
       T.IQ3_XXS, T.IQ3_S]
# Also sampled: Q4_0, the K-quants' fallback here, of which the other fixture set has no real
# blocks (F32, the files' other type, it has).
SAMPLED = NEW + [T.Q4_0]
VALUES_PER_SAMPLE = 1024
HASH_CHUNK_BYTES = 16 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def dequant(raw: np.ndarray, qtype: T) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if qtype == T.Q8_K:
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[T.Q8_K][1])
        d = blocks[:, :4].copy().view("<f4")
        q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
        with np.errstate(over="ignore"):  # a scale near f32's max overflows to inf, as in ggml
            out = d * q
    else:
        out = gguf.quants.dequantize(raw, qtype)
    return np.ascontiguousarray(out, dtype="<f4").reshape(-1)


def full_hash(raw: np.ndarray, qtype: T) -> str:
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    step = max(1, HASH_CHUNK_BYTES // block_bytes) * block_bytes
    h = hashlib.sha256()
    for start in range(0, raw.size, step):
        h.update(dequant(raw[start : start + step], qtype).tobytes())
    return h.hexdigest()


class Writer:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.samples: list[dict] = []

    def sample(self, sid: str, qtype: T, raw: np.ndarray, **meta) -> None:
        block_len, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        assert raw.size % block_bytes == 0, (sid, raw.size)
        expected = dequant(raw, qtype)
        assert expected.size == raw.size // block_bytes * block_len
        for ext, data in ((".raw", raw), (".f32", expected)):
            with open(os.path.join(self.out_dir, sid + ext), "wb") as f:
                f.write(data.tobytes())
        self.samples.append({
            "id": sid,
            "type": qtype.name,
            "type_id": int(qtype),
            "n_blocks": raw.size // block_bytes,
            "n_values": int(expected.size),
            "raw": sid + ".raw",
            "f32": sid + ".f32",
            **meta,
        })


def real_samples(w: Writer, gguf_dir: str) -> tuple[list[dict], list[dict]]:
    models, tensors, taken = [], [], set()
    for fname in FILES:
        path = os.path.join(gguf_dir, fname)
        reader = gguf.GGUFReader(path)
        by_type: dict[T, list] = {}
        for t in reader.tensors:
            by_type.setdefault(t.tensor_type, []).append(t)
        fresh = [q for q in by_type if q in SAMPLED and q not in taken]
        if not fresh:
            continue
        sha = sha256_file(path)
        counts = Counter(t.tensor_type.name for t in reader.tensors)
        models.append({"file": fname, "sha256": sha, "type_counts": dict(sorted(counts.items()))})
        for qtype in fresh:
            taken.add(qtype)
            ts = by_type[qtype]
            block_len, block_bytes = GGML_QUANT_SIZES[qtype]
            # The first tensor's head and the last one's tail.
            for where, t in [("head", ts[0]), ("tail", ts[-1])]:
                raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
                assert raw.size == t.n_bytes
                with open(path, "rb") as f:
                    f.seek(t.data_offset)
                    assert f.read(64) == raw[:64].tobytes(), "data_offset does not match"
                n_blocks = min(VALUES_PER_SAMPLE // block_len, raw.size // block_bytes)
                start = 0 if where == "head" else raw.size - n_blocks * block_bytes
                w.sample(f"smollm2.{qtype.name.lower()}.{t.name}.{where}", qtype,
                         raw[start : start + n_blocks * block_bytes], source="model",
                         model=fname, tensor=t.name, byte_offset=int(start))
                if any(x["model"] == fname and x["name"] == t.name for x in tensors):
                    continue
                tensors.append({
                    "model": fname,
                    "model_sha256": sha,
                    "name": t.name,
                    "type": qtype.name,
                    "type_id": int(qtype),
                    "shape": [int(x) for x in t.shape],
                    "n_elements": int(t.n_elements),
                    "n_bytes": int(t.n_bytes),
                    "data_offset": int(t.data_offset),
                    "dequant_sha256": full_hash(raw, qtype),
                })
                print(f"{fname}: {t.name} {qtype.name} {list(map(int, t.shape))}", file=sys.stderr)
    return models, tensors


EDGE_F16 = np.array(
    [0.0, -0.0, 2.0**-24, -(2.0**-24), 1023 * 2.0**-24, 2.0**-14, 65504.0, -65504.0, 1.0, -0.5],
    dtype=np.float16,
)
EDGE_F32 = np.array(
    [0.0, -0.0, 1e-45, -1e-45, 2.0**-126, 1.1754942e-38, 3.0e38, -3.0e38, 1.0, -0.3333333],
    dtype="<f4",
)


def fp16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    rand = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 8, n))).astype(np.float16)
    rand[~np.isfinite(rand)] = np.float16(1.0)
    return np.concatenate([EDGE_F16, rand])[:n].view(np.uint8).reshape(n, 2)


def synthetic_samples(w: Writer) -> None:
    rng = np.random.default_rng(20261201)
    # Random payload bytes (every grid index and sign pattern is valid) with edge-case scales.
    for qtype, n_blocks, scale_offsets in [
        (T.Q5_1, 16, [0, 2]),
        (T.IQ4_NL, 16, [0]),
        (T.Q2_K, 10, [80, 82]),
        (T.Q3_K, 10, [108]),
        (T.Q5_K, 10, [0, 2]),
        (T.IQ4_XS, 10, [0]),
        (T.IQ2_XXS, 10, [0]),
        (T.IQ2_XS, 10, [0]),
        (T.IQ2_S, 10, [0]),
        (T.IQ3_XXS, 10, [0]),
        (T.IQ3_S, 10, [0]),
    ]:
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for k, off in enumerate(scale_offsets):
            scales = fp16_scales(rng, n_blocks)
            if k:
                scales = scales[::-1]
            blocks[:, off : off + 2] = scales
        w.sample(f"synthetic.{qtype.name.lower()}.edge", qtype, blocks, source="synthetic")
    # Q8_K: llama.cpp uses it for activations only, so no tool writes it into a file.
    blocks = rng.integers(0, 256, (10, GGML_QUANT_SIZES[T.Q8_K][1]), dtype=np.uint8)
    blocks[:, :4] = EDGE_F32.view(np.uint8).reshape(10, 4)
    w.sample("synthetic.q8_k.edge", T.Q8_K, blocks, source="synthetic")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggufs", default="/tmp/qggufs")
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "gguf_quant_types"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        if f.endswith((".raw", ".f32")) or f == "index.json":
            os.remove(os.path.join(args.out, f))
    w = Writer(args.out)
    models, tensors = real_samples(w, args.ggufs)
    synthetic_samples(w)
    index = {
        "generator": "crates/quant/scripts/gguf_quant_types_fixture.py",
        "reference": f"gguf-python {importlib.metadata.version('gguf')} gguf.quants.dequantize "
        f"(Q8_K: numpy d * q), numpy {np.__version__}",
        "quantizer": "llama.cpp llama-quantize (crates/quant/scripts/make_quant_ggufs.sh) from "
        "SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)",
        "byte_order": "little-endian",
        "models": models,
        "tensors": tensors,
        "samples": w.samples,
    }
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"{len(w.samples)} samples, {len(tensors)} tensors, {total} bytes in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
