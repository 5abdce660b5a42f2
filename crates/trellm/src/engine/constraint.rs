//! Constrained decoding: a sequence may carry a grammar (a JSON schema, "any JSON object", a Lark
//! grammar or a regex) that its output must follow. Before each draw the tokens the grammar
//! forbids get a logit of -inf; the drawn token is then committed to the grammar's matcher, and
//! once the grammar is complete (only EOS could follow) the sequence ends with `stop`.
//!
//! The grammar engine is `llguidance`. Its token environment is built once per tokenizer from
//! each id's bytes ([`Constrainer::new`]); each request then compiles its grammar into its own
//! [`Constraint`], so sequences with and without constraints run side by side in one batch and a
//! sequence without one pays nothing.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use trellm_tokenizer::{TokenBytes, Tokenizer};

/// What a constrained output must be.
#[derive(Debug, Clone)]
pub enum Grammar {
    /// JSON matching this schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A grammar in llguidance's Lark syntax (may embed `%json { schema }`).
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

/// JSON layout options for schemas: fixed separators and no free whitespace, so a small model
/// cannot wander into runs of newlines; the output reads as `{"a": 1, "b": 2}`.
pub fn compact_json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with [`compact_json_options`] unless it sets its own.
fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(compact_json_options);
    }
    s
}

/// The grammar engine set up for one tokenizer: compiles [`Grammar`]s into [`Constraint`]s.
pub struct Constrainer {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Constrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constrainer")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl Constrainer {
    /// Builds the token trie of a model whose logits have `vocab` entries. Ids past the
    /// tokenizer's vocabulary (padding rows) are never allowed; `eos_ids` end a sequence once
    /// its grammar is complete.
    pub fn new(tok: &Tokenizer, vocab: usize, eos_ids: &[u32]) -> anyhow::Result<Constrainer> {
        let mut words: Vec<Vec<u8>> = tok
            .vocab_bytes()
            .into_iter()
            .map(|b| match b {
                TokenBytes::Text(t) => t,
                // llguidance's convention: special tokens start with 0xFF, a byte no UTF-8
                // text holds, so no text grammar can match them.
                TokenBytes::Special(s) => {
                    let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    v.extend_from_slice(s.as_bytes());
                    v
                }
            })
            .collect();
        words.resize(vocab, Vec::new());
        let eos: Vec<u32> = eos_ids
            .iter()
            .copied()
            .filter(|&e| (e as usize) < vocab)
            .collect();
        let Some(&first) = eos.first() else {
            anyhow::bail!("constrained decoding needs an end-of-sequence token");
        };
        let info = TokRxInfo {
            vocab_size: vocab as u32,
            tok_eos: first,
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        // Not canonical: llguidance then never re-tokenizes forced text, it only masks.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Constrainer { factory, vocab })
    }

    /// Over a vocabulary of the 256 bytes plus an EOS (unit tests of grammars).
    #[cfg(test)]
    pub(crate) fn single_byte() -> Constrainer {
        let env = ApproximateTokEnv::single_byte_env();
        let vocab = env.tok_trie().vocab_size();
        let mut factory = ParserFactory::new_simple(&env).expect("a byte vocabulary");
        factory.quiet();
        Constrainer { factory, vocab }
    }

    /// Compiles `g`; a bad schema or grammar is an error message for the client.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, String> {
        let top = match g {
            Grammar::JsonSchema(s) => {
                if !(s.is_object() || s.is_boolean()) {
                    return Err("a JSON schema must be an object".into());
                }
                TopLevelGrammar::from_json_schema(with_layout(s))
            }
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"})))
            }
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        // Grammars come from clients: a panic inside the engine must stay a refused request.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(top)
        }))
        .map_err(|_| "the grammar engine failed on this grammar".to_string())?
        .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets the logits of the tokens the grammar forbids now to -inf. An error (the grammar
    /// allows nothing, or its state is broken) means the sequence cannot go on.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if logits.len() != self.vocab {
            return Err(format!(
                "logits have {} entries but the grammar's vocabulary has {}",
                logits.len(),
                self.vocab
            ));
        }
        let allowed = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        if allowed.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        // 32 tokens a word: whole words allowed or forbidden are the common case.
        for (w, chunk) in allowed.as_slice().iter().zip(logits.chunks_mut(32)) {
            match *w {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if bits & (1 << b) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Advances the grammar by the drawn token.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// The grammar is complete and allows nothing more than EOS.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Commits each byte of `text` as a token (with [`Constrainer::single_byte`]); false at
    /// the first byte the grammar refuses.
    #[cfg(test)]
    pub(crate) fn accepts_bytes(&mut self, text: &str) -> bool {
        let mut logits = vec![0.0; self.vocab];
        for b in text.bytes() {
            logits.fill(0.0);
            if self.mask(&mut logits).is_err() || !logits[b as usize].is_finite() {
                return false;
            }
            if self.commit(b as u32).is_err() {
                return false;
            }
        }
        true
    }

    /// Whether the output so far is a complete match (EOS would be allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}
