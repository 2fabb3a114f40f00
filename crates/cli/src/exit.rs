//! Exit statuses, the same in every tool (documented in each tool's `--help` and in README.md).

/// The run did what was asked (for checkers: nothing damaged was found).
pub const SUCCESS: u8 = 0;
/// The run started but failed (a device error, a timeout, a verify mismatch), or a checker found
/// damage.
pub const FAILURE: u8 = 1;
/// The input cannot be used: a bad flag, size, device string, model geometry, a file that cannot
/// be opened or is not what it should be, a memory device larger than the machine can hold.
/// Nothing was changed.
pub const UNUSABLE_INPUT: u8 = 2;
/// Standard output was closed by its reader (e.g. `| head`): the tool stopped quietly, as a C
/// tool killed by SIGPIPE would (a shell reports such a tool as 128 + 13).
pub const STDOUT_CLOSED: u8 = 141;

/// The exit-status paragraph for a tool's long help.
pub fn help_text(checker: bool) -> String {
    let failure = if checker { "the run failed, or damage was found" } else { "the run failed (device error, timeout, verify mismatch)" };
    format!(
        "Exit status: {SUCCESS} done; {FAILURE} {failure}; {UNUSABLE_INPUT} unusable input (bad flag, size, device, \
         geometry, file, or a memory device larger than this machine can hold; nothing was changed); \
         {STDOUT_CLOSED} standard output was closed by its reader (e.g. `| head`)."
    )
}

/// Input the command cannot use: the error a tool returns (through `anyhow` or not) for exit
/// status [`UNUSABLE_INPUT`]; its text is the whole message, in words.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unusable(pub String);

/// Whether an error chain says the input was unusable (an [`Unusable`] anywhere in it).
pub fn is_unusable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(current) = cause {
        if current.is::<Unusable>() {
            return true;
        }
        cause = current.source();
    }
    false
}

/// An error and its causes on one line, `outer: cause: cause`, leaving out a cause the line
/// already ends with after a `": "`: many errors name their source at the end of their own
/// message (`"NVMe: {0}"` with `#[from]`), and anyhow's `{:#}` would print it twice. Only a
/// whole last part counts, so a short cause that happens to appear in the line is still printed.
/// One line indeed: control characters in any part (a daemon's or a device's words among them)
/// are escaped ([`crate::printable`]).
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        let text = current.to_string();
        let named = line.strip_suffix(text.as_str()).is_some_and(|before| before.ends_with(": ") || before.is_empty());
        if !text.is_empty() && !named {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = current.source();
    }
    crate::printable(&line).into_owned()
}

/// The exit status of a run that returned `result` (then flushed standard output): success; a
/// closed standard output, quietly; otherwise the error chain ([`error_line`]) on one line after
/// `tool: `, and [`UNUSABLE_INPUT`] or [`FAILURE`] by [`is_unusable`].
pub fn status_of<E>(tool: &str, result: Result<(), E>) -> std::process::ExitCode
where
    E: std::fmt::Display + AsRef<dyn std::error::Error + 'static>,
{
    let code = match result {
        Ok(()) => SUCCESS,
        Err(error) if crate::is_stdout_closed(error.as_ref()) => STDOUT_CLOSED,
        Err(error) => {
            let _ = crate::stdout::flush();
            crate::errln!("{tool}: {}", error_line(error.as_ref()));
            if is_unusable(error.as_ref()) {
                UNUSABLE_INPUT
            } else {
                FAILURE
            }
        }
    };
    std::process::ExitCode::from(code)
}

/// Prints a command-line parse error the way clap renders it and returns the exit status: help
/// and version are [`SUCCESS`] (a closed pipe while printing them is not a failure either),
/// anything else is [`UNUSABLE_INPUT`].
pub fn report_parse_error(error: &clap::Error) -> u8 {
    let _ = error.print();
    if error.use_stderr() {
        UNUSABLE_INPUT
    } else {
        SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("opening the pool")]
    struct Context(#[source] Unusable);

    #[test]
    fn unusable_is_found_anywhere_in_a_chain() {
        // Goal: a tool that wraps an Unusable in context still exits 2; other errors do not.
        assert!(is_unusable(&Unusable("bad size".into())));
        assert!(is_unusable(&Context(Unusable("bad size".into()))));
        assert!(!is_unusable(&std::io::Error::other("disk on fire")));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("NVMe: {0}")]
    struct Naming(#[source] Unusable);

    #[test]
    fn an_error_line_names_each_cause_once() {
        // Goal: a cause the outer message already holds is not printed again; a cause it does
        // not hold is appended.
        assert_eq!(error_line(&Context(Unusable("bad size".into()))), "opening the pool: bad size");
        assert_eq!(error_line(&Naming(Unusable("nsid:2 does not exist".into()))), "NVMe: nsid:2 does not exist");
        let wrapped = anyhow::Error::new(Naming(Unusable("nsid:2 does not exist".into()))).context("formatting a pool");
        assert_eq!(error_line(wrapped.as_ref()), "formatting a pool: NVMe: nsid:2 does not exist");
        // A cause the line holds only earlier on is its own news.
        assert_eq!(error_line(&Context(Unusable("pool".into()))), "opening the pool: pool");
    }

    #[test]
    fn an_error_line_from_another_process_stays_one_line() {
        // Goal: a message a daemon (or something posing as one) sent, with a newline and an
        // escape sequence, is printed escaped: the tool's error stays one line on the terminal.
        let wrapped = anyhow::Error::new(Unusable("refused\n\u{1b}[2Ktuttid: all fine".into())).context("status");
        assert_eq!(error_line(wrapped.as_ref()), "status: refused\\n\\u{1b}[2Ktuttid: all fine");
    }
}
