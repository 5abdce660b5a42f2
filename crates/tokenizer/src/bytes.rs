//! The bytes each token id stands for, as a grammar engine needs them: the text a token adds to
//! the output, byte for byte (a byte-level BPE token may be half a UTF-8 character, so decoding
//! one id to a `String` would lose it). Special tokens are reported apart: they add no text a
//! grammar could match.

use std::collections::HashMap;

use crate::spm::{self, Kind};
use crate::{Backend, Tokenizer};

/// What one token id adds to the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// Plain text bytes (possibly part of a UTF-8 character).
    Text(Vec<u8>),
    /// A special / control token (BOS, EOS, `<|im_end|>`), with its vocabulary text.
    Special(String),
}

/// GPT-2's byte-to-character table inverted: byte-level BPE vocabularies spell each byte as one
/// printable character (printable ASCII and Latin-1 as themselves, the rest shifted to U+0100..).
fn byte_level_chars() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0;
    for b in 0u32..256 {
        let c = if printable.contains(&b) {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

/// `▁` as a space and `<0xAB>` as the byte: SentencePiece-style pieces.
fn metaspace_bytes(piece: &str) -> Vec<u8> {
    match spm::parse_byte_piece(piece) {
        Some(b) => vec![b],
        None => piece.replace(spm::SPACE, " ").into_bytes(),
    }
}

impl Tokenizer {
    /// The bytes of every id in `0..vocab_size()`, in id order.
    pub fn vocab_bytes(&self) -> Vec<TokenBytes> {
        let n = self.vocab_size() as u32;
        match &self.backend {
            Backend::Hf { tok, .. } => {
                let byte_level = tok
                    .get_decoder()
                    .and_then(|d| serde_json::to_string(d).ok())
                    .is_some_and(|s| s.contains("\"ByteLevel\""));
                let table = byte_level.then(byte_level_chars);
                let added = tok.get_added_vocabulary();
                let added_ids = tok.get_added_tokens_decoder();
                (0..n)
                    .map(|id| {
                        let Some(t) = tok.id_to_token(id) else {
                            return TokenBytes::Text(Vec::new());
                        };
                        if let Some(a) = added_ids.get(&id) {
                            // Added tokens are stored as their literal text, not byte-level.
                            return if a.special || added.is_special_token(&t) {
                                TokenBytes::Special(t)
                            } else {
                                TokenBytes::Text(a.content.clone().into_bytes())
                            };
                        }
                        match &table {
                            Some(map) => {
                                let bytes: Option<Vec<u8>> =
                                    t.chars().map(|c| map.get(&c).copied()).collect();
                                TokenBytes::Text(bytes.unwrap_or_else(|| t.into_bytes()))
                            }
                            None => TokenBytes::Text(metaspace_bytes(&t)),
                        }
                    })
                    .collect()
            }
            Backend::Spm(s) => (0..n)
                .map(|id| match (s.kind(id), s.piece(id)) {
                    (Some(Kind::Byte(b)), _) => TokenBytes::Text(vec![b]),
                    (Some(Kind::Normal | Kind::UserDefined), Some(p)) => {
                        TokenBytes::Text(metaspace_bytes(p))
                    }
                    (_, Some(p)) => TokenBytes::Special(p.to_string()),
                    (_, None) => TokenBytes::Text(Vec::new()),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let m = byte_level_chars();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'a'], b'a');
        let mut bytes: Vec<u8> = m.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn metaspace_pieces() {
        assert_eq!(metaspace_bytes("▁the"), b" the");
        assert_eq!(metaspace_bytes("<0x0A>"), b"\n");
    }
}
