//! The Python side of KV memory: `RawMemory`, `KvBuffer` (memory tutti allocated, handed out
//! through DLPack), `KvLayout` (a layout kind and its tensors), and turning any tensor-like
//! object into a [`TensorDescription`] plus what keeps its memory alive.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use nvme_driver::DmaRegion;
use pyo3::exceptions::{PyBufferError, PyException, PyMemoryError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{ErrorClass, Failure};
use crate::ffi::{self, ImportedDlpack, DLPACK_CPU, DLPACK_CUDA, DLPACK_CUDA_HOST};
use crate::process::OwningProcess;
use crate::tensor::{CheckedLayout, Device, LayoutKind, TensorDescription};

/// What keeps a registered tensor's memory alive while the store may use it.
pub enum Keep {
    /// A consumed DLPack tensor (its deleter runs on drop) and the producer object.
    Dlpack(ImportedDlpack, Py<PyAny>),
    /// Python objects: a buffer export (memoryview and the ctypes view over it) or an owner.
    Objects(Vec<Py<PyAny>>),
    /// Memory tutti allocated (a clone of its region).
    Region(DmaRegion),
}

/// Memory named by address and size (module stub: `RawMemory`).
#[pyclass(frozen, module = "tutti")]
pub struct RawMemory {
    address: u64,
    nbytes: u64,
    owner: Py<PyAny>,
    device: String,
    itemsize: u64,
    shape: Option<Vec<u64>>,
    strides_bytes: Option<Vec<i64>>,
}

#[pymethods]
impl RawMemory {
    #[new]
    #[pyo3(signature = (address, nbytes, *, owner, device = "cpu".to_string(), itemsize = 1, shape = None, strides_bytes = None))]
    fn new(
        address: u64,
        nbytes: u64,
        owner: Py<PyAny>,
        device: String,
        itemsize: u64,
        shape: Option<Vec<u64>>,
        strides_bytes: Option<Vec<i64>>,
    ) -> PyResult<RawMemory> {
        let invalid = |message: String| Failure::new(ErrorClass::InvalidArgument, message);
        if address == 0 || nbytes == 0 {
            return Err(invalid(format!("RawMemory at {address:#x} of {nbytes} bytes: expected a non-null address and a size")).into());
        }
        if address.checked_add(nbytes).is_none() {
            return Err(invalid(format!("RawMemory at {address:#x} of {nbytes} bytes runs past the address space")).into());
        }
        if itemsize == 0 || !nbytes.is_multiple_of(itemsize) {
            return Err(invalid(format!("RawMemory of {nbytes} bytes is not a whole number of {itemsize}-byte elements")).into());
        }
        if let (Some(shape), Some(strides)) = (&shape, &strides_bytes) {
            if shape.len() != strides.len() {
                return Err(invalid(format!("RawMemory: {} strides for {} dimensions", strides.len(), shape.len())).into());
            }
        }
        if strides_bytes.is_some() && shape.is_none() {
            return Err(invalid("RawMemory: strides_bytes without a shape".into()).into());
        }
        // The shape is what registration maps: it must lie within the bytes the caller vouched
        // for, or the devices would write past them.
        if let Some(shape) = &shape {
            let strides = strides_bytes.as_deref();
            let described = |what: String| {
                invalid(format!("RawMemory at {address:#x}: shape {shape:?} (strides {strides:?} B) of {itemsize}-byte elements {what}"))
            };
            match reach_bytes(shape, strides, itemsize) {
                Reach::Within(reach) if reach <= u128::from(nbytes) => {}
                Reach::Within(reach) => {
                    return Err(described(format!(
                        "reaches {reach} bytes past its address, more than its nbytes = {nbytes}: give the shape of memory within nbytes"
                    ))
                    .into())
                }
                Reach::BeforeAddress => {
                    return Err(described("reaches before its address (a negative stride): give positive strides".into()).into())
                }
            }
        }
        Ok(RawMemory { address, nbytes, owner, device, itemsize, shape, strides_bytes })
    }

    #[getter]
    fn address(&self) -> u64 {
        self.address
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    #[getter]
    fn device(&self) -> String {
        self.device.clone()
    }

    fn __repr__(&self) -> String {
        format!("RawMemory(address={:#x}, nbytes={}, device={:?})", self.address, self.nbytes, self.device)
    }
}

/// Whether the store that allocated a KV cache (`allocate_kv`) kept its memory for good at its
/// close (a layer in flight its devices may still move: `StoreState::close`), shared by the
/// store's allocation and every KvBuffer over it, so that no other store registers that memory
/// (it would commit and serve whatever the old queue still writes there).
#[derive(Debug, Clone, Default)]
pub struct KeptForGood(Arc<AtomicBool>);

impl KeptForGood {
    pub fn set(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The most ranges `record_kept_for_good` lists one by one; past it, a range is merged into
/// `KEPT_MERGED`, which then covers it and every other range merged there (more memory
/// refused, never less).
const KEPT_RANGES_MAX: usize = 1024;

/// The address ranges, (first byte, one past the last; 0 while unused), of the memory closed
/// stores of this process kept for good (`StoreState::close`: a layer in flight the devices
/// may still move), so that no other store registers it, through any object over it (a
/// KvBuffer, a numpy or torch view of it, a RawMemory). Never emptied: that memory is never
/// given back. It grows only by what closes keep for good, which is rare (a device that did
/// not answer by the close's deadline), and is bounded: `KEPT_RANGES_MAX` slots, then one
/// merged range. Atomics, not a lock: a close (any thread, the GIL released, a drop too)
/// writes it, and a lock some thread held at a fork would stay held in the child.
static KEPT_RANGES: [(AtomicU64, AtomicU64); KEPT_RANGES_MAX] = [const { (AtomicU64::new(0), AtomicU64::new(0)) }; KEPT_RANGES_MAX];
/// Slots of `KEPT_RANGES` taken (may pass `KEPT_RANGES_MAX`: the rest went to `KEPT_MERGED`).
static KEPT_RANGES_TAKEN: AtomicUsize = AtomicUsize::new(0);
/// The range covering every range past `KEPT_RANGES_MAX`: (first byte, one past the last);
/// empty (start past end) while none.
static KEPT_MERGED: (AtomicU64, AtomicU64) = (AtomicU64::new(u64::MAX), AtomicU64::new(0));

/// Records `len` bytes at `address` as kept for good: `kept_for_good_overlap` reports them from
/// now on, in this process.
pub fn record_kept_for_good(address: u64, len: u64) {
    if len == 0 {
        return;
    }
    let end = address.saturating_add(len);
    // Not fork-atomic: a close runs with the GIL released, so an `os.fork` on another thread
    // can land between the `fetch_add` and the slot's stores (or between `KEPT_MERGED`'s
    // `fetch_min` and `fetch_max`). The child then keeps a taken slot whose end stays 0 (or a
    // merged start with no end), and that range is not refused there. It matters only for
    // memory the child shares with the parent (allocate_kv windows are MAP_SHARED memfds).
    // Not treated as "refuse everything": a reader cannot tell a slot torn for good in a child
    // from one a record on another thread is still filling in.
    let slot = KEPT_RANGES_TAKEN.fetch_add(1, Ordering::AcqRel);
    match KEPT_RANGES.get(slot) {
        Some((first, last)) => {
            first.store(address, Ordering::Relaxed);
            // Published by its end (Release): a reader that sees it sees its start.
            last.store(end, Ordering::Release);
        }
        None => {
            KEPT_MERGED.0.fetch_min(address, Ordering::AcqRel);
            KEPT_MERGED.1.fetch_max(end, Ordering::AcqRel);
        }
    }
}

/// Whether any of `len` bytes at `address` are memory a closed store kept for good
/// (`record_kept_for_good`).
pub fn kept_for_good_overlap(address: u64, len: u64) -> bool {
    if len == 0 {
        return false; // maps nothing
    }
    let end = address.saturating_add(len);
    let overlaps = |first: u64, last: u64| first < end && address < last;
    let taken = KEPT_RANGES_TAKEN.load(Ordering::Acquire).min(KEPT_RANGES_MAX);
    let listed = KEPT_RANGES[..taken].iter().any(|(first, last)| {
        let last = last.load(Ordering::Acquire);
        last != 0 && overlaps(first.load(Ordering::Relaxed), last)
    });
    listed || overlaps(KEPT_MERGED.0.load(Ordering::Acquire), KEPT_MERGED.1.load(Ordering::Acquire))
}

/// A piece of KV memory tutti allocated (module stub: `KvBuffer`).
#[pyclass(frozen, module = "tutti")]
pub struct KvBuffer {
    pub(crate) region: DmaRegion,
    /// Set once the store that allocated it kept it for good: refused by `describe` then.
    kept_for_good: KeptForGood,
    /// The process that allocated it: dropped in a forked child, the region is leaked without
    /// taking the DMA pool's lock (a thread of the parent may have held it at the fork).
    owner: OwningProcess,
}

impl KvBuffer {
    pub(crate) fn new(region: DmaRegion, kept_for_good: KeptForGood) -> KvBuffer {
        KvBuffer { region, kept_for_good, owner: OwningProcess::current() }
    }
}

impl Drop for KvBuffer {
    fn drop(&mut self) {
        if !self.owner.is_current() {
            // One more reference, never dropped: the field's drop below is never the last.
            std::mem::forget(self.region.clone());
        }
    }
}

#[pymethods]
impl KvBuffer {
    #[getter]
    fn address(&self) -> u64 {
        self.region.host_address() as u64
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.region.len() as u64
    }

    #[getter]
    fn device(&self) -> &'static str {
        "cpu"
    }

    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // A CPU tensor has no stream. A consumer that accepts DLPack 1.0 gets the versioned
        // capsule, which can say the memory is writable.
        let _ = stream;
        let versioned = ffi::accepts_versioned(py, max_version);
        if copy == Some(true) {
            return Err(PyBufferError::new_err("a KvBuffer is never copied: it is the KV memory itself"));
        }
        if let Some((device_type, _)) = dl_device {
            if device_type != DLPACK_CPU {
                return Err(PyBufferError::new_err(format!("a KvBuffer is CPU memory, not DLPack device type {device_type}")));
            }
        }
        ffi::export_dlpack(py, &self.region, versioned)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DLPACK_CPU, 0)
    }

    /// `numpy.from_dlpack(self)`.
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("numpy")?.call_method1("from_dlpack", (slf,))
    }

    fn __repr__(&self) -> String {
        format!("KvBuffer(address={:#x}, nbytes={})", self.region.host_address(), self.region.len())
    }
}

/// A layout kind and its tensors (module stub: `KvLayout`).
#[pyclass(frozen, module = "tutti")]
pub struct KvLayout {
    pub(crate) kind: LayoutKind,
    pub(crate) tensors: Vec<Py<PyAny>>,
    /// Set once a store checked it.
    pub(crate) checked: std::sync::Mutex<Option<CheckedLayout>>,
}

impl KvLayout {
    pub fn new_checked(kind: LayoutKind, tensors: Vec<Py<PyAny>>, checked: Option<CheckedLayout>) -> KvLayout {
        KvLayout { kind, tensors, checked: std::sync::Mutex::new(checked) }
    }

    pub fn checked(&self) -> Option<CheckedLayout> {
        self.checked.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    pub fn set_checked(&self, checked: CheckedLayout) {
        *self.checked.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(checked);
    }

    fn pick(&self, py: Python<'_>, kind: &[LayoutKind], index: usize, what: &str) -> PyResult<Py<PyAny>> {
        if !kind.contains(&self.kind) {
            return Err(Failure::new(ErrorClass::InvalidArgument, format!("{what} of a {} layout", self.kind.name())).into());
        }
        self.tensors
            .get(index)
            .map(|tensor| tensor.clone_ref(py))
            .ok_or_else(|| Failure::new(ErrorClass::InvalidArgument, format!("{what}: no such layer")).into())
    }
}

fn list(objects: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Py<PyAny>>> {
    if objects.is_instance_of::<pyo3::types::PyString>() || objects.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err(format!("{what}: expected a sequence of tensors")));
    }
    objects.try_iter()?.map(|item| item.map(Bound::unbind)).collect()
}

#[pymethods]
impl KvLayout {
    #[staticmethod]
    fn separate(keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<KvLayout> {
        let mut tensors = list(keys, "keys")?;
        let values = list(values, "values")?;
        if tensors.len() != values.len() {
            return Err(Failure::new(
                ErrorClass::InvalidArgument,
                format!("{} key tensors and {} value tensors: one of each per layer", tensors.len(), values.len()),
            )
            .into());
        }
        tensors.extend(values);
        Ok(KvLayout::new_checked(LayoutKind::Separate, tensors, None))
    }

    #[staticmethod]
    fn fused(layers: &Bound<'_, PyAny>) -> PyResult<KvLayout> {
        Ok(KvLayout::new_checked(LayoutKind::Fused, list(layers, "layers")?, None))
    }

    #[staticmethod]
    fn paged(layers: &Bound<'_, PyAny>) -> PyResult<KvLayout> {
        Ok(KvLayout::new_checked(LayoutKind::Paged, list(layers, "layers")?, None))
    }

    #[staticmethod]
    fn block_major(tensor: Py<PyAny>) -> KvLayout {
        KvLayout::new_checked(LayoutKind::BlockMajor, vec![tensor], None)
    }

    #[getter]
    fn kind(&self) -> &'static str {
        self.kind.name()
    }

    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.tensors.iter().map(|tensor| tensor.clone_ref(py)))
    }

    fn key(&self, py: Python<'_>, layer: usize) -> PyResult<Py<PyAny>> {
        self.pick(py, &[LayoutKind::Separate], layer, "key(layer)")
    }

    fn value(&self, py: Python<'_>, layer: usize) -> PyResult<Py<PyAny>> {
        let layers = self.tensors.len() / 2;
        if layer >= layers {
            return Err(Failure::new(ErrorClass::InvalidArgument, format!("value({layer}): the layout has {layers} layers")).into());
        }
        self.pick(py, &[LayoutKind::Separate], layers + layer, "value(layer)")
    }

    fn layer(&self, py: Python<'_>, layer: usize) -> PyResult<Py<PyAny>> {
        let index = if self.kind == LayoutKind::BlockMajor { 0 } else { layer };
        self.pick(py, &[LayoutKind::Fused, LayoutKind::Paged, LayoutKind::BlockMajor], index, "layer(layer)")
    }

    #[getter]
    fn num_blocks(&self) -> Option<u32> {
        self.checked().map(|checked| checked.num_blocks)
    }

    #[getter]
    fn block_stride_bytes(&self) -> Option<u64> {
        self.checked().map(|checked| checked.block_stride_bytes)
    }

    fn __repr__(&self) -> String {
        match self.checked() {
            Some(checked) => format!(
                "KvLayout.{}({} tensors, {} blocks, {} bytes apart)",
                self.kind.name(),
                self.tensors.len(),
                checked.num_blocks,
                checked.block_stride_bytes
            ),
            None => format!("KvLayout.{}({} tensors, unchecked)", self.kind.name(), self.tensors.len()),
        }
    }
}

/// How far a strided shape reaches from its first element's address.
#[derive(Debug, PartialEq, Eq)]
enum Reach {
    /// One past its last byte, in bytes from the address (0: no element).
    Within(u128),
    /// Some element lies before the address.
    BeforeAddress,
}

/// The bytes `shape` names from its address, with `strides` in bytes (`None`: C-contiguous)
/// and `itemsize`-byte elements. Worked in i128, whose products and sums never wrap: a product
/// past it is `u128::MAX`, and sums saturate, either way a reach past any nbytes.
fn reach_bytes(shape: &[u64], strides: Option<&[i64]>, itemsize: u64) -> Reach {
    if shape.contains(&0) {
        return Reach::Within(0);
    }
    let (mut lowest, mut highest) = (0i128, 0i128);
    let mut contiguous_stride = i128::from(itemsize);
    for (index, &size) in shape.iter().enumerate().rev() {
        let stride = match strides {
            Some(strides) => strides.get(index).map_or(0, |&stride| i128::from(stride)),
            None => contiguous_stride,
        };
        let Some(span) = i128::from(size - 1).checked_mul(stride) else { return Reach::Within(u128::MAX) };
        if span < 0 {
            lowest = lowest.saturating_add(span);
        } else {
            highest = highest.saturating_add(span);
        }
        contiguous_stride = contiguous_stride.saturating_mul(i128::from(size));
    }
    if lowest < 0 {
        return Reach::BeforeAddress;
    }
    // highest >= 0 here: only non-negative spans were added.
    Reach::Within(u128::try_from(highest.saturating_add(i128::from(itemsize))).unwrap_or(u128::MAX))
}

/// A RawMemory's device: "cpu", "cuda" / "cuda:N" (torch's `str(tensor.device)`), or another.
fn raw_device(name: &str) -> Device {
    match name {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        _ => match name.strip_prefix("cuda:").and_then(|ordinal| ordinal.parse::<i32>().ok()) {
            Some(ordinal) if ordinal >= 0 => Device::Cuda(ordinal),
            _ => Device::Other(name.to_string()),
        },
    }
}

fn device_name(device_type: i32, device_id: i32) -> String {
    let name = match device_type {
        2 => "cuda",
        4 => "opencl",
        7 => "vulkan",
        8 => "metal",
        10 => "rocm",
        14 => "oneapi",
        _ => "device",
    };
    format!("{name}:{device_id} (DLPack device type {device_type})")
}

/// The `error` a producer's `__dlpack_device__` / `__dlpack__` (or a buffer exporter) raised, as
/// the InvalidArgument `refusal` words (naming the tensor: the bare exception named nothing).
/// Passed through as it is: what is not an `Exception` (KeyboardInterrupt, SystemExit: an
/// interrupt, not the producer's answer) and a MemoryError (a resource failure, not a refusal of
/// the tensor). Made a tutti.Error, either would be taken for one the caller may retry or report
/// as a bad tensor.
fn producer_failure(py: Python<'_>, error: PyErr, refusal: impl FnOnce(&PyErr) -> String) -> PyErr {
    if !error.is_instance_of::<PyException>(py) || error.is_instance_of::<PyMemoryError>(py) {
        return error;
    }
    Failure::new(ErrorClass::InvalidArgument, refusal(&error)).into()
}

/// What `object.__dlpack_device__()` says, (DLPack device type, device id); its failure (but see
/// `producer_failure`) or an answer that is not two int32s is an InvalidArgument naming the
/// tensor `name`, as every other refusal of a tensor is (the bare exception named nothing).
fn dlpack_device(object: &Bound<'_, PyAny>, name: &str) -> PyResult<(i32, i32)> {
    let answer = object.call_method0("__dlpack_device__").map_err(|error| {
        producer_failure(object.py(), error, |error| {
            format!("{name}: its __dlpack_device__() failed ({error}): register a tensor whose producer can say its device")
        })
    })?;
    // Reading an int calls the answer's __index__: an interrupt or MemoryError it raised is
    // passed through (`producer_failure`), not taken for a malformed answer.
    answer.extract::<(i32, i32)>().map_err(|error| {
        producer_failure(answer.py(), error, |_| {
            // An answer's repr is the producer's: bounded, and a repr that fails is not the error.
            let mut shown = answer.repr().map(|repr| repr.to_string()).unwrap_or_else(|_| "an object whose repr() failed".into());
            if let Some((cut, _)) = shown.char_indices().nth(REPR_CHARS_MAX) {
                shown.truncate(cut);
                shown.push_str("...");
            }
            format!("{name}: its __dlpack_device__() returned {shown}, not a (device type, device id) pair of ints (DLPack's DLDevice, two int32s)")
        })
    })
}

/// The most characters of a producer's answer a refusal quotes.
const REPR_CHARS_MAX: usize = 80;

/// Describes `object` (a tensor-like, see the stub's `TensorLike`) as `name`; returns what keeps
/// its memory alive. Consumes a DLPack export, takes a buffer export.
pub fn describe(object: &Bound<'_, PyAny>, name: &str) -> PyResult<(TensorDescription, Keep)> {
    let py = object.py();
    if let Ok(buffer) = object.cast::<KvBuffer>() {
        let buffer = buffer.get();
        if buffer.kept_for_good.is_set() {
            return Err(Failure::new(
                ErrorClass::UnsupportedMemory,
                format!(
                    "{name}: memory a closed store kept for good (a layer was still in flight at its close): a device may \
                     still write it; allocate the KV cache again with this store's allocate_kv"
                ),
            )
            .into());
        }
        let description = TensorDescription {
            name: name.into(),
            address: buffer.region.host_address() as u64,
            device: Device::Cpu,
            itemsize: 1,
            raw_bytes: true,
            shape: vec![buffer.region.len() as u64],
            strides_bytes: None,
            writable: true,
        };
        return Ok((description, Keep::Region(buffer.region.clone())));
    }
    if let Ok(raw) = object.cast::<RawMemory>() {
        let raw = raw.get();
        let device = raw_device(&raw.device);
        let description = TensorDescription {
            name: name.into(),
            address: raw.address,
            device,
            itemsize: raw.itemsize,
            raw_bytes: raw.itemsize == 1,
            shape: raw.shape.clone().unwrap_or_else(|| vec![raw.nbytes / raw.itemsize]),
            strides_bytes: raw.strides_bytes.clone(),
            writable: true,
        };
        return Ok((description, Keep::Objects(vec![raw.owner.clone_ref(py)])));
    }
    if object.hasattr("__dlpack__")? && object.hasattr("__dlpack_device__")? {
        let (device_type, device_id) = dlpack_device(object, name)?;
        if device_type != DLPACK_CPU && device_type != DLPACK_CUDA_HOST && device_type != DLPACK_CUDA {
            let description = TensorDescription {
                name: name.into(),
                address: 0,
                device: Device::Other(device_name(device_type, device_id)),
                itemsize: 1,
                raw_bytes: true,
                shape: vec![0],
                strides_bytes: None,
                writable: true,
            };
            return Ok((description, Keep::Objects(Vec::new())));
        }
        // DLPack 1.0 first: its capsule says whether the memory is read-only. A producer that
        // does not know the keyword (TypeError, as the array API standard says) is asked again
        // without it, for the legacy capsule, which cannot say (taken as writable).
        let keywords = PyDict::new(py);
        keywords.set_item("max_version", (1, 0))?;
        let mut asked_max_version = true;
        let capsule = match object.call_method("__dlpack__", (), Some(&keywords)) {
            Err(error) if error.is_instance_of::<PyTypeError>(py) => {
                asked_max_version = false;
                object.call_method0("__dlpack__")
            }
            answer => answer,
        }
        .map_err(|error| {
            producer_failure(py, error, |error| format!("{name}: its __dlpack__() failed ({error}): register a writable tensor"))
        })?;
        let (tensor, imported) = ffi::import_dlpack(&capsule, asked_max_version).map_err(|error| match error {
            ffi::ImportError::Refused(reason) => PyErr::from(Failure::new(ErrorClass::InvalidArgument, format!("{name}: {reason}"))),
            ffi::ImportError::Python(error) => error,
        })?;
        // The capsule is what is mapped, so its device decides: one tutti cannot reach is
        // refused (UnsupportedMemory) even when __dlpack_device__ said otherwise, and a capsule
        // of a device other than the one __dlpack_device__ named is a producer to distrust.
        if ![DLPACK_CPU, DLPACK_CUDA_HOST, DLPACK_CUDA].contains(&tensor.device_type) {
            let description = TensorDescription {
                name: name.into(),
                address: 0,
                device: Device::Other(device_name(tensor.device_type, tensor.device_id)),
                itemsize: 1,
                raw_bytes: true,
                shape: vec![0],
                strides_bytes: None,
                writable: true,
            };
            return Ok((description, Keep::Dlpack(imported, object.clone().unbind())));
        }
        let same_id = tensor.device_type != DLPACK_CUDA || tensor.device_id == device_id;
        if tensor.device_type != device_type || !same_id {
            return Err(Failure::new(
                ErrorClass::InvalidArgument,
                format!(
                    "{name}: its __dlpack_device__ says DLPack device type {device_type} (device {device_id}), its capsule device type {} (device {}): a tensor must describe one device",
                    tensor.device_type, tensor.device_id
                ),
            )
            .into());
        }
        let itemsize = tensor.itemsize.max(1);
        let negative = |what: &str| PyErr::from(Failure::new(ErrorClass::InvalidArgument, format!("{name}: a negative {what}")));
        let shape =
            tensor.shape.iter().map(|&size| u64::try_from(size).map_err(|_| negative("dimension"))).collect::<PyResult<Vec<u64>>>()?;
        let strides_bytes =
            tensor.strides.as_ref().map(|strides| strides.iter().map(|&stride| stride.saturating_mul(itemsize as i64)).collect());
        // CUDA, or the host (CPU, CUDA host memory): checked above.
        let device = if tensor.device_type == DLPACK_CUDA { Device::Cuda(tensor.device_id) } else { Device::Cpu };
        let description = TensorDescription {
            name: name.into(),
            address: tensor.address,
            device,
            itemsize: tensor.itemsize,
            raw_bytes: tensor.raw_bytes,
            shape: if shape.is_empty() { vec![1] } else { shape },
            strides_bytes,
            // A versioned capsule flagged read-only: `check_layout` refuses it by name.
            writable: !tensor.read_only,
        };
        return Ok((description, Keep::Dlpack(imported, object.clone().unbind())));
    }
    // The buffer protocol, through a memoryview; the address through a ctypes view over it,
    // which holds the export (so the object cannot be resized or freed while kept). A TypeError
    // is memoryview's "no buffer": not a tensor. The exporter's own failure (a BufferError, ...)
    // is quoted; an interrupt or MemoryError passes through (`producer_failure`).
    let view = py.import("builtins")?.getattr("memoryview")?.call1((object,)).map_err(|error| {
        let type_name = object.get_type().name().map(|name| name.to_string()).unwrap_or_default();
        let kinds = "give an object with __dlpack__ (torch, numpy), a writable buffer (bytearray, mmap, numpy), a KvBuffer or a RawMemory";
        if error.is_instance_of::<PyTypeError>(py) {
            return PyErr::from(Failure::new(ErrorClass::InvalidArgument, format!("{name} ({type_name}) is not a tensor: {kinds}")));
        }
        producer_failure(py, error, |error| format!("{name} ({type_name}): its buffer export failed ({error}): {kinds}"))
    })?;
    let readonly: bool = view.getattr("readonly")?.extract()?;
    let contiguous: bool = view.getattr("c_contiguous")?.extract()?;
    let nbytes: u64 = view.getattr("nbytes")?.extract()?;
    let itemsize: u64 = view.getattr("itemsize")?.extract()?;
    let format: String = view.getattr("format")?.extract()?;
    let shape: Vec<u64> = view.getattr("shape")?.extract::<Option<Vec<u64>>>()?.unwrap_or_default();
    let invalid = |message: String| PyErr::from(Failure::new(ErrorClass::InvalidArgument, message));
    if readonly {
        return Err(invalid(format!("{name} is read-only: retrieves write into it (register a writable buffer)")));
    }
    if !contiguous {
        return Err(invalid(format!("{name} is not C-contiguous: register a contiguous buffer")));
    }
    if nbytes == 0 {
        return Err(invalid(format!("{name} is empty")));
    }
    let ctypes = py.import("ctypes")?;
    let array_type = ctypes.getattr("c_char")?.call_method1("__mul__", (nbytes,))?;
    let array = array_type.call_method1("from_buffer", (&view,))?;
    let address: u64 = ctypes.call_method1("addressof", (&array,))?.extract()?;
    let description = TensorDescription {
        name: name.into(),
        address,
        device: Device::Cpu,
        itemsize,
        raw_bytes: is_byte_format(&format),
        shape: if shape.is_empty() { vec![1] } else { shape },
        strides_bytes: None,
        writable: true,
    };
    let keep = Keep::Objects(vec![view.unbind(), array.unbind()]);
    Ok((description, keep))
}

/// Whether a buffer's struct format names single bytes ("B", "b", "c"), after at most one
/// byte-order character: ctypes spells its byte arrays "<B", "<b", "<c".
fn is_byte_format(format: &str) -> bool {
    let element = format.strip_prefix(['<', '>', '=', '@', '!']).unwrap_or(format);
    matches!(element, "B" | "b" | "c")
}

/// The names the error messages give a layout's tensors.
pub fn tensor_names(kind: LayoutKind, count: usize) -> Vec<String> {
    match kind {
        LayoutKind::Separate => {
            let layers = count / 2;
            (0..count).map(|i| if i < layers { format!("keys[{i}]") } else { format!("values[{}]", i - layers) }).collect()
        }
        LayoutKind::Fused | LayoutKind::Paged => (0..count).map(|i| format!("layers[{i}]")).collect(),
        LayoutKind::BlockMajor => vec!["tensor".into()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_formats_are_raw_bytes_with_one_byte_order_prefix_at_most() {
        // Goal: the buffer formats of single bytes, bare or after one byte-order character
        // (ctypes' "<c", "<b"), are raw bytes; wider formats, and two prefixes, are not.
        for format in ["B", "b", "c", "<B", "<b", "<c", ">c", "=B", "@b", "!B"] {
            assert!(is_byte_format(format), "{format}");
        }
        for format in ["", "<", "H", "<e", "e", "<<B", "2B", "Bx"] {
            assert!(!is_byte_format(format), "{format}");
        }
    }

    #[test]
    fn reach_is_the_bytes_a_shape_names_from_its_address() {
        // Goal: a shape's reach (what RawMemory checks against nbytes) is one past its last
        // byte, contiguous or strided; no element is nothing; a negative stride that steps
        // below the address is said, and products past u64 neither wrap nor panic.
        assert_eq!(reach_bytes(&[4, 16, 2, 64], None, 2), Reach::Within(4 * 4096));
        assert_eq!(reach_bytes(&[4, 16384], Some(&[65536, 2]), 2), Reach::Within(3 * 65536 + 16384 * 2));
        assert_eq!(reach_bytes(&[4, 0], None, 2), Reach::Within(0));
        assert_eq!(reach_bytes(&[1, 8], Some(&[-4096, 2]), 2), Reach::Within(16));
        assert_eq!(reach_bytes(&[2, 8], Some(&[-4096, 2]), 2), Reach::BeforeAddress);
        assert_eq!(reach_bytes(&[u64::MAX, u64::MAX, u64::MAX], None, 8), Reach::Within(u128::MAX));
    }

    #[test]
    fn memory_kept_for_good_is_found_by_any_overlapping_range() {
        // Goal: a range recorded as kept for good is reported for any range sharing a byte
        // with it, and not for those beside it or empty ones. Addresses past the user half of
        // the address space, which no real memory of another test has.
        let base = 0xfff0_0000_0000_0000u64;
        record_kept_for_good(base, 4096);
        assert!(kept_for_good_overlap(base, 4096) && kept_for_good_overlap(base + 4095, 1), "inside");
        assert!(kept_for_good_overlap(base - 8, 9) && kept_for_good_overlap(base - 8, 8192), "across an edge, around");
        assert!(!kept_for_good_overlap(base - 8, 8) && !kept_for_good_overlap(base + 4096, 4096), "beside");
        assert!(!kept_for_good_overlap(base, 0), "empty");
        assert!(kept_for_good_overlap(u64::MAX - 1, u64::MAX) == kept_for_good_overlap(u64::MAX - 1, 1), "no overflow");
    }
}
