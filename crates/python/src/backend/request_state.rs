//! A live request's state beyond the store's own: its layers in flight and its completions
//! not yet returned by a `wait`, as the binding mirrors them (`StoreState` keeps one per
//! prepared request).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use nix::sys::eventfd::{EfdFlags, EventFd};
use objstore::Direction;

use crate::errors::{ErrorClass, Failure};

/// How an issued layer ended: completed, or failed with its own failure (whose message names
/// it: "layer N failed: ..."). `issue` says which issue of the layer it ended (a layer may be
/// issued again once ended): a LayerIo takes only its own issue's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub layer: u32,
    pub issue: u64,
    pub failure: Option<Failure>,
}

impl Outcome {
    /// The layer, or its failure.
    pub fn into_result(self) -> Result<u32, Failure> {
        match self.failure {
            None => Ok(self.layer),
            Some(failure) => Err(failure),
        }
    }
}

/// A wait for the oldest issue in flight that failed without ending it (a queue error): kept
/// to report (`Request.wait`, `poll`, or that issue's LayerIo raise it, once) while the issue
/// is in flight, and forgotten as soon as the issue ends, however it ends. It gates nothing: a
/// later layer's wait drives the request (retrying this issue's wait) as usual.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub layer: u32,
    /// The issue whose wait failed (a layer may be issued again once ended: only this issue's
    /// end forgets the stall).
    pub issue: u64,
    pub failure: Failure,
    /// Until when the completion thread leaves the request alone before it retries the wait
    /// (None once a retry no longer failed): a queue that keeps failing is not polled hot.
    pub backoff_until: Option<Instant>,
}

/// A request's issues, numbered 0, 1, ... in issue order (a LayerIo holds its issue's number):
/// which are in flight and which failed, so that a LayerIo answers for its own issue only, also
/// after its outcome was returned by a wait and after the request ended (a copy is kept then).
#[derive(Debug, Clone, Default)]
pub struct Issues {
    /// The number the next issue gets.
    next: u64,
    /// The issue of each layer in flight (a layer is in flight at most once), as `in_flight`.
    in_flight: Vec<(u32, u64)>,
    /// Issues that failed, each with its failure: what its LayerIo raises however often it is
    /// asked. Off the per-layer path (only a failure adds one).
    failed: Vec<(u64, Failure)>,
}

impl Issues {
    fn begin(&mut self, layer: u32) -> u64 {
        let issue = self.next;
        self.next += 1;
        self.in_flight.push((layer, issue));
        issue
    }

    /// Ends the issue of `layer` in flight: its number (a fresh one should the mirror have
    /// drifted and not know it).
    fn end(&mut self, layer: u32) -> u64 {
        match self.in_flight.iter().position(|&(in_flight, _)| in_flight == layer) {
            Some(position) => self.in_flight.remove(position).1,
            None => {
                let issue = self.next;
                self.next += 1;
                issue
            }
        }
    }

    /// The issues in flight, oldest first, each with its layer.
    pub fn in_flight(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.in_flight.iter().copied()
    }

    /// Whether `issue` is in flight.
    pub fn is_in_flight(&self, issue: u64) -> bool {
        self.in_flight.iter().any(|&(_, in_flight)| in_flight == issue)
    }

    /// How `issue` ended: `Some(Ok)` completed, `Some(Err)` its failure; None while it is in
    /// flight, or never issued.
    pub fn result(&self, issue: u64) -> Option<Result<(), Failure>> {
        if issue >= self.next || self.is_in_flight(issue) {
            return None;
        }
        match self.failed.iter().find(|&&(failed, _)| failed == issue) {
            Some((_, failure)) => Some(Err(failure.clone())),
            None => Some(Ok(())),
        }
    }
}

/// A live request's state, beyond the store's own.
///
/// Its layers, in issue order, are: ended (completed or failed) and not yet returned by a
/// `wait` (`unreported`, each with its outcome), then in flight (`in_flight`). The store ends
/// layers in issue order, so the two queues only ever move from the back of one to the back
/// of the other. Together they hold at most the store's `layers_in_flight_max` layers: an
/// issue is refused while they are full (`issue_refusal`), so no outcome is ever dropped and
/// whether an issue is accepted depends only on the caller's issues and waits, not on when
/// the I/O completed. Both are reserved once, at prepare, and never grow on the per-layer
/// path. A failure belongs to the layer it ended, so that whoever waits for another layer
/// never takes it.
pub struct RequestState {
    pub direction: Direction,
    /// Layers issued and not yet ended, oldest first (a mirror of the store's own list, taken
    /// from it again whenever a wait or an issue fails).
    pub in_flight: VecDeque<u32>,
    /// Layers completed, in order (a failed layer is not).
    pub completed: Vec<u32>,
    /// Every issue's number, whether in flight, and failure.
    pub issues: Issues,
    /// Layers ended whose outcome no wait returned yet (the completion thread, a poll or
    /// another layer's LayerIo.wait saw it end), oldest first.
    pub unreported: VecDeque<Outcome>,
    /// A wait for the oldest issue in flight that failed without ending it, as the completion
    /// thread saw it (see `Stall`): the issue stays in flight, and the next wait (anyone's, the
    /// thread's after a backoff) tries again.
    pub stalled: Option<Stall>,
    /// Signalled once per ended layer (and on a failure), created by `fileno()`.
    pub eventfd: Option<Arc<EventFd>>,
    /// The request moves no block (a store whose blocks the pool holds already): the store
    /// puts nothing in flight when a layer is issued, so the layer completes at the issue.
    pub moves_nothing: bool,
    /// The store's `layers_in_flight_max` when the request was prepared.
    layers_max: usize,
}

impl RequestState {
    pub fn new(direction: Direction, moves_nothing: bool, layers_max: u32) -> RequestState {
        let layers_max = layers_max.max(1) as usize;
        RequestState {
            direction,
            in_flight: VecDeque::with_capacity(layers_max),
            completed: Vec::new(),
            issues: Issues { next: 0, in_flight: Vec::with_capacity(layers_max), failed: Vec::new() },
            unreported: VecDeque::with_capacity(layers_max),
            stalled: None,
            eventfd: None,
            moves_nothing,
            layers_max,
        }
    }

    pub(super) fn signal(&self) {
        if let Some(eventfd) = &self.eventfd {
            // Saturation (2^64 - 2 unread signals) is the only failure: the fd is readable then.
            let _ = eventfd.write(1);
        }
    }

    /// Records that `layer` was put in flight; returns the issue's number (its LayerIo's).
    pub(super) fn issued(&mut self, layer: u32) -> u64 {
        self.in_flight.push_back(layer);
        self.issues.begin(layer)
    }

    /// Records that `layer`, issued on a request that moves nothing, completed at its issue;
    /// returns the issue's number.
    pub(super) fn completed_at_issue(&mut self, layer: u32) -> u64 {
        let issue = self.issued(layer);
        self.complete(layer);
        issue
    }

    /// Takes `layer` out of flight; returns its issue's number. A stall of that issue is
    /// forgotten: the issue ended.
    fn leave_flight(&mut self, layer: u32) -> u64 {
        // The store ends layers in issue order, so this is the front; by value, so that a
        // mirror that drifted cannot keep an ended layer in flight.
        if let Some(position) = self.in_flight.iter().position(|&in_flight| in_flight == layer) {
            self.in_flight.remove(position);
        }
        let issue = self.issues.end(layer);
        if self.stalled.as_ref().is_some_and(|stall| stall.issue == issue) {
            self.stalled = None;
        }
        issue
    }

    /// Records that a wait for the oldest issue in flight failed with `failure` without ending
    /// it (the completion thread's), to report and to retry after `backoff_until`.
    pub(super) fn stall(&mut self, failure: Failure, backoff_until: Instant) {
        let Some(&layer) = self.in_flight.front() else { return };
        if let Some(issue) = self.issue_in_flight(layer) {
            self.stalled = Some(Stall { layer, issue, failure, backoff_until: Some(backoff_until) });
        }
    }

    /// Takes the stall to raise it, if any (`Request.wait`, `poll`).
    pub fn take_stall(&mut self) -> Option<Failure> {
        self.stalled.take().map(|stall| stall.failure)
    }

    /// Takes the stall of `issue`, if that issue's wait is the one that failed (its LayerIo).
    pub fn take_stall_of(&mut self, issue: u64) -> Option<Failure> {
        if self.stalled.as_ref().is_some_and(|stall| stall.issue == issue) {
            return self.take_stall();
        }
        None
    }

    /// Records that `layer`, the oldest in flight, completed.
    pub(super) fn complete(&mut self, layer: u32) {
        let issue = self.leave_flight(layer);
        self.completed.push(layer);
        self.unreported.push_back(Outcome { layer, issue, failure: None });
        self.signal();
    }

    /// Records that `layer`, the oldest in flight, ended with `failure`: its own, which its
    /// LayerIo raises, and the waits in issue order (once).
    pub(super) fn fail(&mut self, layer: u32, failure: &Failure) {
        let issue = self.leave_flight(layer);
        let failure = Failure { message: format!("layer {layer} failed: {}", failure.message), ..failure.clone() };
        self.issues.failed.push((issue, failure.clone()));
        self.unreported.push_back(Outcome { layer, issue, failure: Some(failure) });
        self.signal();
    }

    /// Takes the outcome of `issue` if no wait returned it yet, for its LayerIo.
    pub fn take_outcome(&mut self, issue: u64) -> Option<Outcome> {
        let position = self.unreported.iter().position(|outcome| outcome.issue == issue)?;
        self.unreported.remove(position)
    }

    /// Whether `issue` ended (completed or failed).
    pub fn is_ended(&self, issue: u64) -> bool {
        issue < self.issues.next && !self.issues.is_in_flight(issue)
    }

    /// Why issuing `layer` is refused, or None when it may be issued: the request holds
    /// `layers_max` layers that no wait returned yet (in flight, or ended with their outcome
    /// not yet returned). Refusing rather than forgetting the oldest outcome keeps every
    /// layer returnable, in issue order, by the waits the caller makes.
    pub fn issue_refusal(&self, layer: u32) -> Option<String> {
        let limit = self.layers_max;
        if self.in_flight.len() + self.unreported.len() < limit {
            return None;
        }
        if self.unreported.is_empty() {
            return Some(format!(
                "{} still in flight (layers_in_flight = {limit} per request): wait for the oldest before issuing layer {layer}",
                self.in_flight_text()
            ));
        }
        let layers: Vec<u32> = self.unreported.iter().map(|outcome| outcome.layer).chain(self.in_flight.iter().copied()).collect();
        let each: Vec<String> = self
            .unreported
            .iter()
            .map(|outcome| format!("layer {} {}", outcome.layer, if outcome.failure.is_some() { "failed" } else { "completed" }))
            .chain(self.in_flight.iter().map(|layer| format!("layer {layer} still in flight")))
            .collect();
        Some(format!(
            "{} not yet returned by a wait ({}; layers_in_flight = {limit} per request): wait for layer {} before issuing layer {layer}",
            layers_text(&layers),
            each.join(", "),
            layers[0]
        ))
    }

    /// Takes the store's own list of the layers in flight (after a failed issue or wait), in
    /// place: the queue keeps the capacity reserved at prepare.
    pub(super) fn set_in_flight(&mut self, layers: impl IntoIterator<Item = u32>) {
        self.in_flight.clear();
        self.in_flight.extend(layers);
        let in_flight = &self.in_flight;
        self.issues.in_flight.retain(|(layer, _)| in_flight.contains(layer));
        // A stall of an issue the store no longer lists: that issue ended.
        if let Some(stall) = &self.stalled {
            if !self.issues.is_in_flight(stall.issue) {
                self.stalled = None;
            }
        }
        for &layer in &self.in_flight {
            // A layer the mirror did not have in flight gets an issue of its own (no LayerIo).
            if !self.issues.in_flight.iter().any(|&(known, _)| known == layer) {
                let issue = self.issues.next;
                self.issues.next += 1;
                self.issues.in_flight.push((layer, issue));
            }
        }
    }

    /// The issue of `layer` in flight, if it is.
    pub fn issue_in_flight(&self, layer: u32) -> Option<u64> {
        self.issues.in_flight.iter().find(|&&(in_flight, _)| in_flight == layer).map(|&(_, issue)| issue)
    }

    /// The layers in flight as text (error messages): "layer 3", "layers 3, 4".
    pub fn in_flight_text(&self) -> String {
        let layers: Vec<u32> = self.in_flight.iter().copied().collect();
        layers_text(&layers)
    }

    pub fn eventfd(&mut self) -> Result<Arc<EventFd>, Failure> {
        if let Some(eventfd) = &self.eventfd {
            return Ok(Arc::clone(eventfd));
        }
        let eventfd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|errno| Failure::new(ErrorClass::Device, format!("creating the request's eventfd: {errno}")))?;
        let eventfd = Arc::new(eventfd);
        self.eventfd = Some(Arc::clone(&eventfd));
        // Layers completed before the fd existed are announced at once.
        if !self.unreported.is_empty() {
            let _ = eventfd.write(1);
        }
        Ok(eventfd)
    }
}

/// Layers as text (error messages): "layer 3", "layers 3, 4".
fn layers_text(layers: &[u32]) -> String {
    let listed: Vec<String> = layers.iter().map(u32::to_string).collect();
    let noun = if listed.len() == 1 { "layer" } else { "layers" };
    format!("{noun} {}", listed.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issues `layer` as `StoreState::issue` does: refused while the request is full; returns
    /// the issue's number (its LayerIo's).
    fn issue(state: &mut RequestState, layer: u32) -> u64 {
        assert_eq!(state.issue_refusal(layer), None, "layer {layer}");
        state.issued(layer)
    }

    /// The layers of the outcomes no wait returned yet, oldest first.
    fn unreported(state: &RequestState) -> Vec<u32> {
        state.unreported.iter().map(|outcome| outcome.layer).collect()
    }

    fn device_failure(what: &str) -> Failure {
        Failure::new(ErrorClass::Device, what)
    }

    #[test]
    fn one_layer_in_flight_refuses_an_issue_until_the_last_layer_is_returned() {
        // Goal: with one layer in flight (the default), a layer that completed (a poll, the
        // completion thread) and was not returned by a wait refuses the next issue, naming
        // it; once a wait returned it, the next layer is accepted (issue, wait, issue).
        let mut state = RequestState::new(Direction::Retrieve, false, 1);
        issue(&mut state, 0);
        assert_eq!(
            state.issue_refusal(1).as_deref(),
            Some("layer 0 still in flight (layers_in_flight = 1 per request): wait for the oldest before issuing layer 1")
        );
        state.complete(0);
        assert_eq!(
            state.issue_refusal(1).as_deref(),
            Some(
                "layer 0 not yet returned by a wait (layer 0 completed; layers_in_flight = 1 per request): wait for layer 0 before \
                 issuing layer 1"
            )
        );
        assert_eq!(state.unreported.pop_front().map(Outcome::into_result), Some(Ok(0))); // the wait
        issue(&mut state, 1);
        assert_eq!(state.in_flight, [1]);
    }

    #[test]
    fn completions_are_kept_in_issue_order_and_an_issue_past_them_is_refused() {
        // Goal: layers end from the front of `in_flight` to the back of `unreported`; an
        // engine that waits once per issue never loses a completion; issuing while the two
        // queues hold the limit is refused (naming each layer), never forgets the oldest, and
        // the queues never grow past their reservation.
        let mut state = RequestState::new(Direction::Retrieve, false, 2);
        let reserved = (state.in_flight.capacity(), state.unreported.capacity());
        issue(&mut state, 0);
        issue(&mut state, 1);
        state.complete(0);
        state.complete(1); // the completion thread, before the engine's first wait
        assert_eq!((state.in_flight.len(), unreported(&state)), (0, vec![0, 1]));
        assert!(state.issue_refusal(2).is_some_and(|refusal| refusal.starts_with("layers 0, 1 not yet returned by a wait")));
        assert_eq!(state.unreported.pop_front().map(Outcome::into_result), Some(Ok(0))); // the engine's wait
        issue(&mut state, 2);
        assert_eq!(unreported(&state), [1], "the layer the engine waits for next is kept");
        assert_eq!(state.unreported.pop_front().map(Outcome::into_result), Some(Ok(1)));
        issue(&mut state, 3);
        assert_eq!((state.in_flight.clone(), state.completed.clone()), (VecDeque::from([2, 3]), vec![0, 1]));
        state.complete(2);
        state.fail(3, &device_failure("a command failed"));
        assert_eq!(
            state.issue_refusal(0).as_deref(),
            Some(
                "layers 2, 3 not yet returned by a wait (layer 2 completed, layer 3 failed; layers_in_flight = 2 per request): \
                 wait for layer 2 before issuing layer 0"
            )
        );
        assert_eq!((state.in_flight.capacity(), state.unreported.capacity()), reserved);
    }

    #[test]
    fn every_issued_layer_is_returned_once_in_issue_order_against_a_model() {
        // Goal: over many random interleavings of issues, completions, failures, waits and
        // LayerIo waits (a small deterministic generator), the request's two queues are
        // always the model's list of layers issued and not yet returned (a VecDeque), an
        // issue is refused exactly when that list holds the limit, and each returned layer is
        // the one the model expects: nothing is dropped or returned twice.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound
        };
        for limit in 1..=4_u32 {
            let mut state = RequestState::new(Direction::Retrieve, false, limit);
            let mut model: VecDeque<(u32, u64, bool)> = VecDeque::new(); // (layer, issue, ended)
            let mut next_layer = 0_u32;
            for _ in 0..2_000 {
                match next(5) {
                    0 => {
                        let layer = next_layer % 8;
                        let in_flight = model.iter().any(|&(issued, _, ended)| issued == layer && !ended);
                        assert_eq!(state.issue_refusal(layer).is_some(), model.len() == limit as usize);
                        if state.issue_refusal(layer).is_none() && !in_flight {
                            let issue = state.issued(layer);
                            model.push_back((layer, issue, false));
                            next_layer += 1;
                        }
                    }
                    1 | 2 => {
                        if let Some(oldest) = model.iter_mut().find(|(_, _, ended)| !ended) {
                            oldest.2 = true;
                            if next(4) == 0 {
                                state.fail(oldest.0, &device_failure("injected"));
                            } else {
                                state.complete(oldest.0);
                            }
                        }
                    }
                    3 => {
                        // Request.wait: the oldest not returned, once ended.
                        if model.front().is_some_and(|&(_, _, ended)| ended) {
                            let (layer, issue, _) = model.pop_front().unwrap();
                            let outcome = state.unreported.pop_front().map(|outcome| (outcome.layer, outcome.issue));
                            assert_eq!(outcome, Some((layer, issue)));
                        }
                    }
                    _ => {
                        // A LayerIo.wait of an ended issue: takes that issue's outcome only.
                        let ended: Vec<(u32, u64)> =
                            model.iter().filter(|(_, _, ended)| *ended).map(|&(layer, issue, _)| (layer, issue)).collect();
                        if !ended.is_empty() {
                            let (layer, issue) = ended[next(ended.len() as u64) as usize];
                            model.retain(|&(_, issued, _)| issued != issue);
                            let outcome = state.take_outcome(issue).map(|outcome| (outcome.layer, outcome.issue));
                            assert_eq!(outcome, Some((layer, issue)));
                        }
                    }
                }
                let queues: Vec<u32> = unreported(&state).into_iter().chain(state.in_flight.iter().copied()).collect();
                let expected: Vec<u32> = model.iter().map(|&(layer, _, _)| layer).collect();
                assert_eq!(queues, expected, "limit {limit}");
                assert!(state.in_flight.capacity() >= limit as usize && state.unreported.len() + state.in_flight.len() <= limit as usize);
            }
        }
    }

    #[test]
    fn a_failure_belongs_to_the_layer_it_ended() {
        // Goal: a failed layer's outcome names it and sits in issue order among the others;
        // its LayerIo takes it (not another layer's), and still answers "layer N failed" after
        // a wait returned it; the failure is forgotten when the layer is issued again.
        let mut state = RequestState::new(Direction::Retrieve, false, 3);
        let [three, zero, one] = [3, 0, 1].map(|layer| issue(&mut state, layer));
        state.fail(3, &device_failure("a command failed"));
        state.complete(0);
        assert_eq!((unreported(&state), state.in_flight.clone()), (vec![3, 0], VecDeque::from([1])));
        assert!(state.is_ended(three) && state.is_ended(zero) && !state.is_ended(one));
        assert_eq!(state.take_outcome(zero).map(Outcome::into_result), Some(Ok(0)), "layer 0's LayerIo takes its own");
        let own = state.unreported.pop_front().map(Outcome::into_result); // the next Request.wait
        let expected = Failure::new(ErrorClass::Device, "layer 3 failed: a command failed");
        assert_eq!(own, Some(Err(expected.clone())));
        assert_eq!(state.issues.result(three), Some(Err(expected.clone())), "layer 3's LayerIo still says it failed");
        assert_eq!((state.issues.result(zero), state.issues.result(one), state.issues.result(99)), (Some(Ok(())), None, None));
        assert_eq!(state.completed, [0]);
        state.complete(1);
        let again = issue(&mut state, 3);
        assert!(!state.is_ended(again) && state.issues.result(again).is_none(), "issued again: in flight");
        assert_eq!(state.issues.result(three), Some(Err(expected)), "the first issue's LayerIo still says it failed");
    }

    #[test]
    fn a_layer_issued_twice_gives_each_layer_io_its_own_issues_outcome() {
        // Goal: with a layer issued again while (or after) its first outcome waits, each
        // LayerIo takes its own issue's outcome: the first issue's success is not the second's
        // failure, and a handle whose outcome a Request.wait returned reports its own result,
        // never the later issue's outcome.
        let mut state = RequestState::new(Direction::Retrieve, false, 2);
        let first = issue(&mut state, 0);
        state.complete(0); // a poll
        let second = issue(&mut state, 0);
        state.fail(0, &device_failure("a command failed"));
        assert_ne!(first, second);
        assert_eq!(state.take_outcome(first).map(Outcome::into_result), Some(Ok(0)), "the first issue completed");
        let failed = state.take_outcome(second).map(Outcome::into_result);
        assert!(matches!(failed, Some(Err(ref failure)) if failure.message == "layer 0 failed: a command failed"));
        assert!(state.unreported.is_empty());
        // Stale handle: the first issue's outcome returned by Request.wait, layer 0 issued again.
        let third = issue(&mut state, 0);
        state.complete(0);
        assert_eq!(state.unreported.pop_front().map(|outcome| outcome.issue), Some(third));
        let fourth = issue(&mut state, 0);
        state.complete(0);
        assert_eq!(state.take_outcome(third), None, "the third issue's outcome was returned");
        assert_eq!(state.issues.result(third), Some(Ok(())));
        assert_eq!(state.unreported.front().map(|outcome| outcome.issue), Some(fourth), "the fourth's is left for its waits");
        assert!(state.issues.result(second).is_some_and(|result| result.is_err()));
    }

    #[test]
    fn a_stall_is_forgotten_once_its_issue_ends_another_way() {
        // Goal: a wait that failed without ending its layer is kept to report only while that
        // issue is in flight: once the issue ends (a later wait, the request's exit settling
        // it) or the store's list no longer holds it, nothing is left to say "still in flight"
        // about, and a later issue of the same layer is not blamed for it.
        let mut state = RequestState::new(Direction::Store, false, 2);
        let stuck = || device_failure("the queue could not be polled");
        issue(&mut state, 0);
        state.stall(stuck(), Instant::now());
        state.complete(0);
        assert!(state.stalled.is_none(), "layer 0's issue completed");
        state.unreported.clear(); // the waits
        issue(&mut state, 1);
        state.stall(stuck(), Instant::now());
        state.fail(1, &device_failure("a command failed"));
        assert!(state.stalled.is_none(), "layer 1's issue failed: its own failure reports it");
        state.unreported.clear();
        issue(&mut state, 2);
        state.stall(stuck(), Instant::now());
        state.set_in_flight([]);
        assert!(state.stalled.is_none(), "the store no longer lists layer 2");
        let second = issue(&mut state, 2);
        issue(&mut state, 3);
        state.stall(stuck(), Instant::now());
        state.set_in_flight([2, 3]);
        assert_eq!(state.stalled.as_ref().map(|stall| (stall.layer, stall.issue)), Some((2, second)), "still listed: kept");
        assert_eq!(state.take_stall_of(second + 1), None, "layer 3's LayerIo does not take layer 2's");
        assert_eq!(state.take_stall_of(second), Some(stuck()), "layer 2's second issue's LayerIo does");
    }

    #[test]
    fn the_store_list_replaces_the_mirror_and_messages_name_every_layer() {
        // Goal: after a failure the store's own list is taken (a failed layer ended, the later
        // ones still in flight); messages name the layers in flight.
        let mut state = RequestState::new(Direction::Store, false, 4);
        for layer in 0..3 {
            issue(&mut state, layer);
        }
        assert_eq!(state.in_flight_text(), "layers 0, 1, 2");
        state.set_in_flight([1, 2]);
        assert_eq!(state.in_flight_text(), "layers 1, 2");
        state.complete(1);
        assert_eq!(state.in_flight_text(), "layer 2");
        assert_eq!(state.completed, [1]);
    }
}
