//! The metrics endpoint's HTTP side, bounded like everything else in the daemon: one thread,
//! at most [`CONNECTIONS_MAX`] connections open at once (when all are taken, every unfinished
//! head is read again, a whole one answered, then one is closed to admit a new one: the oldest
//! that has sent nothing, else the oldest whose head is unfinished, and an answer being taken
//! only when every slot is one, then for any newcomer, even one that has sent nothing; so
//! connections that have not sent a whole request head cannot cut off an answer while any slot
//! holds something else. One accepted in the same pass that has sent nothing is closed only to
//! admit a newcomer being answered (the newcomer is closed when no slot may be): a scrape
//! accepted before its head arrived is closed at its accept only if every slot held an answer
//! or such a connection, not all answers; once in, it is kept through that pass while it has
//! sent nothing, unless a newcomer being answered is given its slot, and closed for another
//! only if its head has still not come when it is next read: [`make_room`], [`to_close`]),
//! each given [`REQUEST_DEADLINE`] to send a request head of at most [`HEAD_BYTES_MAX`] (its
//! lines ended by CRLF or a bare LF, RFC 9112 §2.2) and [`WRITE_TIMEOUT`] in all to take its
//! answer.
//! Answers are written without blocking, a little each pass as the scraper takes them, so the
//! thread never waits on a scraper that does not read (one slot each, until its deadline).
//! `GET /metrics` answers the registry's text; another path is 404, another method 405, a head
//! that is too long or not HTTP 400. Every answer closes its connection (no keep-alive: a
//! scraper asks every few seconds). The endpoint is on loopback by default and reachable by
//! any local user, so a client that opens connections and sends nothing costs one slot each for
//! a bounded time, never a thread or unbounded memory.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::{Metrics, Snapshot};
use crate::DaemonError;

/// Connections open at once.
pub const CONNECTIONS_MAX: usize = 16;
/// Time from accept to a whole request head.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// The longest request head (request line and headers).
pub const HEAD_BYTES_MAX: usize = 8 << 10;
/// The longest a scraper may take to read its whole answer (one deadline for all of it, so a
/// reader that takes a byte at a time cannot stretch it).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections accepted in one pass before the endpoint goes back to its loop (the stop flag,
/// the deadlines of connections already open): local users who keep the accept queue full
/// would otherwise keep it accepting for as long as they like, and hold off stopping.
pub const ACCEPTS_PER_PASS_MAX: usize = 64;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The HTTP endpoint: `GET /metrics` answers the registry's text; anything else an error.
pub struct MetricsEndpoint {
    listener: TcpListener,
    address: SocketAddr,
}

/// A connection whose request head is still arriving, or (`answer`) whose answer is being
/// written; `deadline` is the head's, then the answer's.
struct Pending {
    stream: TcpStream,
    head: Vec<u8>,
    deadline: Instant,
    answer: Option<Answer>,
    /// Accepted in the accept pass under way: while it has sent nothing, not closed to admit a
    /// connection without an answer ([`to_close`]), so that a scrape accepted just before its
    /// head arrives is read at least once before it can be.
    fresh: bool,
}

/// An answer and how much of it the scraper has taken.
struct Answer {
    bytes: Vec<u8>,
    written: usize,
}

/// What writing an answer found.
enum Written {
    /// All of it: the connection is closed.
    Done,
    /// Some is left; the scraper has not taken it yet.
    Waiting,
    /// The socket failed: the connection is dropped.
    Failed,
}

/// What reading a connection found.
enum Head {
    /// The head so far; more may come.
    Partial,
    /// A whole head (ends with an empty line: [`head_is_whole`]).
    Complete,
    /// Longer than the cap without ending.
    TooLong,
    /// The peer closed or the socket failed.
    Gone,
}

impl MetricsEndpoint {
    /// Binds `address` (port 0 picks a free one; see [`MetricsEndpoint::address`]).
    pub fn bind(address: SocketAddr) -> Result<MetricsEndpoint, DaemonError> {
        let io = |context: String| move |source| DaemonError::Io { context, source };
        let listener = TcpListener::bind(address).map_err(io(format!("binding the metrics endpoint on {address}")))?;
        listener.set_nonblocking(true).map_err(io("making the metrics listener non-blocking".into()))?;
        let address = listener.local_addr().map_err(io("the metrics endpoint's address".into()))?;
        Ok(MetricsEndpoint { listener, address })
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serves scrapes until `stopped` says so, checking it every `tick`. `snapshot` reads the
    /// daemon's state for each scrape.
    pub fn serve(&self, metrics: &Metrics, tick: Duration, stopped: &dyn Fn() -> bool, snapshot: &dyn Fn() -> Snapshot) {
        let tick_ms = u16::try_from(tick.as_millis()).unwrap_or(u16::MAX);
        let mut open: VecDeque<Pending> = VecDeque::with_capacity(CONNECTIONS_MAX);
        while !stopped() {
            {
                let mut fds = Vec::with_capacity(1 + open.len());
                fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                fds.extend(open.iter().map(|pending| {
                    let wanted = if pending.answer.is_some() { PollFlags::POLLOUT } else { PollFlags::POLLIN };
                    PollFd::new(pending.stream.as_fd(), wanted)
                }));
                match poll(&mut fds, PollTimeout::from(tick_ms)) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(errno) => {
                        tracing::warn!("metrics endpoint: polling: {errno}");
                        std::thread::sleep(tick);
                    }
                }
            }
            if !self.accept_pending(&mut open, metrics, stopped, snapshot) {
                // The listener stays readable while descriptors run out: wait a tick rather
                // than spin on it.
                std::thread::sleep(tick);
            }
            serve_open(&mut open, metrics, stopped, snapshot);
        }
    }

    /// Accepts the connections waiting, at most [`ACCEPTS_PER_PASS_MAX`] and none once
    /// `stopped` says so. One whose request is already there is answered at once (as much as
    /// its socket takes); the others, and an answer not all taken, wait in a slot, and when all
    /// are taken one is closed ([`make_room`]: a scrape being answered last). False when
    /// accepting failed (the caller waits a tick).
    fn accept_pending(
        &self,
        open: &mut VecDeque<Pending>,
        metrics: &Metrics,
        stopped: &dyn Fn() -> bool,
        snapshot: &dyn Fn() -> Snapshot,
    ) -> bool {
        for pending in open.iter_mut() {
            pending.fresh = false;
        }
        for _ in 0..ACCEPTS_PER_PASS_MAX {
            if stopped() {
                return true;
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Err(error) = stream.set_nonblocking(true) {
                        tracing::info!("metrics endpoint: a connection: {error}");
                        continue;
                    }
                    let deadline = Instant::now() + REQUEST_DEADLINE;
                    let mut pending = Pending { stream, head: Vec::new(), deadline, answer: None, fresh: true };
                    let waiting = match read_head(&mut pending) {
                        Head::Complete => answer(&mut pending, false, metrics, snapshot),
                        Head::TooLong => answer(&mut pending, true, metrics, snapshot),
                        Head::Gone => false,
                        Head::Partial => true,
                    };
                    if waiting && make_room(open, pending.answer.is_some(), metrics, stopped, snapshot) {
                        open.push_back(pending);
                    }
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => return true,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => {
                    // ECONNABORTED, EMFILE...: that connection is lost.
                    tracing::warn!("metrics endpoint: accept failed: {error}");
                    return false;
                }
            }
        }
        true
    }
}

/// One pass over the connections open: each answer is written as far as its socket takes it,
/// each head read as far as it has come (a whole one answered); a connection done, gone or past
/// its deadline is closed.
fn serve_open(open: &mut VecDeque<Pending>, metrics: &Metrics, stopped: &dyn Fn() -> bool, snapshot: &dyn Fn() -> Snapshot) {
    let now = Instant::now();
    let mut index = 0;
    while index < open.len() {
        let pending = &mut open[index];
        let keep =
            if pending.answer.is_some() { keep_writing(pending, now) } else { progress_head(pending, now, metrics, stopped, snapshot) };
        if keep {
            index += 1;
        } else {
            open.remove(index);
        }
    }
}

/// Reads what `pending` (its head unfinished) has sent and answers a whole head. True while
/// it stays open: its head unfinished before its deadline, or its answer not all taken.
fn progress_head(
    pending: &mut Pending,
    now: Instant,
    metrics: &Metrics,
    stopped: &dyn Fn() -> bool,
    snapshot: &dyn Fn() -> Snapshot,
) -> bool {
    let head = read_head(pending);
    match head {
        Head::Partial => now < pending.deadline,
        // Gone: closed unanswered.
        Head::Gone => false,
        // Stopping: the rest are closed unanswered.
        Head::Complete | Head::TooLong if stopped() => false,
        Head::Complete | Head::TooLong => answer(pending, matches!(head, Head::TooLong), metrics, snapshot),
    }
}

/// Makes a slot for a connection just accepted (`answering`: its answer begun) when all are
/// taken; false when it is the one to close. First every head unfinished is read again, and
/// those now whole are answered (an answer taken whole, or a connection gone, frees its slot):
/// a scrape accepted before its head arrived is not taken for one that sent nothing while its
/// head waits unread. Then [`to_close`] picks one.
fn make_room(
    open: &mut VecDeque<Pending>,
    answering: bool,
    metrics: &Metrics,
    stopped: &dyn Fn() -> bool,
    snapshot: &dyn Fn() -> Snapshot,
) -> bool {
    if open.len() < CONNECTIONS_MAX {
        return true;
    }
    let now = Instant::now();
    let mut index = 0;
    while index < open.len() {
        let pending = &mut open[index];
        if pending.answer.is_some() || progress_head(pending, now, metrics, stopped, snapshot) {
            index += 1;
        } else {
            open.remove(index);
        }
    }
    if open.len() < CONNECTIONS_MAX {
        return true;
    }
    match to_close(open, answering) {
        Some(index) => {
            open.remove(index);
            true
        }
        None => false,
    }
}

/// The slot closed to admit a new connection when all are taken (`answering`: the newcomer's
/// answer is begun), or None to close the newcomer instead: the oldest that has sent nothing,
/// else the oldest whose head is unfinished, only then the oldest (every slot a scrape being
/// answered). Never an answer while a head is unfinished: connections that send one byte and
/// idle would otherwise cut off every scrape whose answer is still being taken. A connection
/// accepted in the pass under way (`fresh`) that has sent nothing is closed only for a
/// newcomer being answered; for another, the newcomer is closed: a flood accepted in one pass
/// cannot close a scrape accepted in it before the endpoint has read it. Only one that has
/// sent nothing: protecting one that has sent a byte too would let a one-byte flood's own first
/// connections of a pass fill every slot and shut out a scrape accepted after them; the price is
/// that a scrape whose head arrives in pieces (its request line in, its headers not yet) can be
/// closed by a flood in its pass.
fn to_close(open: &VecDeque<Pending>, answering: bool) -> Option<usize> {
    let closable = |pending: &Pending| pending.answer.is_none() && (answering || !pending.fresh || !pending.head.is_empty());
    open.iter()
        .position(|pending| closable(pending) && pending.head.is_empty())
        .or_else(|| open.iter().position(closable))
        .or_else(|| open.iter().all(|pending| pending.answer.is_some()).then_some(0))
}

/// Whether `head` holds an empty line: its lines end in CRLF or, as RFC 9112 lets a recipient
/// take them, a bare LF (a CR before it ignored). Complete only at CRLF CRLF, a head ended by
/// LF LF would wait out [`REQUEST_DEADLINE`] and be closed without an answer.
fn head_is_whole(head: &[u8]) -> bool {
    head.windows(2).any(|window| window == b"\n\n") || head.windows(3).any(|window| window == b"\n\r\n")
}

/// Reads what the connection has sent (non-blocking), up to the head's cap.
fn read_head(pending: &mut Pending) -> Head {
    let mut chunk = [0u8; 1024];
    loop {
        if head_is_whole(&pending.head) {
            return Head::Complete;
        }
        if pending.head.len() >= HEAD_BYTES_MAX {
            return Head::TooLong;
        }
        let room = (HEAD_BYTES_MAX - pending.head.len()).min(chunk.len());
        match pending.stream.read(&mut chunk[..room]) {
            Ok(0) => return Head::Gone,
            Ok(read) => pending.head.extend_from_slice(&chunk[..read]),
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Head::Partial,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Head::Gone,
        }
    }
}

/// The status line, content type and body for a request head (`HEAD` is answered as `GET`;
/// `answer` leaves the body out).
fn response_for(head: &[u8], too_long: bool, metrics: &Metrics, snapshot: &dyn Fn() -> Snapshot) -> (&'static str, &'static str, String) {
    let plain = "text/plain; charset=utf-8";
    if too_long {
        return ("400 Bad Request", plain, format!("request head longer than {HEAD_BYTES_MAX} bytes\n"));
    }
    let line = String::from_utf8_lossy(request_line(head));
    let mut words = line.split_ascii_whitespace();
    let (Some(method), Some(target), Some(version)) = (words.next(), words.next(), words.next()) else {
        return ("400 Bad Request", plain, "not an HTTP request line\n".into());
    };
    if !version.starts_with("HTTP/1.") {
        return ("400 Bad Request", plain, format!("HTTP/1.x only, not {version}\n"));
    }
    if method != "GET" && method != "HEAD" {
        return ("405 Method Not Allowed", plain, "tuttid serves GET /metrics only\n".into());
    }
    if target.split('?').next() != Some("/metrics") {
        return ("404 Not Found", plain, "tuttid serves GET /metrics only\n".into());
    }
    match metrics.encode(&snapshot()) {
        Ok(text) => ("200 OK", OPENMETRICS, text),
        Err(error) => ("500 Internal Server Error", plain, format!("encoding failed: {error}\n")),
    }
}

/// Whether the request line's method is `HEAD` (its answer has no body), its words split on
/// whitespace as [`response_for`] splits them (a tab after the method included).
fn is_head_request(head: &[u8]) -> bool {
    request_line(head).split(u8::is_ascii_whitespace).find(|word| !word.is_empty()) == Some(&b"HEAD"[..])
}

/// The head's first line (to its first LF), which both [`response_for`] and
/// [`is_head_request`] read.
fn request_line(head: &[u8]) -> &[u8] {
    head.split(|&byte| byte == b'\n').next().unwrap_or_default()
}

/// Starts answering `pending`'s request: writes what its socket takes now (without blocking)
/// and gives the scraper [`WRITE_TIMEOUT`] in all to take the rest ([`keep_writing`]). True
/// while some is left to write.
fn answer(pending: &mut Pending, too_long: bool, metrics: &Metrics, snapshot: &dyn Fn() -> Snapshot) -> bool {
    let (status, content_type, body) = response_for(&pending.head, too_long, metrics, snapshot);
    let with_body = !is_head_request(&pending.head);
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
        body.len(),
        if status.starts_with("405") { "Allow: GET, HEAD\r\n" } else { "" }
    );
    let mut bytes = header.into_bytes();
    if with_body {
        bytes.extend_from_slice(body.as_bytes());
    }
    let now = Instant::now();
    pending.answer = Some(Answer { bytes, written: 0 });
    pending.deadline = now + WRITE_TIMEOUT;
    keep_writing(pending, now)
}

/// Writes what `pending`'s socket takes of its answer now; closes the connection once all of
/// it is written. True while some is left and its deadline has not passed (one deadline for
/// all of it, so a reader that takes a byte at a time cannot stretch it).
fn keep_writing(pending: &mut Pending, now: Instant) -> bool {
    let Some(answer) = pending.answer.as_mut() else { return false };
    match write_some(&mut pending.stream, answer) {
        Written::Done => {
            finish(&mut pending.stream);
            false
        }
        Written::Failed => false,
        Written::Waiting if now >= pending.deadline => {
            tracing::info!(
                "metrics endpoint: a scraper took {} of {} bytes of its answer in {WRITE_TIMEOUT:?}: closed",
                answer.written,
                answer.bytes.len()
            );
            false
        }
        Written::Waiting => true,
    }
}

/// Writes (non-blocking) as much of `answer` as the socket takes.
fn write_some(stream: &mut TcpStream, answer: &mut Answer) -> Written {
    while answer.written < answer.bytes.len() {
        match stream.write(&answer.bytes[answer.written..]) {
            Ok(0) => return Written::Failed,
            Ok(written) => answer.written += written,
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Written::Waiting,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => {
                tracing::info!("metrics endpoint: answering a scrape: {error}");
                return Written::Failed;
            }
        }
    }
    Written::Done
}

/// Closes a connection whose answer is all written. Bytes the client sent past the head (a
/// body, the rest of an over-long head) would turn the close into a reset, which can lose the
/// answer on the client's side: take what has arrived (without waiting, at most 64 KiB) after
/// saying the answer is complete.
fn finish(stream: &mut TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut scratch = [0u8; 4096];
    for _ in 0..16 {
        match stream.read(&mut scratch) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    fn endpoint() -> (SocketAddr, Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = endpoint.address();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let metrics = Metrics::new();
            endpoint.serve(&metrics, Duration::from_millis(20), &|| stopped.load(Ordering::Acquire), &Snapshot::default);
        });
        (address, stop, thread)
    }

    /// Sends `request` and reads the whole answer (bounded).
    fn ask(address: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(request).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    }

    #[test]
    fn scrapes_get_the_text_and_everything_else_an_error() {
        // Goal: GET /metrics (with or without a query) answers the registry's text with its
        // length; another path 404, another method 405, garbage and an endless head 400.
        let (address, stop, thread) = endpoint();
        let ok = ask(address, b"GET /metrics?x=1 HTTP/1.1\r\nHost: here\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: application/openmetrics-text") && ok.contains("tuttid_clients 0"), "{ok}");
        let (head, body) = ok.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "{head}");
        assert!(ask(address, b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(ask(address, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        let head = ask(address, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"), "HEAD: the headers alone: {head}");
        assert!(ask(address, b"hello\r\n\r\n").starts_with("HTTP/1.1 400"));
        // Exactly the cap, no end: all of it read, so the close is clean (bytes left unread
        // would make the kernel reset the connection, and the client might lose the answer).
        let mut endless = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        endless.resize(HEAD_BYTES_MAX, b'a');
        assert!(ask(address, &endless).starts_with("HTTP/1.1 400"));
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
    }

    #[test]
    fn a_head_request_whose_words_are_tab_separated_gets_no_body() {
        // Goal: the method is read from the request line split on whitespace (RFC 9112 lets a
        // recipient take a tab for the space), so a HEAD whose method ends in a tab is a HEAD:
        // its answer ends after the header block. The body used to be left out only for a head
        // starting with the bytes "HEAD ".
        let (address, stop, thread) = endpoint();
        let head = ask(address, b"HEAD\t/metrics HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"), "HEAD: the headers alone: {head}");
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
    }

    #[test]
    fn a_head_whose_lines_end_in_a_bare_lf_is_answered_at_once() {
        // Goal: RFC 9112 lets a recipient take a bare LF for a line's end; a head ended by an
        // empty line so (LF LF, or mixed with CRLF) is whole and answered well before the
        // request deadline. It used to be complete only at CRLF CRLF, so such a scrape waited
        // out REQUEST_DEADLINE and was closed with no answer.
        let (address, stop, thread) = endpoint();
        for request in [&b"GET /metrics HTTP/1.1\n\n"[..], b"GET /metrics HTTP/1.1\nHost: here\r\n\n", b"GET /other HTTP/1.1\n\r\n"] {
            let started = Instant::now();
            let answer = ask(address, request);
            let took = started.elapsed();
            assert!(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 404"), "{request:?}: {answer}");
            assert!(took < REQUEST_DEADLINE / 2, "{request:?} answered after {took:?}");
        }
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
    }

    #[test]
    fn a_flood_of_scrapes_does_not_hold_off_stopping() {
        // Goal: `Server::serve` joins the metrics thread before it finishes stopping, so the
        // endpoint must see the stop flag even while local users keep its accept queue full:
        // several threads connect and ask without pause (never reading), each scrape takes 20 ms
        // (a snapshot waits on the pool's busy lock), so the queue never runs dry; after the stop the endpoint's
        // thread returns within a few seconds (it used to accept and answer until the queue
        // ran dry, which a flood never lets happen).
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = endpoint.address();
        let stop = Arc::new(AtomicBool::new(false));
        let (finished_sender, finished) = std::sync::mpsc::channel();
        let stopped = Arc::clone(&stop);
        let server = std::thread::spawn(move || {
            let metrics = Metrics::new();
            let slow_snapshot = || {
                std::thread::sleep(Duration::from_millis(20));
                Snapshot::default()
            };
            endpoint.serve(&metrics, Duration::from_millis(20), &|| stopped.load(Ordering::Acquire), &slow_snapshot);
            let _ = finished_sender.send(());
        });
        let flooding = Arc::new(AtomicBool::new(true));
        let flooders: Vec<_> = (0..6)
            .map(|_| {
                let flooding = Arc::clone(&flooding);
                std::thread::spawn(move || {
                    while flooding.load(Ordering::Acquire) {
                        // Bounded: a full accept queue makes a connect wait on SYN resends.
                        if let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_millis(500)) {
                            let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let stopping = Instant::now();
        stop.store(true, Ordering::Release);
        let returned = finished.recv_timeout(Duration::from_secs(5)).is_ok();
        flooding.store(false, Ordering::Release);
        for flooder in flooders {
            flooder.join().unwrap();
        }
        assert!(returned, "the endpoint still served {:?} after the stop", stopping.elapsed());
        server.join().unwrap();
    }

    #[test]
    fn scrapers_that_never_read_do_not_hold_up_a_real_scrape() {
        // Goal: the endpoint's one thread never waits on a scraper that does not read its
        // answer: 20 connections that ask for a large text (more than the sockets' buffers
        // hold) and never read cost no write timeout each; a real scrape after them is
        // answered, whole, within a few seconds (it used to wait WRITE_TIMEOUT per non-reader).
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = endpoint.address();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let metrics = Metrics::new();
            let large = || Snapshot {
                devices_fenced: (0..2_500).map(|device| (format!("emu:mem:{device:0>2000}"), device % 2 == 0)).collect(),
                ..Snapshot::default()
            };
            endpoint.serve(&metrics, Duration::from_millis(20), &|| stopped.load(Ordering::Acquire), &large);
        });
        let silent: Vec<TcpStream> = (0..20)
            .map(|_| {
                let mut stream = TcpStream::connect(address).unwrap();
                stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
                stream
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let answer = ask(address, b"GET /metrics HTTP/1.1\r\n\r\n");
        let took = started.elapsed();
        assert!(answer.starts_with("HTTP/1.1 200"), "{}", &answer[..answer.len().min(200)]);
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "the whole answer: {head}");
        assert!(body.len() > 4 << 20, "a text larger than the sockets' buffers: {} bytes", body.len());
        // 15 s: some 21 renders of a 4 MiB text in a debug build on a loaded machine take
        // seconds; waiting WRITE_TIMEOUT per non-reader took 40 s.
        assert!(took < Duration::from_secs(15), "the scrape waited {took:?} behind scrapers that never read");
        drop(silent);
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
    }

    /// Connects to `address` and sends `sent` (nothing if empty).
    fn sending(address: SocketAddr, sent: &[u8]) -> TcpStream {
        let mut stream = TcpStream::connect(address).unwrap();
        stream.write_all(sent).unwrap();
        stream
    }

    /// Time for bytes written on loopback to arrive (and connects to be queued) before the
    /// endpoint, driven by the test, accepts and reads.
    fn settle() {
        std::thread::sleep(Duration::from_millis(50));
    }

    /// A client that reads what `stream` gets, to its end (bounded: 10 s), on a thread.
    fn reading(mut stream: TcpStream) -> std::thread::JoinHandle<(std::io::Result<usize>, Vec<u8>)> {
        std::thread::spawn(move || {
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut answer = Vec::new();
            let read = stream.read_to_end(&mut answer);
            (read, answer)
        })
    }

    #[test]
    fn connections_that_sent_a_byte_do_not_evict_a_scrape_being_answered() {
        // Goal: with every slot taken by connections that sent one byte of a head and idle, a
        // new connection closes one of them, never a scrape whose answer is being written: the
        // scrape gets its whole body. Before, the oldest connection was closed once none had
        // sent nothing, and 16 more such connections cut the answer off (a local user could
        // starve every scrape). The endpoint is driven here pass by pass, so that the scrape's
        // answer is seen not to have been written whole at its accept (else the test would
        // prove nothing: a host whose socket buffers take it all) and its reader has all of
        // WRITE_TIMEOUT: it reads from the moment the answer begins.
        use nix::sys::socket::{connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = endpoint.address();
        // The buffers are set small on both sides (the send buffer through the listener, which
        // its connections inherit, fixed rather than grown to the host's tcp_wmem maximum), so
        // that the 5 MB text cannot be taken whole at once on any host.
        setsockopt(&endpoint.listener, sockopt::SndBuf, &(64 << 10)).unwrap();
        let metrics = Metrics::new();
        let never = || false;
        let large = || Snapshot {
            devices_fenced: (0..2_500).map(|device| (format!("emu:mem:{device:0>2000}"), device % 2 == 0)).collect(),
            ..Snapshot::default()
        };
        let mut open = VecDeque::new();
        let mut heads: Vec<TcpStream> = (0..CONNECTIONS_MAX).map(|_| sending(address, b"G")).collect();
        settle();
        assert!(endpoint.accept_pending(&mut open, &metrics, &never, &large));
        assert!(open.len() == CONNECTIONS_MAX && open.iter().all(|pending| pending.head == b"G"), "{} open", open.len());
        // The scrape, then more one-byte connections than there are slots, all in one pass.
        let scrape = {
            let socket = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
            // Before the connect, so that the window offered stays small.
            setsockopt(&socket, sockopt::RcvBuf, &(16 << 10)).unwrap();
            let SocketAddr::V4(v4) = address else { unreachable!("bound on 127.0.0.1") };
            connect(std::os::fd::AsRawFd::as_raw_fd(&socket), &SockaddrIn::from(v4)).unwrap();
            let mut scrape = TcpStream::from(socket);
            scrape.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            scrape
        };
        heads.extend((0..CONNECTIONS_MAX + 4).map(|_| sending(address, b"G")));
        settle();
        let reader = reading(scrape.try_clone().unwrap());
        assert!(endpoint.accept_pending(&mut open, &metrics, &never, &large));
        let answering: Vec<(usize, usize)> =
            open.iter().filter_map(|pending| pending.answer.as_ref().map(|answer| (answer.written, answer.bytes.len()))).collect();
        match answering[..] {
            [(written, all)] => assert!(written < all, "the answer was taken whole at its accept ({all} bytes): this test proves nothing"),
            _ => panic!("the scrape was closed to admit connections that sent a byte: answers open {answering:?}"),
        }
        let started = Instant::now();
        while !reader.is_finished() && started.elapsed() < Duration::from_secs(10) {
            serve_open(&mut open, &metrics, &never, &large);
            std::thread::sleep(Duration::from_micros(200));
        }
        let (read, answer) = reader.join().unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{read:?}: {}", &answer[..answer.len().min(200)]);
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "{read:?}: {} bytes of the body came: {head}", body.len());
        drop((heads, scrape));
    }

    #[test]
    fn a_scrape_whose_head_comes_after_its_accept_is_not_evicted_by_one_byte_connections() {
        // Goal: a scrape accepted before its request arrives (a few microseconds behind the
        // connect) looks like a connection that sent nothing; with every other slot taken by
        // connections that sent one byte, it was the first closed to admit the next one (at
        // 64 accepts a pass, a flood closed it before it was read). It is kept through the
        // pass it was accepted in, even when every other slot was taken by the flood in that
        // pass before it came (the flood's connections, having sent a byte, are closed for
        // one another, not the scrape for them), and read again before a slot is chosen to
        // close in the next: its request is answered.
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = endpoint.address();
        let metrics = Metrics::new();
        let never = || false;
        let snapshot = Snapshot::default;
        let mut open = VecDeque::new();
        let mut heads: Vec<TcpStream> = (0..CONNECTIONS_MAX).map(|_| sending(address, b"G")).collect();
        settle();
        assert!(endpoint.accept_pending(&mut open, &metrics, &never, &snapshot));
        assert!(open.len() == CONNECTIONS_MAX && open.iter().all(|pending| pending.head == b"G"), "{} open", open.len());
        // Accepted before its head came, in a pass where a flood came first (enough to replace
        // every older slot, so that every slot is one accepted in this pass when the scrape
        // comes) and goes on after it.
        heads.extend((0..CONNECTIONS_MAX).map(|_| sending(address, b"G")));
        let mut scrape = sending(address, b"");
        heads.extend((0..CONNECTIONS_MAX + 2).map(|_| sending(address, b"G")));
        settle();
        assert!(endpoint.accept_pending(&mut open, &metrics, &never, &snapshot));
        assert_eq!(open.len(), CONNECTIONS_MAX);
        // Its head comes; the flood goes on in the next pass, before the endpoint's loop has
        // read the slots.
        scrape.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        heads.push(sending(address, b"G"));
        settle();
        let reader = reading(scrape);
        assert!(endpoint.accept_pending(&mut open, &metrics, &never, &snapshot));
        serve_open(&mut open, &metrics, &never, &snapshot);
        let (read, answer) = reader.join().unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "the scrape was closed unanswered: {read:?}: {answer:?}");
        drop(heads);
    }

    #[test]
    fn idle_connections_neither_keep_a_scraper_out_nor_take_threads() {
        // Goal: many connections that send nothing cost no thread (the endpoint is one) and
        // cannot keep a scrape out: it is answered at once, the oldest idle ones closed to
        // admit it; an idle connection is closed at its deadline.
        let (address, stop, thread) = endpoint();
        let threads = || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            status.lines().find_map(|line| line.strip_prefix("Threads:")).unwrap().trim().parse::<u32>().unwrap()
        };
        let before = threads();
        let idle: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(address).unwrap()).collect();
        // Time for the endpoint to accept them all before the scrape connects: else, on a loaded
        // machine, 16 or more of them could share the scrape's accept pass, and a scrape whose
        // request lags its connect would be closed at its accept (a newcomer that has sent
        // nothing, every slot taken by such a connection of the same pass).
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        let answer = ask(address, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(started.elapsed() < REQUEST_DEADLINE, "the scrape waited {:?} behind idle connections", started.elapsed());
        // Other tests of this binary run beside this one: a margin for their threads, far
        // below the 200 a thread per connection would add.
        assert!(threads() < before + 50, "the endpoint started threads: {} then {}", before, threads());
        // An idle connection is closed at its deadline (EOF to a read), not before: one opened
        // after a settle, alone in its accept pass, so that no newcomer's rule can close it at
        // its accept (as it could the 200th of the flood above, sharing a pass with 16 or more
        // of them, and the read's EOF would not have tested the deadline).
        std::thread::sleep(Duration::from_millis(100));
        let opened = Instant::now();
        let mut last = TcpStream::connect(address).unwrap();
        last.set_read_timeout(Some(REQUEST_DEADLINE * 5)).unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(last.read(&mut byte).unwrap(), 0, "the idle connection was not closed");
        let closed = opened.elapsed();
        assert!(
            closed >= REQUEST_DEADLINE - Duration::from_millis(500) && closed < REQUEST_DEADLINE * 5,
            "the idle connection was closed {closed:?} after its connect, not at its deadline ({REQUEST_DEADLINE:?})"
        );
        drop(idle);
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
    }
}
