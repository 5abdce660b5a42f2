#!/usr/bin/env python3
"""exllamav3 1.6.5's default calibration corpus as token rows for `trellm quantize --calibration`.

    python3 scripts/exllamav3_calibration.py WHEEL MODEL_DIR OUT.safetensors [--rows 250] [--cols 2048]

WHEEL is exllamav3's wheel (`pip download --no-deps exllamav3==1.6.5`); its bundled texts
(`exllamav3/conversion/standard_cal_data/*.utf8`) are read from the wheel at run time and never
stored here. MODEL_DIR holds the model's `tokenizer.json` and `config.json` (for a GGUF source,
the folder `trellm quantize` dequantizes it into: OUT/.source). Needs the `tokenizers` and
`numpy` packages.

The mix follows exllamav3's `get_default_calibration` as documented there: per source a share
of the rows by weight (c4 20, code 20, multilingual 10, technical 10, wiki 50, tiny 5, random
20), texts cut into articles (lines shuffled with Python's `random.seed(0)`, wiki documents,
tiny stories) and packed into rows with BOS/EOS around each article on every other row, or
tokenized whole and cut (code, technical). One difference: exllamav3 draws its random rows
with torch's generator, this script with numpy's (`default_rng(0)`): uniform ids all the same.
Writes `input_ids` (I64, [rows, cols], zero-padded) and `lengths` (I64, [rows]).
"""

import argparse
import json
import random
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# (file, weight, how it is cut); the random rows take what the others leave.
SOURCES = [
    ("c4.utf8", 20, "lines"),
    ("code.utf8", 20, "raw"),
    ("multilingual.utf8", 10, "lines"),
    ("technical.utf8", 10, "raw"),
    ("wiki.utf8", 50, "wiki"),
    ("tiny.utf8", 5, "tiny"),
    (None, 20, "random"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=250)
    ap.add_argument("--cols", type=int, default=2048)
    a = ap.parse_args()

    model = Path(a.model_dir)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    # Special-token strings in the texts are text, and no template adds BOS: as exllamav3 encodes.
    tok.encode_special_tokens = True
    cfg = json.loads((model / "config.json").read_text())
    bos, eos = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = 1 + max(tok.get_vocab(with_added_tokens=True).values())

    def encode(text, ends=False):
        ids = tok.encode(text, add_special_tokens=False).ids
        if ends:
            ids = ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
        return ids

    def pack(articles, rows):
        # Articles appended to the row until it is full; what overflows a full row is dropped.
        out, row, i = [], [], 0
        while len(out) < rows:
            row = (row + encode(articles[i % len(articles)], ends=len(out) % 2 == 0))[: a.cols]
            if len(row) == a.cols:
                out.append(row)
                row = []
            i += 1
        return out

    with zipfile.ZipFile(a.wheel) as wheel:
        def text(name):
            return wheel.read(f"exllamav3/conversion/standard_cal_data/{name}").decode("utf8")

        total = sum(w for _, w, _ in SOURCES)
        rows = []
        for name, weight, how in SOURCES:
            n = max(1, int(weight / total * a.rows))
            if how == "random":
                n = max(1, a.rows - len(rows))
                rng = np.random.default_rng(0)
                rows += [list(rng.integers(0, vocab, a.cols)) for _ in range(n)]
            elif how == "raw":
                ids = encode(text(name))
                rows += [ids[i * a.cols:(i + 1) * a.cols] for i in range(n)]
            elif how == "lines":
                lines = [t for t in text(name).split("\n") if not t.isspace()]
                random.seed(0)
                random.shuffle(lines)
                rows += pack(lines, n)
            elif how == "wiki":
                docs = [d[d.find("\n") + 1:] for d in text(name).split("</doc>\n")]
                rows += pack([d for d in docs if len(d) > 50], n)
            elif how == "tiny":
                rows += pack([t.strip() for t in text(name).split("<|endoftext|>")], n)
            print(f"{name or 'random'}: {n} rows", file=sys.stderr)

    rows = [r for r in rows if r]
    ids = np.zeros((len(rows), a.cols), dtype="<i8")
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], dtype="<i8")
    write_safetensors(a.out, {"input_ids": ids, "lengths": lengths})
    print(f"{a.out}: {len(rows)} rows, {int(lengths.sum())} tokens, vocab {vocab}", file=sys.stderr)


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        b = t.tobytes()
        header[name] = {"dtype": "I64", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


if __name__ == "__main__":
    main()
