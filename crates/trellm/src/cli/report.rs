//! The one error line trellm prints: bounded in length, with control characters escaped, since
//! errors quote files and flags that may hold anything.

/// Characters of an error line at most.
pub const MAX_ERROR_CHARS: usize = 400;

/// `text` on one line: newlines as spaces, other control characters escaped, cut to
/// [`MAX_ERROR_CHARS`].
pub fn one_line(text: &str) -> String {
    let mut out = String::new();
    for (n, c) in text.chars().enumerate() {
        if n >= MAX_ERROR_CHARS {
            out.push_str("...");
            break;
        }
        match c {
            '\n' | '\r' => out.push(' '),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out
}
