//! Weights as the decoder sees them: matrices stay in the file's memory map, in their stored
//! format; only small vectors (norms) are copied out as f32.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::{Dtype, SafeTensors};
use trellm_quant::exl3::{Codebook, Exl3Shape};
use trellm_quant::GgmlType;

use super::config::{Mlp, ModelConfig, Norm, QkNorm};

/// A row-major matrix `[rows, cols]` in any ggml block format, borrowed from a memory map.
#[derive(Clone)]
pub struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    map: Arc<memmap2::Mmap>,
    offset: usize,
    row_bytes: usize,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({:?}, {}x{})", self.ty, self.rows, self.cols)
    }
}

impl Matrix {
    fn new(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        map: Arc<memmap2::Mmap>,
        offset: usize,
    ) -> Result<Self> {
        if !ty.is_supported() {
            bail!("tensor {name} has type {ty:?}, which trellm cannot decode yet");
        }
        let row_bytes = ty.bytes_for(cols).ok_or_else(|| {
            anyhow!("tensor {name}: {cols} columns is not a whole number of {ty:?} blocks")
        })?;
        if offset + row_bytes * rows > map.len() {
            bail!("tensor {name} lies beyond the end of its file");
        }
        Ok(Matrix {
            ty,
            rows,
            cols,
            map,
            offset,
            row_bytes,
        })
    }

    /// The stored bytes of row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        self.rows_bytes(r, 1)
    }

    /// The stored bytes of rows `r..r + m` (rows are contiguous).
    #[inline]
    pub fn rows_bytes(&self, r: usize, m: usize) -> &[u8] {
        let s = self.offset + r * self.row_bytes;
        &self.map[s..s + m * self.row_bytes]
    }

    /// Row `r` decoded exactly into `out` (`cols` values).
    #[inline]
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        trellm_quant::dequantize(self.ty, self.row(r), out)
            .expect("row geometry validated at load");
    }
}

/// An EXL3 linear layer (`y = x W`, W `[k in][n out]`): the trellis stays in the memory map,
/// compressed; the fp16 sign/scale vectors are copied out as f32. exllamav3 pads both dimensions
/// to multiples of 128 (its Hadamard blocks): `shape` is the stored, padded geometry; the layer
/// takes `cols` inputs (zero-extended) and gives its first `rows` outputs.
#[derive(Clone)]
pub struct Exl3Matrix {
    pub shape: Exl3Shape,
    /// Output features the model uses (`<= shape.n`).
    pub rows: usize,
    /// Input features the model gives (`<= shape.k`).
    pub cols: usize,
    /// Input-side scales (`suh`, or legacy `su` signs), `k` values.
    pub suh: Vec<f32>,
    /// Output-side scales (`svh`, or legacy `sv` signs), `n` values.
    pub svh: Vec<f32>,
    map: Arc<memmap2::Mmap>,
    offset: usize,
}

impl std::fmt::Debug for Exl3Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shape;
        write!(
            f,
            "Exl3Matrix({:?}, {} bits, {}x{})",
            s.codebook,
            s.rate.bits(),
            s.n,
            s.k
        )
    }
}

impl Exl3Matrix {
    /// An EXL3 layer held in memory (an anonymous map), e.g. one the quantizer has just made;
    /// `suh`/`svh` are the stored fp16 values as f32.
    pub fn from_parts(
        shape: Exl3Shape,
        rows: usize,
        cols: usize,
        suh: Vec<f32>,
        svh: Vec<f32>,
        trellis: &[u8],
    ) -> Result<Exl3Matrix> {
        shape
            .check_trellis(trellis)
            .map_err(|e| anyhow!("in-memory EXL3 layer: {e}"))?;
        if suh.len() != shape.k || svh.len() != shape.n || rows > shape.n || cols > shape.k {
            bail!(
                "in-memory EXL3 layer: scales or dims do not fit its {}x{} trellis",
                shape.k,
                shape.n
            );
        }
        let mut map = memmap2::MmapMut::map_anon(trellis.len().max(1))?;
        map[..trellis.len()].copy_from_slice(trellis);
        Ok(Exl3Matrix {
            shape,
            rows,
            cols,
            suh,
            svh,
            map: Arc::new(map.make_read_only()?),
            offset: 0,
        })
    }

    /// The stored trellis, int16 `[k/16][n/16][16 K]` as bytes.
    #[inline]
    pub fn trellis(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.shape.trellis_bytes()]
    }

    /// Outputs `start..start + n` as a layer of their own. The output Hadamard mixes the
    /// outputs of a 128-block, so the slice must start on a block and end on one or at the last
    /// output (taking the padding with it). Copied: each row of tiles holds every output's.
    pub fn outputs(&self, start: usize, n: usize) -> Result<Exl3Matrix> {
        let (end, pad_end) = block_slice("outputs", start, n, self.rows, self.shape.n)?;
        let shape = Exl3Shape {
            n: pad_end - start,
            ..self.shape
        };
        let tile = self.shape.rate.tile_bytes();
        let row = self.shape.tiles_n() * tile;
        let trellis: Vec<u8> = self
            .trellis()
            .chunks_exact(row)
            .flat_map(|r| &r[start / 16 * tile..pad_end / 16 * tile])
            .copied()
            .collect();
        Exl3Matrix::from_parts(
            shape,
            end - start,
            self.cols,
            self.suh.clone(),
            self.svh[start..pad_end].to_vec(),
            &trellis,
        )
    }

    /// Inputs `start..start + n`: its product is the layer's partial sum over those inputs, the
    /// output Hadamard and scales applied (both linear, so the ranks' partials add up to the
    /// whole). The input Hadamard mixes a 128-block of inputs: the slice starts on one and ends
    /// on one or at the last input. A view: the trellis is stored input-major.
    pub fn inputs(&self, start: usize, n: usize) -> Result<Exl3Matrix> {
        let (end, pad_end) = block_slice("inputs", start, n, self.cols, self.shape.k)?;
        let row = self.shape.tiles_n() * self.shape.rate.tile_bytes();
        Ok(Exl3Matrix {
            shape: Exl3Shape {
                k: pad_end - start,
                ..self.shape
            },
            cols: end - start,
            suh: self.suh[start..pad_end].to_vec(),
            offset: self.offset + start / 16 * row,
            ..self.clone()
        })
    }
}

/// `start..start + n` of `used` features stored padded to `padded`, checked to cut no 128-wide
/// Hadamard block: its end, and its end in the padded storage.
fn block_slice(
    what: &str,
    start: usize,
    n: usize,
    used: usize,
    padded: usize,
) -> Result<(usize, usize)> {
    let end = start + n;
    if n == 0 || end > used {
        bail!("EXL3 {what} {start}..{end} of {used}");
    }
    let pad_end = if end == used { padded } else { end };
    if !start.is_multiple_of(128) || !pad_end.is_multiple_of(128) {
        bail!(
            "EXL3 {what} {start}..{end} of {used} cut a 128-wide Hadamard block \
             (an EXL3 layer splits only at multiples of 128)"
        );
    }
    Ok((end, pad_end))
}

/// A projection's weight: a ggml-format matrix or an EXL3 trellis.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    Ggml(Matrix),
    Exl3(Exl3Matrix),
}

impl LinearWeight {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            LinearWeight::Ggml(m) => m.rows,
            LinearWeight::Exl3(e) => e.rows,
        }
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            LinearWeight::Ggml(m) => m.cols,
            LinearWeight::Exl3(e) => e.cols,
        }
    }
}

/// Where tensors come from: a GGUF file or a folder of safetensors.
pub enum TensorSource {
    Gguf(Gguf),
    SafeTensors(SafeTensors),
}

impl TensorSource {
    fn has(&self, name: &str) -> bool {
        match self {
            TensorSource::Gguf(g) => g.tensor(name).is_some(),
            TensorSource::SafeTensors(s) => s.get(name).is_some(),
        }
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let m = match self {
            TensorSource::Gguf(g) => {
                let t = g
                    .tensor(name)
                    .ok_or_else(|| anyhow!("the model file lacks tensor {name}"))?;
                let (r, c) = t.rows_cols();
                if (r, c) != (rows, cols) {
                    bail!("tensor {name} is {r}x{c}, expected {rows}x{cols}");
                }
                Matrix::new(name, t.ty, r, c, g.map_of(t).clone(), t.offset)?
            }
            TensorSource::SafeTensors(s) => {
                let t = s
                    .get(name)
                    .ok_or_else(|| anyhow!("the model lacks tensor {name}"))?;
                let ty = st_type(name, t.dtype, &t.dtype_name)?;
                if t.shape != [rows, cols] {
                    bail!(
                        "tensor {name} has shape {:?}, expected [{rows}, {cols}]",
                        t.shape
                    );
                }
                Matrix::new(name, ty, rows, cols, s.shards[t.shard].1.clone(), t.start)?
            }
        };
        Ok(m)
    }

    /// An EXL3 layer `{base}.trellis` (with `suh`/`svh` or legacy `su`/`sv`, and the codebook
    /// marker `mcg`/`mul1`), if the folder has one; its K comes from the trellis shape.
    fn exl3(&self, base: &str, rows: usize, cols: usize) -> Result<Option<Exl3Matrix>> {
        let TensorSource::SafeTensors(s) = self else {
            return Ok(None);
        };
        let Some(t) = s.get(&format!("{base}.trellis")) else {
            return Ok(None);
        };
        if t.dtype != Dtype::I16 {
            bail!(
                "tensor {base}.trellis has dtype {}, expected I16",
                t.dtype_name
            );
        }
        let has = |suffix: &str| s.get(&format!("{base}.{suffix}")).is_some();
        let codebook = match (has("mcg"), has("mul1")) {
            (true, true) => bail!("{base} has both mcg and mul1 markers"),
            (true, false) => Codebook::Mcg,
            (false, true) => Codebook::Mul1,
            (false, false) => Codebook::Inst3,
        };
        let shape =
            Exl3Shape::from_trellis(&t.shape, codebook).map_err(|e| anyhow!("{base}: {e}"))?;
        if (shape.n, shape.k) != (rows.next_multiple_of(128), cols.next_multiple_of(128)) {
            bail!(
                "EXL3 layer {base} is {}x{} (out x in), expected {rows}x{cols} (padded to 128s)",
                shape.n,
                shape.k
            );
        }
        if t.end - t.start != shape.trellis_bytes() {
            bail!("tensor {base}.trellis has the wrong byte size");
        }
        // Scales as stored (fp16), else legacy packed signs.
        let scales = |h: &str, packed: &str, len: usize| -> Result<Vec<f32>> {
            if has(h) {
                self.vector(&format!("{base}.{h}"), len)
            } else if let Some(p) = s.get(&format!("{base}.{packed}")) {
                if p.dtype != Dtype::I16 || p.end - p.start != len / 8 {
                    bail!("tensor {base}.{packed} is not int16 [{}]", len / 16);
                }
                Ok(trellm_quant::exl3::unpack_signs(s.data(p))
                    .iter()
                    .map(|v| v.to_f32())
                    .collect())
            } else {
                bail!("EXL3 layer {base} has neither {h} nor {packed}")
            }
        };
        Ok(Some(Exl3Matrix {
            shape,
            rows,
            cols,
            suh: scales("suh", "su", shape.k)?,
            svh: scales("svh", "sv", shape.n)?,
            map: s.shards[t.shard].1.clone(),
            offset: t.start,
        }))
    }

    /// A projection `{base}.weight`, or for EXL3 folders `{base}.trellis` where stored.
    fn linear_weight(
        &self,
        base: &str,
        rows: usize,
        cols: usize,
        exl3: bool,
    ) -> Result<LinearWeight> {
        if exl3 {
            if let Some(e) = self.exl3(base, rows, cols)? {
                return Ok(LinearWeight::Exl3(e));
            }
        }
        Ok(LinearWeight::Ggml(self.matrix(
            &format!("{base}.weight"),
            rows,
            cols,
        )?))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let m = match self {
            TensorSource::Gguf(g) => {
                let t = g
                    .tensor(name)
                    .ok_or_else(|| anyhow!("the model file lacks tensor {name}"))?;
                if t.n_elements() != len as u64 {
                    bail!(
                        "tensor {name} has {} values, expected {len}",
                        t.n_elements()
                    );
                }
                Matrix::new(name, t.ty, 1, len, g.map_of(t).clone(), t.offset)?
            }
            TensorSource::SafeTensors(s) => {
                let t = s
                    .get(name)
                    .ok_or_else(|| anyhow!("the model lacks tensor {name}"))?;
                if t.shape.iter().product::<usize>() != len {
                    bail!(
                        "tensor {name} has shape {:?}, expected {len} values",
                        t.shape
                    );
                }
                let ty = st_type(name, t.dtype, &t.dtype_name)?;
                Matrix::new(name, ty, 1, len, s.shards[t.shard].1.clone(), t.start)?
            }
        };
        let mut v = vec![0.0; len];
        m.dequantize_row(0, &mut v);
        Ok(v)
    }
}

fn st_type(name: &str, dtype: Dtype, dtype_name: &str) -> Result<GgmlType> {
    Ok(match dtype {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
        _ => bail!("tensor {name} has unsupported dtype {dtype_name}"),
    })
}

/// A projection `y = W x (+ b)`.
#[derive(Clone)]
pub struct Linear {
    pub w: LinearWeight,
    pub b: Option<Vec<f32>>,
}

/// A norm's scale (the f32 value the reference multiplies by) and, for LayerNorm, its bias.
#[derive(Clone)]
pub struct NormWeights {
    pub w: Vec<f32>,
    pub b: Option<Vec<f32>>,
}

#[derive(Clone)]
pub struct LayerWeights {
    pub attn_norm: Option<NormWeights>,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<NormWeights>,
    pub ffn_norm: Option<NormWeights>,
    /// None for a plain (ungated) MLP.
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
    pub post_ffn_norm: Option<NormWeights>,
}

#[derive(Clone)]
pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: NormWeights,
    /// The output projection; the embedding itself when they are tied.
    pub lm_head: LinearWeight,
}

/// The decoder's roles for a layer's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    PostAttnNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    PostFfnNorm,
}

/// GGUF names (without `.weight`/`.bias`), as llama.cpp's converter writes them.
pub fn gguf_name(role: Role, l: usize) -> String {
    let s = match role {
        Role::AttnNorm => "attn_norm",
        Role::Q => "attn_q",
        Role::K => "attn_k",
        Role::V => "attn_v",
        Role::O => "attn_output",
        Role::QNorm => "attn_q_norm",
        Role::KNorm => "attn_k_norm",
        Role::PostAttnNorm => "post_attention_norm",
        Role::FfnNorm => "ffn_norm",
        Role::Gate => "ffn_gate",
        Role::Up => "ffn_up",
        Role::Down => "ffn_down",
        Role::PostFfnNorm => "post_ffw_norm",
    };
    format!("blk.{l}.{s}")
}

/// Hugging Face names (without `.weight`/`.bias`). They follow from the layout: the fused
/// matrices of phi3 are looked up by `fused_name`.
pub fn hf_name(cfg: &ModelConfig, role: Role, l: usize) -> String {
    let s = match role {
        Role::AttnNorm => "input_layernorm",
        Role::Q => "self_attn.q_proj",
        Role::K => "self_attn.k_proj",
        Role::V => "self_attn.v_proj",
        Role::O => "self_attn.o_proj",
        Role::QNorm => "self_attn.q_norm",
        Role::KNorm => "self_attn.k_norm",
        // Llama's norm before the MLP is called post_attention_layernorm; with post-norms
        // (gemma2/3, olmo2) that name takes its literal meaning.
        Role::FfnNorm if !cfg.post_norms => "post_attention_layernorm",
        Role::FfnNorm => "pre_feedforward_layernorm",
        Role::PostAttnNorm => "post_attention_layernorm",
        Role::Gate => "mlp.gate_proj",
        Role::Up if cfg.mlp == Mlp::Plain => "mlp.c_fc",
        Role::Up => "mlp.up_proj",
        Role::Down if cfg.mlp == Mlp::Plain => "mlp.c_proj",
        Role::Down => "mlp.down_proj",
        Role::PostFfnNorm => "post_feedforward_layernorm",
    };
    format!("model.layers.{l}.{s}")
}

impl Matrix {
    /// An f32 matrix held in memory (an anonymous map) rather than a file, e.g. weights rounded
    /// for a comparison.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Matrix> {
        if values.len() != rows * cols {
            bail!("{} values for a {rows}x{cols} matrix", values.len());
        }
        let mut map = memmap2::MmapMut::map_anon((values.len() * 4).max(1))?;
        for (b, v) in map.chunks_exact_mut(4).zip(values) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        Matrix::new(
            "in-memory",
            GgmlType::F32,
            rows,
            cols,
            Arc::new(map.make_read_only()?),
            0,
        )
    }

    /// Columns `start..start + n` of every row, copied into a matrix of their own (in memory).
    /// Both ends must fall on the format's block boundaries.
    pub fn cols_copy(&self, start: usize, n: usize) -> Result<Matrix> {
        let block = self.ty.block_len();
        if start + n > self.cols || !start.is_multiple_of(block) || !n.is_multiple_of(block) {
            bail!(
                "columns {start}..{} of a {:?} matrix of {} columns do not fall on its {block}-value blocks",
                start + n,
                self.ty,
                self.cols
            );
        }
        let skip = self.ty.bytes_for(start).expect("whole blocks");
        let take = self.ty.bytes_for(n).expect("whole blocks");
        let mut map = memmap2::MmapMut::map_anon((self.rows * take).max(1))?;
        for (r, out) in map
            .chunks_exact_mut(take.max(1))
            .take(self.rows)
            .enumerate()
        {
            out.copy_from_slice(&self.row(r)[skip..skip + take]);
        }
        Matrix::new(
            "a column slice",
            self.ty,
            self.rows,
            n,
            Arc::new(map.make_read_only()?),
            0,
        )
    }

    /// Rows `start..start + n` as a matrix of their own (a view of the same bytes).
    pub fn rows_view(&self, start: usize, n: usize) -> Matrix {
        assert!(start + n <= self.rows);
        Matrix {
            rows: n,
            offset: self.offset + start * self.row_bytes,
            ..self.clone()
        }
    }
}

impl Weights {
    pub fn load(src: &TensorSource, cfg: &ModelConfig) -> Result<Self> {
        let gguf = matches!(src, TensorSource::Gguf(_));
        let name = |role, l| {
            if gguf {
                gguf_name(role, l)
            } else {
                hf_name(cfg, role, l)
            }
        };
        let (embed_name, norm_name, head_name) = if gguf {
            ("token_embd.weight", "output_norm", "output.weight")
        } else {
            ("model.embed_tokens.weight", "model.norm", "lm_head.weight")
        };
        // Gemma computes RMSNorm with (1 + w). HF folders store w; GGUF stores 1 + w, which we
        // take apart and rebuild so the f32 value equals the reference's 1 + w bit for bit.
        let scale = |n: &str, len| -> Result<Vec<f32>> {
            let mut v = src.vector(&format!("{n}.weight"), len)?;
            if cfg.norm_plus_one {
                for x in &mut v {
                    *x = if gguf { (*x - 1.0) + 1.0 } else { 1.0 + *x };
                }
            }
            Ok(v)
        };
        let norm = |n: &str, len| -> Result<NormWeights> {
            Ok(NormWeights {
                w: scale(n, len)?,
                b: match cfg.norm {
                    Norm::Rms => None,
                    Norm::Layer => Some(src.vector(&format!("{n}.bias"), len)?),
                },
            })
        };
        let linear = |n: &str, rows, cols, bias: bool| -> Result<Linear> {
            Ok(Linear {
                w: src.linear_weight(n, rows, cols, cfg.exl3)?,
                b: if bias {
                    let name = format!("{n}.bias");
                    let padded = rows.next_multiple_of(128);
                    Some(match src.vector(&name, rows) {
                        // An EXL3 layer padded to 128 outputs may store its bias padded too.
                        Err(_) if cfg.exl3 && padded != rows && src.has(&name) => {
                            let mut b = src.vector(&name, padded)?;
                            b.truncate(rows);
                            b
                        }
                        r => r?,
                    })
                } else {
                    None
                },
            })
        };
        let (h, hd, ff) = (cfg.hidden, cfg.head_dim, cfg.intermediate);
        let q_rows = cfg.n_heads * hd;
        let kv_rows = cfg.n_kv_heads * hd;
        let mut layers = Vec::with_capacity(cfg.n_layers());
        for l in 0..cfg.n_layers() {
            let nm = |role| name(role, l);
            // exllamav3 quantizes phi3's fused projections part by part and stores each under
            // the part's name (q/k/v, gate/up): such folders read like unfused ones.
            let fused = |on: bool, part: Role, what: &str| -> Result<bool> {
                if !on || !cfg.exl3 {
                    return Ok(on);
                }
                if src.has(&format!("{}.trellis", nm(part))) {
                    return Ok(false);
                }
                bail!("EXL3 layer {l}: no {what} projections (exllamav3 stores them split, e.g. {}.trellis)", nm(part))
            };
            let fused_qkv = fused(cfg.fused_qkv, Role::Q, "q/k/v")?;
            let fused_gate_up = fused(cfg.fused_gate_up, Role::Gate, "gate/up")?;
            let (q, k, v) = if fused_qkv {
                let n = if gguf {
                    format!("blk.{l}.attn_qkv.weight")
                } else {
                    format!("model.layers.{l}.self_attn.qkv_proj.weight")
                };
                let m = src.matrix(&n, q_rows + 2 * kv_rows, h)?;
                let part = |start, rows| Linear {
                    w: LinearWeight::Ggml(m.rows_view(start, rows)),
                    b: None,
                };
                (
                    part(0, q_rows),
                    part(q_rows, kv_rows),
                    part(q_rows + kv_rows, kv_rows),
                )
            } else {
                (
                    linear(&nm(Role::Q), q_rows, h, cfg.qkv_bias)?,
                    linear(&nm(Role::K), kv_rows, h, cfg.qkv_bias)?,
                    linear(&nm(Role::V), kv_rows, h, cfg.qkv_bias)?,
                )
            };
            let (gate, up) = match (cfg.mlp, fused_gate_up) {
                (Mlp::Plain, _) => (None, linear(&nm(Role::Up), ff, h, cfg.mlp_bias)?),
                (Mlp::Gated, true) => {
                    // GGUF keeps phi3's fused gate/up under the up projection's name.
                    let n = if gguf {
                        format!("blk.{l}.ffn_up.weight")
                    } else {
                        format!("model.layers.{l}.mlp.gate_up_proj.weight")
                    };
                    let m = src.matrix(&n, 2 * ff, h)?;
                    let part = |start| Linear {
                        w: LinearWeight::Ggml(m.rows_view(start, ff)),
                        b: None,
                    };
                    (Some(part(0)), part(ff))
                }
                (Mlp::Gated, false) => (
                    Some(linear(&nm(Role::Gate), ff, h, cfg.mlp_bias)?),
                    linear(&nm(Role::Up), ff, h, cfg.mlp_bias)?,
                ),
            };
            let (qn_len, kn_len) = match cfg.qk_norm {
                QkNorm::Whole => (q_rows, kv_rows),
                _ => (hd, hd),
            };
            let opt_scale = |role, len| -> Result<Option<Vec<f32>>> {
                let n = nm(role);
                if src.has(&format!("{n}.weight")) {
                    scale(&n, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let lw = LayerWeights {
                attn_norm: if cfg.pre_norms {
                    Some(norm(&nm(Role::AttnNorm), h)?)
                } else {
                    None
                },
                q,
                k,
                v,
                o: linear(&nm(Role::O), h, q_rows, cfg.o_bias)?,
                q_norm: opt_scale(Role::QNorm, qn_len)?,
                k_norm: opt_scale(Role::KNorm, kn_len)?,
                post_attn_norm: if cfg.post_norms {
                    Some(norm(&nm(Role::PostAttnNorm), h)?)
                } else {
                    None
                },
                ffn_norm: if cfg.pre_norms {
                    Some(norm(&nm(Role::FfnNorm), h)?)
                } else {
                    None
                },
                gate,
                up,
                down: linear(&nm(Role::Down), h, ff, cfg.mlp_bias)?,
                post_ffn_norm: if cfg.post_norms {
                    Some(norm(&nm(Role::PostFfnNorm), h)?)
                } else {
                    None
                },
            };
            if cfg.qk_norm != QkNorm::None && (lw.q_norm.is_none() || lw.k_norm.is_none()) {
                bail!("layer {l} lacks its q/k norm weights");
            }
            layers.push(lw);
        }
        let embed = src.matrix(embed_name, cfg.vocab, h)?;
        // GGUF ties by leaving output.weight out; a HF config says so (and mlx-lm then ignores
        // any lm_head tensor). EXL3 quantizes the head separately even for tied models.
        let exl3_head = if cfg.exl3 {
            src.exl3("lm_head", cfg.vocab, h)?
        } else {
            None
        };
        let lm_head = match exl3_head {
            Some(e) => LinearWeight::Exl3(e),
            None if cfg.tied_embeddings => LinearWeight::Ggml(embed.clone()),
            None => LinearWeight::Ggml(src.matrix(head_name, cfg.vocab, h)?),
        };
        Ok(Weights {
            embed,
            layers,
            final_norm: norm(norm_name, h)?,
            lm_head,
        })
    }
}
