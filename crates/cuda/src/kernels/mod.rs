//! CUDA C++ kernel sources, embedded in the binary. Each is compiled with [`PRELUDE`] in front
//! (bf16 helpers, reductions, activations); see [`crate::nvrtc`].
//!
//! The Rust launchers for these kernels live in [`crate::dense`], [`crate::exl3`], [`crate::viterbi`] and [`crate::bench`], next to the
//! code that owns the buffers they run on.

/// Definitions shared by every kernel source.
pub const PRELUDE: &str = include_str!("prelude.cuh");

/// One `.cu` source.
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
    /// Its `extern "C"` kernels.
    pub functions: &'static [&'static str],
    /// Hot kernels (run every token) must compile without register spills.
    pub hot: bool,
    /// Compile-time variants CI checks (`-D` defines), besides none.
    pub variants: &'static [&'static str],
    /// Whether its kernels are launched with programmatic dependent launch: each calls
    /// `pdl_wait()` (prelude) before it touches memory an earlier kernel may still write or read.
    pub dependent_launch: bool,
}

impl KernelSource {
    /// The text NVRTC compiles.
    pub fn full_source(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }
}

pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    source: include_str!("elementwise.cu"),
    functions: &[
        "embed_rows",
        "norm_rows",
        "residual_norm",
        "act_rows",
        "logits_argmax_partial",
        "argmax_final",
        "fill_uniform_bf16",
        "fill_random_u32",
        "fill_f32",
        "spin_ns",
        "gather_rows",
    ],
    hot: true,
    variants: &[],
    dependent_launch: true,
};

pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    source: include_str!("rope.cu"),
    functions: &["qkv_rope"],
    hot: true,
    variants: &[],
    dependent_launch: true,
};

pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    source: include_str!("attention.cu"),
    functions: &[
        "attn_partial",
        "attn_combine",
        "attn_prefill",
        "attn_decode",
        "attn_softmax",
        "attn_unstack",
        "kv_gather",
    ],
    hot: true,
    variants: &[
        "HEAD_DIM=16",
        "HEAD_DIM=32",
        "HEAD_DIM=64",
        "HEAD_DIM=96",
        "HEAD_DIM=128",
        "HEAD_DIM=256",
    ],
    dependent_launch: true,
};

pub const GEMV: KernelSource = KernelSource {
    name: "gemv",
    source: include_str!("gemv.cu"),
    functions: &[
        "gemv_f32",
        "gemv_glu",
        "gemv_act",
        "gemv_qkv_rope",
        "gemv_res",
        "gemm_rows8",
    ],
    hot: true,
    variants: &[],
    dependent_launch: false,
};

/// EXL3 trellis layers (launcher: [`crate::exl3`]); one module per codebook x bitrate.
pub const EXL3: KernelSource = KernelSource {
    name: "exl3",
    source: include_str!("exl3.cu"),
    functions: &[
        "exl3_in",
        "exl3_gemv",
        "exl3_q8",
        "exl3_mma8",
        "exl3_mma16",
        "exl3_mma32",
        "exl3_mma64",
        "exl3_out",
        "exl3_dequant",
    ],
    hot: true,
    variants: crate::exl3::VARIANTS,
    dependent_launch: true,
};

/// The EXL3 tile encoder (launcher: [`crate::viterbi`]); one module per K.
pub const VITERBI: KernelSource = KernelSource {
    name: "viterbi",
    source: include_str!("viterbi.cu"),
    functions: &["viterbi_tiles"],
    hot: true,
    variants: crate::viterbi::VARIANTS,
    dependent_launch: false,
};

/// Every kernel source.
pub const ALL: &[&KernelSource] = &[&ELEMENTWISE, &ROPE, &ATTENTION, &GEMV, &EXL3, &VITERBI];
