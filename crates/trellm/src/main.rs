use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
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
            eprintln!("{}", msg.lines().next().unwrap_or("invalid arguments"));
            return ExitCode::from(2);
        }
    };
    match trellm::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
