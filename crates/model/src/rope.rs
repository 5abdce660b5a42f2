//! Rotary position embeddings: every variant mlx-lm builds (`rope_utils.initialize_rope` plus
//! phi3's own construction), with frequency tables and rotations computed by the same float32
//! operations mlx runs on the CPU, so that tables and rotated vectors are bit-identical.
//!
//! mlx's `fast.rope` takes either a `base` (inverse frequencies `exp(-i * ln(base) / half)`) or a
//! table of `freqs` (periods; it uses `1 / freqs`), scales positions by `scale`, and rotates
//! `x[..dims]` by `theta = position * inv_freq` with its own (Cephes) `sin`/`cos`, not libm's.

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::mlx_math::{mlx_exp, mlx_sin_cos};

/// Where a layer's inverse frequencies come from.
#[derive(Debug, Clone, PartialEq)]
enum Freqs {
    /// mlx's `base=` path: `exp(-i * ln(base) / half)`.
    Base(f32),
    /// mlx's `freqs=` path: the periods, used as `1 / freqs`.
    Table(Vec<f32>),
    /// Dynamic NTK: the base grows with the length of the sequence seen so far.
    Dynamic {
        base: f64,
        factor: f64,
        max_positions: usize,
    },
}

/// One layer's rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// Rotated dimensions at the start of each head (the rest pass through).
    pub dims: usize,
    /// Pairs are adjacent `(x[2i], x[2i+1])` rather than split halves `(x[i], x[i + dims/2])`.
    pub traditional: bool,
    /// Positions are multiplied by this (linear scaling's `1 / factor`).
    pub position_scale: f32,
    /// The rotated part of x is multiplied by this before rotating (longrope's and yarn's mscale).
    pub input_scale: Option<f32>,
    freqs: Freqs,
}

/// A `rope_scaling` object's fields, with errors that name the missing one.
struct Scaling<'a>(&'a serde_json::Map<String, Value>);

impl Scaling<'_> {
    fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.0.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| anyhow!("rope_scaling.{k} is not a number")),
        }
    }
    fn f64(&self, k: &str) -> Result<f64> {
        self.opt_f64(k)?
            .ok_or_else(|| anyhow!("rope_scaling lacks the field {k}"))
    }
    /// A number or a list of numbers, as float32 (mlx converts these to float32 arrays).
    fn factors(&self, k: &str, len: usize) -> Result<Vec<f32>> {
        match self.0.get(k) {
            None | Some(Value::Null) => bail!("rope_scaling lacks the field {k}"),
            Some(Value::Array(a)) => {
                let v = a
                    .iter()
                    .map(|x| x.as_f64().map(|x| x as f32))
                    .collect::<Option<Vec<f32>>>()
                    .ok_or_else(|| anyhow!("rope_scaling.{k} holds a non-number"))?;
                if v.len() != len {
                    bail!("rope_scaling.{k} has {} entries, expected {len}", v.len());
                }
                Ok(v)
            }
            Some(v) => {
                let x = v
                    .as_f64()
                    .ok_or_else(|| anyhow!("rope_scaling.{k} is not a number or a list"))?;
                Ok(vec![x as f32; len])
            }
        }
    }
}

/// The scaling types `Rope::new` accepts (`type` or `rope_type` of `rope_scaling`).
pub const ROPE_TYPES: &[&str] = &[
    "default",
    "linear",
    "dynamic",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "telechat3-yarn",
    "longrope",
    "proportional",
    "mrope",
];

/// `base ** (arange(0, dims, 2) / dims)` in float32: the periods of plain RoPE.
fn periods(dims: usize, rotated: usize, base: f32) -> Vec<f32> {
    (0..rotated)
        .step_by(2)
        .map(|i| base.powf(i as f32 / dims as f32))
        .collect()
}

impl Rope {
    /// Plain RoPE (`nn.RoPE`).
    pub fn plain(dims: usize, base: f32, traditional: bool, position_scale: f32) -> Rope {
        Rope {
            dims,
            traditional,
            position_scale,
            input_scale: None,
            freqs: Freqs::Base(base),
        }
    }

    /// Plain RoPE whose pair `i` turns `factors[i]` times slower (GGUF's `rope_freqs` tensor, which
    /// llama.cpp's converter writes for llama3 scaling): periods `base^(2i/dims) * factors[i]`.
    pub fn with_factors(dims: usize, base: f32, traditional: bool, factors: &[f32]) -> Rope {
        let freqs = periods(dims, dims, base)
            .into_iter()
            .zip(factors)
            .map(|(p, f)| p * f)
            .collect();
        Rope {
            dims,
            traditional,
            position_scale: 1.0,
            input_scale: None,
            freqs: Freqs::Table(freqs),
        }
    }

    /// mlx-lm's `initialize_rope(dims, base, traditional, scaling_config, max_position_embeddings)`.
    pub fn new(
        dims: usize,
        base: f64,
        traditional: bool,
        scaling: Option<&Value>,
        max_positions: Option<usize>,
    ) -> Result<Rope> {
        if dims == 0 || !dims.is_multiple_of(2) {
            bail!("rotary dimensions must be even and positive, got {dims}");
        }
        let scaling = match scaling {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => Some(Scaling(m)),
            Some(_) => bail!("rope_scaling is not an object"),
        };
        let ty = match &scaling {
            None => "default",
            Some(s) => {
                s.0.get("type")
                    .and_then(Value::as_str)
                    .or_else(|| s.0.get("rope_type").and_then(Value::as_str))
                    .unwrap_or("default")
            }
        };
        let base32 = base as f32;
        let need_max = || {
            max_positions.ok_or_else(|| {
                anyhow!("rope_scaling type '{ty}' needs the field max_position_embeddings")
            })
        };
        let half = dims / 2;
        let rope = match (ty, &scaling) {
            ("default" | "mrope", _) | (_, None) => Rope::plain(dims, base32, traditional, 1.0),
            ("linear", Some(s)) => {
                Rope::plain(dims, base32, traditional, (1.0 / s.f64("factor")?) as f32)
            }
            ("dynamic", Some(s)) => Rope {
                dims,
                traditional,
                position_scale: 1.0,
                input_scale: None,
                freqs: Freqs::Dynamic {
                    base,
                    factor: s.f64("factor")?,
                    max_positions: need_max()?,
                },
            },
            ("llama3", Some(s)) => {
                let factor = s.f64("factor")? as f32;
                let low = s.opt_f64("low_freq_factor")?.unwrap_or(1.0);
                let high = s.opt_f64("high_freq_factor")?.unwrap_or(4.0);
                let old_ctx = s
                    .opt_f64("original_max_position_embeddings")?
                    .unwrap_or(8192.0);
                let low_wavelen = (old_ctx / low) as f32;
                let high_wavelen = (old_ctx / high) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let (old32, low32) = (old_ctx as f32, low as f32);
                let span = (high - low) as f32;
                let freqs = periods(dims, dims, base32)
                    .into_iter()
                    .map(|f| {
                        let wavelen = two_pi * f;
                        let f = if wavelen > low_wavelen { f * factor } else { f };
                        if wavelen > high_wavelen && wavelen < low_wavelen {
                            let smooth = (old32 / wavelen - low32) / span;
                            f / ((1.0 - smooth) / factor + smooth)
                        } else {
                            f
                        }
                    })
                    .collect();
                Rope {
                    dims,
                    traditional,
                    position_scale: 1.0,
                    input_scale: None,
                    freqs: Freqs::Table(freqs),
                }
            }
            ("yarn" | "deepseek_yarn" | "telechat3-yarn", Some(s)) => {
                let factor = s.f64("factor")?;
                let orig = s
                    .opt_f64("original_max_position_embeddings")?
                    .unwrap_or(4096.0);
                let beta_fast = s.opt_f64("beta_fast")?.unwrap_or(32.0);
                let beta_slow = s.opt_f64("beta_slow")?.unwrap_or(1.0);
                let mscale = s.opt_f64("mscale")?.unwrap_or(1.0);
                let mscale_all_dim = s.opt_f64("mscale_all_dim")?.unwrap_or(0.0);
                let correction_dim = |rotations: f64| {
                    dims as f64 * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let low = (correction_dim(beta_fast).floor()).max(0.0);
                let high = (correction_dim(beta_slow).ceil()).min(dims as f64 - 1.0);
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let input_scale = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);
                let high = if low == high { high + 0.001 } else { high };
                let (low32, span32) = (low as f32, (high - low) as f32);
                let factor32 = factor as f32;
                let freqs = periods(dims, dims, base32)
                    .into_iter()
                    .enumerate()
                    .map(|(i, extra)| {
                        let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
                        let mask = 1.0 - ramp;
                        let inter = factor32 * extra;
                        (inter * extra) / (inter * mask + extra * (1.0 - mask))
                    })
                    .collect();
                Rope {
                    dims,
                    traditional,
                    position_scale: 1.0,
                    input_scale: (input_scale != 1.0).then_some(input_scale as f32),
                    freqs: Freqs::Table(freqs),
                }
            }
            ("longrope", Some(s)) => {
                let orig = s.f64("original_max_position_embeddings")?;
                Rope::su_scaled(dims, base32, need_max()? as f64, orig, s, None)?
            }
            ("proportional", Some(s)) => {
                let partial = s.opt_f64("partial_rotary_factor")?.unwrap_or(1.0);
                let rotated = (dims as f64 * partial) as usize;
                if rotated > dims {
                    bail!("rope_scaling.partial_rotary_factor {partial} rotates more than {dims} dimensions");
                }
                let factor = s.opt_f64("factor")?.unwrap_or(1.0) as f32;
                // Unrotated pairs get an infinite period: theta = 0, an exact identity.
                let mut freqs: Vec<f32> = periods(dims, rotated, base32)
                    .into_iter()
                    .map(|p| factor * p)
                    .collect();
                freqs.resize(half, f32::INFINITY);
                Rope {
                    dims,
                    traditional,
                    position_scale: 1.0,
                    input_scale: None,
                    freqs: Freqs::Table(freqs),
                }
            }
            (other, Some(_)) => bail!(
                "unsupported rope_scaling type '{}' (supported: {})",
                trellm_formats::quote(other),
                ROPE_TYPES.join(", ")
            ),
        };
        Ok(rope)
    }

    /// Su-scaled ("longrope") RoPE as mlx-lm builds it: `long_factor` at every position, and the
    /// rotated part of x scaled by `sqrt(1 + ln(max / orig) / ln(orig))` (or `long_mscale`).
    fn su_scaled(
        dims: usize,
        base: f32,
        max_positions: f64,
        orig: f64,
        s: &Scaling,
        long_mscale: Option<f64>,
    ) -> Result<Rope> {
        let long = s.factors("long_factor", dims / 2)?;
        let freqs = periods(dims, dims, base)
            .into_iter()
            .zip(long)
            .map(|(p, l)| l * p)
            .collect();
        let factor = max_positions / orig;
        let scale = match long_mscale {
            Some(m) if m != 0.0 => m,
            _ if factor <= 1.0 => 1.0,
            _ => (1.0 + factor.ln() / orig.ln()).sqrt(),
        };
        Ok(Rope {
            dims,
            traditional: false,
            position_scale: 1.0,
            input_scale: Some(scale as f32),
            freqs: Freqs::Table(freqs),
        })
    }

    /// Phi-3's own construction: su-scaling for `longrope`/`su` (with the top-level
    /// `original_max_position_embeddings`), linear scaling, or plain RoPE.
    pub fn phi3(
        dims: usize,
        base: f64,
        traditional: bool,
        scaling: Option<&Value>,
        max_positions: usize,
        original_max_positions: usize,
    ) -> Result<Rope> {
        let Some(Value::Object(m)) = scaling else {
            return Ok(Rope::plain(dims, base as f32, traditional, 1.0));
        };
        let s = Scaling(m);
        let ty = m.get("type").and_then(Value::as_str).ok_or_else(|| {
            anyhow!("rope_scaling lacks the field type (phi3 needs type and long_factor)")
        })?;
        if !m.contains_key("long_factor") {
            bail!("rope_scaling lacks the field long_factor (phi3 needs type and long_factor)");
        }
        match ty {
            "longrope" | "su" => Rope::su_scaled(
                dims,
                base as f32,
                max_positions as f64,
                original_max_positions as f64,
                &s,
                None,
            ),
            "linear" => Ok(Rope::plain(
                dims,
                base as f32,
                traditional,
                (1.0 / s.f64("factor")?) as f32,
            )),
            // mlx-lm warns and runs without scaling.
            _ => Ok(Rope::plain(dims, base as f32, traditional, 1.0)),
        }
    }

    /// Checks what a config file could have made impossible: the rotated dimensions (even, within
    /// the head), the base, scales and periods (finite and positive; a period may be infinite,
    /// which leaves its pair unrotated).
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let bad = |what: &str, v: f64| anyhow!("RoPE {what} must be finite and positive, got {v}");
        if self.dims == 0 || !self.dims.is_multiple_of(2) || self.dims > head_dim {
            bail!(
                "RoPE rotates {} dimensions of a {head_dim}-dimensional head (must be even, positive, at most the head)",
                self.dims
            );
        }
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.position_scale as f64) {
            return Err(bad("position scale", self.position_scale as f64));
        }
        if let Some(s) = self.input_scale {
            if !pos(s as f64) {
                return Err(bad("input scale (mscale)", s as f64));
            }
        }
        match &self.freqs {
            Freqs::Base(b) if !pos(*b as f64) => return Err(bad("base (rope_theta)", *b as f64)),
            Freqs::Table(t) => {
                if let Some(&f) = t.iter().find(|&&f| f.is_nan() || f <= 0.0) {
                    return Err(bad("frequency table entry", f as f64));
                }
                if t.len() != self.dims / 2 {
                    bail!(
                        "RoPE table has {} entries for {} dimensions",
                        t.len(),
                        self.dims
                    );
                }
            }
            Freqs::Dynamic {
                base,
                factor,
                max_positions,
            } => {
                if !pos(*base) {
                    return Err(bad("base (rope_theta)", *base));
                }
                if !pos(*factor) {
                    return Err(bad("scaling factor", *factor));
                }
                if *max_positions == 0 || self.dims <= 2 {
                    bail!("dynamic RoPE needs max_position_embeddings >= 1 and more than 2 rotated dimensions");
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The periods mlx is given (`freqs=`), where the variant uses a table.
    pub fn freqs(&self) -> Option<&[f32]> {
        match &self.freqs {
            Freqs::Table(t) => Some(t),
            _ => None,
        }
    }

    /// Whether the frequencies depend on the sequence length (dynamic NTK).
    pub fn is_dynamic(&self) -> bool {
        matches!(self.freqs, Freqs::Dynamic { .. })
    }

    /// Inverse frequencies (one per rotated pair) for a forward pass whose last position is
    /// `seq_len - 1`.
    pub fn inv_freq(&self, seq_len: usize) -> Vec<f32> {
        let half = self.dims / 2;
        let from_base = |base: f32| {
            let step = base.ln() / half as f32;
            (0..half)
                .map(|i| mlx_exp(-(i as f32) * step))
                .collect::<Vec<_>>()
        };
        match &self.freqs {
            Freqs::Base(b) => from_base(*b),
            Freqs::Table(t) => t.iter().map(|f| 1.0 / f).collect(),
            Freqs::Dynamic {
                base,
                factor,
                max_positions,
            } => {
                let len = seq_len.max(*max_positions) as f64;
                let d = self.dims as f64;
                let b = base
                    * ((factor * len / *max_positions as f64) - (factor - 1.0)).powf(d / (d - 2.0));
                from_base(b as f32)
            }
        }
    }

    /// cos and sin of `position * position_scale * inv_freq` for every pair.
    pub fn cos_sin(&self, position: i64, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
        let p = position as f32 * self.position_scale;
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
            let (sv, cv) = mlx_sin_cos(p * f);
            *c = cv;
            *s = sv;
        }
    }

    /// Rotates one head in place with a row's `cos_sin` table.
    pub fn rotate(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let x = &mut head[..self.dims];
        if let Some(s) = self.input_scale {
            x.iter_mut().for_each(|v| *v *= s);
        }
        let half = self.dims / 2;
        for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
            let (a, b) = if self.traditional {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x1, x2) = (x[a], x[b]);
            x[a] = x1 * c - x2 * s;
            x[b] = x1 * s + x2 * c;
        }
    }
}
