//! `trellm quantize`: a model becomes an EXL3 folder that exllamav3 and trellm load.
//!
//! The calibration rows run through the model's CPU decoder one half-layer at a time
//! (attention, then MLP), quantizing as they go, as GPTQ's sequential mode does. In each half,
//! [`calibration::Hessian`]s first collect the normed rows that q/k/v (gate/up) read, and those
//! projections are quantized ([`trellm_quant::exl3::quantize::quantize_layer`]: incoherence,
//! LDLQ, the trellis search); then the rows run through the *quantized* q/k/v and attention
//! (gate/up and activation) while o's (down's) input is collected and kept, o (down) is
//! quantized, and the half is finished from the kept inputs. Every projection is thus
//! calibrated against the errors the ones before it really make, and each runs once per pass
//! over the rows (the kept inputs are recomputed instead where they would exceed
//! [`KEEP_BYTES`]). The head is quantized last, from the final normed rows. Each finished layer
//! goes to a checkpoint in `OUT/.checkpoint/`, with the calibration state every so often, so an
//! interrupted run resumes where it stopped.

pub mod calibration;
pub mod folder;
pub mod gguf_source;

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use half::f16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use trellm_quant::exl3::codebook::{MCG_MUL, MUL1_MUL};
use trellm_quant::exl3::quantize::{quantize_layer_with, CpuEncoder, LayerOptions, TileEncoder};
use trellm_quant::exl3::Codebook;

use crate::backend::cpu::model::{Tail, Tap};
use crate::backend::cpu::{self, CpuModel};
use crate::backend::Device;
use crate::model::load::LoadedModel;
use crate::model::plan::Op;
use crate::model::weights::{hf_name, Exl3Matrix, LayerWeights, Linear, LinearWeight, Role};
use calibration::Hessian;
use folder::{Checkpoint, Tensor};

/// What to make.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bits per weight of the decoder layers' projections on average, 1 to 8: a fractional
    /// target is met by giving some projections the next whole number of bits ([`allocate`]).
    pub bits: f64,
    /// Bits per weight of the output head; `None` keeps it as stored.
    pub head_bits: Option<u32>,
    pub codebook: Codebook,
    /// Shards above this many bytes (exllamav3's default: 8192 MB).
    pub shard_bytes: u64,
    /// Stop after this many layers with the checkpoint saved (as an interruption would).
    pub stop_after: Option<usize>,
    pub quiet: bool,
    /// Where the tiles are encoded (the same bytes on every device).
    pub device: Device,
    /// Mixed into every tensor's seed for its random signs (0: the default signs).
    pub seed: u64,
}

/// The tile encoder of a run (`--device`).
struct Encoder {
    #[cfg(feature = "cuda")]
    gpu: Option<trellm_cuda::viterbi::GpuEncoder>,
}

impl Encoder {
    fn new(device: Device) -> Result<Encoder> {
        match device {
            Device::Cpu => Ok(Encoder {
                #[cfg(feature = "cuda")]
                gpu: None,
            }),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let gpu = trellm_cuda::Gpu::new(0).context("--device cuda")?;
                Ok(Encoder {
                    gpu: Some(trellm_cuda::viterbi::GpuEncoder::new(std::sync::Arc::new(
                        gpu,
                    ))),
                })
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => bail!("this trellm was built without CUDA support (feature `cuda`)"),
        }
    }

    fn get(&self) -> &dyn TileEncoder {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g;
        }
        &CpuEncoder
    }

    /// Fails once the GPU encoder has failed (its calls went to the CPU since: same bytes).
    fn check(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(e) = self.gpu.as_ref().and_then(|g| g.error()) {
            bail!("the CUDA tile encoder failed: {e}");
        }
        Ok(())
    }
}

/// Token rows to calibrate with (none: H = identity, no calibration) and what they are.
pub struct Calibration {
    pub rows: Vec<Vec<u32>>,
    /// The rows and columns asked for, and the text's description, for `config.json`.
    pub asked: (usize, usize),
    pub text: String,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Layers quantized by this run (fewer than the model's after a resume or a stop).
    pub layers_done: usize,
    pub finished: bool,
    pub warnings: Vec<String>,
    /// Bits per weight of the decoder layers' trellises over their stored (padded) weights;
    /// of everything they store (scales too) over the model's own weights; the bytes of the
    /// folder's weights.
    pub decoder_bpw: f64,
    pub model_bpw: f64,
    pub bytes: u64,
}

/// How often the calibration state (all rows' hidden vectors, large) is saved to the
/// checkpoint: a resumed run redoes at most this much work.
const STATE_SAVE_INTERVAL: Duration = Duration::from_secs(60);

/// The most bytes of the o / down inputs kept between the pass that collects them and the one
/// that finishes the half-layer from them (beyond it, that pass runs the half again).
const KEEP_BYTES: usize = 4 << 30;

/// A layer's projections in the order they are quantized, with the input each reads.
const ATTN: [(Role, Tap); 4] = [
    (Role::Q, Tap::Qkv),
    (Role::K, Tap::Qkv),
    (Role::V, Tap::Qkv),
    (Role::O, Tap::O),
];
const MLP: [(Role, Tap); 3] = [
    (Role::Gate, Tap::GateUp),
    (Role::Up, Tap::GateUp),
    (Role::Down, Tap::Down),
];

fn linear_of(lw: &LayerWeights, role: Role) -> Option<&Linear> {
    match role {
        Role::Q => Some(&lw.q),
        Role::K => Some(&lw.k),
        Role::V => Some(&lw.v),
        Role::O => Some(&lw.o),
        Role::Gate => lw.gate.as_ref(),
        Role::Up => Some(&lw.up),
        Role::Down => Some(&lw.down),
        _ => None,
    }
}

fn slot(lw: &mut LayerWeights, role: Role) -> Option<&mut Linear> {
    match role {
        Role::Q => Some(&mut lw.q),
        Role::K => Some(&mut lw.k),
        Role::V => Some(&mut lw.v),
        Role::O => Some(&mut lw.o),
        Role::Gate => lw.gate.as_mut(),
        Role::Up => Some(&mut lw.up),
        Role::Down => Some(&mut lw.down),
        _ => None,
    }
}

fn tap_name(t: Tap) -> &'static str {
    match t {
        Tap::Qkv => "q/k/v",
        Tap::O => "o",
        Tap::GateUp => "gate/up",
        Tap::Down => "down",
    }
}

/// FNV-1a over `words` from the offset basis xor `start`: stable across runs and builds.
fn fnv1a(start: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    words
        .into_iter()
        .fold(0xcbf2_9ce4_8422_2325 ^ start, |h, w| {
            (h ^ w).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A stable seed per tensor for its random signs, varied by the run's `seed`.
fn seed_of(name: &str, seed: u64) -> u64 {
    fnv1a(seed, name.bytes().map(u64::from))
}

/// One projection quantized: the layer the decoder runs and the tensors the folder stores.
struct Quantized {
    linear: Linear,
    tensors: Vec<Tensor>,
    proxy_err: f64,
}

/// Quantizes the projection `src` (stored as `base`) at `bits`, weighing errors by `h`, with the
/// run's codebook and seed.
fn quantize_linear(
    base: &str,
    src: &Linear,
    h: Option<&Hessian>,
    bits: u32,
    run: &Options,
    enc: &Encoder,
    warnings: &mut Vec<String>,
) -> Result<Quantized> {
    let LinearWeight::Ggml(m) = &src.w else {
        bail!("{base} is already EXL3");
    };
    let (rows, cols) = (m.rows, m.cols);
    // HF stores [out][in]; the quantizer takes [in][out], zero-padded to 128s as exllamav3
    // pads (the reader keeps the model's dims and ignores the padding).
    let (k, n) = (cols.next_multiple_of(128), rows.next_multiple_of(128));
    let mut wt = vec![0.0f32; k * n];
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        m.dequantize_row(r, &mut row);
        for (c, &v) in row.iter().enumerate() {
            wt[c * n + r] = v;
        }
    }
    let hp = h.filter(|h| h.rows > 0).map(|h| h.padded(k));
    let cb = run.codebook;
    let mut opts = LayerOptions::new(bits, cb);
    opts.seed = seed_of(base, run.seed);
    let q = cpu::pool()
        .install(|| quantize_layer_with(&wt, k, n, hp.as_deref(), &opts, enc.get()))
        .with_context(|| base.to_string())?;
    enc.check()?;
    warnings.extend(q.warnings.iter().map(|w| format!("{base}: {w}")));
    let f16_bytes = |v: &[f16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut tensors = vec![
        Tensor {
            name: format!("{base}.trellis"),
            dtype: "I16".into(),
            shape: vec![k / 16, n / 16, 16 * bits as usize],
            bytes: q.trellis.clone(),
        },
        Tensor {
            name: format!("{base}.suh"),
            dtype: "F16".into(),
            shape: vec![k],
            bytes: f16_bytes(&q.suh),
        },
        Tensor {
            name: format!("{base}.svh"),
            dtype: "F16".into(),
            shape: vec![n],
            bytes: f16_bytes(&q.svh),
        },
    ];
    let marker = match cb {
        Codebook::Mul1 => Some(MUL1_MUL),
        Codebook::Mcg => Some(MCG_MUL),
        Codebook::Inst3 => None,
    };
    if let Some(mul) = marker {
        tensors.push(Tensor {
            name: format!("{base}.{}", cb.name()),
            dtype: "I32".into(),
            shape: vec![],
            bytes: mul.to_le_bytes().to_vec(),
        });
    }
    let to_f32 = |v: &[f16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let e = Exl3Matrix::from_parts(
        q.shape,
        rows,
        cols,
        to_f32(&q.suh),
        to_f32(&q.svh),
        &q.trellis,
    )?;
    Ok(Quantized {
        linear: Linear {
            w: LinearWeight::Exl3(e),
            b: src.b.clone(),
        },
        tensors,
        proxy_err: q.proxy_err,
    })
}

/// The order in which a layer's projections get the extra bit of a fractional target: the
/// small attention projections whose errors reach every later token (v, o, k) first, then the
/// MLP's down projection, which writes to the residual stream, then the rest.
const UPGRADE_ORDER: [Role; 7] = [
    Role::V,
    Role::O,
    Role::K,
    Role::Down,
    Role::Q,
    Role::Up,
    Role::Gate,
];

/// Whole bits per projection (`layers[l]`: each projection's role and size in tiles) so the
/// average over the stored (padded) weights is `bits`: every projection gets `floor(bits)`,
/// and in each layer some get one more, in [`UPGRADE_ORDER`], while the running total stays
/// within the target; what a layer leaves unspent carries to the next, so the model's average
/// lands on the target within one projection's worth.
pub fn allocate(bits: f64, layers: &[Vec<(Role, u64)>]) -> Vec<HashMap<Role, u32>> {
    let base = bits.floor().clamp(1.0, 8.0) as u32;
    let extra = bits - base as f64;
    let mut surplus = 0.0f64;
    layers
        .iter()
        .map(|projs| {
            let mut out: HashMap<Role, u32> = projs.iter().map(|&(r, _)| (r, base)).collect();
            if base < 8 && extra > 0.0 {
                let mut budget = surplus + extra * projs.iter().map(|p| p.1).sum::<u64>() as f64;
                for role in UPGRADE_ORDER {
                    if let Some(&(_, t)) = projs.iter().find(|p| p.0 == role) {
                        if t as f64 <= budget {
                            budget -= t as f64;
                            out.insert(role, base + 1);
                        }
                    }
                }
                surplus = budget;
            }
            out
        })
        .collect()
}

/// Tiles of a projection of `rows x cols` once padded (the encoder's unit of work).
fn tiles(rows: usize, cols: usize) -> u64 {
    (rows.next_multiple_of(128) * cols.next_multiple_of(128) / 256) as u64
}

/// Refuses what this quantizer cannot make into an EXL3 folder, with the reason.
fn check_source(m: &LoadedModel) -> Result<()> {
    let cfg = &m.model.cfg;
    if cfg.exl3 {
        bail!(
            "{} is already an EXL3 folder; quantize its source model",
            m.path.display()
        );
    }
    if !(m.path.is_dir() && m.path.join("config.json").is_file()) {
        bail!(
            "{}: trellm quantize reads Hugging Face folders (config.json + safetensors) and llama / gemma3 GGUFs",
            m.path.display()
        );
    }
    for (l, ops) in m.model.plan.layers.iter().enumerate() {
        if mlp_start(&ops.ops).is_none() {
            bail!("layer {l}: its plan has no MLP after the attention; this family cannot be quantized");
        }
    }
    Ok(())
}

/// Where a layer's MLP half starts in its plan.
fn mlp_start(ops: &[Op]) -> Option<usize> {
    ops.iter().position(|o| matches!(o, Op::MlpNorm(_)))
}

/// The job a checkpoint belongs to: a resumed run must make the same folder.
fn job(origin: &str, opts: &Options, cal: &Calibration) -> Value {
    let hash = fnv1a(0, cal.rows.iter().flatten().map(|&t| u64::from(t)));
    let mut spec = json!({
        "source": origin,
        "bits": opts.bits,
        "head_bits": opts.head_bits,
        "codebook": opts.codebook.name(),
        "calibration_rows": cal.rows.len(),
        "calibration_tokens": cal.rows.iter().map(Vec::len).sum::<usize>(),
        "calibration_hash": format!("{hash:016x}"),
        "trellm": env!("CARGO_PKG_VERSION"),
    });
    // Only a non-default seed is named, so checkpoints made before it existed still resume.
    if opts.seed != 0 {
        spec["seed"] = json!(opts.seed);
    }
    spec
}

fn progress(total: u64, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::new(total);
    if quiet || !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {percent:>3}% ETA {eta_precise} {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    pb
}

/// A source's identity for the checkpoint: its path, and for a file its size and time.
fn origin(path: &Path) -> String {
    let p = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    match std::fs::metadata(&p) {
        Ok(md) if md.is_file() => format!(
            "{} ({} bytes, modified {:?})",
            p.display(),
            md.len(),
            md.modified().ok()
        ),
        _ => p.display().to_string(),
    }
}

/// Quantizes `m` (a Hugging Face folder, or a llama / gemma3 GGUF dequantized exactly into one in
/// `OUT/.source/` first) into `out`, or resumes an interrupted run there.
pub fn quantize(m: &LoadedModel, out: &Path, cal: &Calibration, opts: &Options) -> Result<Summary> {
    let origin = origin(&m.path);
    if !m.path.is_file() {
        return quantize_hf(m, &origin, out, cal, opts, None);
    }
    if m.model.cfg.exl3 {
        bail!("{} is already EXL3", m.path.display());
    }
    let dir = out.join(".source");
    // A conversion left by another source is redone.
    let marker = dir.join("source");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(origin.as_str()) {
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot clear {}", dir.display()))?;
        }
        gguf_source::to_hf_folder(m, &dir)?;
        if !opts.quiet {
            eprintln!(
                "trellm quantize: {} dequantized exactly into {}",
                m.path.display(),
                dir.display()
            );
        }
        std::fs::write(&marker, &origin)?;
    }
    let hf = crate::model::load::load(&dir)?;
    quantize_hf(&hf, &origin, out, cal, opts, Some(&dir))
}

fn quantize_hf(
    m: &LoadedModel,
    origin: &str,
    out: &Path,
    cal: &Calibration,
    opts: &Options,
    converted: Option<&Path>,
) -> Result<Summary> {
    check_source(m)?;
    if !(1.0..=8.0).contains(&opts.bits) {
        bail!("--bits must be 1 to 8, got {}", opts.bits);
    }
    if let Some(b) = opts.head_bits.filter(|b| !(1..=8).contains(b)) {
        bail!("--head-bits must be 1..8 or none, got {b}");
    }
    let model: &CpuModel = &m.model;
    let cfg = &model.cfg;
    let (hidden, n_layers) = (cfg.hidden, cfg.n_layers());
    let src_st = trellm_formats::safetensors::SafeTensors::open(&m.path)
        .with_context(|| m.path.display().to_string())?;
    let enc = Encoder::new(opts.device)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let ck = Checkpoint::new(out);
    let job = job(origin, opts, cal);
    let resumed = ck.resume(&job, hidden)?;
    ck.begin(&job)?;

    let layer_tiles = |l: usize| -> u64 {
        let lw = &model.weights.layers[l];
        ATTN.iter()
            .chain(&MLP)
            .filter_map(|(r, _)| linear_of(lw, *r).map(|x| tiles(x.w.rows(), x.w.cols())))
            .sum()
    };
    let bit_plan = allocate(
        opts.bits,
        &(0..n_layers)
            .map(|l| {
                ATTN.iter()
                    .chain(&MLP)
                    .filter_map(|(r, _)| {
                        linear_of(&model.weights.layers[l], *r)
                            .map(|x| (*r, tiles(x.w.rows(), x.w.cols())))
                    })
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>(),
    );
    let head_tiles = opts.head_bits.map_or(0, |_| tiles(cfg.vocab, hidden));
    let total: u64 = (0..n_layers).map(layer_tiles).sum::<u64>() + head_tiles;
    let pb = progress(total, opts.quiet);
    let say = |s: String| {
        if !opts.quiet {
            pb.suspend(|| eprintln!("{s}"));
        }
    };
    let mut warnings = Vec::new();
    let warn = |w: String, warnings: &mut Vec<String>| {
        say(format!("warning: {w}"));
        warnings.push(w);
    };

    // The rows entering the first layer still to do.
    let (start, mut state) = match resumed {
        Some((l, s)) => {
            say(format!(
                "trellm quantize: resuming at layer {l} of {n_layers} from {}",
                ck.dir.display()
            ));
            (l, s)
        }
        None => {
            let rows = cal
                .rows
                .iter()
                .map(|r| {
                    let mut x = vec![0.0f32; r.len() * hidden];
                    for (t, &id) in r.iter().enumerate() {
                        let row = &mut x[t * hidden..(t + 1) * hidden];
                        model.weights.embed.dequantize_row(id as usize, row);
                        if let Some(s) = model.plan.embed_scale {
                            row.iter_mut().for_each(|v| *v *= s);
                        }
                    }
                    x
                })
                .collect();
            (0, rows)
        }
    };
    pb.set_position((0..start).map(layer_tiles).sum());
    let tokens: usize = state.iter().map(|r| r.len() / hidden).sum();
    say(format!(
        "trellm quantize: {} -> {}: {n_layers} layers at {} bpw ({}), head {}, calibration {} rows / {tokens} tokens",
        m.path.display(),
        out.display(),
        opts.bits,
        opts.codebook.name(),
        opts.head_bits.map_or("as stored".to_string(), |b| format!("{b} bpw")),
        state.len(),
    ));

    let t0 = Instant::now();
    let mut last_save = Instant::now();
    let mut layers_done = 0;
    // The o / down inputs a half keeps (one buffer a calibration row), reused from half to half:
    // fresh buffers each time faulted in about 1 GB of pages a layer.
    let mut kept: Vec<Vec<f32>> = Vec::new();
    for (l, layer_bits) in bit_plan.iter().enumerate().skip(start) {
        let tl = Instant::now();
        let ops = &model.plan.layers[l].ops;
        let split = mlp_start(ops).expect("checked");
        let src = &model.weights.layers[l];
        let mut qlw = src.clone();
        let mut tensors = Vec::new();
        let mut worst = 0.0f64;
        for (half, roles) in [(&ops[..split], &ATTN[..]), (&ops[split..], &MLP[..])] {
            // Two groups a half: the projections that read its norm's output (q/k/v, gate/up),
            // then the one that reads theirs (o, down). Each group's inputs are collected with
            // the groups before it already quantized, so each pass runs its projections once.
            let (first, last) = (roles[0].1, roles[roles.len() - 1].1);
            let finish = half.last().expect("a half has ops");
            // The last group's inputs, kept to finish the half from when they fit.
            let width = linear_of(&qlw, roles[roles.len() - 1].0).map_or(0, |x| x.w.cols());
            let keep = tokens * width * 4 <= KEEP_BYTES;
            let mut n_kept = 0;
            for (tap, tail) in [(first, Tail::InputOnly), (last, Tail::TapOnly)] {
                let mut h: Option<Hessian> = None;
                for row in &mut state {
                    let n = row.len() / hidden;
                    model.forward_layer(half, &qlw, row, tail, &mut |t, input| {
                        if t != tap {
                            return;
                        }
                        h.get_or_insert_with(|| Hessian::new(input.len() / n))
                            .add(input);
                        if t == last && keep {
                            if n_kept == kept.len() {
                                kept.push(Vec::new());
                            }
                            kept[n_kept].clear();
                            kept[n_kept].extend_from_slice(input);
                            n_kept += 1;
                        }
                    })?;
                }
                if let Some(h) = h.as_ref().filter(|h| h.skipped > 0) {
                    warn(
                        format!(
                            "layer {l} {} input: {} of {} rows held inf/NaN and were left out of H",
                            tap_name(tap),
                            h.skipped,
                            h.rows + h.skipped
                        ),
                        &mut warnings,
                    );
                }
                for &(role, _) in roles.iter().filter(|(_, t)| *t == tap) {
                    let Some(lin) = slot(&mut qlw, role) else {
                        continue;
                    };
                    let base = hf_name(cfg, role, l);
                    pb.set_message(base.clone());
                    let mut w = Vec::new();
                    let bits = layer_bits[&role];
                    let q = quantize_linear(&base, lin, h.as_ref(), bits, opts, &enc, &mut w)?;
                    for w in w {
                        warn(w, &mut warnings);
                    }
                    pb.inc(tiles(lin.w.rows(), lin.w.cols()));
                    worst = worst.max(q.proxy_err);
                    *lin = q.linear;
                    tensors.extend(q.tensors);
                }
            }
            // On through the quantized half.
            for (i, row) in state.iter_mut().enumerate() {
                match kept[..n_kept].get(i) {
                    Some(input) => model.finish_half(finish, &qlw, input, row)?,
                    None => model.forward_layer(half, &qlw, row, Tail::Residual, &mut |_, _| {})?,
                }
            }
        }
        folder::write_safetensors(&ck.layer_file(l), &tensors.iter().collect::<Vec<_>>())?;
        layers_done += 1;
        say(format!(
            "layer {}/{n_layers}: worst proxy error {worst:.5}, {:.1}s",
            l + 1,
            tl.elapsed().as_secs_f64()
        ));
        let stop = opts.stop_after.is_some_and(|s| layers_done >= s);
        if stop || last_save.elapsed() >= STATE_SAVE_INTERVAL {
            ck.save_state(&job, l + 1, &state, hidden)?;
            last_save = Instant::now();
        }
        if stop && l + 1 < n_layers {
            pb.finish_and_clear();
            say(format!(
                "stopped after layer {} (checkpoint in {}); run the same command again to resume",
                l + 1,
                ck.dir.display()
            ));
            return Ok(Summary {
                layers_done,
                finished: false,
                warnings,
                decoder_bpw: 0.0,
                model_bpw: 0.0,
                bytes: 0,
            });
        }
    }

    drop(kept);
    let mut head = Vec::new();
    if let Some(bits) = opts.head_bits {
        pb.set_message("lm_head");
        let mut h = Hessian::new(hidden);
        for row in &mut state {
            model.final_norm_rows(row);
            h.add(row);
        }
        if h.skipped > 0 {
            warn(
                format!(
                    "head input: {} rows held inf/NaN and were left out of H",
                    h.skipped
                ),
                &mut warnings,
            );
        }
        let lin = Linear {
            w: model.weights.lm_head.clone(),
            b: None,
        };
        let mut w = Vec::new();
        let q = quantize_linear("lm_head", &lin, Some(&h), bits, opts, &enc, &mut w)?;
        for w in w {
            warn(w, &mut warnings);
        }
        head = q.tensors;
        pb.inc(head_tiles);
    }
    pb.finish_and_clear();

    // The folder: the source's other tensors as stored, the quantized layers, the head.
    let mut consumed: std::collections::HashSet<String> = std::collections::HashSet::new();
    for l in 0..n_layers {
        for (role, _) in ATTN.iter().chain(&MLP) {
            consumed.insert(format!("{}.weight", hf_name(cfg, *role, l)));
        }
        consumed.insert(format!("model.layers.{l}.self_attn.qkv_proj.weight"));
        consumed.insert(format!("model.layers.{l}.mlp.gate_up_proj.weight"));
    }
    if opts.head_bits.is_some() {
        consumed.insert("lm_head.weight".into());
    }
    let mut all: Vec<Tensor> = src_st
        .tensors
        .values()
        .filter(|t| !consumed.contains(&t.name))
        .map(|t| Tensor {
            name: t.name.clone(),
            dtype: t.dtype_name.clone(),
            shape: t.shape.clone(),
            bytes: src_st.data(t).to_vec(),
        })
        .collect();
    // Bits per weight two ways: the trellis over the stored (padded) weights, which the
    // allocation targets, and everything a layer stores (scales included) over the model's own
    // weights, which is what comparisons with other formats count.
    let (mut trellis_bits, mut padded, mut stored_bits) = (0u64, 0u64, 0u64);
    for l in 0..n_layers {
        for t in folder::read_safetensors(&ck.layer_file(l))? {
            if t.name.ends_with(".trellis") {
                trellis_bits += t.bytes.len() as u64 * 8;
                padded += (t.shape[0] * t.shape[1] * 256) as u64;
            }
            stored_bits += t.bytes.len() as u64 * 8;
            all.push(t);
        }
    }
    let weights: u64 = model
        .weights
        .layers
        .iter()
        .flat_map(|lw| {
            ATTN.iter()
                .chain(&MLP)
                .filter_map(|(r, _)| linear_of(lw, *r))
        })
        .map(|x| (x.w.rows() * x.w.cols()) as u64)
        .sum();
    all.extend(head);
    let bytes = folder::write_model(out, &all, opts.shard_bytes)?;

    let mut config: Value = trellm_formats::hf::read_config(&m.path)?;
    let qc = json!({
        "quant_method": "exl3",
        "version": format!("trellm {}", env!("CARGO_PKG_VERSION")),
        "bits": opts.bits,
        "head_bits": opts.head_bits.map_or(Value::Null, |b| json!(b)),
        "calibration": {
            "rows": cal.asked.0,
            "cols": cal.asked.1,
            "rows_used": cal.rows.len(),
            "tokens": cal.rows.iter().map(Vec::len).sum::<usize>(),
            "text": cal.text,
        },
        "out_scales": "always",
        "codebook": opts.codebook.name(),
    });
    // The head is stored beside the embedding: a loader that trusts the flag must see them
    // untied (exllamav3 does the same).
    if opts.head_bits.is_some() && config.get("tie_word_embeddings").is_some() {
        config["tie_word_embeddings"] = json!(false);
    }
    config["quantization_config"] = qc.clone();
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        out.join("quantization_config.json"),
        serde_json::to_string_pretty(&folder::quantization_config_json(&qc, &all))?,
    )?;
    folder::copy_side_files(&m.path, out)?;
    ck.remove()?;
    if let Some(dir) = converted {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    let decoder_bpw = trellis_bits as f64 / padded.max(1) as f64;
    let model_bpw = stored_bits as f64 / weights.max(1) as f64;
    say(format!(
        "done: {} layers in {:.0}s, {decoder_bpw:.3} bpw over the decoder projections as stored ({model_bpw:.3} with scales and padding over the model's {weights} weights), {:.1} MB of weights{}",
        layers_done,
        t0.elapsed().as_secs_f64(),
        bytes as f64 / 1e6,
        if warnings.is_empty() {
            String::new()
        } else {
            format!(", {} warnings", warnings.len())
        }
    ));
    Ok(Summary {
        layers_done,
        finished: true,
        warnings,
        decoder_bpw,
        model_bpw,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2's layer shapes in tiles (q, k, v, o, gate, up, down; padded to 128s).
    fn smollm2_layer() -> Vec<(Role, u64)> {
        vec![
            (Role::Q, 1600),
            (Role::K, 640),
            (Role::V, 640),
            (Role::O, 1600),
            (Role::Gate, 3840),
            (Role::Up, 3840),
            (Role::Down, 3840),
        ]
    }

    #[test]
    fn fractional_bits_average_to_the_target() {
        let layers = vec![smollm2_layer(); 30];
        let total: u64 = layers.iter().flatten().map(|p| p.1).sum();
        for target in [1.5, 2.0, 2.25, 2.5, 3.05, 3.5, 4.0, 7.9, 8.0] {
            let plan = allocate(target, &layers);
            let bits: u64 = plan
                .iter()
                .zip(&layers)
                .flat_map(|(p, l)| l.iter().map(move |(r, t)| p[r] as u64 * t))
                .sum();
            let avg = bits as f64 / total as f64;
            // Below the target by at most one projection's worth of the last layer.
            assert!(avg <= target + 1e-12, "{target}: {avg}");
            assert!(
                target - avg < 3840.0 / total as f64 + 1e-12,
                "{target}: {avg}"
            );
            let lo = target.floor() as u32;
            assert!(plan
                .iter()
                .flat_map(|p| p.values())
                .all(|&b| b == lo || b == lo + 1));
        }
        // Whole targets give every projection the same bits.
        assert!(allocate(3.0, &layers)
            .iter()
            .flat_map(|p| p.values())
            .all(|&b| b == 3));
    }
}
