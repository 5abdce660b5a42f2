#!/usr/bin/env python3
"""exllamav3 1.6.5 as a side-by-side peer on the GPU machine (issue 15). Run by scripts/gpu/run_exllamav3.sh
with the folder from scripts/gpu/prep_exllamav3_peer.sh carried. Each part runs on its own (a failure prints
its traceback and the next part runs). Results: one JSON object a line in $OUT/exl3peer.jsonl; exllamav3's
logits and dequantized weights in $OUT/exl3peer_tensors.safetensors (EXL3PEER_TENSORS=0: none).

(B) Viterbi speed: exllamav3's CUDA tile quantizer (exllamav3.modules.quant.exl3_lib.quantize.quantize_tiles,
    the wrapper its LDLQ calls; MUL1 codebook, K = 1..8) on the carried seeded Gaussian tiles (unit variance, as
    its regularized weights are; i.i.d. values, so the tensor-core element order it permutes into is moot).
    Timed as crates/cuda/tests/gpu_viterbi.rs `throughput` times ours: 16 waves of 132 blocks x tiles-per-block
    tiles (1 a block below K = 6, 2^(K-6) above), a one-tile warm call first, then host->device copy + kernel +
    download of the indices; best of REPS. Also kernel-only (tiles resident, CUDA events) on TILES_BIG tiles,
    and the mean squared error of its reconstruction per K.
(A) Compatibility: exllamav3 loads each carried folder (our quantizer's, and the fp16 source model as its fp16
    noise baseline), runs the token chunks stored in trellm's logits file (trellm eval --save-logits: no BOS for
    this tokenizer, tokens as stored), and its log-probabilities at the scored positions are compared with
    trellm's (CPU, f32; stored at 16/65535-nat resolution, tokens within 16 nats of the top).
"""
import argparse, hashlib, json, os, struct, subprocess, sys, time, traceback

ap = argparse.ArgumentParser()
ap.add_argument("--peer", default=".device/peer")
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/exl3peer-out"))
ap.add_argument("--parts", default=os.environ.get("EXL3PEER_PARTS", "info,B,A"))
ap.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "3")))
ap.add_argument("--sms", type=int, default=0, help="blocks a wave (default: the GPU's SM count, 132 on the H200)")
ap.add_argument("--tiles-big", type=int, default=int(os.environ.get("TILES_BIG", "8448")))
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
JL = open(os.path.join(a.out, "exl3peer.jsonl"), "a")
TENSORS = {}


def emit(**kw):
    line = json.dumps(kw)
    print(line, flush=True)
    JL.write(line + "\n")
    JL.flush()


def part(name, fn):
    if name not in a.parts.split(","):
        return
    t = time.time()
    print(f"== part {name}", flush=True)
    try:
        fn()
    except Exception:
        tb = traceback.format_exc()
        print(tb, flush=True)
        emit(part=name, error=tb[-2000:])
    print(f"== part {name} done in {time.time() - t:.1f}s", flush=True)


import numpy as np
import torch

ext = None


def info():
    global ext
    import importlib.metadata as md
    vers = {}
    for p in ("torch", "numpy", "safetensors", "tokenizers", "pydantic", "marisa-trie", "exllamav3", "ninja",
              "typing_extensions", "rich", "pyyaml", "pillow"):
        try:
            vers[p] = md.version(p)
        except Exception as e:
            vers[p] = f"missing ({e.__class__.__name__})"
    emit(part="info", versions=vers, gpu=torch.cuda.get_device_name(0), sms=torch.cuda.get_device_properties(0).multi_processor_count,
         cuda=torch.version.cuda, arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"))
    t = time.time()
    from exllamav3.ext import exllamav3_ext as e
    ext = e
    emit(part="info", ext_build_or_load_s=round(time.time() - t, 1), ext_functions=len(dir(ext)),
         quantize_fns=[n for n in dir(ext) if "quant" in n or "trellis" in n])


def viterbi_speed():
    global ext
    if ext is None:
        from exllamav3.ext import exllamav3_ext as e
        ext = e
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_tiles
    sms = a.sms or torch.cuda.get_device_properties(0).multi_processor_count
    path = os.path.join(a.peer, "tiles.npy")
    if os.path.exists(path):
        tiles = np.load(path)
        src = "tiles.npy"
    else:  # prep_exllamav3_peer.sh's generator, when the file was left behind to save transfer
        tiles = np.random.default_rng(15).standard_normal((8448, 256), dtype=np.float32)
        src = "regenerated default_rng(15)"
    emit(part="B", tiles_source=src, tiles_shape=list(tiles.shape), sha256=hashlib.sha256(tiles.tobytes()).hexdigest(),
         mean=float(tiles.mean()), var=float(tiles.var()))
    dev = torch.device("cuda:0")
    for cb in os.environ.get("CODEBOOKS", "mul1").split(","):
        qa = {"mul1": {"mul1": True}, "mcg": {"mcg": True}, "3inst": {}}[cb]
        for k in range(1, 9):
            try:
                args = dict(qa, K=k)
                try:
                    optimized, wave = ext.quantize_tiles_scratch(0, k, cb == "mcg", cb == "mul1", 256)
                except Exception as e:
                    optimized, wave = None, repr(e)
                per_block = 1 << (k - 6) if k >= 6 else 1
                n = sms * per_block * 16
                need = max(n, a.tiles_big)
                reps = -(-need // len(tiles))
                host = torch.from_numpy(np.ascontiguousarray(np.tile(tiles, (reps, 1))[:need]))
                h = host[:n].contiguous()
                quantize_tiles(h[:1].to(dev), args)  # warm: temp buffers, autotune, lazy loads
                torch.cuda.synchronize()
                best, times = None, []
                for _ in range(a.reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    d = h.to(dev)
                    qw, qi = quantize_tiles(d, args)
                    idx = qi.cpu()
                    s = time.perf_counter() - t0
                    times.append(s)
                    best = s if best is None or s < best else best
                mse = float(((qw.cpu().double() - h.double()) ** 2).mean())
                # Kernel only, on TILES_BIG resident tiles.
                big = host[:a.tiles_big].to(dev)
                quantize_tiles(big[:1], args)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                qwb, _ = quantize_tiles(big, args)
                e1.record()
                torch.cuda.synchronize()
                kb = e0.elapsed_time(e1) / 1e3
                mse_big = float(((qwb.double() - big.double()) ** 2).mean())
                emit(part="B", test="exllamav3_viterbi_throughput", codebook=cb, k=k, tiles=n,
                     seconds=round(best, 5), seconds_all=[round(x, 5) for x in times], tiles_per_s=round(n / best, 1),
                     mse=mse, kernel_tiles=a.tiles_big, kernel_seconds=round(kb, 5),
                     kernel_tiles_per_s=round(a.tiles_big / kb, 1), mse_kernel_tiles=mse_big,
                     optimized_kernel=optimized, wave=wave, idx_dtype=str(idx.dtype))
                del qw, qi, qwb, big, d
            except Exception:
                tb = traceback.format_exc()
                print(tb, flush=True)
                emit(part="B", codebook=cb, k=k, error=tb[-1500:])


def read_logits_file(path):
    b = open(path, "rb").read()
    assert b[:8] == b"_logits_", "not a logits file"
    ctx, vocab, chunks = struct.unpack_from("<Iii", b, 8)
    off = 20
    toks = np.frombuffer(b, dtype="<i4", count=ctx * chunks, offset=off).reshape(chunks, ctx)
    off += 4 * ctx * chunks
    nv = 2 * ((vocab + 1) // 2) + 4
    rows = ctx - 1 - ctx // 2
    data = np.frombuffer(b, dtype="<u2", count=chunks * rows * nv, offset=off).reshape(chunks, rows, nv)
    assert off + data.nbytes == len(b), "logits file size"
    hdr = data[:, :, :4].copy().view("<f4")  # (chunks, rows, 2): scale, min
    q = data[:, :, 4:4 + vocab].astype(np.float64)
    lp = hdr[:, :, :1].astype(np.float64) * q + hdr[:, :, 1:2].astype(np.float64)
    lp[q == 0] = -np.inf
    return ctx, vocab, toks, lp


def compat():
    from exllamav3 import Config, Model
    mdir = os.path.join(a.peer, "models")
    order = sorted(os.listdir(mdir), key=lambda m: (m != "src", m))
    for m in order:
        d = os.path.join(mdir, m)
        try:
            r = {"part": "A", "model": m}
            qc = os.path.join(d, "quantization_config.json")
            r["has_quantization_config_json"] = os.path.exists(qc)
            t = time.time()
            cfg = Config.from_directory(d)
            r["config_class"] = type(cfg).__name__
            model = Model.from_config(cfg)
            model.load()
            r["load_s"] = round(time.time() - t, 2)
            ctx, vocab, toks, lp_t = read_logits_file(os.path.join(d, "trellm_logits.bin"))
            first = ctx // 2
            ex = []
            with torch.inference_mode():
                for c in range(toks.shape[0]):
                    ids = torch.tensor(toks[c:c + 1].astype(np.int64))
                    lg = model.forward(ids, {}).float().cpu()[0]
                    ex.append(lg)
            ex = torch.stack(ex)  # chunks, ctx, vocab'
            r["exl_logits_shape"] = list(ex.shape)
            if os.environ.get("EXL3PEER_TENSORS", "1") != "0":
                TENSORS[f"logits/{m}"] = ex.contiguous()
            lp_e = torch.log_softmax(ex[:, first:ctx - 1, :vocab].double(), -1).numpy()
            present = np.isfinite(lp_t)
            diff = np.abs(np.where(present, lp_t - lp_e, 0.0))
            top = lp_t >= lp_t.max(-1, keepdims=True) - 5.0
            p_t = np.where(present, np.exp(lp_t), 0.0)
            kl = (p_t * np.where(present, lp_t - lp_e, 0.0)).sum(-1)
            am_t, am_e = lp_t.argmax(-1), lp_e.argmax(-1)
            tgt = toks[:, first + 1:ctx]
            nll_e = -np.take_along_axis(lp_e, tgt[..., None], -1)[..., 0]
            r.update(rows=int(np.prod(kl.shape)), vocab=vocab, ctx=ctx, chunks=int(toks.shape[0]),
                     max_abs_dlogp=float(diff.max()), mean_abs_dlogp=float(diff[present].mean()),
                     max_abs_dlogp_top5nats=float(np.where(top, diff, 0).max()),
                     kl_trellm_exl_mean=float(kl.mean()), kl_trellm_exl_max=float(kl.max()),
                     argmax_agree=float((am_t == am_e).mean()), ppl_exl=float(np.exp(nll_e.mean())))
            try:
                r["trellm_eval"] = json.load(open(os.path.join(d, "trellm_eval.json")))["ppl"]
            except Exception:
                pass
            # exllamav3's dequantized weights (its reconstruction, fp16, [in, out]) for a bit-exact check against ours.
            nw = 0
            if os.environ.get("EXL3PEER_TENSORS", "1") != "0":
                def walk(mod):
                    nonlocal nw
                    inner = getattr(mod, "inner", None)
                    if inner is not None and hasattr(inner, "get_weight_tensor"):
                        try:
                            TENSORS[f"weight/{m}/{mod.key}"] = inner.get_weight_tensor().detach().half().cpu().contiguous()
                            nw += 1
                        except Exception as e:
                            r.setdefault("weight_errors", []).append(f"{mod.key}: {e!r}"[:200])
                    for sm in getattr(mod, "modules", []) or []:
                        walk(sm)
                for mod in model.modules:
                    walk(mod)
                r["inner_types"] = sorted({type(getattr(x, "inner", None)).__name__ for x in _all(model)} - {"NoneType"})
            r["weights_dumped"] = nw
            model.unload()
            emit(**r)
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            emit(part="A", model=m, error=tb[-2500:])


def _all(model):
    st, out = list(model.modules), []
    while st:
        x = st.pop()
        out.append(x)
        st.extend(getattr(x, "modules", []) or [])
    return out


t_all = time.time()
part("info", info)
part("B", viterbi_speed)
part("A", compat)
if TENSORS:
    try:
        from safetensors.torch import save_file
        save_file(TENSORS, os.path.join(a.out, "exl3peer_tensors.safetensors"),
                  metadata={"exllamav3": "1.6.5", "weights": "[in_features, out_features] fp16 from get_weight_tensor",
                            "logits": "[chunks, ctx, vocab] f32, forward() of the chunks in trellm_logits.bin"})
    except Exception:
        traceback.print_exc()
emit(part="done", seconds=round(time.time() - t_all, 1))
