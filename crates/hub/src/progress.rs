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

    /// A byte-count bar; hidden unless on a terminal.
    pub(crate) fn bytes(&self, total: Option<u64>, msg: String) -> ProgressBar {
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

    /// A spinner for work with no byte count (pip running).
    pub(crate) fn spinner(&self, msg: String) -> ProgressBar {
        if self.mode != Mode::Bars {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("static template"),
        );
        pb.set_message(msg);
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }
}
