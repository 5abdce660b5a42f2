//! Writing results to stdout as `cat` does: a reader that goes away (`| head -c1`) ends the
//! run quietly; any other write error (a full disk) is an error, never a silent success.

use std::io::{ErrorKind, Write};

use anyhow::{anyhow, Result};

/// Writes and flushes `s`. `Ok(true)`: written; `Ok(false)`: the reader closed the pipe, stop
/// writing and end quietly; `Err`: the output could not be written.
pub fn emit(w: &mut (impl Write + ?Sized), s: &str) -> Result<bool> {
    match w.write_all(s.as_bytes()).and_then(|()| w.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(anyhow!("cannot write the output: {e}")),
    }
}

/// [`emit`] to stdout.
pub fn print(s: &str) -> Result<bool> {
    emit(&mut std::io::stdout().lock(), s)
}
