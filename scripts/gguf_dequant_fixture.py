#!/usr/bin/env python3
"""Writes the reference fixtures for trellm-quant's dequantizers.

Reference = gguf-python's `gguf.quants.dequantize` (a numpy port of ggml's reference
dequantizers). Run with a venv that has `gguf` and `numpy`:

    /tmp/oracle/bin/python scripts/gguf_dequant_fixture.py \
        --models /tmp/models --out tests/fixtures/gguf_dequant

Output (all little-endian):
  index.json          what every file below is, plus whole-tensor hashes
  <sample>.raw        raw block bytes, exactly as stored in the GGUF (or synthetic)
  <sample>.f32        gguf-python's dequantization of <sample>.raw, as f32

Real samples come from the two models; types the models lack (F16, BF16, Q4_0) and edge-case
scales (negative, zero, subnormal, max fp16) come from seeded synthetic blocks, so the output is
reproducible byte for byte.
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

MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}
SHORT = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2", "gemma-3-270m-q4_k_m.gguf": "gemma3"}

# Values per sample: enough to span many blocks (and, for K types, several super-blocks) while
# keeping the whole fixture directory small.
HEAD_VALUES = {"F32": 512, "F16": 512, "BF16": 512, "Q4_K": 2048, "Q6_K": 2048}
HEAD_DEFAULT = 1024
TAIL_VALUES = {"Q4_K": 1024, "Q6_K": 1024}
TAIL_DEFAULT = 512

# Raw bytes dequantized per step when hashing a whole tensor (bounds memory on big embeddings).
HASH_CHUNK_BYTES = 16 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def dequant(raw: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-python's dequantization of whole blocks of raw bytes, as flat little-endian f32."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if qtype in (T.F32, T.F16):
        # gguf.quants.dequantize views the input in the element dtype for these two.
        elem = np.float32 if qtype == T.F32 else np.float16
        out = gguf.quants.dequantize(raw.view(elem), qtype)
    else:
        out = gguf.quants.dequantize(raw, qtype)
    return np.ascontiguousarray(out, dtype="<f4").reshape(-1)


def tensor_bytes(t) -> np.ndarray:
    return np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)


def full_hash(raw: np.ndarray, qtype: T) -> str:
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
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
        with open(os.path.join(self.out_dir, sid + ".raw"), "wb") as f:
            f.write(raw.tobytes())
        with open(os.path.join(self.out_dir, sid + ".f32"), "wb") as f:
            f.write(expected.tobytes())
        self.samples.append(
            {
                "id": sid,
                "type": qtype.name,
                "type_id": int(qtype),
                "n_blocks": raw.size // block_bytes,
                "n_values": int(expected.size),
                "raw": sid + ".raw",
                "f32": sid + ".f32",
                **meta,
            }
        )


def real_samples(w: Writer, models_dir: str) -> tuple[list[dict], list[dict]]:
    models, tensors = [], []
    for fname, want_sha in MODELS.items():
        path = os.path.join(models_dir, fname)
        got_sha = sha256_file(path)
        if got_sha != want_sha:
            sys.exit(f"{path}: sha256 {got_sha}, expected {want_sha}")
        reader = gguf.GGUFReader(path)
        counts = Counter(t.tensor_type.name for t in reader.tensors)
        models.append({"file": fname, "sha256": want_sha, "type_counts": dict(sorted(counts.items()))})

        by_type: dict[T, list] = {}
        for t in reader.tensors:
            by_type.setdefault(t.tensor_type, []).append(t)

        for qtype, ts in sorted(by_type.items()):
            block_len, block_bytes = GGML_QUANT_SIZES[qtype]
            # The first and last tensor of each type: two different tensors where there are two.
            picks = [("head", ts[0])] + ([("tail", ts[-1])] if len(ts) > 1 else [])
            for where, t in picks:
                raw = tensor_bytes(t)
                assert raw.size == t.n_bytes
                with open(path, "rb") as f:
                    f.seek(t.data_offset)
                    assert f.read(64) == raw[:64].tobytes(), "data_offset does not match reader data"
                n_values = (HEAD_VALUES if where == "head" else TAIL_VALUES).get(
                    qtype.name, HEAD_DEFAULT if where == "head" else TAIL_DEFAULT
                )
                n_blocks = min(n_values // block_len, raw.size // block_bytes)
                start = 0 if where == "head" else raw.size - n_blocks * block_bytes
                sid = f"{SHORT[fname]}.{qtype.name.lower()}.{t.name}.{where}"
                w.sample(
                    sid,
                    qtype,
                    raw[start : start + n_blocks * block_bytes],
                    source="model",
                    model=fname,
                    tensor=t.name,
                    byte_offset=int(start),
                )
                tensors.append(
                    {
                        "model": fname,
                        "model_sha256": want_sha,
                        "name": t.name,
                        "type": qtype.name,
                        "type_id": int(qtype),
                        # ggml order: shape[0] is the contiguous row length.
                        "shape": [int(x) for x in t.shape],
                        "n_elements": int(t.n_elements),
                        "n_bytes": int(t.n_bytes),
                        # Absolute offset of the tensor data in the file.
                        "data_offset": int(t.data_offset),
                        "dequant_sha256": full_hash(raw, qtype),
                    }
                )
                print(f"{fname}: {t.name} {qtype.name} {list(map(int, t.shape))}", file=sys.stderr)
    return models, tensors


# Scale values that real files rarely hold but the decoders must get right.
EDGE_F16 = np.array(
    [0.0, -0.0, 2.0**-24, -(2.0**-24), 1023 * 2.0**-24, 2.0**-14, 65504.0, -65504.0, 1.0, -0.5],
    dtype=np.float16,
)


def fp16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite fp16 scales: the edge cases first, then random magnitudes of both signs."""
    rand = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 8, n))).astype(np.float16)
    rand[~np.isfinite(rand)] = np.float16(1.0)
    out = np.concatenate([EDGE_F16, rand])[:n]
    return out.view(np.uint8).reshape(n, 2)


def synthetic_samples(w: Writer) -> None:
    rng = np.random.default_rng(20240521)

    # F16 / BF16: every special class, then random bit patterns.
    f16_special = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x7C00, 0xFC00,
                            0x7E00, 0x7C01, 0xFFFF], dtype="<u2")
    f16 = np.concatenate([f16_special, rng.integers(0, 1 << 16, 512 - f16_special.size, dtype=np.uint16)])
    w.sample("synthetic.f16.bits", T.F16, f16.astype("<u2").view(np.uint8), source="synthetic")

    bf16_special = np.array([0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0x7F80, 0xFF80,
                             0x7FC0, 0x7F81, 0xFFFF], dtype="<u2")
    bf16 = np.concatenate([bf16_special, rng.integers(0, 1 << 16, 512 - bf16_special.size, dtype=np.uint16)])
    w.sample("synthetic.bf16.bits", T.BF16, bf16.astype("<u2").view(np.uint8), source="synthetic")

    # F32 bit patterns, NaN payloads included: the decoder must pass them through untouched.
    f32 = rng.integers(0, 1 << 32, 256, dtype=np.uint32)
    f32[:6] = [0x00000000, 0x80000000, 0x00000001, 0x7F800000, 0x7FC00001, 0xFF800001]
    w.sample("synthetic.f32.bits", T.F32, f32.astype("<u4").view(np.uint8), source="synthetic")

    # Q4_0 as a real converter writes it: gguf-python's quantizer on Gaussian data.
    x = (rng.standard_normal((16, 64)) * 0.05).astype(np.float32)
    x[3] *= 1e-4  # tiny scales: fp16 subnormal territory
    w.sample("synthetic.q4_0.quantized", T.Q4_0, gguf.quants.quantize(x, T.Q4_0), source="synthetic")

    # Random payload bytes with edge-case scales, for every block type we decode.
    for qtype, n_blocks, scale_offsets in [
        (T.Q4_0, 16, [0]),
        (T.Q4_1, 16, [0, 2]),
        (T.Q5_0, 16, [0]),
        (T.Q8_0, 16, [0]),
        (T.Q4_K, 4, [0, 2]),
        (T.Q6_K, 4, [208]),
    ]:
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for k, off in enumerate(scale_offsets):
            scales = fp16_scales(rng, n_blocks)
            if k:
                scales = scales[::-1]  # pair different edge cases in the two-scale types
            blocks[:, off : off + 2] = scales
        w.sample(f"synthetic.{qtype.name.lower()}.edge", qtype, blocks, source="synthetic")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "gguf_dequant"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        if f.endswith((".raw", ".f32")) or f == "index.json":
            os.remove(os.path.join(args.out, f))

    w = Writer(args.out)
    models, tensors = real_samples(w, args.models)
    synthetic_samples(w)
    index = {
        "generator": "scripts/gguf_dequant_fixture.py",
        "reference": f"gguf-python {importlib.metadata.version('gguf')} gguf.quants.dequantize, "
        f"numpy {np.__version__}",
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
