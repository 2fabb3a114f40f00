//! [`RequestSlots`]: the daemon's request handles translated to the data half's.
//!
//! objstore's `StoreData` keeps a request at its handle's slot index, one of its own
//! `StoreConfig::requests_max` slots. Under tuttid the handle comes from the daemon, whose one
//! control half numbers the requests of every session (`clients_max × requests per session`
//! slots): an index past this process's count would be refused as unknown. So every prepared
//! request takes one of this process's slots, and the data half sees a local handle (that
//! slot, a local generation) while the engine and the daemon see the daemon's, so that the
//! engine's handles match the daemon's logs and metrics.
//!
//! The table is allocated once, at connect. Finding a daemon handle scans it: `requests_max`
//! compares of a u64 (32 by default) per data-half call, next to a layer's NVMe commands.

use objstore::{ObjstoreError, RequestHandle};

/// This process's request slots: which daemon request each holds.
#[derive(Debug)]
pub(super) struct RequestSlots {
    /// Per local slot: the daemon's handle of the request in it; None when free.
    daemon: Vec<Option<RequestHandle>>,
    /// Per local slot: the generation of its latest request (a new one on each take, so that a
    /// local handle of a slot taken again names the new request only).
    generations: Vec<u32>,
}

impl RequestSlots {
    /// `requests_max` free slots (`StoreData` refuses a count of 0 or past u32).
    pub(super) fn new(requests_max: usize) -> Self {
        Self { daemon: vec![None; requests_max], generations: vec![0; requests_max] }
    }

    /// Takes a free slot for the daemon's request `daemon` and returns the data half's handle
    /// for it. None free is `TooManyRequests`; a daemon handle already here (the daemon hands
    /// out each once until released: untrusted input) is `HandleState`.
    pub(super) fn take(&mut self, daemon: RequestHandle) -> Result<RequestHandle, ObjstoreError> {
        if self.daemon.contains(&Some(daemon)) {
            return Err(ObjstoreError::HandleState {
                handle: daemon.to_bits(),
                reason: "the daemon handed out a handle already prepared here".into(),
            });
        }
        let slot = self.daemon.iter().position(Option::is_none).ok_or(ObjstoreError::TooManyRequests { max: self.daemon.len() })?;
        self.daemon[slot] = Some(daemon);
        self.generations[slot] = self.generations[slot].wrapping_add(1);
        Ok(local_handle(slot, self.generations[slot]))
    }

    /// Refuses with `take`'s `TooManyRequests` when no slot is free: a store checks before the
    /// daemon reserves, as that reservation may evict cached blocks that releasing it does not
    /// bring back.
    pub(super) fn check_free(&self) -> Result<(), ObjstoreError> {
        if self.daemon.contains(&None) {
            Ok(())
        } else {
            Err(ObjstoreError::TooManyRequests { max: self.daemon.len() })
        }
    }

    /// The data half's handle for the daemon's `daemon`; a handle not prepared here (never,
    /// or finished since) is `UnknownHandle`, naming the daemon's handle.
    pub(super) fn local(&self, daemon: RequestHandle) -> Result<RequestHandle, ObjstoreError> {
        match self.daemon.iter().position(|held| *held == Some(daemon)) {
            Some(slot) => Ok(local_handle(slot, self.generations[slot])),
            None => Err(ObjstoreError::UnknownHandle { handle: daemon.to_bits() }),
        }
    }

    /// Frees the slot of `daemon`'s request (its data path ended). A handle not here is a bug
    /// of the caller: each request is freed once, when the data half's request ends.
    pub(super) fn free(&mut self, daemon: RequestHandle) {
        let slot = self.daemon.iter().position(|held| *held == Some(daemon));
        debug_assert!(slot.is_some(), "freeing request {:#x}, which holds no slot", daemon.to_bits());
        if let Some(slot) = slot {
            self.daemon[slot] = None;
        }
    }

    /// Slots taken.
    #[cfg(test)]
    fn taken(&self) -> usize {
        self.daemon.iter().filter(|held| held.is_some()).count()
    }
}

/// The handle objstore gives request slot `slot` in `generation` (its bit layout, as handles
/// travel between processes: the slot in the high half, the generation in the low half).
fn local_handle(slot: usize, generation: u32) -> RequestHandle {
    RequestHandle::from_bits((slot as u64) << 32 | u64::from(generation))
}

/// `error` from the data half, about its handle `local`, as the engine must see it: naming
/// the daemon's handle `daemon`.
pub(super) fn to_daemon(error: ObjstoreError, local: RequestHandle, daemon: RequestHandle) -> ObjstoreError {
    let name = |handle: u64| if handle == local.to_bits() { daemon.to_bits() } else { handle };
    match error {
        ObjstoreError::UnknownHandle { handle } => ObjstoreError::UnknownHandle { handle: name(handle) },
        ObjstoreError::HandleState { handle, reason } => ObjstoreError::HandleState { handle: name(handle), reason },
        ObjstoreError::PayloadMismatch { handle, blocks } => ObjstoreError::PayloadMismatch { handle: name(handle), blocks },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemon_handle(index: u64, generation: u32) -> RequestHandle {
        RequestHandle::from_bits(index << 32 | u64::from(generation))
    }

    #[test]
    fn daemon_handles_past_the_local_count_take_local_slots() {
        // Goal: any daemon handle (its index far past this process's count) gets a local slot
        // below the count; a full table is TooManyRequests; each daemon handle maps to its own
        // slot until freed, then is unknown; a slot taken again gets a new local handle.
        let mut slots = RequestSlots::new(2);
        let (a, b, c) = (daemon_handle(70, 1), daemon_handle(3, 9), daemon_handle(500, 2));
        let local_a = slots.take(a).unwrap();
        let local_b = slots.take(b).unwrap();
        assert!(local_a.to_bits() >> 32 < 2 && local_b.to_bits() >> 32 < 2);
        assert_ne!(local_a, local_b);
        assert!(matches!(slots.take(c), Err(ObjstoreError::TooManyRequests { max: 2 })));
        assert!(matches!(slots.check_free(), Err(ObjstoreError::TooManyRequests { max: 2 })));
        assert_eq!(slots.taken(), 2);
        assert_eq!(slots.local(a).unwrap(), local_a);
        assert_eq!(slots.local(b).unwrap(), local_b);
        assert!(matches!(slots.local(c), Err(ObjstoreError::UnknownHandle { handle }) if handle == c.to_bits()));

        slots.free(a);
        assert!(matches!(slots.local(a), Err(ObjstoreError::UnknownHandle { handle }) if handle == a.to_bits()));
        let local_c = slots.take(c).unwrap();
        assert_eq!(local_c.to_bits() >> 32, local_a.to_bits() >> 32, "the freed slot is taken again");
        assert_ne!(local_c, local_a, "with a new generation");
        assert_eq!(slots.taken(), 2);
    }

    #[test]
    fn a_daemon_handle_already_prepared_is_refused() {
        // Goal: the daemon handing out a handle this process still holds (a daemon bug or a
        // hostile daemon) is refused, and the request already in the slot keeps it.
        let mut slots = RequestSlots::new(4);
        let a = daemon_handle(1, 1);
        let local = slots.take(a).unwrap();
        assert!(matches!(slots.take(a), Err(ObjstoreError::HandleState { handle, .. }) if handle == a.to_bits()));
        assert_eq!(slots.local(a).unwrap(), local);
        assert_eq!(slots.taken(), 1);
    }

    #[test]
    fn data_half_errors_name_the_daemons_handle() {
        // Goal: an error the data half raised about the local handle names the daemon's (the
        // one the engine holds); other handles and other errors pass unchanged.
        let (local, daemon) = (daemon_handle(0, 1), daemon_handle(40, 7));
        let unknown = to_daemon(ObjstoreError::UnknownHandle { handle: local.to_bits() }, local, daemon);
        assert!(matches!(unknown, ObjstoreError::UnknownHandle { handle } if handle == daemon.to_bits()));
        let state = to_daemon(ObjstoreError::HandleState { handle: local.to_bits(), reason: "x".into() }, local, daemon);
        assert!(matches!(state, ObjstoreError::HandleState { handle, .. } if handle == daemon.to_bits()));
        let mismatch = to_daemon(ObjstoreError::PayloadMismatch { handle: local.to_bits(), blocks: Vec::new() }, local, daemon);
        assert!(matches!(mismatch, ObjstoreError::PayloadMismatch { handle, .. } if handle == daemon.to_bits()));
        let other = to_daemon(ObjstoreError::UnknownHandle { handle: 5 }, local, daemon);
        assert!(matches!(other, ObjstoreError::UnknownHandle { handle: 5 }));
        assert!(matches!(to_daemon(ObjstoreError::TooManyRequests { max: 2 }, local, daemon), ObjstoreError::TooManyRequests { max: 2 }));
    }
}
