//! Progress while a phase runs: an indicatif bar when stderr is a terminal, a plain line every
//! few seconds otherwise (logs, CI). Results go to stdout; progress always to stderr.

use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::format_size;
use crate::workloads::Progress;

/// Period of plain progress lines.
const PLAIN_PERIOD: Duration = Duration::from_secs(5);
const BAR_PERIOD: Duration = Duration::from_millis(100);
/// Whether the run has said that it goes on without progress (a thread refused).
static WARNED_NO_THREAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `work` while showing progress of `progress.bytes_done` towards `total_bytes` (a byte
/// count for one-pass phases, or none for time-based ones, shown against `runtime`).
pub fn with_progress<T>(
    label: &str,
    total_bytes: Option<u64>,
    runtime: Option<Duration>,
    progress: &Arc<Progress>,
    work: impl FnOnce() -> T,
) -> T {
    with_progress_with(label, total_bytes, runtime, progress, &|| Ok(std::thread::Builder::new().name("progress".into())), work)
}

/// [`with_progress`] with the progress thread's builder from `builder` (a test fails it).
fn with_progress_with<T>(
    label: &str,
    total_bytes: Option<u64>,
    runtime: Option<Duration>,
    progress: &Arc<Progress>,
    builder: &dyn Fn() -> std::io::Result<std::thread::Builder>,
    work: impl FnOnce() -> T,
) -> T {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let done = &done;
        // Progress is best effort: where the OS refuses one more thread (a pids cgroup,
        // RLIMIT_NPROC), the phase runs without it, said once for the run (not once a phase).
        if let Err(error) =
            builder().and_then(|builder| builder.spawn_scoped(scope, move || show(label, total_bytes, runtime, progress, done)))
        {
            if !WARNED_NO_THREAD.swap(true, Ordering::Relaxed) {
                tutti_cli::errln!("tutti-bench: warning: cannot start the progress thread ({error}); the run goes on without progress");
            }
        }
        // Set as `work` returns or unwinds: a panic in it must not leave the scope waiting on
        // a progress thread that never ends.
        let _finished = Finished(done);
        work()
    })
}

/// Tells the progress thread to end when dropped.
struct Finished<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn show(label: &str, total_bytes: Option<u64>, runtime: Option<Duration>, progress: &Progress, done: &std::sync::atomic::AtomicBool) {
    let started = Instant::now();
    let terminal = std::io::stderr().is_terminal();
    let bar = terminal.then(|| {
        let bar = match total_bytes {
            Some(total) => ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()),
            None => ProgressBar::with_draw_target(runtime.map(|runtime| runtime.as_millis() as u64), ProgressDrawTarget::stderr()),
        };
        let template = if total_bytes.is_some() {
            "{prefix} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}"
        } else {
            "{prefix} [{bar:30}] {elapsed}"
        };
        bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> "));
        bar.set_prefix(label.to_string());
        bar
    });
    let mut last_line = started;
    let mut last_bytes = 0u64;
    // Standard error closed (`2>&1 | head -1`): progress is best effort, the run goes on
    // quietly.
    let mut silenced = false;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(BAR_PERIOD);
        let bytes = progress.bytes_done.load(Ordering::Relaxed);
        match &bar {
            Some(bar) if total_bytes.is_some() => bar.set_position(bytes),
            Some(bar) => bar.set_position(started.elapsed().as_millis() as u64),
            None => {
                if !silenced && last_line.elapsed() >= PLAIN_PERIOD {
                    let rate = (bytes - last_bytes) as f64 / last_line.elapsed().as_secs_f64();
                    let of = total_bytes.map(|total| format!(" of {}", format_size(total))).unwrap_or_default();
                    silenced = !tutti_cli::errln!(
                        "{label}: {}{of} done, {} /s, {:.0}s elapsed",
                        format_size(bytes),
                        format_size(rate as u64),
                        started.elapsed().as_secs_f64()
                    );
                    last_line = Instant::now();
                    last_bytes = bytes;
                }
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_phase_ends_its_progress_thread() {
        // Goal: a panic inside a phase used to leave the progress thread looping (its `done` never
        // set), so the scope never returned; the panic now comes out at once.
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let progress = Arc::new(Progress::default());
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_progress("test", Some(1), None, &progress, || panic!("a phase failed"))
            }));
            let _ = sender.send(outcome.is_err());
        });
        let panicked = receiver.recv_timeout(Duration::from_secs(1)).expect("with_progress returned within 1 s");
        assert!(panicked);
    }

    #[test]
    fn a_progress_thread_the_system_refuses_leaves_the_phase_to_run_without_progress() {
        // Goal: progress is best effort. Where the OS refuses one more thread (a pids cgroup,
        // RLIMIT_NPROC), the phase runs without it (a warning said once) instead of panicking.
        let progress = Arc::new(Progress::default());
        let refused = || Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
        for _ in 0..2 {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_progress_with("test", Some(1), None, &progress, &refused, || 42)
            }));
            assert_eq!(outcome.ok(), Some(42), "the phase did not run to its result");
        }
    }
}
