//! Progress reporting on stderr: bars on a terminal, plain lines otherwise.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Quiet,
    /// stderr is not a terminal (CI logs, pipes): one line per phase.
    Lines,
    /// stderr is a terminal: indicatif bars, which also say the phase.
    Bars,
}

pub(crate) struct Reporter {
    mode: Mode,
}

impl Reporter {
    pub(crate) fn new(progress: bool) -> Self {
        let mode = if !progress {
            Mode::Quiet
        } else if std::io::stderr().is_terminal() {
            Mode::Bars
        } else {
            Mode::Lines
        };
        Reporter { mode }
    }

    /// Announces a phase; on a terminal the bar that follows says it instead.
    pub(crate) fn phase(&self, msg: &str) {
        if self.mode == Mode::Lines {
            eprintln!("trellm: {msg}");
        }
    }

    /// Something the user should see whenever progress is on (results, repairs).
    pub(crate) fn note(&self, msg: &str) {
        if self.mode != Mode::Quiet {
            eprintln!("trellm: {msg}");
        }
    }

    /// A byte-count bar: on a terminal a bar with bytes, rate and ETA; in a log a line with
    /// the same every [`LINE_EVERY`] (and none for work that ends sooner); hidden when quiet.
    pub(crate) fn bytes(&self, total: Option<u64>, msg: String) -> ProgressBar {
        if self.mode == Mode::Lines {
            let pb = ProgressBar::hidden();
            if let Some(n) = total {
                pb.set_length(n);
            }
            pb.set_message(msg);
            spawn_line_ticker(pb.downgrade());
            return pb;
        }
        if self.mode != Mode::Bars {
            return ProgressBar::hidden();
        }
        let pb = match total {
            Some(n) => ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr()),
            None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
        };
        let template = if total.is_some() {
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}"
        } else {
            "{spinner} {msg} {bytes} {binary_bytes_per_sec}"
        };
        pb.set_style(
            ProgressStyle::with_template(template)
                .expect("static template")
                .progress_chars("=> "),
        );
        pb.set_message(msg);
        pb
    }
}

/// How often a log gets a progress line.
pub(crate) const LINE_EVERY: Duration = Duration::from_secs(5);

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// One progress line: bytes so far, of how many, rate, time left.
pub(crate) fn progress_line(msg: &str, pos: u64, len: Option<u64>, elapsed: Duration) -> String {
    let rate = pos as f64 / elapsed.as_secs_f64().max(1e-3);
    let mut s = format!("trellm: {msg}: {}", mib(pos));
    if let Some(n) = len.filter(|&n| n > 0) {
        s.push_str(&format!(
            " of {} ({:.0}%)",
            mib(n),
            100.0 * pos as f64 / n as f64
        ));
    }
    s.push_str(&format!(", {}/s", mib(rate as u64)));
    if let Some(n) = len {
        if rate > 0.0 && n > pos {
            s.push_str(&format!(", about {:.0} s left", (n - pos) as f64 / rate));
        }
    }
    s
}

/// Prints a progress line for `pb` every [`LINE_EVERY`] until it is finished or dropped.
fn spawn_line_ticker(weak: indicatif::WeakProgressBar) {
    let start = std::time::Instant::now();
    std::thread::spawn(move || {
        let tick = Duration::from_millis(250);
        let mut last = std::time::Instant::now();
        loop {
            std::thread::sleep(tick);
            let Some(pb) = weak.upgrade() else { return };
            if pb.is_finished() {
                return;
            }
            if last.elapsed() >= LINE_EVERY {
                last = std::time::Instant::now();
                eprintln!(
                    "{}",
                    progress_line(&pb.message(), pb.position(), pb.length(), start.elapsed())
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_say_bytes_rate_and_time_left() {
        let mib = 1u64 << 20;
        let l = progress_line(
            "downloading x",
            10 * mib,
            Some(40 * mib),
            Duration::from_secs(5),
        );
        assert_eq!(
            l,
            "trellm: downloading x: 10.0 MiB of 40.0 MiB (25%), 2.0 MiB/s, about 15 s left"
        );
        let l = progress_line("downloading y", 3 * mib, None, Duration::from_secs(3));
        assert_eq!(l, "trellm: downloading y: 3.0 MiB, 1.0 MiB/s");
    }
}
