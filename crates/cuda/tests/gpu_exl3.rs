//! GPU tests of the EXL3 kernels (`crates/cuda/src/exl3.rs`) against the CPU codec in the same
//! binary, on random trellis words (every word is a valid code). Ignored here; run with
//! `--include-ignored` on the GPU machine. `timing` prints (and with `TRELLM_RESULTS=<file>`
//! appends as JSON lines) the kernel-only GB/s at the Llama-3.1-8B MLP shapes.

mod common;

use common::gpu;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use trellm_cuda::exl3::{
    Exl3Linear, Exl3Scratch, Regime, RopeKv, Rows, GEMM_MIN_ROWS, PREROTATE_ROWS,
};
use trellm_cuda::{bench, Gpu};
use trellm_model::weights::{Linear, LinearWeight, TensorSource, Weights};
use trellm_model::ModelConfig;
use trellm_quant::exl3::{self, Bitrate, Codebook, Exl3Shape};

const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];

fn all_rates() -> Vec<Bitrate> {
    (1..=8)
        .map(Bitrate::int)
        .chain((1..=3).map(Bitrate::half))
        .collect()
}

/// A random layer: trellis words, suh/svh of random sign and size, a bias, the model's input.
struct Host {
    shape: Exl3Shape,
    rows: usize,
    cols: usize,
    trellis: Vec<u8>,
    suh: Vec<f32>,
    svh: Vec<f32>,
    bias: Vec<f32>,
    x: Vec<f32>,
}

fn host(
    k: usize,
    n: usize,
    cols: usize,
    rows: usize,
    cb: Codebook,
    rate: Bitrate,
    seed: u64,
) -> Host {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let shape = Exl3Shape {
        k,
        n,
        rate,
        codebook: cb,
    };
    let mut trellis = vec![0u8; shape.trellis_bytes()];
    r.fill(&mut trellis[..]);
    let scale = |len: usize, r: &mut ChaCha8Rng| -> Vec<f32> {
        (0..len)
            .map(|_| {
                let s = if r.gen::<bool>() { 1.0 } else { -1.0 };
                s * r.gen_range(0.5f32..1.5) / 64.0
            })
            .collect()
    };
    let suh = scale(k, &mut r);
    let svh = scale(n, &mut r);
    let bias = (0..rows).map(|_| r.gen_range(-0.1f32..0.1)).collect();
    let x = (0..cols).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    Host {
        shape,
        rows,
        cols,
        trellis,
        suh,
        svh,
        bias,
        x,
    }
}

impl Host {
    fn upload(&self, gpu: &Gpu) -> Exl3Linear {
        Exl3Linear::from_parts(
            gpu,
            self.shape,
            self.rows,
            self.cols,
            &self.trellis,
            &self.suh,
            &self.svh,
            Some(&self.bias),
        )
        .unwrap()
    }

    /// The CPU twin: the inputs zero-extended to k, the codec's tile matmul, the first `rows`
    /// outputs plus the bias (as the CPU backend runs a padded layer).
    fn cpu(&self) -> Vec<f32> {
        let mut xp = vec![0.0f32; self.shape.k];
        xp[..self.cols].copy_from_slice(&self.x);
        let mut y = vec![0.0f32; self.shape.n];
        exl3::matmul::matmul_tiles(
            &self.shape,
            &self.trellis,
            &self.suh,
            &self.svh,
            &xp,
            1,
            &mut y,
            exl3::matmul::Activations::Exact,
        );
        y.truncate(self.rows);
        y.iter_mut().zip(&self.bias).for_each(|(v, b)| *v += b);
        y
    }
}

fn gpu_gemv(gpu: &Gpu, h: &Host, l: &Exl3Linear) -> Vec<f32> {
    let s = Exl3Scratch::new(gpu, &[(l, 1)]).unwrap();
    let x = gpu.upload(&h.x).unwrap();
    let y = gpu.alloc::<f32>(h.rows).unwrap();
    l.gemv(gpu, &s, gpu.ptr(&x), gpu.ptr(&y)).unwrap();
    gpu.sync().unwrap();
    gpu.stream.clone_dtoh(&y).unwrap()
}

/// Within f32 accumulation tolerance: relative L2 error and the largest error against the RMS.
/// One wrong weight moves an output by about 1/sqrt(k) of its size, far above both bounds.
/// Returns the failure, so a test reports every failing case at once.
fn check_close(got: &[f32], want: &[f32], what: &str) -> Result<(), String> {
    check_within(got, want, 2e-5, 2e-4, what)
}

/// Relative L2 error below `rel_max` and every error below `max_rms` times the RMS.
fn check_within(
    got: &[f32],
    want: &[f32],
    rel_max: f64,
    max_rms: f64,
    what: &str,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} outputs, expected {}",
            got.len(),
            want.len()
        ));
    }
    if !got.iter().all(|v| v.is_finite()) {
        return Err(format!("{what}: non-finite output"));
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    let rms = (den / want.len() as f64).sqrt();
    let rel = (num / den).sqrt();
    let max = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() as f64)
        .fold(0.0, f64::max);
    eprintln!("{what}: relative L2 error {rel:.3e}, max error {max:.3e} (rms {rms:.3e})");
    if rel < rel_max && max < max_rms * rms {
        Ok(())
    } else {
        Err(format!(
            "{what}: relative L2 error {rel:.3e}, max error {max:.3e} (rms {rms:.3e})"
        ))
    }
}

fn assert_none_failed(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn label(h: &Host) -> String {
    format!(
        "{:?} K={} {}x{} (used {}x{})",
        h.shape.codebook,
        h.shape.rate.bits(),
        h.shape.k,
        h.shape.n,
        h.cols,
        h.rows
    )
}

/// The decoded weights are the codec's, bit for bit, for every codebook and bitrate, from both
/// decoders (f32 for the exact GEMV, packed fp16 for the tensor-core kernels).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn decode_is_bit_identical_to_the_codec() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    for (i, cb) in CODEBOOKS.into_iter().enumerate() {
        for (j, rate) in all_rates().into_iter().enumerate() {
            let h = host(256, 384, 256, 384, cb, rate, (100 * i + j) as u64);
            let (got, got16) = h.upload(&gpu).dequant(&gpu).unwrap();
            let want = exl3::reconstruct_inner(&h.shape, &h.trellis).unwrap();
            let bad16 = (0..want.len())
                .filter(|&i| got16[i] != want[i].to_bits())
                .count();
            if bad16 > 0 {
                failures.push(format!(
                    "{}: the fp16 decoder differs at {bad16} of {} weights",
                    label(&h),
                    want.len()
                ));
            }
            let bad: Vec<usize> = (0..want.len())
                .filter(|&i| got[i].to_bits() != want[i].to_f32().to_bits())
                .collect();
            if let Some(&i) = bad.first() {
                failures.push(format!(
                    "{}: {} of {} weights differ, first at [{}][{}]: {} for {}",
                    label(&h),
                    bad.len(),
                    want.len(),
                    i / h.shape.n,
                    i % h.shape.n,
                    got[i],
                    want[i]
                ));
            }
        }
    }
    assert_none_failed(failures);
}

/// The GEMV against the CPU matmul for every codebook and bitrate, on a square layer and on a
/// padded one (576 inputs in 640, 1000 outputs in 1024, as exllamav3 pads to 128s).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn gemv_matches_cpu_every_codebook_and_rate() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    for (i, cb) in CODEBOOKS.into_iter().enumerate() {
        for (j, rate) in all_rates().into_iter().enumerate() {
            for (s, &(k, n, cols, rows)) in [(256, 384, 256, 384), (640, 1024, 576, 1000)]
                .iter()
                .enumerate()
            {
                let h = host(k, n, cols, rows, cb, rate, (1000 * s + 100 * i + j) as u64);
                let l = h.upload(&gpu);
                if let Err(e) = check_close(&gpu_gemv(&gpu, &h, &l), &h.cpu(), &label(&h)) {
                    failures.push(e);
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// The Llama-3.1-8B layer shapes (q/o, k/v, gate/up, down) at K = 2, 3, 4 for every codebook,
/// and the device bytes of a layer: the file's trellis plus its vectors, never the dequantized
/// size.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn gemv_matches_cpu_llama_shapes() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    for (i, cb) in CODEBOOKS.into_iter().enumerate() {
        for kb in 2..=4u32 {
            for &(k, n) in &[(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)] {
                let h = host(
                    k,
                    n,
                    k,
                    n,
                    cb,
                    Bitrate::int(kb),
                    (10 * i) as u64 + kb as u64,
                );
                let l = h.upload(&gpu);
                let file = h.shape.trellis_bytes() + 2 * (k + n) + 2 * n;
                assert!(
                    l.device_bytes() <= file + 2 * (k + 2 * n),
                    "{}: {} device bytes for a {file}-byte layer",
                    label(&h),
                    l.device_bytes()
                );
                if let Err(e) = check_close(&gpu_gemv(&gpu, &h, &l), &h.cpu(), &label(&h)) {
                    failures.push(e);
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// Every EXL3 layer of the tiny exllamav3-converted llama folders (`oracle-data/exl3-tiny-llama`:
/// 3INST 4.0, MCG 2.0, MUL1 2.5 and 3.0, padded dims, real suh/svh), uploaded from the loaded model
/// as the engine would and run on the GPU, against the CPU matmul. `TRELLM_EXL3_TINY` points at
/// the folder of folders (the device run carries a copy).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn real_exl3_layers_match_cpu() {
    let gpu = gpu();
    let root = std::env::var_os("TRELLM_EXL3_TINY")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../tests/fixtures/exl3/tiny-llama"
            )
            .into()
        });
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "no model folders under {}",
        root.display()
    );
    let mut failures: Vec<String> = Vec::new();
    let mut checked = 0;
    let mut r = ChaCha8Rng::seed_from_u64(5);
    for dir in dirs {
        let config = trellm_formats::hf::read_config(&dir).unwrap();
        let cfg = ModelConfig::from_hf(&config, None).unwrap();
        let st = trellm_formats::safetensors::SafeTensors::open(&dir).unwrap();
        let w = Weights::load(&TensorSource::SafeTensors(st), &cfg).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        for (l, lw) in w.layers.iter().enumerate() {
            let mut projs: Vec<(&str, &Linear)> =
                vec![("q", &lw.q), ("k", &lw.k), ("v", &lw.v), ("o", &lw.o)];
            projs.extend(lw.gate.as_ref().map(|g| ("gate", g)));
            projs.push(("up", &lw.up));
            projs.push(("down", &lw.down));
            for (pname, lin) in projs {
                let LinearWeight::Exl3(e) = &lin.w else {
                    continue;
                };
                let layer = Exl3Linear::upload(&gpu, e, lin.b.as_deref()).unwrap();
                let x: Vec<f32> = (0..e.cols).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                let h = Host {
                    shape: e.shape,
                    rows: e.rows,
                    cols: e.cols,
                    trellis: e.trellis().to_vec(),
                    suh: e.suh.clone(),
                    svh: e.svh.clone(),
                    bias: lin.b.clone().unwrap_or_else(|| vec![0.0; e.rows]),
                    x,
                };
                let what = format!("{name} layer {l} {pname}: {}", label(&h));
                if let Err(msg) = check_close(&gpu_gemv(&gpu, &h, &layer), &h.cpu(), &what) {
                    failures.push(msg);
                }
                checked += 1;
            }
        }
    }
    eprintln!("{checked} EXL3 layers checked");
    assert!(checked > 0, "no EXL3 layers in the folders");
    assert_none_failed(failures);
}

/// `m` rows of inputs for `h`, bf16-representable (so the bf16 and f32 inputs are the same values).
fn inputs(h: &Host, m: usize, seed: u64) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..m * h.cols)
        .map(|_| half::bf16::from_f32(r.gen_range(-1.0f32..1.0)).to_f32())
        .collect()
}

/// The CPU twin for `m` rows (row-major `[m][cols]` in, `[m][rows]` out, bias added).
fn cpu_rows(h: &Host, x: &[f32], m: usize) -> Vec<f32> {
    let mut xp = vec![0.0f32; m * h.shape.k];
    for r in 0..m {
        xp[r * h.shape.k..][..h.cols].copy_from_slice(&x[r * h.cols..][..h.cols]);
    }
    let mut y = vec![0.0f32; m * h.shape.n];
    exl3::matmul::matmul_tiles(
        &h.shape,
        &h.trellis,
        &h.suh,
        &h.svh,
        &xp,
        m,
        &mut y,
        exl3::matmul::Activations::Exact,
    );
    let mut out = Vec::with_capacity(m * h.rows);
    for r in 0..m {
        out.extend(
            y[r * h.shape.n..][..h.rows]
                .iter()
                .zip(&h.bias)
                .map(|(v, b)| v + b),
        );
    }
    out
}

/// `m` rows through [`Exl3Linear::forward_in`] with input of `x` (bf16 or f32 on the device) and
/// an output row stride of `rows + 3`; returns the rows, the stride's gaps dropped.
fn gpu_rows(
    gpu: &Gpu,
    h: &Host,
    l: &Exl3Linear,
    x: &[f32],
    m: usize,
    bf16: bool,
    regime: Regime,
) -> Vec<f32> {
    let s = Exl3Scratch::new(gpu, &[(l, m.max(GEMM_MIN_ROWS))]).unwrap();
    let xd = if bf16 {
        let v: Vec<u16> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let d = gpu.upload(&v).unwrap();
        (gpu.ptr(&d), Some(d), None)
    } else {
        let d = gpu.upload(x).unwrap();
        (gpu.ptr(&d), None, Some(d))
    };
    let ldy = h.rows + 3;
    let y = gpu.alloc::<f32>(m * ldy).unwrap();
    let rows = Rows {
        ptr: xd.0,
        bf16,
        ld: h.cols,
    };
    l.forward_in(gpu, &s, regime, m, rows, gpu.ptr(&y), ldy)
        .unwrap();
    gpu.sync().unwrap();
    let all = gpu.stream.clone_dtoh(&y).unwrap();
    (0..m)
        .flat_map(|r| all[r * ldy..][..h.rows].to_vec())
        .collect()
}

/// Every row regime against the CPU matmul at row counts across the tensor-core kernels'
/// instantiations (8, 16, 32, 64 rows, the remainders) and beyond: the exact GEMV within f32
/// tolerance of the CPU; the tensor-core GEMV and the GEMM within the tolerance of their fp16
/// activations (relative L2 1e-3: fp16 keeps 11 bits, so about 3e-4 is expected).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn row_regimes_match_cpu() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    let cases = [
        (Codebook::Mul1, Bitrate::int(3), (640, 1024, 576, 1000)),
        (Codebook::Mcg, Bitrate::half(2), (256, 384, 256, 384)),
        (Codebook::Inst3, Bitrate::int(4), (4096, 1024, 4096, 1024)),
        (Codebook::Mul1, Bitrate::int(2), (1024, 4096, 1024, 4096)),
    ];
    for (i, &(cb, rate, (k, n, cols, rows))) in cases.iter().enumerate() {
        let h = host(k, n, cols, rows, cb, rate, 50 + i as u64);
        let l = h.upload(&gpu);
        for (j, m) in [1usize, 2, 3, 5, 8, 9, 13, 17, 40, 64, 70]
            .into_iter()
            .enumerate()
        {
            let x = inputs(&h, m, (10 * i + j) as u64);
            let want = cpu_rows(&h, &x, m);
            let what = format!("{} m={m}", label(&h));
            let bf16 = j % 2 == 0;
            let gemv = gpu_rows(&gpu, &h, &l, &x, m, bf16, Regime::Gemv);
            if let Err(e) = check_close(&gemv, &want, &format!("{what} GEMV")) {
                failures.push(e);
            }
            for regime in [Regime::Mma, Regime::Gemm] {
                let got = gpu_rows(&gpu, &h, &l, &x, m, bf16, regime);
                if let Err(e) = check_within(&got, &want, 1e-3, 1e-2, &format!("{what} {regime:?}"))
                {
                    failures.push(e);
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// The regimes a fused launch runs in for `cb` and the row counts each is checked at: the
/// tensor-core GEMV across its instantiations, and MUL1's int8 path (one row).
fn fused_cases(cb: Codebook) -> Vec<(Regime, &'static [usize])> {
    let mut cases: Vec<(Regime, &'static [usize])> = vec![(Regime::Mma, &[1, 5, 7, 16, 33, 64])];
    if cb == Codebook::Mul1 {
        cases.push((Regime::Int8, &[1]));
    }
    cases
}

/// Layers that share their input (q, k, v; gate, up) as one launch ([`Exl3Linear::forward_parts`]):
/// three parts of different widths, one with padded outputs, each part's outputs side by side
/// against the CPU matmul of that part alone, through the tensor-core GEMV (1..64 rows) and the
/// int8 path (one row, MUL1), with bf16 and f32 inputs.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn fused_parts_match_cpu() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    let (i, h) = (Bitrate::int, Bitrate::half);
    // Each part's rate: uniform, and parts at other rates than part 0's (a quantizer's
    // allocation: k and v a bit above q), three rates in one launch, half rates.
    for (c, &(cb, rates)) in [
        (Codebook::Mul1, [i(3), i(3), i(3)]),
        (Codebook::Inst3, [h(2), h(2), h(2)]),
        (Codebook::Mul1, [i(4), i(4), i(4)]),
        (Codebook::Mul1, [i(3), i(4), i(4)]),
        (Codebook::Mcg, [i(2), i(3), i(2)]),
        (Codebook::Mul1, [h(2), i(3), h(3)]),
        (Codebook::Inst3, [i(8), i(4), i(6)]),
    ]
    .iter()
    .enumerate()
    {
        let (k, cols) = (640, 576);
        let hosts: Vec<Host> = [(1024, 1000), (256, 256), (384, 300)]
            .iter()
            .zip(rates)
            .enumerate()
            .map(|(i, (&(n, rows), rate))| {
                host(k, n, cols, rows, cb, rate, 300 + 10 * c as u64 + i as u64)
            })
            .collect();
        let mut parts: Vec<Exl3Linear> = hosts.iter().map(|h| h.upload(&gpu)).collect();
        Exl3Linear::join(&gpu, &mut parts).unwrap();
        assert!(
            Exl3Linear::one_launch(&parts),
            "{cb:?} {rates:?}: the parts do not run as one launch"
        );
        let width: usize = hosts.iter().map(|h| h.rows).sum();
        for (regime, ms) in fused_cases(cb) {
            for (j, &m) in ms.iter().enumerate() {
                let x = inputs(&hosts[0], m, (40 * c + j) as u64);
                let bf16 = j % 2 == 0;
                let xd: Vec<u16> = x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                let (xb, xf) = (gpu.upload(&xd).unwrap(), gpu.upload(&x).unwrap());
                let rows = Rows {
                    ptr: if bf16 { gpu.ptr(&xb) } else { gpu.ptr(&xf) },
                    bf16,
                    ld: cols,
                };
                let y = gpu.alloc::<f32>(m * width).unwrap();
                let mut s = Exl3Scratch::for_groups(&gpu, &[(&parts[..], 64)]).unwrap();
                s.int8 = regime == Regime::Int8;
                Exl3Linear::forward_parts(&gpu, &s, &parts, m, rows, gpu.ptr(&y), width).unwrap();
                gpu.sync().unwrap();
                let all = gpu.stream.clone_dtoh(&y).unwrap();
                let mut off = 0;
                for (i, h) in hosts.iter().enumerate() {
                    let want = cpu_rows(h, &x, m);
                    let got: Vec<f32> = (0..m)
                        .flat_map(|r| all[r * width + off..][..h.rows].to_vec())
                        .collect();
                    let (rel, rms) = if regime == Regime::Int8 {
                        (2e-2, 0.1)
                    } else {
                        (1e-3, 1e-2)
                    };
                    let what = format!("{} part {i} of 3, m={m} {regime:?} fused", label(h));
                    if let Err(e) = check_within(&got, &want, rel, rms, &what) {
                        failures.push(e);
                    }
                    off += h.rows;
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// q, k and v of an attention with a head dimension of 128 as one launch with RoPE and the
/// KV-cache write fused ([`Exl3Linear::forward_rope`]), against the CPU matmuls of the three
/// layers (biases included) and RoPE computed here in f64 from the same f32 angle: q (f32,
/// scaled) and every slot of both paged caches, so a value written to a wrong slot fails too.
/// Positions reach 1999 (angles far past 2 pi); rows 1-16 through the tensor-core GEMV and one
/// row through the int8 path; 32 rows are refused (their kernel has no such epilogue).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn fused_rope_kv_matches_cpu_layers_and_rope() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    let (hidden, heads, kv, hd, bs) = (512, 4, 2, 128, 16);
    let per_seq = 2000usize.div_ceil(bs);
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| (500000f64.powf(-(i as f64) / (hd / 2) as f64)) as f32)
        .collect();
    let (pos_scale, in_scale, q_scale) = (0.5f32, 1.25f32, 1.0 / (hd as f32).sqrt());
    let freq = gpu.upload(&inv_freq).unwrap();
    // The shape's fields; each case points it at its buffers.
    let unbound = RopeKv {
        pos: 0,
        inv_freq: gpu.ptr(&freq),
        n_heads: heads,
        n_kv: kv,
        pos_scale,
        in_scale,
        q_scale,
        q: 0,
        k_cache: 0,
        v_cache: 0,
        tables: 0,
        table_off: 0,
        block: bs,
    };
    let (i, h) = (Bitrate::int, Bitrate::half);
    for (c, &(cb, rates)) in [
        (Codebook::Mul1, [i(3), i(3), i(3)]),
        (Codebook::Inst3, [h(2), h(2), h(2)]),
        (Codebook::Mul1, [i(2), i(3), i(3)]),
    ]
    .iter()
    .enumerate()
    {
        let hosts: Vec<Host> = [heads, kv, kv]
            .iter()
            .zip(rates)
            .enumerate()
            .map(|(i, (&n, rate))| {
                let n = n * hd;
                host(
                    hidden,
                    n,
                    hidden,
                    n,
                    cb,
                    rate,
                    700 + 10 * c as u64 + i as u64,
                )
            })
            .collect();
        let mut parts: Vec<Exl3Linear> = hosts.iter().map(|h| h.upload(&gpu)).collect();
        Exl3Linear::join(&gpu, &mut parts).unwrap();
        let mut cases: Vec<(Regime, usize)> = [1, 3, 8, 16].map(|m| (Regime::Mma, m)).to_vec();
        if cb == Codebook::Mul1 {
            cases.push((Regime::Int8, 1));
        }
        for (j, &(regime, m)) in cases.iter().enumerate() {
            let mut r = ChaCha8Rng::seed_from_u64(900 + j as u64);
            let x = inputs(&hosts[0], m, (60 * c + j) as u64);
            let pos: Vec<i32> = (0..m).map(|_| r.gen_range(0..2000)).collect();
            // Each row its own sequence, its blocks a shuffled stretch of the pool.
            let mut tables: Vec<i32> = (0..(m * per_seq) as i32).collect();
            for i in (1..tables.len()).rev() {
                tables.swap(i, r.gen_range(0..=i));
            }
            let table_off: Vec<i32> = (0..m).map(|t| (t * per_seq) as i32).collect();
            let slots = m * per_seq * bs;
            let xd: Vec<u16> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let xb = gpu.upload(&xd).unwrap();
            let (pos_d, tab_d, off_d) = (
                gpu.upload(&pos).unwrap(),
                gpu.upload(&tables).unwrap(),
                gpu.upload(&table_off).unwrap(),
            );
            let q = gpu.alloc::<f32>(m * heads * hd).unwrap();
            let kc = gpu.alloc::<u16>(slots * kv * hd).unwrap();
            let vc = gpu.alloc::<u16>(slots * kv * hd).unwrap();
            let mut s = Exl3Scratch::for_groups(&gpu, &[(&parts[..], 64)]).unwrap();
            s.int8 = regime == Regime::Int8;
            let e = RopeKv {
                pos: gpu.ptr(&pos_d),
                q: gpu.ptr(&q),
                k_cache: gpu.ptr(&kc),
                v_cache: gpu.ptr(&vc),
                tables: gpu.ptr(&tab_d),
                table_off: gpu.ptr(&off_d),
                ..unbound
            };
            let rows = Rows {
                ptr: gpu.ptr(&xb),
                bf16: true,
                ld: hidden,
            };
            let ran = Exl3Linear::forward_rope(&gpu, &s, &parts, m, rows, &e).unwrap();
            assert!(
                ran,
                "{cb:?} m={m} {regime:?}: the fused epilogue did not run"
            );
            gpu.sync().unwrap();
            let (gq, gk, gv) = (
                gpu.stream.clone_dtoh(&q).unwrap(),
                gpu.stream.clone_dtoh(&kc).unwrap(),
                gpu.stream.clone_dtoh(&vc).unwrap(),
            );
            // The CPU twin: the layers, then RoPE (pair i, i + 64) at each row's position.
            let want: Vec<Vec<f32>> = hosts.iter().map(|h| cpu_rows(h, &x, m)).collect();
            let rope = |v: &[f32], p: i32| -> Vec<f32> {
                let mut out = v.to_vec();
                for i in 0..hd / 2 {
                    let ang = ((p as f32 * pos_scale) * inv_freq[i]) as f64;
                    let (sn, cs) = ang.sin_cos();
                    let (x1, x2) = ((v[i] * in_scale) as f64, (v[i + hd / 2] * in_scale) as f64);
                    out[i] = (x1 * cs - x2 * sn) as f32;
                    out[i + hd / 2] = (x1 * sn + x2 * cs) as f32;
                }
                out
            };
            let mut wq = vec![0.0f32; m * heads * hd];
            let (mut wk, mut wv) = (vec![0.0f32; slots * kv * hd], vec![0.0f32; slots * kv * hd]);
            for t in 0..m {
                let p = pos[t];
                let slot =
                    tables[table_off[t] as usize + p as usize / bs] as usize * bs + p as usize % bs;
                for h in 0..heads {
                    let head = &want[0][(t * heads + h) * hd..][..hd];
                    let rot = rope(head, p);
                    for d in 0..hd {
                        wq[(t * heads + h) * hd + d] = rot[d] * q_scale;
                    }
                }
                for h in 0..kv {
                    let rot = rope(&want[1][(t * kv + h) * hd..][..hd], p);
                    wk[(slot * kv + h) * hd..][..hd].copy_from_slice(&rot);
                    wv[(slot * kv + h) * hd..][..hd]
                        .copy_from_slice(&want[2][(t * kv + h) * hd..][..hd]);
                }
            }
            // The rows' slots, compared below; every other slot must still be zero.
            let mut written = vec![false; slots * kv * hd];
            for t in 0..m {
                let p = pos[t] as usize;
                let slot = tables[table_off[t] as usize + p / bs] as usize * bs + p % bs;
                written[slot * kv * hd..][..kv * hd].fill(true);
            }
            let stray = gk.iter().chain(&gv).zip(written.iter().chain(&written));
            if stray.filter(|&(&b, &w)| !w && b != 0).count() > 0 {
                failures.push(format!(
                    "{cb:?} m={m} {regime:?}: writes outside the rows' slots"
                ));
            }
            let f32s = |c: &[u16]| -> Vec<f32> {
                c.iter()
                    .zip(&written)
                    .filter(|p| *p.1)
                    .map(|(&b, _)| half::bf16::from_bits(b).to_f32())
                    .collect()
            };
            let used = |c: Vec<f32>| -> Vec<f32> {
                c.into_iter()
                    .zip(&written)
                    .filter(|p| *p.1)
                    .map(|p| p.0)
                    .collect()
            };
            let (wk, wv) = (used(wk), used(wv));
            let (rel, rms): (f64, f64) = if regime == Regime::Int8 {
                (2e-2, 0.1)
            } else {
                (1e-3, 1e-2)
            };
            // k and v are stored as bf16 (8 bits).
            let (rel16, rms16) = (rel.max(1e-2), rms.max(3e-2));
            let what = |t: &str| format!("{cb:?} m={m} {regime:?} rope {t}");
            for (got, want, what, rel, rms) in [
                (gq, wq, what("q"), rel, rms),
                (f32s(&gk), wk, what("k cache"), rel16, rms16),
                (f32s(&gv), wv, what("v cache"), rel16, rms16),
            ] {
                if let Err(e) = check_within(&got, &want, rel, rms, &what) {
                    failures.push(e);
                }
            }
        }
        // Rows past the epilogue's kernels: refused, nothing run.
        let s = Exl3Scratch::for_groups(&gpu, &[(&parts[..], 64)]).unwrap();
        let x = gpu.alloc::<u16>(32 * hidden).unwrap();
        let rows = Rows {
            ptr: gpu.ptr(&x),
            bf16: true,
            ld: hidden,
        };
        assert!(!Exl3Linear::forward_rope(&gpu, &s, &parts, 32, rows, &unbound).unwrap());
    }
    assert_none_failed(failures);
}

/// A gated MLP's gate and up as one launch with the activation fused
/// ([`Exl3Linear::forward_gated`]): bf16(silu(gate) * up) against the CPU matmuls of both layers
/// (padded outputs, biases), through the tensor-core GEMV (1..64 rows) and the int8 path (one row).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn fused_gate_up_activation_matches_cpu() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    let i = Bitrate::int;
    // Gate and up at one rate, and at two (up a bit above gate, as `trellm quantize` allocates).
    for (c, &(cb, rates)) in [
        (Codebook::Mul1, [i(3), i(3)]),
        (Codebook::Mcg, [i(2), i(2)]),
        (Codebook::Mul1, [i(3), i(4)]),
        (Codebook::Mcg, [i(5), i(4)]),
    ]
    .iter()
    .enumerate()
    {
        let (k, n, cols, rows) = (640, 1024, 576, 1000);
        let hosts: Vec<Host> = rates
            .iter()
            .enumerate()
            .map(|(i, &rate)| host(k, n, cols, rows, cb, rate, 500 + 10 * c as u64 + i as u64))
            .collect();
        let mut parts: Vec<Exl3Linear> = hosts.iter().map(|h| h.upload(&gpu)).collect();
        Exl3Linear::join(&gpu, &mut parts).unwrap();
        for (regime, ms) in fused_cases(cb) {
            for (j, &m) in ms.iter().enumerate() {
                let x = inputs(&hosts[0], m, (70 * c + j) as u64);
                let xd: Vec<u16> = x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                let xb = gpu.upload(&xd).unwrap();
                let rows_in = Rows {
                    ptr: gpu.ptr(&xb),
                    bf16: true,
                    ld: cols,
                };
                let out = gpu.alloc::<u16>(m * rows).unwrap();
                let mut s = Exl3Scratch::for_groups(&gpu, &[(&parts[..], 64)]).unwrap();
                s.int8 = regime == Regime::Int8;
                let ran = Exl3Linear::forward_gated(&gpu, &s, &parts, m, rows_in, 0, gpu.ptr(&out))
                    .unwrap();
                assert!(
                    ran,
                    "{cb:?} m={m} {regime:?}: the fused activation did not run"
                );
                gpu.sync().unwrap();
                let got: Vec<f32> = gpu
                    .stream
                    .clone_dtoh(&out)
                    .unwrap()
                    .iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect();
                let (g, u) = (cpu_rows(&hosts[0], &x, m), cpu_rows(&hosts[1], &x, m));
                let want: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                // bf16 output: 8 bits, so about 2e-3 relative on top of the inputs' rounding.
                let (rel, rms) = if regime == Regime::Int8 {
                    (3e-2, 0.15)
                } else {
                    (5e-3, 2e-2)
                };
                let what = format!("{} m={m} {regime:?} gate/up + silu", label(&hosts[0]));
                if let Err(e) = check_within(&got, &want, rel, rms, &what) {
                    failures.push(e);
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// The fast path (MUL1, int8 activations per 128-block, dp4a) against the CPU's exact matmul at
/// every MUL1 rate, on padded and 8B-sized layers, one and several rows (run one at a time):
/// within its rounding (relative L2 2e-2: the activations keep about 7 bits).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn int8_path_matches_cpu_within_its_rounding() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    for (i, rate) in all_rates().into_iter().enumerate() {
        for (j, &(k, n, cols, rows)) in [(640, 1024, 576, 1000), (4096, 1024, 4096, 1024)]
            .iter()
            .enumerate()
        {
            let h = host(
                k,
                n,
                cols,
                rows,
                Codebook::Mul1,
                rate,
                90 + (2 * i + j) as u64,
            );
            let l = h.upload(&gpu);
            for m in [1usize, 3] {
                let x = inputs(&h, m, (7 * i + j + m) as u64);
                let want = cpu_rows(&h, &x, m);
                let got = gpu_rows(&gpu, &h, &l, &x, m, m == 1, Regime::Int8);
                if let Err(e) =
                    check_within(&got, &want, 2e-2, 0.1, &format!("{} m={m} Int8", label(&h)))
                {
                    failures.push(e);
                }
            }
        }
    }
    assert_none_failed(failures);
}

/// The GEMM path of a layer without padded outputs or a bias, whose output Hadamard and svh are
/// folded into the decoded fp16 band (one more fp16 rounding, of W H128 * svh), against the CPU:
/// within the same tolerance as the unfolded path.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn folded_gemm_matches_cpu() {
    let gpu = gpu();
    let mut failures: Vec<String> = Vec::new();
    let cases = [
        (Codebook::Mul1, Bitrate::int(3), (4096, 1024)),
        (Codebook::Mcg, Bitrate::half(2), (256, 384)),
        (Codebook::Inst3, Bitrate::int(4), (1024, 4096)),
    ];
    for (i, &(cb, rate, (k, n))) in cases.iter().enumerate() {
        let mut h = host(k, n, k, n, cb, rate, 70 + i as u64);
        h.bias = vec![0.0; n];
        let l =
            Exl3Linear::from_parts(&gpu, h.shape, n, k, &h.trellis, &h.suh, &h.svh, None).unwrap();
        for m in [65usize, 100, 300] {
            let x = inputs(&h, m, (5 * i + m) as u64);
            let want = cpu_rows(&h, &x, m);
            let s = Exl3Scratch::new(&gpu, &[(&l, m)]).unwrap();
            let xd = gpu.upload(&x).unwrap();
            let y = gpu.alloc::<f32>(m * n).unwrap();
            let rows = Rows {
                ptr: gpu.ptr(&xd),
                bf16: false,
                ld: k,
            };
            l.forward_in(&gpu, &s, Regime::Gemm, m, rows, gpu.ptr(&y), n)
                .unwrap();
            let got = gpu.stream.clone_dtoh(&y).unwrap();
            if let Err(e) = check_within(
                &got,
                &want,
                1e-3,
                1e-2,
                &format!("{} m={m} folded Gemm", label(&h)),
            ) {
                failures.push(e);
            }
        }
    }
    assert_none_failed(failures);
}

/// Bad parts are errors, not panics.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn bad_parts_are_errors() {
    let gpu = gpu();
    let h = host(256, 256, 256, 256, Codebook::Mul1, Bitrate::int(3), 1);
    let try_parts = |shape: Exl3Shape, rows, cols, t: &[u8], suh: &[f32], svh: &[f32]| {
        Exl3Linear::from_parts(&gpu, shape, rows, cols, t, suh, svh, None).is_err()
    };
    assert!(try_parts(
        h.shape,
        256,
        256,
        &h.trellis[1..],
        &h.suh,
        &h.svh
    ));
    assert!(try_parts(
        h.shape,
        256,
        256,
        &h.trellis,
        &h.suh[1..],
        &h.svh
    ));
    assert!(try_parts(h.shape, 257, 256, &h.trellis, &h.suh, &h.svh));
    assert!(try_parts(h.shape, 0, 256, &h.trellis, &h.suh, &h.svh));
    let odd = Exl3Shape { k: 200, ..h.shape };
    assert!(try_parts(odd, 256, 200, &h.trellis, &h.suh, &h.svh));
}

/// Timing at the 8B layer shapes (gate/up, down, q/o, k/v): every codebook at K = 2, 3, 4, the
/// trellis kernel alone and the whole layer (both Hadamards included) for one row; then MUL1 at
/// K = 2, 3, 4 per row count through both regimes (where the GEMV's crossover to the GEMM is
/// chosen). Each timing runs over enough copies of the layer that they do not fit in L2; GB/s
/// counts trellis bytes, % is of the device copy measured here. Checks nothing but that it runs.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn timing() {
    let gpu = gpu();
    let copy = bench::copy_bytes_per_s(&gpu, 10).unwrap();
    let mut emit = common::results();
    emit(format!(
        "{{\"device\": \"{}\", \"copy_gb_s\": {:.1}}}",
        gpu.name,
        copy / 1e9
    ));
    let shapes = [
        (4096usize, 14336usize),
        (14336, 4096),
        (4096, 4096),
        (4096, 1024),
    ];
    let row_counts = [1usize, 2, 4, 8, 12, 16, 24, 32, 64, 128, 512, 2048];
    for cb in CODEBOOKS {
        for kb in 2..=4u32 {
            for &(k, n) in &shapes {
                let h = host(k, n, k, n, cb, Bitrate::int(kb), 7);
                let bytes = h.shape.trellis_bytes();
                let copies = (400usize << 20).div_ceil(bytes).max(2);
                let layers: Vec<Exl3Linear> = (0..copies).map(|_| h.upload(&gpu)).collect();
                let sweep = cb == Codebook::Mul1;
                let most = if sweep {
                    *row_counts.last().unwrap()
                } else {
                    1
                };
                let s = Exl3Scratch::new(&gpu, &[(&layers[0], most)]).unwrap();
                let xs: Vec<f32> = (0..most).flat_map(|_| h.x.iter().copied()).collect();
                let x = gpu.upload(&xs).unwrap();
                let y = gpu.alloc::<f32>(most * n).unwrap();
                let xh = gpu.alloc::<f32>(k).unwrap();
                let (splits, per) = layers[0].split(gpu.sm_count, trellm_cuda::exl3::BLOCKS_PER_SM);
                let part = gpu.alloc::<f32>(splits * n).unwrap();
                let inner = bench::time_ms(&gpu, 2, 7, || {
                    for l in &layers {
                        l.launch_inner(&gpu, gpu.ptr(&xh), gpu.ptr(&part), splits, per)?;
                    }
                    Ok(())
                })
                .unwrap()
                    / copies as f64;
                let gbs = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
                let rows_in = || Rows {
                    ptr: gpu.ptr(&x),
                    bf16: false,
                    ld: k,
                };
                for &m in row_counts.iter().take_while(|&&m| m <= most) {
                    for regime in [Regime::Gemv, Regime::Mma, Regime::Gemm, Regime::Int8] {
                        if (regime != Regime::Gemm && m > 64)
                            || (regime == Regime::Gemm && m < 2)
                            || (regime == Regime::Int8 && (m > 1 || cb != Codebook::Mul1))
                        {
                            continue;
                        }
                        let full = bench::time_ms(&gpu, 2, 7, || {
                            for l in &layers {
                                l.forward_in(&gpu, &s, regime, m, rows_in(), gpu.ptr(&y), n)?;
                            }
                            Ok(())
                        })
                        .unwrap()
                            / copies as f64;
                        emit(format!(
                            "{{\"codebook\": \"{cb:?}\", \"K\": {kb}, \"k\": {k}, \"n\": {n}, \"rows\": {m}, \"regime\": \"{regime:?}\", \"splits\": {splits}, \"copies\": {copies}, \"kernel_us\": {:.2}, \"kernel_pct_copy\": {:.1}, \"layer_us\": {:.2}, \"layer_gb_s\": {:.1}, \"layer_pct_copy\": {:.1}, \"us_per_row\": {:.2}}}",
                            inner * 1e3,
                            100.0 * gbs(inner) * 1e9 / copy,
                            full * 1e3,
                            gbs(full),
                            100.0 * gbs(full) * 1e9 / copy,
                            full * 1e3 / m as f64
                        ));
                    }
                }
                // The one-row GEMVs' split (blocks per SM aimed for), at K = 3.
                if sweep && kb == 3 {
                    let mut s = Exl3Scratch::new(&gpu, &[(&layers[0], 1)]).unwrap();
                    for per_sm in [4usize, 8, 12, 16, 24, 32] {
                        s.mma_per_sm = Some(per_sm);
                        for regime in [Regime::Mma, Regime::Int8] {
                            let full = bench::time_ms(&gpu, 2, 7, || {
                                for l in &layers {
                                    l.forward_in(&gpu, &s, regime, 1, rows_in(), gpu.ptr(&y), n)?;
                                }
                                Ok(())
                            })
                            .unwrap()
                                / copies as f64;
                            emit(format!(
                                "{{\"codebook\": \"{cb:?}\", \"K\": {kb}, \"k\": {k}, \"n\": {n}, \"rows\": 1, \"regime\": \"{regime:?}\", \"per_sm\": {per_sm}, \"layer_us\": {:.2}, \"layer_pct_copy\": {:.1}}}",
                                full * 1e3,
                                100.0 * gbs(full) * 1e9 / copy,
                            ));
                        }
                    }
                }
            }
        }
    }
}

/// A target for Nsight Compute (`ncu -k regex:exl3_`): one 4096x14336 MUL1 K = 3 layer through
/// the tensor-core GEMV at 1, 8, 16 and 32 rows, the int8 path and the exact GEMV at 1 row, three
/// times each, with the inputs of many rows rotated beforehand and then in the blocks. Checks
/// nothing but that it runs.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn profile_target() {
    let gpu = gpu();
    let h = host(4096, 14336, 4096, 14336, Codebook::Mul1, Bitrate::int(3), 3);
    let l = h.upload(&gpu);
    let mut s = Exl3Scratch::new(&gpu, &[(&l, 32)]).unwrap();
    let xs: Vec<f32> = (0..32).flat_map(|_| h.x.iter().copied()).collect();
    let x = gpu.upload(&xs).unwrap();
    let y = gpu.alloc::<f32>(32 * h.shape.n).unwrap();
    let rows = Rows {
        ptr: gpu.ptr(&x),
        bf16: false,
        ld: h.cols,
    };
    for prerotate in [PREROTATE_ROWS, usize::MAX] {
        s.prerotate_rows = prerotate;
        for _ in 0..3 {
            for (regime, m) in [
                (Regime::Mma, 1),
                (Regime::Int8, 1),
                (Regime::Mma, 8),
                (Regime::Mma, 16),
                (Regime::Mma, 32),
                (Regime::Gemv, 1),
            ] {
                l.forward_in(&gpu, &s, regime, m, rows, gpu.ptr(&y), h.shape.n)
                    .unwrap();
            }
        }
    }
    gpu.sync().unwrap();
}

/// The one-row tensor-core GEMV's split, swept on the groups a Llama-3.1-8B layer launches at
/// MUL1 K = 3 (q/k/v as one launch, o, gate/up with the activation fused, down): for each split
/// the blocks per SM asked for reach, the group's time per launch over enough copies that they do
/// not fit in L2, and the split the default rule picks. Checks nothing but that it runs.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn one_row_split_sweep() {
    let gpu = gpu();
    let mut emit = common::results();
    let shape = |k: usize, n: usize| Exl3Shape {
        k,
        n,
        rate: Bitrate::int(3),
        codebook: Codebook::Mul1,
    };
    let groups: [(&str, Vec<Exl3Shape>); 4] = [
        (
            "qkv",
            vec![shape(4096, 4096), shape(4096, 1024), shape(4096, 1024)],
        ),
        ("o", vec![shape(4096, 4096)]),
        ("gate_up", vec![shape(4096, 14336), shape(4096, 14336)]),
        ("down", vec![shape(14336, 4096)]),
    ];
    for (name, shapes) in groups {
        let bytes: usize = shapes.iter().map(|s| s.trellis_bytes()).sum();
        let copies = (400usize << 20).div_ceil(bytes).max(2);
        let seed = |c: usize, i: usize| (c * 8 + i) as u64 + 1;
        let layers: Vec<Vec<Exl3Linear>> = (0..copies)
            .map(|c| {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| Exl3Linear::synthetic(&gpu, s, seed(c, i)).unwrap())
                    .collect()
            })
            .collect();
        let (k, n) = (shapes[0].k, shapes.iter().map(|s| s.n).sum::<usize>());
        let gated = name == "gate_up";
        let mut s = Exl3Scratch::for_groups(&gpu, &[(&layers[0][..], 1)]).unwrap();
        let x = gpu.upload(&vec![0.5f32; k]).unwrap();
        let y = gpu.alloc::<f32>(n).unwrap();
        let act_out = gpu.alloc::<u16>(n).unwrap();
        let rows_in = Rows {
            ptr: gpu.ptr(&x),
            bf16: false,
            ld: k,
        };
        // The group as the launch sees it: the parts' outputs side by side.
        let whole = Exl3Shape { n, ..shapes[0] };
        let default = trellm_cuda::exl3::mma_split(&whole, gpu.sm_count, 1);
        let mut seen = Vec::new();
        for per_sm in 1..=trellm_cuda::exl3::MMA_SWEEP_MAX {
            let (splits, per) = trellm_cuda::exl3::mma_split_for(&whole, gpu.sm_count, 1, per_sm);
            if seen.contains(&splits) {
                continue;
            }
            seen.push(splits);
            s.mma_per_sm = Some(per_sm);
            let ms = bench::time_ms(&gpu, 2, 7, || {
                for l in &layers {
                    if gated {
                        Exl3Linear::forward_gated(&gpu, &s, l, 1, rows_in, 0, gpu.ptr(&act_out))?;
                    } else {
                        Exl3Linear::forward_parts(&gpu, &s, l, 1, rows_in, gpu.ptr(&y), n)?;
                    }
                }
                Ok(())
            })
            .unwrap()
                / copies as f64;
            emit(format!(
                "{{\"group\": \"{name}\", \"k\": {k}, \"n\": {n}, \"per_sm\": {per_sm}, \"splits\": {splits}, \"per\": {per}, \"blocks\": {}, \"default_splits\": {}, \"us\": {:.2}}}",
                splits * n / 128,
                default.0,
                ms * 1e3
            ));
        }
    }
}
