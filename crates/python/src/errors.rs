//! The Python exceptions and how each Rust error maps onto one. The classification is plain
//! data ([`Failure`]: a class and the Rust error's message) so that it can be kept (a failure
//! the completion thread saw, reported at the next wait) and unit-tested without Python.

use gio_uring::GioError;
use objstore::{ObjstoreError, RemoteFailure};
use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use tutti_daemon::{DaemonError, ErrorCode};

/// The exception classes, most specific first where one derives from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    InvalidArgument,
    UnsupportedMemory,
    NotRegistered,
    Timeout,
    LimitReached,
    PoolFull,
    StaleRequest,
    InvalidState,
    Integrity,
    Pool,
    Device,
    Daemon,
    Disconnected,
}

impl ErrorClass {
    const ALL: [ErrorClass; 13] = [
        ErrorClass::InvalidArgument,
        ErrorClass::UnsupportedMemory,
        ErrorClass::NotRegistered,
        ErrorClass::Timeout,
        ErrorClass::LimitReached,
        ErrorClass::PoolFull,
        ErrorClass::StaleRequest,
        ErrorClass::InvalidState,
        ErrorClass::Integrity,
        ErrorClass::Pool,
        ErrorClass::Device,
        ErrorClass::Daemon,
        ErrorClass::Disconnected,
    ];

    /// The Python name, its parent in this hierarchy (None: `Error`) and a builtin base.
    fn python(self) -> (&'static str, Option<ErrorClass>, Option<&'static str>, &'static str) {
        match self {
            ErrorClass::InvalidArgument => ("InvalidArgument", None, Some("ValueError"), "A value the store cannot accept."),
            ErrorClass::UnsupportedMemory => {
                ("UnsupportedMemory", Some(ErrorClass::InvalidArgument), None, "Memory the store cannot reach.")
            }
            ErrorClass::NotRegistered => ("NotRegistered", None, None, "A call that needs registered KV memory before it."),
            ErrorClass::Timeout => ("TimeoutError", None, Some("TimeoutError"), "A deadline passed."),
            ErrorClass::LimitReached => ("LimitReached", None, None, "A bounded resource is exhausted."),
            ErrorClass::PoolFull => ("PoolFull", Some(ErrorClass::LimitReached), None, "The pool has no free or evictable slot."),
            ErrorClass::StaleRequest => ("StaleRequest", None, None, "A finished, foreign or closed request."),
            ErrorClass::InvalidState => ("InvalidState", None, None, "A call out of order on a live request."),
            ErrorClass::Integrity => ("IntegrityError", None, None, "A retrieved block did not match its recorded CRC."),
            ErrorClass::Pool => ("PoolError", None, None, "The pool on the devices cannot be used as asked."),
            ErrorClass::Device => ("DeviceError", None, None, "A device failed or could not be opened."),
            ErrorClass::Daemon => ("DaemonError", None, None, "tuttid refused or failed a request."),
            ErrorClass::Disconnected => ("Disconnected", Some(ErrorClass::Daemon), None, "The connection to tuttid is gone."),
        }
    }
}

/// A classified error: what Python raises, with the Rust error's message and, for a daemon
/// refusal, the daemon's code name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub class: ErrorClass,
    pub message: String,
    pub code: Option<String>,
}

impl Failure {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Failure {
        Failure { class, message: message.into(), code: None }
    }
}

/// The class of a daemon refusal by its code; `message` disambiguates LimitReached, which the
/// daemon uses for a full pool and for its per-session caps alike.
fn refusal_class(code: ErrorCode, message: &str) -> ErrorClass {
    match code {
        ErrorCode::BadRequest => ErrorClass::InvalidArgument,
        // The daemon's words for objstore's PoolFull (its Display, carried in the message).
        ErrorCode::LimitReached if message.contains("pool full") => ErrorClass::PoolFull,
        ErrorCode::LimitReached => ErrorClass::LimitReached,
        ErrorCode::NotYours => ErrorClass::StaleRequest,
        // The daemon ended the connection (a lease or shutdown goodbye, a frame it refused or
        // that timed out, a peer it does not serve): the caller reconnects at once.
        code if tutti_daemon::client::ends_the_connection(code) => ErrorClass::Disconnected,
        _ => ErrorClass::Daemon,
    }
}

fn code_name(code: ErrorCode) -> String {
    match code {
        ErrorCode::Unknown(number) => format!("Unknown({number})"),
        other => format!("{other:?}"),
    }
}

impl From<&ObjstoreError> for Failure {
    fn from(error: &ObjstoreError) -> Failure {
        let message = error.to_string();
        let class = match error {
            ObjstoreError::InvalidGeometry { .. }
            | ObjstoreError::InvalidRegistration { .. }
            | ObjstoreError::OverlappingRegistration { .. }
            | ObjstoreError::MisalignedRegistration { .. }
            | ObjstoreError::AddressOverflow { .. }
            | ObjstoreError::BlockOutOfRange { .. }
            | ObjstoreError::LayerOutOfRange { .. }
            | ObjstoreError::BadRequest { .. }
            | ObjstoreError::InvalidFormat { .. }
            | ObjstoreError::KeySecret { .. }
            | ObjstoreError::InvalidPoolShape { .. }
            | ObjstoreError::BadPlacement { .. } => ErrorClass::InvalidArgument,
            ObjstoreError::NamespaceTooSmall { .. }
            | ObjstoreError::CorruptSuperblock { .. }
            | ObjstoreError::LbaSizeMismatch { .. }
            | ObjstoreError::NewerFormatVersion { .. }
            | ObjstoreError::OlderFormatVersion { .. }
            | ObjstoreError::KeySecretSource { .. }
            | ObjstoreError::GeometryMismatch { .. }
            | ObjstoreError::PoolMembership { .. }
            | ObjstoreError::QueuePairs { .. }
            | ObjstoreError::MetadataFenced { .. }
            | ObjstoreError::GenerationExhausted { .. } => ErrorClass::Pool,
            ObjstoreError::PoolFull { .. } => ErrorClass::PoolFull,
            // A prepare that found no free IOCBs: each prepared request holds one set per layer
            // it may keep in flight, so requests_max x layers_in_flight can outgrow `iocbs`
            // (`StoreState::prepare` says so in the message, with the option to raise).
            ObjstoreError::TooManyRequests { .. } | ObjstoreError::Gio(GioError::NoFreeIocb { .. }) => ErrorClass::LimitReached,
            ObjstoreError::UnknownHandle { .. } => ErrorClass::StaleRequest,
            ObjstoreError::HandleState { .. } => ErrorClass::InvalidState,
            ObjstoreError::DeadlinePassed { .. } | ObjstoreError::Gio(GioError::WaitTimeout { .. }) => ErrorClass::Timeout,
            ObjstoreError::PayloadMismatch { .. } => ErrorClass::Integrity,
            ObjstoreError::LayerIo { .. } | ObjstoreError::Gio(_) | ObjstoreError::Nvme(_) | ObjstoreError::Dma(_) => ErrorClass::Device,
            ObjstoreError::RemoteFailed { failure, reason } => {
                return match failure {
                    RemoteFailure::Refused { code } => {
                        let code = ErrorCode::from_u16(*code);
                        Failure { class: refusal_class(code, reason), message, code: Some(code_name(code)) }
                    }
                    // The daemon's goodbye, when it said one, is kept (`e.code`), as it is for
                    // the daemon client's own error (attach, the LookupClient).
                    RemoteFailure::Disconnected { code } => {
                        Failure { class: ErrorClass::Disconnected, message, code: code.map(|code| code_name(ErrorCode::from_u16(code))) }
                    }
                    RemoteFailure::TimedOut => Failure::new(ErrorClass::Timeout, message),
                };
            }
            ObjstoreError::Remote { .. } => ErrorClass::Daemon,
            // A variant added later: the most general class that still says "the store".
            #[allow(unreachable_patterns)]
            _ => ErrorClass::Device,
        };
        Failure::new(class, message)
    }
}

impl From<ObjstoreError> for Failure {
    fn from(error: ObjstoreError) -> Failure {
        Failure::from(&error)
    }
}

impl From<DaemonError> for Failure {
    fn from(error: DaemonError) -> Failure {
        let message = error.to_string();
        match &error {
            DaemonError::Remote { code, message: sentence } => {
                Failure { class: refusal_class(*code, sentence), message, code: Some(code_name(*code)) }
            }
            // A reply that does not answer its request leaves the connection out of step: the
            // client is broken, as after a lost connection (RemoteKvStore says Disconnected). So
            // does every `Protocol` error the daemon client returns: each is about what the
            // daemon sent (a reply body that does not decode, a frame header or size refused, a
            // lookup answer that does not fit the request), the one a request can meet before it
            // is sent (over the frame cap) being `RequestTooLarge`. This sees the error only, not
            // the client; RemoteKvStore tells by the client's state (`Client::is_broken`).
            DaemonError::Closed
            | DaemonError::Truncated { .. }
            | DaemonError::Io { .. }
            | DaemonError::UnexpectedReply { .. }
            | DaemonError::Protocol(_) => Failure::new(ErrorClass::Disconnected, message),
            DaemonError::Timeout { .. } => Failure::new(ErrorClass::Timeout, message),
            DaemonError::Devices(_) | DaemonError::Controller { .. } | DaemonError::DeviceInUse { .. } => {
                Failure::new(ErrorClass::Device, message)
            }
            DaemonError::Pool { source, .. } => Failure { message, ..Failure::from(source) },
            // A request over the frame cap (a lookup of more than 262,142 tokens) is refused
            // before a byte is sent, and the connection stays usable: the caller's argument, not
            // a lost connection (which the connectors reconnect after).
            DaemonError::RequestTooLarge { .. } | DaemonError::ClientNameTooLong { .. } => {
                Failure::new(ErrorClass::InvalidArgument, message)
            }
            _ => Failure::new(ErrorClass::Daemon, message),
        }
    }
}

impl From<tutti_devices::DeviceError> for Failure {
    fn from(error: tutti_devices::DeviceError) -> Failure {
        Failure::new(ErrorClass::Device, error.to_string())
    }
}

impl From<nvme_driver::HwError> for Failure {
    fn from(error: nvme_driver::HwError) -> Failure {
        Failure::new(ErrorClass::Device, error.to_string())
    }
}

/// The module's exception classes, made once at import.
struct Classes {
    base: Py<PyType>,
    each: Vec<(ErrorClass, Py<PyType>)>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn make_class<'py>(py: Python<'py>, name: &str, bases: &[Bound<'py, PyAny>], doc: &str, module: &str) -> PyResult<Bound<'py, PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__doc__", doc)?;
    namespace.set_item("__module__", module)?;
    let bases = PyTuple::new(py, bases)?;
    let class = py.import("builtins")?.getattr("type")?.call1((name, bases, namespace))?;
    Ok(class.cast_into::<PyType>()?)
}

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let module = "tutti";
        let base = make_class(py, "Error", &[py.get_type::<PyException>().into_any()], "Base of every error tutti raises.", module)?;
        base.setattr("code", py.None())?;
        let mut each: Vec<(ErrorClass, Py<PyType>)> = Vec::new();
        for class in ErrorClass::ALL {
            let (name, parent, builtin, doc) = class.python();
            let parent = match parent {
                None => base.clone().into_any(),
                Some(parent) => {
                    let found = each.iter().find(|(c, _)| *c == parent).expect("parents are made before their children");
                    found.1.bind(py).clone().into_any()
                }
            };
            let mut bases = vec![parent];
            match builtin {
                Some("ValueError") => bases.push(py.get_type::<PyValueError>().into_any()),
                Some("TimeoutError") => bases.push(py.get_type::<PyTimeoutError>().into_any()),
                _ => {}
            }
            each.push((class, make_class(py, name, &bases, doc, module)?.unbind()));
        }
        Ok(Classes { base: base.unbind(), each })
    })
}

/// Adds `Error` and every class to the module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    let classes = classes(py)?;
    module.add("Error", classes.base.bind(py))?;
    for (class, object) in &classes.each {
        module.add(class.python().0, object.bind(py))?;
    }
    Ok(())
}

impl Failure {
    /// The Python exception: its class, the message, `code` set on it.
    pub fn to_pyerr(&self, py: Python<'_>) -> PyErr {
        let class = match classes(py) {
            Ok(classes) => classes.each.iter().find(|(class, _)| *class == self.class).map(|(_, object)| object.bind(py).clone()),
            Err(error) => return error,
        };
        let Some(class) = class else { return PyValueError::new_err(self.message.clone()) };
        match class.call1((self.message.clone(),)) {
            Ok(instance) => {
                if let Err(error) = instance.setattr("code", self.code.clone()) {
                    return error;
                }
                PyErr::from_value(instance)
            }
            Err(error) => error,
        }
    }
}

/// Maps any classified error to a Python exception (the GIL is taken to build it).
pub fn raise<E: Into<Failure>>(error: E) -> PyErr {
    let failure: Failure = error.into();
    Python::attach(|py| failure.to_pyerr(py))
}

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> PyErr {
        Python::attach(|py| failure.to_pyerr(py))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map_to_the_class_an_engine_acts_on() {
        // Goal: the mapping the Python tests rely on, without an interpreter.
        let full = ObjstoreError::PoolFull { needed: 3, evictable: 1 };
        assert_eq!(Failure::from(&full).class, ErrorClass::PoolFull);
        assert_eq!(Failure::from(&ObjstoreError::UnknownHandle { handle: 7 }).class, ErrorClass::StaleRequest);
        let state = ObjstoreError::HandleState { handle: 7, reason: "layer 2 in flight".into() };
        assert_eq!(Failure::from(&state).class, ErrorClass::InvalidState);
        let no_iocbs = ObjstoreError::Gio(GioError::NoFreeIocb { requested: 4, available: 2 });
        assert_eq!(Failure::from(&no_iocbs).class, ErrorClass::LimitReached);
        let lba = ObjstoreError::LbaSizeMismatch { device: 0, recorded: 512, namespace: 4096 };
        assert_eq!(Failure::from(&lba).class, ErrorClass::Pool);
        let timeout = ObjstoreError::Gio(GioError::WaitTimeout { id: gio_uring::IocbId(1), waited_ms: 5 });
        assert_eq!(Failure::from(&timeout).class, ErrorClass::Timeout);
        let refused = |code: ErrorCode, reason: &str| ObjstoreError::RemoteFailed {
            failure: RemoteFailure::Refused { code: code.to_u16() },
            reason: reason.into(),
        };
        let pool_full = Failure::from(&refused(ErrorCode::LimitReached, "tuttid refused the request (LimitReached): pool full: 9 slots"));
        assert_eq!((pool_full.class, pool_full.code.as_deref()), (ErrorClass::PoolFull, Some("LimitReached")));
        assert_eq!(Failure::from(&refused(ErrorCode::LimitReached, "at most 32 prepared requests")).class, ErrorClass::LimitReached);
        assert_eq!(Failure::from(&refused(ErrorCode::NotYours, "")).class, ErrorClass::StaleRequest);
        assert_eq!(Failure::from(&refused(ErrorCode::Busy, "")).class, ErrorClass::Daemon);
        let gone =
            Failure::from(&ObjstoreError::RemoteFailed { failure: RemoteFailure::Disconnected { code: None }, reason: "closed".into() });
        assert_eq!((gone.class, gone.code), (ErrorClass::Disconnected, None));
        assert_eq!(Failure::from(DaemonError::Closed).class, ErrorClass::Disconnected);
        // A reply that does not answer the request leaves the connection out of step (broken):
        // lost, as RemoteKvStore reports it, so the connectors reconnect.
        let kind = tutti_daemon::protocol::Kind::Lookup;
        let odd = Failure::from(DaemonError::UnexpectedReply { asked: kind, got: tutti_daemon::protocol::Kind::Ping });
        assert_eq!((odd.class, odd.code), (ErrorClass::Disconnected, None));
        // An exchange that timed out: tutti.TimeoutError with no code; the connectors treat it
        // (as Disconnected, and any DaemonError without a code) as a lost connection.
        let late = Failure::from(DaemonError::Timeout { what: "Lookup request".into(), after_ms: 5 });
        assert_eq!((late.class, late.code), (ErrorClass::Timeout, None));
        let too_long = Failure::from(DaemonError::RequestTooLarge {
            kind: tutti_daemon::protocol::Kind::Lookup,
            body_bytes: 1 << 21,
            cap_bytes: 1 << 20,
        });
        assert_eq!((too_long.class, too_long.code), (ErrorClass::InvalidArgument, None));
        let long_name = Failure::from(DaemonError::ClientNameTooLong { name_bytes: 65, max_bytes: 64 });
        assert_eq!((long_name.class, long_name.code), (ErrorClass::InvalidArgument, None));
        // A reply over the cap is the daemon's, its connection out of step: not the caller's.
        let reply_too_long = Failure::from(DaemonError::Protocol(tutti_daemon::ProtocolError::FrameTooLarge { body_bytes: 1 << 21 }));
        assert_ne!(reply_too_long.class, ErrorClass::InvalidArgument);
        // Any `Protocol` error the daemon client returns is about what the daemon sent (a body
        // that does not decode, a frame header refused, a lookup answer that does not fit),
        // after which the client is broken: lost, as RemoteKvStore reports it.
        assert_eq!((reply_too_long.class, reply_too_long.code), (ErrorClass::Disconnected, None));
        let cut = tutti_daemon::ProtocolError::MalformedBody { kind: tutti_daemon::protocol::Kind::LookupReply, reason: "cut".into() };
        assert_eq!(Failure::from(DaemonError::Protocol(cut)).class, ErrorClass::Disconnected);
        let busy = Failure::from(DaemonError::Remote { code: ErrorCode::Busy, message: "64 clients".into() });
        assert_eq!((busy.class, busy.code.as_deref()), (ErrorClass::Daemon, Some("Busy")));
        assert!(busy.message.contains("64 clients"), "the Rust message is carried: {}", busy.message);
        // The daemon ended the connection (a lease or shutdown goodbye, a frame it refused or
        // that timed out, a peer it does not serve): Disconnected, so that connection_lost() is
        // true at once, keeping the code, whether the daemon client's error reaches Python
        // (attach, the LookupClient) or a Store's (RemoteKvStore's RemoteFailure). A Refused
        // with such a code is not produced (RemoteKvStore says Disconnected); it would read the
        // same.
        for code in [
            ErrorCode::FrameTimeout,
            ErrorCode::BadMagic,
            ErrorCode::UnknownKind,
            ErrorCode::PermissionDenied,
            ErrorCode::LeaseExpired,
            ErrorCode::ShuttingDown,
        ] {
            let name = Some(format!("{code:?}"));
            let ended = Failure::from(DaemonError::Remote { code, message: "ended".into() });
            assert_eq!((ended.class, &ended.code), (ErrorClass::Disconnected, &name), "{code}");
            let store =
                ObjstoreError::RemoteFailed { failure: RemoteFailure::Disconnected { code: Some(code.to_u16()) }, reason: "ended".into() };
            let store = Failure::from(&store);
            assert_eq!((store.class, &store.code), (ErrorClass::Disconnected, &name), "{code} (a Store's)");
            let refused = Failure::from(&refused(code, "ended"));
            assert_eq!((refused.class, &refused.code), (ErrorClass::Disconnected, &name), "{code}");
        }
    }
}
