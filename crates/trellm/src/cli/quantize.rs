//! `trellm quantize`: parse and check the flags, pick the calibration rows, run
//! [`crate::quantize::quantize`].

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use trellm_quant::exl3::Codebook;

use super::{flags, ModelArgs};
use crate::backend::Device;
use crate::quantize::{calibration, quantize, Calibration, Options};

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The EXL3 folder to write (a run interrupted there resumes when started again).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Bits per weight of the decoder layers' projections, 1 to 8; a fraction (2.5) is met on
    /// average by giving some projections of each layer one bit more.
    #[arg(long, short = 'b')]
    pub bits: String,
    /// Bits per weight of the output head (1 to 8), or `none` to keep it as stored.
    #[arg(long, default_value = "6")]
    pub head_bits: String,
    /// Trellis codebook: mul1 (exllamav3's default), mcg or 3inst.
    #[arg(long, default_value = "mul1")]
    pub codebook: String,
    /// Calibration text (UTF-8, used whole), or token rows: a `.safetensors` file with
    /// `input_ids` [rows, cols] (and optionally `lengths`), as exllamav3's --cal_data [default:
    /// the first 40% of the lines of ../shared/data/wikitext-2-raw-test.raw, lines 1-1156 of
    /// 2892 split on \n; evaluate on the rest].
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Calibration rows (0: no calibration, every H the identity), the first of the file's:
    /// exllamav3's default (the default text fills only 64 rows of 2048).
    #[arg(long, visible_alias = "rows", default_value_t = 250)]
    pub calib_rows: usize,
    /// Tokens per calibration row (at most the model's context). exllamav3's default.
    #[arg(long, visible_alias = "cols", default_value_t = 2048)]
    pub calib_cols: usize,
    /// Largest safetensors shard in MB; bigger models are split into model-0000N-of-0000M
    /// files. exllamav3's default.
    #[arg(long, default_value_t = 8192.0)]
    pub shard_size: f64,
    /// Seed mixed into every tensor's random signs (0: the default ones). Other seeds give other,
    /// equally valid files: at 3 bpw on SmolLM2 their mean KLD spread by about ±4%.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop after this many layers with the checkpoint saved, as an interruption would (tests).
    #[arg(long, hide = true)]
    pub stop_after_layers: Option<usize>,
    /// Where the trellis search (the tile encoder) runs: cpu, or cuda (the first NVIDIA GPU);
    /// the same bytes either way.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// No progress bar or per-layer lines.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Flag checks that need no model.
fn options(a: &QuantizeArgs) -> Result<Options> {
    let bits = match a.bits.trim().parse::<f64>() {
        Ok(b) if (1.0..=8.0).contains(&b) => b,
        _ => bail!(
            "--bits must be a number of bits from 1 to 8, got '{}'",
            a.bits
        ),
    };
    let head_bits = match a.head_bits.trim() {
        "none" => None,
        s => match s.parse::<u32>() {
            Ok(b) if (1..=8).contains(&b) => Some(b),
            _ => bail!("--head-bits must be 1 to 8 or none, got '{s}'"),
        },
    };
    let Some(codebook) = Codebook::from_name(&a.codebook) else {
        bail!(
            "--codebook must be mul1, mcg or 3inst, got '{}'",
            a.codebook
        );
    };
    if a.calib_rows > 0 && a.calib_cols < 2 {
        bail!("--calib-cols must be at least 2");
    }
    flags::check_count("--calib-rows", a.calib_rows, 1 << 20)?;
    if !(a.shard_size.is_finite() && a.shard_size > 0.0) {
        bail!("--shard-size must be a positive number of MB");
    }
    Ok(Options {
        bits,
        head_bits,
        codebook,
        shard_bytes: (a.shard_size * (1u64 << 20) as f64) as u64,
        stop_after: a.stop_after_layers,
        quiet: a.quiet,
        device: a.device,
        seed: a.seed,
    })
}

pub fn run(mut a: QuantizeArgs) -> Result<()> {
    let opts = options(&a)?;
    // The calibration passes run the projections quantized so far exactly (the fast paths'
    // int16 activations would make the files depend on the CPU).
    a.model.exl3_exact = true;
    let token_file = a
        .calibration
        .as_deref()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"));
    // A text is read before the model so a missing file fails at once.
    let text = if a.calib_rows > 0 && token_file.is_none() {
        Some(calibration::text(a.calibration.as_deref())?)
    } else {
        None
    };
    let m = a.model.load()?;
    let cols = a.calib_cols.min(m.model.cfg.max_context.max(2));
    // The rows, their description for config.json, and what gave them (for a shortfall).
    let (rows, describe, source) = match (text, token_file) {
        (_, Some(file)) if a.calib_rows > 0 => {
            let t = calibration::token_rows(file, a.calib_rows, cols, m.model.cfg.vocab)?;
            (t.rows, t.describe, file.display().to_string())
        }
        (Some(t), _) => {
            let tok = m.tokenizer()?;
            let ids = tok.encode(&t.text, false)?;
            let bos = if tok.add_bos() { tok.bos_id() } else { None };
            let rows = calibration::rows(&ids, bos, a.calib_rows, cols);
            let source = format!("the calibration text ({} tokens)", ids.len());
            (rows, t.describe, source)
        }
        _ => (Vec::new(), "none (H = identity)".into(), String::new()),
    };
    if rows.len() < a.calib_rows && !a.quiet {
        eprintln!(
            "trellm quantize: {source} gives {} rows of up to {cols} tokens, fewer than --calib-rows {}",
            rows.len(),
            a.calib_rows
        );
    }
    let asked = if a.calib_rows > 0 {
        (a.calib_rows, cols)
    } else {
        (0, 0)
    };
    let cal = Calibration {
        rows,
        asked,
        text: describe,
    };
    quantize(&m, &a.out, &cal, &opts)?;
    Ok(())
}
