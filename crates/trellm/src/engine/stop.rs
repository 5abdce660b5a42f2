//! Stop strings over streamed text: text is released only once it cannot be the start of a stop
//! string, and generation ends at the first complete one (which is not part of the output).

#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    text: String,
    released: usize,
    /// The stop string that ended the text.
    matched: Option<String>,
    stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    /// Adds newly decoded text; returns the part that is now safe to show.
    pub fn push(&mut self, chunk: &str) -> &str {
        if self.stopped {
            return "";
        }
        let from = self.released;
        self.text.push_str(chunk);
        // A stop string can begin up to its length before the new text.
        let search_from = floor_boundary(&self.text, from.saturating_sub(self.max_stop_len()));
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at)
        {
            self.matched = Some(stop.clone());
            self.text.truncate(search_from + at);
            self.stopped = true;
            self.released = self.text.len();
            return &self.text[from..];
        }
        let hold = self.partial_suffix_len();
        self.released = (self.text.len() - hold).max(from);
        &self.text[from..self.released]
    }

    /// Releases whatever is held back (generation ended without a stop string).
    pub fn finish(&mut self) -> &str {
        let from = self.released;
        self.released = self.text.len();
        &self.text[from..]
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// All text so far, without any stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn max_stop_len(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }

    /// Longest suffix of the text that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        let max = self.max_stop_len().min(self.text.len());
        (1..=max)
            .rev()
            .filter(|&n| self.text.is_char_boundary(self.text.len() - n))
            .find(|&n| {
                let tail = &self.text[self.text.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            out.push_str(s.push(c));
            if s.stopped() {
                return (out, true);
            }
        }
        out.push_str(s.finish());
        (out, false)
    }

    #[test]
    fn stops_across_chunks_and_holds_back_prefixes() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D tail"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["END"], &["hello E", "x"]), ("hello Ex".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["\n\n"], &["line\n", "\nmore"]), ("line".into(), true));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
