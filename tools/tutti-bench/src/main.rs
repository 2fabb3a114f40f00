//! tutti-bench: an fio-like benchmark of the raw NVMe path (software controller, VFIO, or the
//! kernel's io_uring as comparator) and of layer-wise KV store/retrieve.
//!
//! Exit status (`tutti_cli::exit`): 0 on success, 1 when the run failed (device error, verify
//! mismatch, a block missing from a kept pool), 2 when the input was wrong (bad flag, size,
//! device string, file, model, a memory device larger than the machine can hold) with one line
//! saying what is wrong and what is accepted, 130 when interrupted, 141 when standard output was
//! closed by its reader.

mod args;
mod attach;
mod cpus;
mod devices;
mod filesystems;
mod kv;
mod kv_workload;
mod memory;
mod progress;
mod report;
mod run;
mod serve;
mod uring;
mod workloads;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use tutti_cli::exit;

use crate::args::Cli;

/// Input the run cannot accept: printed as one line, exit status 2.
pub use tutti_cli::exit::Unusable;

/// Shorthand for returning a usage error.
pub fn usage<T>(message: impl Into<String>) -> anyhow::Result<T> {
    Err(Unusable(message.into()).into())
}

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    // Status 130 on SIGINT/SIGTERM for every run, not only one that created a file.
    uring::handle_interrupts();
    let parsed = Cli::command().try_get_matches().and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (matches, cli)));
    let (matches, cli) = match parsed {
        Ok(parsed) => parsed,
        Err(error) => return clap_error(error),
    };
    let result = run::run(&cli, args::select_workload(&matches, &cli), &matches).and_then(|()| Ok(tutti_cli::stdout::flush()?));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if tutti_cli::is_stdout_closed(error.as_ref()) => ExitCode::from(exit::STDOUT_CLOSED),
        Err(error) => {
            let _ = tutti_cli::stdout::flush();
            if let Some(usage) = error.downcast_ref::<Unusable>() {
                // One line indeed: the message may quote a file's, a model config's or a
                // daemon's words.
                tutti_cli::errln!("tutti-bench: {}", tutti_cli::printable(&usage.to_string()));
                ExitCode::from(exit::UNUSABLE_INPUT)
            } else {
                tutti_cli::errln!("tutti-bench: error: {}", exit::error_line(error.as_ref()));
                ExitCode::from(exit::FAILURE)
            }
        }
    }
}

/// clap's own errors, reduced to one line (help and version keep their full text).
fn clap_error(error: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // A closed pipe while printing help is not a failure either.
            let _ = error.print();
            ExitCode::SUCCESS
        }
        _ => {
            let rendered = error.render().to_string();
            let first = rendered.lines().find(|line| !line.trim().is_empty()).unwrap_or("invalid arguments");
            let first = first.trim_start_matches("error: ").trim();
            // A missing required argument is named on the indented lines below: keep them.
            let first = if error.kind() == ErrorKind::MissingRequiredArgument {
                let named: Vec<&str> = rendered
                    .lines()
                    .skip_while(|line| !line.contains(first))
                    .skip(1)
                    .take_while(|line| line.starts_with(' ') && !line.trim().is_empty())
                    .map(str::trim)
                    .collect();
                if named.is_empty() {
                    first.to_string()
                } else {
                    format!("{first} {}", named.join(", "))
                }
            } else {
                first.to_string()
            };
            // Enumerated flags list what they accept on a later line: keep it on this one.
            let possible = rendered.lines().map(str::trim).find(|line| line.starts_with("[possible values:"));
            let hint = match (error.kind(), possible) {
                (_, Some(values)) => format!("; accepted: {}", values.trim_start_matches("[possible values:").trim_end_matches(']').trim()),
                (ErrorKind::UnknownArgument, None) => "; run tutti-bench --help for the accepted options".to_string(),
                _ => String::new(),
            };
            tutti_cli::errln!("tutti-bench: {}{hint}", tutti_cli::printable(&first));
            ExitCode::from(exit::UNUSABLE_INPUT)
        }
    }
}
