//! `LookupClient`: a tuttid session that only looks up (an engine's scheduler process).

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tutti_daemon::client::wire_first_block;
use tutti_daemon::protocol::Hello;
use tutti_daemon::{Client, DaemonError};

use crate::errors::{ErrorClass, Failure};
use crate::geometry::ModelGeometry;
use crate::process::OwningProcess;

/// A lookup-only session (module stub: `LookupClient`).
#[pyclass(frozen, module = "tutti")]
pub struct LookupClient {
    client: Mutex<Option<Client>>,
    session: u64,
    geometry: objstore::ModelGeometry,
    lease_ms: u32,
    /// The process that connected: the only one whose calls go on the connection (a forked
    /// child shares its socket with the parent; `process`).
    owner: OwningProcess,
    /// The connection's descriptors recorded for forked children to close (another thread's
    /// connection opened meanwhile may be among them): those the client closes are forgotten
    /// as it closes them (`process::close_and_forget`).
    connections: Vec<std::os::fd::RawFd>,
}

impl Drop for LookupClient {
    fn drop(&mut self) {
        if !self.owner.is_current() {
            // Inherited across fork: the connection is the parent's. Nothing is sent on it and
            // the client is never dropped here; only this process's copy of the socket is
            // closed (close(2), at the fork already: `process`), so that tuttid sees the
            // connection end when the parent closes.
            let client = self.client.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            std::mem::forget(client);
            crate::process::close_inherited();
        } else {
            // Still open: closed here, and the records of what it closed forgotten. Not the
            // others: `connections` may hold another thread's connection (found with this one
            // at connect), and once `close` closed this one its numbers may name another
            // connection's recorded socket; either record must stay (`close_and_forget`).
            let client = self.client.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            if client.is_some() {
                crate::process::close_and_forget(client, &self.connections);
            }
        }
    }
}

impl LookupClient {
    fn call<T: Send>(&self, py: Python<'_>, call: impl FnOnce(&mut Client) -> Result<T, DaemonError> + Send) -> PyResult<T> {
        py.detach(|| {
            self.owner.check("the lookup client")?;
            let mut client = self.client.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let client = client.as_mut().ok_or_else(|| Failure::new(ErrorClass::Disconnected, "the client is closed"))?;
            call(client).map_err(Failure::from)
        })
        .map_err(|failure| failure.to_pyerr(py))
    }
}

#[pymethods]
impl LookupClient {
    #[staticmethod]
    #[pyo3(signature = (socket, *, model_fingerprint, tp_rank = 0, tp_world = 1, client_name = "python-scheduler".to_string(), timeout_s = 5.0))]
    fn connect(
        py: Python<'_>,
        socket: PathBuf,
        model_fingerprint: Vec<u8>,
        tp_rank: u32,
        tp_world: u32,
        client_name: String,
        timeout_s: f64,
    ) -> PyResult<LookupClient> {
        let fingerprint = crate::store::fingerprint_of(&model_fingerprint)?;
        // Bounded as every timeout of the package: a deadline past the clock's range would panic.
        let timeout = crate::store::duration_of(timeout_s, "timeout_s")?;
        let hello = Hello { model_fingerprint: fingerprint, tp_rank, tp_world, client_name };
        let crate::store::Hellod { client, reply, geometry, connections } = py
            .detach(|| crate::store::hello_daemon(&socket, timeout, &hello, crate::store::Busy::Refuse))
            .map_err(|failure| failure.to_pyerr(py))?;
        Ok(LookupClient {
            client: Mutex::new(Some(client)),
            session: reply.session,
            geometry,
            lease_ms: reply.lease_ms,
            owner: OwningProcess::current(),
            connections,
        })
    }

    #[getter]
    fn session(&self) -> u64 {
        self.session
    }

    #[getter]
    fn geometry(&self) -> ModelGeometry {
        ModelGeometry::from_inner(self.geometry)
    }

    #[getter]
    fn block_tokens(&self) -> u32 {
        self.geometry.block_tokens
    }

    #[getter]
    fn lease_s(&self) -> f64 {
        f64::from(self.lease_ms) / 1000.0
    }

    /// `first_block` is taken as Store.lookup takes it (any non-negative int): one past what
    /// tuttid takes is InvalidArgument, as there, not an OverflowError.
    #[pyo3(signature = (tokens, first_block = 0))]
    fn lookup(&self, py: Python<'_>, tokens: Vec<u32>, first_block: usize) -> PyResult<u32> {
        let first_block = wire_first_block(first_block).map_err(Failure::from)?;
        self.call(py, move |client| client.lookup_from(&tokens, first_block))
    }

    #[pyo3(signature = (tokens, first_block = 0))]
    fn lookup_all_ranks(&self, py: Python<'_>, tokens: Vec<u32>, first_block: usize) -> PyResult<u32> {
        let first_block = wire_first_block(first_block).map_err(Failure::from)?;
        self.call(py, move |client| client.lookup_all_ranks_from(&tokens, first_block))
    }

    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, Client::ping)
    }

    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let status = self.call(py, Client::status)?;
        let out = PyDict::new(py);
        out.set_item("daemon_pid", status.daemon_pid)?;
        out.set_item("uptime_ms", status.uptime_ms)?;
        out.set_item("connections", status.connections)?;
        out.set_item("leaked_queue_pairs", status.leaked_queue_pairs)?;
        let devices = PyList::empty(py);
        for (index, device) in status.devices.iter().enumerate() {
            let entry = PyDict::new(py);
            entry.set_item("spec", &device.spec)?;
            entry.set_item("description", &device.description)?;
            entry.set_item("refused_commands", device.refused_commands)?;
            entry.set_item("metadata_fenced", status.metadata_fenced.get(index).copied().unwrap_or(false))?;
            devices.append(entry)?;
        }
        out.set_item("devices", devices)?;
        let pool = PyDict::new(py);
        let counts = &status.pool;
        for (name, value) in [
            ("slots", counts.slots),
            ("free_slots", counts.free_slots),
            ("valid_slots", counts.valid_slots),
            ("writing_slots", counts.writing_slots),
            ("pinned_slots", counts.pinned_slots),
            ("cached_blocks", counts.cached_blocks),
            ("evictions", counts.evictions),
        ] {
            pool.set_item(name, value)?;
        }
        out.set_item("pool", pool)?;
        let clients = PyList::empty(py);
        for client in &status.clients {
            let entry = PyDict::new(py);
            entry.set_item("session", client.session)?;
            entry.set_item("pid", client.pid)?;
            entry.set_item("uid", client.uid)?;
            entry.set_item("name", &client.name)?;
            entry.set_item("tp_rank", client.tp_rank)?;
            entry.set_item("tp_world", client.tp_world)?;
            entry.set_item("requests", client.requests)?;
            entry.set_item("idle_ms", client.idle_ms)?;
            entry.set_item("registrations", client.registrations)?;
            entry.set_item("queue_pairs", client.queue_pairs)?;
            entry.set_item("requests_in_flight", client.requests_in_flight)?;
            entry.set_item("awaiting_exit", client.awaiting_exit)?;
            entry.set_item("kept", client.kept)?;
            entry.set_item("retiring", client.retiring)?;
            clients.append(entry)?;
        }
        out.set_item("clients", clients)?;
        Ok(out)
    }

    /// InvalidState in another process (the connection is the parent's to close).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.owner.check("the lookup client").map_err(|failure| failure.to_pyerr(py))?;
        py.detach(|| {
            let client = self.client.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
            // Only the records of what it closes (see `Drop`).
            if client.is_some() {
                crate::process::close_and_forget(client, &self.connections);
            }
        });
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }
}
