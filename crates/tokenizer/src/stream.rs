//! Incremental detokenization. Text is only handed out once later ids cannot change it:
//! - while the decoded tail ends in U+FFFD (a UTF-8 sequence split across byte-level tokens)
//!   it is held back;
//! - with a `tokenizers` `ByteFallback` decoder, after a `<0xE2>`-style token everything is held
//!   until a non-byte token, because such a run is decoded as a whole (an invalid run turns into
//!   one U+FFFD per byte, which would rewrite text already handed out).
//!
//! Each step decodes only a small window (the ids of the last emitted chunk plus the new ones)
//! and emits the difference, so the concatenated chunks equal `decode(all ids)`.

use crate::{Tokenizer, TokenizerError};

pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Window start: the ids before it are fully emitted and end at a clean boundary.
    prefix: usize,
    /// Ids in `prefix..read` were emitted by the previous chunk.
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one id; returns the text that became final (often empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        if self.tok.id_to_token(id).is_none() {
            return Err(TokenizerError::InvalidId {
                id,
                vocab_size: self.tok.vocab_size(),
            });
        }
        self.ids.push(id);
        if self.tok.in_byte_run(&self.ids, self.skip_special) {
            return Ok(String::new());
        }
        self.step(false)
    }

    /// Flushes whatever is still held back (an unfinished byte sequence comes out as U+FFFD,
    /// as in `decode`). The decoder can keep going afterwards.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        self.step(true)
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn step(&mut self, flush: bool) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let at_start = self.prefix == 0;
        let old = self.tok.decode_part(
            &self.ids[self.prefix..self.read],
            self.skip_special,
            at_start,
        )?;
        let new = self
            .tok
            .decode_part(&self.ids[self.prefix..], self.skip_special, at_start)?;
        if !flush && (new.len() <= old.len() || new.ends_with('\u{FFFD}')) {
            return Ok(String::new());
        }
        // The new window extends the old one; should a decoder ever rewrite earlier text, fall
        // back to the longest common prefix rather than panic.
        let cut = if new.starts_with(&old) {
            old.len()
        } else {
            new.char_indices()
                .zip(old.chars())
                .find(|((_, a), b)| a != b)
                .map_or(old.len().min(new.len()), |((i, _), _)| i)
        };
        let chunk = new.get(cut..).unwrap_or("").to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(chunk)
    }
}
