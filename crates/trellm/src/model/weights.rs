//! Weights as the decoder sees them: matrices stay in the file's memory map, in their stored
//! format; only small vectors (norms) are copied out as f32.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::{Dtype, SafeTensors};
use trellm_quant::GgmlType;

use super::config::{Family, ModelConfig};

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
        let s = self.offset + r * self.row_bytes;
        &self.map[s..s + self.row_bytes]
    }

    /// Row `r` decoded exactly into `out` (`cols` values).
    #[inline]
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        trellm_quant::dequantize(self.ty, self.row(r), out)
            .expect("row geometry validated at load");
    }

    pub fn n_bytes(&self) -> usize {
        self.row_bytes * self.rows
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
                Matrix::new(name, t.ty, r, c, g.map().clone(), t.offset)?
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
                Matrix::new(name, t.ty, 1, len, g.map().clone(), t.offset)?
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

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
    pub post_ffn_norm: Option<Vec<f32>>,
}

pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// The output projection; the embedding itself when they are tied.
    pub lm_head: Matrix,
}

/// The decoder's roles for a layer's tensors.
#[derive(Clone, Copy)]
enum Role {
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

fn gguf_name(role: Role, l: usize) -> String {
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
    format!("blk.{l}.{s}.weight")
}

fn hf_name(family: Family, role: Role, l: usize) -> String {
    let s = match (family, role) {
        (_, Role::AttnNorm) => "input_layernorm",
        (_, Role::Q) => "self_attn.q_proj",
        (_, Role::K) => "self_attn.k_proj",
        (_, Role::V) => "self_attn.v_proj",
        (_, Role::O) => "self_attn.o_proj",
        (_, Role::QNorm) => "self_attn.q_norm",
        (_, Role::KNorm) => "self_attn.k_norm",
        // Llama's norm before the MLP is called post_attention_layernorm; gemma's sandwich norms
        // give that name its literal meaning.
        (Family::Llama, Role::FfnNorm) => "post_attention_layernorm",
        (_, Role::PostAttnNorm) => "post_attention_layernorm",
        (_, Role::FfnNorm) => "pre_feedforward_layernorm",
        (_, Role::Gate) => "mlp.gate_proj",
        (_, Role::Up) => "mlp.up_proj",
        (_, Role::Down) => "mlp.down_proj",
        (_, Role::PostFfnNorm) => "post_feedforward_layernorm",
    };
    format!("model.layers.{l}.{s}.weight")
}

impl Weights {
    pub fn load(src: &TensorSource, cfg: &ModelConfig) -> Result<Self> {
        let gguf = matches!(src, TensorSource::Gguf(_));
        let name = |role, l| {
            if gguf {
                gguf_name(role, l)
            } else {
                hf_name(cfg.family, role, l)
            }
        };
        let (embed_name, norm_name, head_name) = if gguf {
            ("token_embd.weight", "output_norm.weight", "output.weight")
        } else {
            (
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
            )
        };
        // Gemma computes RMSNorm with (1 + w). HF folders store w; GGUF stores 1 + w, which we
        // take apart and rebuild so the f32 value equals the reference's 1 + w bit for bit.
        let norm = |n: &str, len| -> Result<Vec<f32>> {
            let mut v = src.vector(n, len)?;
            if cfg.family == Family::Gemma3 {
                for x in &mut v {
                    *x = if gguf { (*x - 1.0) + 1.0 } else { 1.0 + *x };
                }
            }
            Ok(v)
        };
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let q_rows = cfg.n_heads * hd;
        let kv_rows = cfg.n_kv_heads * hd;
        let mut layers = Vec::with_capacity(cfg.n_layers());
        for l in 0..cfg.n_layers() {
            let opt_norm = |role, len| -> Result<Option<Vec<f32>>> {
                let n = name(role, l);
                if src.has(&n) {
                    norm(&n, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let lw = LayerWeights {
                attn_norm: norm(&name(Role::AttnNorm, l), h)?,
                q: src.matrix(&name(Role::Q, l), q_rows, h)?,
                k: src.matrix(&name(Role::K, l), kv_rows, h)?,
                v: src.matrix(&name(Role::V, l), kv_rows, h)?,
                o: src.matrix(&name(Role::O, l), h, q_rows)?,
                q_norm: opt_norm(Role::QNorm, hd)?,
                k_norm: opt_norm(Role::KNorm, hd)?,
                post_attn_norm: if cfg.sandwich_norms {
                    Some(norm(&name(Role::PostAttnNorm, l), h)?)
                } else {
                    None
                },
                ffn_norm: norm(&name(Role::FfnNorm, l), h)?,
                gate: src.matrix(&name(Role::Gate, l), cfg.intermediate, h)?,
                up: src.matrix(&name(Role::Up, l), cfg.intermediate, h)?,
                down: src.matrix(&name(Role::Down, l), h, cfg.intermediate)?,
                post_ffn_norm: if cfg.sandwich_norms {
                    Some(norm(&name(Role::PostFfnNorm, l), h)?)
                } else {
                    None
                },
            };
            if cfg.qk_norm && (lw.q_norm.is_none() || lw.k_norm.is_none()) {
                bail!("layer {l} lacks its q/k norm weights");
            }
            layers.push(lw);
        }
        let embed = src.matrix(embed_name, cfg.vocab, h)?;
        let lm_head = if src.has(head_name) {
            src.matrix(head_name, cfg.vocab, h)?
        } else {
            embed.clone()
        };
        Ok(Weights {
            embed,
            layers,
            final_norm: norm(norm_name, h)?,
            lm_head,
        })
    }
}
