//! The `Status` reply: devices, pool fill, clients, leaks and the doorbell relay, as
//! `tuttid --status` and tools read them. Encoded field by field with the protocol's
//! bounds-checked reader (protocol.rs).

use super::{
    put_shape, put_str, put_str_within, put_u16, put_u32, put_u64, BodyReader, PoolShape, ProtocolError, BODY_BYTES_MAX,
    CLIENT_NAME_BYTES_MAX, STRING_BYTES_MAX,
};

/// The most bytes one client's entry in a status reply takes (see `put_status`): its name is
/// cut to the longest `Hello` accepts.
pub const CLIENT_STATUS_BYTES_MAX: usize = 8 + 4 + 4 + (2 + CLIENT_NAME_BYTES_MAX) + 4 + 4 + 8 + 8 + 4 + 4 + 4 + 8 + 8 + 1 + 1 + 1;
/// The most bytes one device's entry takes (both strings at [`STRING_BYTES_MAX`], its refused
/// commands, its `metadata_fenced` flag).
pub const DEVICE_STATUS_BYTES_MAX: usize = (2 + STRING_BYTES_MAX) * 2 + 8 + 1;
/// Devices a status reply keeps room for when working out [`STATUS_CLIENTS_MAX`]: as many as
/// one attach reply can carry register pages for (a pool with more serves no client).
pub const STATUS_DEVICES_RESERVED: usize = crate::fd_passing::FDS_PER_FRAME_MAX;
/// Everything in a status reply but its devices and clients: pid, uptime, shape, device count,
/// pool counts, connections, client count, leaks, relay counts.
const STATUS_FIXED_BYTES: usize = 4 + 8 + 6 * 4 + 2 + 7 * 8 + 4 + 2 + 8 + 3 * 8 + 4 * 8;
/// The most sessions one status reply can list within the body cap, with room for
/// [`STATUS_DEVICES_RESERVED`] devices at their longest: the daemon serves no more clients
/// than this (`ServerConfig::validate`), so `tuttid --status` works when it is busiest.
pub const STATUS_CLIENTS_MAX: usize =
    (BODY_BYTES_MAX as usize - STATUS_FIXED_BYTES - STATUS_DEVICES_RESERVED * DEVICE_STATUS_BYTES_MAX) / CLIENT_STATUS_BYTES_MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    pub spec: String,
    pub description: String,
    /// Commands the software controller refused because they named memory or blocks outside
    /// their queue's restriction (always 0 on other devices).
    pub refused_commands: u64,
}

/// Pool fill: the index's counts, sent field by field (see `encode`/`decode`).
pub type PoolStatus = objstore::IndexCounts;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientStatus {
    pub session: u64,
    pub pid: u32,
    pub uid: u32,
    pub name: String,
    pub tp_rank: u32,
    pub tp_world: u32,
    pub requests: u64,
    pub idle_ms: u64,
    /// Memory windows registered, queue pairs attached, requests prepared and not yet
    /// committed or released.
    pub registrations: u32,
    pub queue_pairs: u32,
    pub requests_in_flight: u32,
    /// Doorbell values the relay forwarded for this session's queue pairs, and values it
    /// dropped (outside the queue's depth); 0 on devices with a shared register page.
    pub doorbells_relayed: u64,
    pub doorbells_dropped: u64,
    /// The daemon ended the session while its client process still runs: its holdings are
    /// kept until that process exits (protocol version 5; docs/tuttid.md "Leases and crashes").
    pub awaiting_exit: bool,
    /// The session ended and its queue pairs could not be deleted: they, its windows, device
    /// memory and reservations are kept for good, and so is this entry (protocol version 7).
    /// Its client must never free or reuse memory it registered (the pairs may still write it).
    pub kept: bool,
    /// The session ended and the deletion of its queue pairs is not confirmed yet: retried every
    /// tick, its memory kept until the controller confirms (then the entry goes) or a deletion
    /// fails for good (then `kept`). Its client must not free memory it registered meanwhile.
    pub retiring: bool,
}

/// The doorbell relay's counters (`crate::relay`), sent field by field.
pub type RelayStatus = crate::relay::RelayCounts;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusReply {
    pub daemon_pid: u32,
    pub uptime_ms: u64,
    pub shape: PoolShape,
    pub devices: Vec<DeviceStatus>,
    /// Per entry of `devices`, in order: whether the pool fenced the device's metadata (header
    /// writes or cache flushes kept failing, or a metadata command stuck on a queue pair the
    /// controller would not delete): no store goes to it and its free slots take none, until
    /// tuttid restarts and reopens the pool (docs/objstore.md, "Metadata timeouts"). Sent in
    /// each device's entry (protocol version 8); an entry missing here is sent as not fenced.
    /// Kept beside `devices` rather than in [`DeviceStatus`], which the pool's opener builds
    /// before any device could be fenced.
    pub metadata_fenced: Vec<bool>,
    pub pool: PoolStatus,
    /// Open connections, attached or not (a status query is one).
    pub connections: u32,
    /// Attached sessions.
    pub clients: Vec<ClientStatus>,
    /// Client queue pairs whose deletion failed since start: their rings, windows and
    /// reservations are kept for good (docs/tuttid.md, "Leases and crashes").
    pub leaked_queue_pairs: u64,
    /// What those sessions kept with them: windows (and their bytes), still mapped for the
    /// devices, and requests whose slots stay reserved (protocol version 3).
    pub leaked_windows: u64,
    pub leaked_window_bytes: u64,
    pub leaked_requests: u64,
    pub relay: RelayStatus,
}

pub(super) fn put_status(out: &mut Vec<u8>, status: &StatusReply) {
    put_u32(out, status.daemon_pid);
    put_u64(out, status.uptime_ms);
    put_shape(out, &status.shape);
    put_u16(out, status.devices.len() as u16);
    for (index, device) in status.devices.iter().enumerate() {
        put_str(out, &device.spec);
        put_str(out, &device.description);
        put_u64(out, device.refused_commands);
        out.push(u8::from(status.metadata_fenced.get(index).copied().unwrap_or(false)));
    }
    let pool = &status.pool;
    for value in [pool.slots, pool.free_slots, pool.valid_slots, pool.writing_slots, pool.pinned_slots, pool.cached_blocks, pool.evictions]
    {
        put_u64(out, value);
    }
    put_u32(out, status.connections);
    put_u16(out, status.clients.len() as u16);
    for client in &status.clients {
        put_u64(out, client.session);
        put_u32(out, client.pid);
        put_u32(out, client.uid);
        put_str_within(out, &client.name, CLIENT_NAME_BYTES_MAX);
        put_u32(out, client.tp_rank);
        put_u32(out, client.tp_world);
        put_u64(out, client.requests);
        put_u64(out, client.idle_ms);
        put_u32(out, client.registrations);
        put_u32(out, client.queue_pairs);
        put_u32(out, client.requests_in_flight);
        put_u64(out, client.doorbells_relayed);
        put_u64(out, client.doorbells_dropped);
        out.push(u8::from(client.awaiting_exit));
        out.push(u8::from(client.kept));
        out.push(u8::from(client.retiring));
    }
    put_u64(out, status.leaked_queue_pairs);
    let relay = &status.relay;
    for value in [status.leaked_windows, status.leaked_window_bytes, status.leaked_requests] {
        put_u64(out, value);
    }
    for value in [relay.passes, relay.forwarded, relay.dropped, relay.queues] {
        put_u64(out, value);
    }
}

impl BodyReader<'_> {
    pub(super) fn status(&mut self) -> Result<StatusReply, ProtocolError> {
        let daemon_pid = self.u32("daemon_pid")?;
        let uptime_ms = self.u64("uptime_ms")?;
        let shape = self.shape()?;
        let device_count = self.u16("device_count")?;
        let mut devices = Vec::new();
        let mut metadata_fenced = Vec::new();
        for _ in 0..device_count {
            devices.push(DeviceStatus {
                spec: self.string("device spec", STRING_BYTES_MAX)?,
                description: self.string("device description", STRING_BYTES_MAX)?,
                refused_commands: self.u64("refused_commands")?,
            });
            metadata_fenced.push(self.flag("metadata_fenced")?);
        }
        let pool = PoolStatus {
            slots: self.u64("slots")?,
            free_slots: self.u64("free_slots")?,
            valid_slots: self.u64("valid_slots")?,
            writing_slots: self.u64("writing_slots")?,
            pinned_slots: self.u64("pinned_slots")?,
            cached_blocks: self.u64("cached_blocks")?,
            evictions: self.u64("evictions")?,
        };
        let connections = self.u32("connections")?;
        let client_count = self.u16("client_count")?;
        let mut clients = Vec::new();
        for _ in 0..client_count {
            clients.push(ClientStatus {
                session: self.u64("session")?,
                pid: self.u32("pid")?,
                uid: self.u32("uid")?,
                name: self.string("client name", CLIENT_NAME_BYTES_MAX)?,
                tp_rank: self.u32("tp_rank")?,
                tp_world: self.u32("tp_world")?,
                requests: self.u64("requests")?,
                idle_ms: self.u64("idle_ms")?,
                registrations: self.u32("registrations")?,
                queue_pairs: self.u32("queue_pairs")?,
                requests_in_flight: self.u32("requests_in_flight")?,
                doorbells_relayed: self.u64("doorbells_relayed")?,
                doorbells_dropped: self.u64("doorbells_dropped")?,
                awaiting_exit: self.flag("awaiting_exit")?,
                kept: self.flag("kept")?,
                retiring: self.flag("retiring")?,
            });
        }
        let leaked_queue_pairs = self.u64("leaked_queue_pairs")?;
        let leaked_windows = self.u64("leaked_windows")?;
        let leaked_window_bytes = self.u64("leaked_window_bytes")?;
        let leaked_requests = self.u64("leaked_requests")?;
        let relay = RelayStatus {
            passes: self.u64("relay passes")?,
            forwarded: self.u64("relay forwarded")?,
            dropped: self.u64("relay dropped")?,
            queues: self.u64("relay queues")?,
        };
        Ok(StatusReply {
            daemon_pid,
            uptime_ms,
            shape,
            devices,
            metadata_fenced,
            pool,
            connections,
            clients,
            leaked_queue_pairs,
            leaked_windows,
            leaked_window_bytes,
            leaked_requests,
            relay,
        })
    }
}
