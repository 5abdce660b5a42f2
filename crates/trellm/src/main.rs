use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // glibc gives each worker thread its own heap arena, and the large buffers one thread frees
    // stay resident in its arena while another thread allocates anew elsewhere: with one arena,
    // prefill's temporaries are reused and peak memory stays near weights + KV cache. Buffers
    // up to 32 MB (a layer's activations, a decoded band) come from that heap rather than fresh
    // maps, and up to 64 MB of free space stays mapped: otherwise every layer of a prefill pays
    // page faults on its temporaries (13% of an EXL3 prefill's time, measured).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
    let cli = match trellm::cli::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind::*;
            if matches!(
                e.kind(),
                DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line: clap's first line names the flag and the problem.
            let msg = e.render().to_string();
            let first = msg.lines().next().unwrap_or("invalid arguments");
            eprintln!("{}", trellm::cli::report::one_line(first));
            return ExitCode::from(2);
        }
    };
    match trellm::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "error: {}",
                trellm::cli::report::one_line(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}
