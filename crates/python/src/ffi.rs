//! The crate's only unsafe code: reading a DLPack capsule a producer gave us, handing one out
//! over memory tutti allocated, and mapping a caller's memory for the store's devices.
//!
//! DLPack (dlpack.h): a capsule named "dltensor_versioned" holds a pointer to a
//! `DLManagedTensorVersioned` (DLPack 1.0, which `__dlpack__(max_version=(1, 0))` asks for: its
//! flags say whether the memory is read-only); one named "dltensor" a legacy `DLManagedTensor`
//! (producers without DLPack 1.0, or asked without `max_version`: it cannot say read-only). The
//! consumer renames it "used_dltensor_versioned" / "used_dltensor" and owns the tensor from then
//! on, calling its `deleter` when done. Until then the producer keeps its export, not necessarily
//! the memory: a torch tensor's `resize_`, `set_` or `untyped_storage().resize_(0)` free or move
//! the storage under a live export (the Python docs tell the caller never to). The deleter may be
//! called from any thread, with or without the GIL (the spec requires producers to take the GIL
//! themselves where they need it: numpy does).

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use nvme_driver::{DmaAllocator, DmaRegion, HwError, Iova};
use pyo3::ffi;
use pyo3::prelude::*;

/// The unused-capsule name and the consumed one (DLPack's Python specification), and the
/// versioned capsule's (DLPack 1.0: `DLManagedTensorVersioned`, which can say "writable").
const DLTENSOR: &CStr = c"dltensor";
const USED_DLTENSOR: &CStr = c"used_dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";
const USED_DLTENSOR_VERSIONED: &CStr = c"used_dltensor_versioned";
/// The one DLPack major version whose `DLManagedTensorVersioned` layout this reads (a capsule of
/// another major version guarantees only its `version`, `manager_ctx` and `deleter` fields).
const DLPACK_MAJOR: u32 = 1;
/// `DLManagedTensorVersioned::flags` bit 0 (`DLPACK_FLAG_BITMASK_READ_ONLY`).
const DLPACK_FLAG_READ_ONLY: u64 = 1;
/// `DLManagedTensorVersioned::flags` bit 1 (`DLPACK_FLAG_BITMASK_IS_COPIED`): the producer
/// exported a copy of its tensor (the array API lets it when the consumer did not pass
/// `copy=False`).
const DLPACK_FLAG_IS_COPIED: u64 = 2;
/// More dimensions than any KV tensor has: a larger `ndim` is refused as garbage.
const NDIM_MAX: i32 = 32;
/// Pages of the devices' DMA mappings.
const PAGE_BYTES: u64 = 4096;

/// dlpack.h `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// dlpack.h `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// dlpack.h `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// dlpack.h `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// dlpack.h `DLPackVersion`.
#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// dlpack.h `DLManagedTensorVersioned` (DLPack 1.0).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    /// Bit 0: read-only; bit 1: a copy. 0: the producer's own, writable memory.
    flags: u64,
    dl_tensor: DlTensor,
}

/// DLPack device types (dlpack.h `DLDeviceType`): the CPU and CUDA host-pinned memory are
/// host memory this process can address; CUDA device memory is not.
pub const DLPACK_CPU: i32 = 1;
pub const DLPACK_CUDA_HOST: i32 = 3;
/// GPU memory (kDLCUDA): never read or written here, only exported to tuttid (CUDA IPC).
pub const DLPACK_CUDA: i32 = 2;
/// DLPack type codes: unsigned and signed integers (8-bit ones are raw bytes).
const DLPACK_INT: u8 = 0;
const DLPACK_UINT: u8 = 1;

/// A DLPack tensor's description, copied out of the producer's struct.
#[derive(Debug, Clone)]
pub struct DlpackTensor {
    /// `data + byte_offset`.
    pub address: u64,
    pub device_type: i32,
    pub device_id: i32,
    pub itemsize: u64,
    pub raw_bytes: bool,
    pub shape: Vec<i64>,
    /// In elements, as DLPack gives them; `None`: compact (C order).
    pub strides: Option<Vec<i64>>,
    /// A versioned capsule flagged read-only; a legacy capsule cannot say so (false).
    pub read_only: bool,
}

/// The producer's struct a consumed capsule pointed to, by the capsule's kind.
enum Managed {
    Legacy(NonNull<DlManagedTensor>),
    Versioned(NonNull<DlManagedTensorVersioned>),
}

/// A consumed DLPack tensor: the producer's export is held until this is dropped, which calls
/// the producer's deleter (once). That holds the producer's tensor object, not its memory (see
/// the module's doc: torch can free or move it under a live export).
pub struct ImportedDlpack {
    managed: Managed,
}

// SAFETY: the pointer is only used to call the producer's deleter, which the DLPack
// specification requires to be callable from any thread (taking the GIL itself if it needs it);
// nothing else reads or writes through it after import.
unsafe impl Send for ImportedDlpack {}
// SAFETY: no method reads through the pointer; `&ImportedDlpack` gives no access to it.
unsafe impl Sync for ImportedDlpack {}

impl Drop for ImportedDlpack {
    fn drop(&mut self) {
        // SAFETY: `managed` came from a capsule named "dltensor" or "dltensor_versioned" that we
        // renamed, so we own it (DLPack's protocol) and call its deleter exactly once, here, with
        // the struct's own address (each kind's deleter takes its own struct); the struct is
        // valid until then (the producer frees it only in the deleter).
        unsafe {
            match self.managed {
                Managed::Legacy(managed) => {
                    if let Some(deleter) = (*managed.as_ptr()).deleter {
                        deleter(managed.as_ptr());
                    }
                }
                Managed::Versioned(managed) => {
                    if let Some(deleter) = (*managed.as_ptr()).deleter {
                        deleter(managed.as_ptr());
                    }
                }
            }
        }
    }
}

/// Why a capsule was not imported.
#[derive(Debug)]
pub enum ImportError {
    /// The capsule or its tensor is not one tutti takes (the caller names the tensor).
    Refused(String),
    /// The capsule API failed.
    Python(PyErr),
}

/// Copies the description out of a producer's `DLTensor`, or says why it is refused.
///
/// # Safety
/// `tensor` is the `dl_tensor` of a live, unconsumed DLPack struct: `shape` and `strides` point
/// to `ndim` int64s each when not null (strides may be null: compact), as the spec requires.
unsafe fn read_tensor(tensor: &DlTensor, read_only: bool) -> Result<DlpackTensor, String> {
    if !(0..=NDIM_MAX).contains(&tensor.ndim) {
        return Err(format!("a DLPack tensor with {} dimensions", tensor.ndim));
    }
    let ndim = tensor.ndim as usize;
    if ndim > 0 && tensor.shape.is_null() {
        return Err("a DLPack tensor without a shape".into());
    }
    let DlDataType { code, bits, lanes } = tensor.dtype;
    let bits_per_element = u64::from(bits) * u64::from(lanes);
    // Sub-byte dtypes (int4, packed lanes) have no byte size: rounding down would register the
    // memory with a wrong element size (20 bits as 2 bytes).
    if bits_per_element % 8 != 0 {
        return Err(format!(
            "a DLPack dtype of {bits} bits x {lanes} lanes (type code {code}) is not a whole number of bytes: register the memory's bytes (uint8) or a dtype of whole bytes"
        ));
    }
    // SAFETY: `ndim` is in 0..=NDIM_MAX and `shape` is not null when ndim > 0 (checked above);
    // the caller's contract makes both arrays `ndim` long.
    let (shape, strides) = unsafe {
        let shape = if ndim == 0 { Vec::new() } else { std::slice::from_raw_parts(tensor.shape, ndim).to_vec() };
        let strides = (!tensor.strides.is_null() && ndim > 0).then(|| std::slice::from_raw_parts(tensor.strides, ndim).to_vec());
        (shape, strides)
    };
    Ok(DlpackTensor {
        address: (tensor.data as u64).wrapping_add(tensor.byte_offset),
        device_type: tensor.device.device_type,
        device_id: tensor.device.device_id,
        itemsize: bits_per_element / 8,
        raw_bytes: matches!(code, DLPACK_INT | DLPACK_UINT) && bits == 8 && lanes == 1,
        shape,
        strides,
        read_only,
    })
}

/// Consumes the capsule `producer.__dlpack__(...)` returned, "dltensor_versioned" (DLPack 1.0)
/// or "dltensor": checks its name; a versioned one's major version (1) and its IS_COPIED flag (a
/// copy the producer made is refused: retrieves would write into the copy); the tensor's ndim,
/// shape and dtype (whole bytes, see `read_tensor`). Copies the tensor's description, with a
/// versioned one's READ_ONLY flag as `read_only` (not refused here: the caller registers it as
/// not writable and `check_layout` refuses it by name; a legacy capsule cannot say, false), and
/// renames it "used_dltensor_versioned" / "used_dltensor" (so that its destructor leaves the
/// tensor to us), last. A refused capsule is left unconsumed: its producer's destructor frees
/// it. `asked_max_version`: whether the `__dlpack__` call that returned it was given
/// `max_version=(1, 0)` (a refusal says so only when it was).
pub fn import_dlpack(capsule: &Bound<'_, PyAny>, asked_max_version: bool) -> Result<(DlpackTensor, ImportedDlpack), ImportError> {
    let object = capsule.as_ptr();
    let fetch = || ImportError::Python(PyErr::fetch(capsule.py()));
    // SAFETY: `object` is a live object (borrowed for this call); PyCapsule_IsValid accepts any
    // object, only reads its type and name, and sets no error.
    let (versioned, legacy) = unsafe {
        (ffi::PyCapsule_IsValid(object, DLTENSOR_VERSIONED.as_ptr()) == 1, ffi::PyCapsule_IsValid(object, DLTENSOR.as_ptr()) == 1)
    };
    let (description, managed, used) = if versioned {
        // SAFETY: the capsule is valid under this name (checked above); its pointer is non-null
        // by the capsule API's definition of valid.
        let pointer = unsafe { ffi::PyCapsule_GetPointer(object, DLTENSOR_VERSIONED.as_ptr()) } as *mut DlManagedTensorVersioned;
        let managed = NonNull::new(pointer).ok_or_else(fetch)?;
        // SAFETY: a "dltensor_versioned" capsule points to a DLManagedTensorVersioned that stays
        // valid until its deleter is called (not yet: unconsumed). Its `version` comes first in
        // every DLPack version; the rest of the layout is read only for major version 1.
        let description = unsafe {
            let managed = &*managed.as_ptr();
            let DlPackVersion { major, minor } = managed.version;
            if major != DLPACK_MAJOR {
                let asked = if asked_max_version {
                    format!("its __dlpack__ was given max_version=({DLPACK_MAJOR}, 0)")
                } else {
                    format!("its __dlpack__ did not take max_version=({DLPACK_MAJOR}, 0) and handed this out to the call without it")
                };
                return Err(ImportError::Refused(format!("a DLPack {major}.{minor} capsule: tutti reads DLPack {DLPACK_MAJOR} ({asked})")));
            }
            // Registered, a copy would take the retrieves (which the engine, reading its own
            // tensor, never sees) and give the stores the copy's bytes. tutti does not pass
            // `copy=False` instead: a producer that takes `max_version` but not `copy` would
            // raise TypeError and be asked for the legacy capsule, which cannot say read-only.
            if managed.flags & DLPACK_FLAG_IS_COPIED != 0 {
                return Err(ImportError::Refused(
                    "a copy the producer made (DLPack IS_COPIED): retrieves would write into the copy, not the tensor; register a tensor its producer exports in place".into(),
                ));
            }
            read_tensor(&managed.dl_tensor, managed.flags & DLPACK_FLAG_READ_ONLY != 0).map_err(ImportError::Refused)?
        };
        (description, Managed::Versioned(managed), USED_DLTENSOR_VERSIONED)
    } else if legacy {
        // SAFETY: as above, under the legacy name.
        let pointer = unsafe { ffi::PyCapsule_GetPointer(object, DLTENSOR.as_ptr()) } as *mut DlManagedTensor;
        let managed = NonNull::new(pointer).ok_or_else(fetch)?;
        // SAFETY: a "dltensor" capsule points to a DLManagedTensor that stays valid until its
        // deleter is called (not yet: unconsumed).
        let description = unsafe { read_tensor(&(*managed.as_ptr()).dl_tensor, false) }.map_err(ImportError::Refused)?;
        (description, Managed::Legacy(managed), USED_DLTENSOR)
    } else {
        return Err(ImportError::Refused(
            "__dlpack__() did not return an unused \"dltensor_versioned\" or \"dltensor\" capsule (already consumed, or not a DLPack capsule)"
                .into(),
        ));
    };
    // SAFETY: renaming a valid capsule; the name is a static C string that outlives it.
    if unsafe { ffi::PyCapsule_SetName(object, used.as_ptr()) } != 0 {
        return Err(fetch());
    }
    Ok((description, ImportedDlpack { managed }))
}

/// What a capsule we hand out keeps alive: the memory (a clone of its region holds the
/// allocation and its mapping) and the shape DLPack points to.
struct ExportContext {
    _region: DmaRegion,
    shape: [i64; 1],
}

/// DLPack deleter of the tensors we hand out: frees the struct and the context (dropping the
/// region clone). Needs no GIL.
unsafe extern "C" fn export_deleter(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `export_dlpack`, and
    // DLPack calls the deleter once (the consumer after renaming, or our capsule destructor if
    // never consumed, never both).
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx as *mut ExportContext));
    }
}

/// Runs a capsule destructor's `body` with the caller's error indicator set aside, as the DLPack
/// reference destructor does: a capsule is freed wherever its last reference goes, often while
/// an exception propagates (a capsule on the value stack of a frame that raised), and the
/// destructor must neither clear that exception nor leave one of its own (either ends in a
/// SystemError, or a crash). An error `body` leaves is reported as unraisable, with no object
/// (none of `body`'s calls sets one today: `PyCapsule_IsValid` never does, and
/// `PyCapsule_GetPointer` is called only on a capsule it found valid).
///
/// # Safety
/// The GIL is held (CPython calls capsule destructors with it).
unsafe fn keeping_error_indicator(body: impl FnOnce()) {
    let (mut kind, mut value, mut traceback) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the GIL is held (this fn's contract); PyErr_Fetch takes the indicator's three
    // references (possibly null) into the locals, PyErr_Restore gives them back, unchanged.
    unsafe {
        ffi::PyErr_Fetch(&mut kind, &mut value, &mut traceback);
        body();
        if !ffi::PyErr_Occurred().is_null() {
            // NULL, not the capsule: a capsule's destructor runs from its deallocation, with
            // its reference count already 0, and PyErr_WriteUnraisable takes a reference to
            // the object it is given (for sys.unraisablehook's `object`): the capsule would be
            // resurrected and, once that reference went, deallocated a second time. NULL is
            // allowed (the hook gets None).
            ffi::PyErr_WriteUnraisable(std::ptr::null_mut());
        }
        ffi::PyErr_Restore(kind, value, traceback);
    }
}

/// Destructor of the capsules we hand out: an unconsumed capsule still owns its tensor.
unsafe extern "C" fn export_capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython calls this with the GIL held and `capsule` alive. Under the name
    // "dltensor" nobody consumed it, so the tensor is still ours to delete; a consumer renamed
    // it and calls the deleter itself (PyCapsule_IsValid sets no error either way).
    unsafe {
        keeping_error_indicator(|| {
            if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
                let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) as *mut DlManagedTensor;
                export_deleter(managed);
            }
        });
    }
}

/// DLPack deleter of the versioned tensors we hand out (as `export_deleter`).
unsafe extern "C" fn export_versioned_deleter(managed: *mut DlManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `export_dlpack`, and
    // DLPack calls a deleter once (by the consumer, or by our capsule destructor when unconsumed).
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx as *mut ExportContext));
    }
}

/// Destructor of the versioned capsules we hand out (as `export_capsule_destructor`).
unsafe extern "C" fn export_versioned_capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython calls this with the GIL held and `capsule` alive. Still named
    // "dltensor_versioned", nobody consumed it, so the tensor is ours to delete; a consumer
    // renamed it and calls the deleter itself.
    unsafe {
        keeping_error_indicator(|| {
            if ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) == 1 {
                let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr()) as *mut DlManagedTensorVersioned;
                export_versioned_deleter(managed);
            }
        });
    }
}

/// Whether a `__dlpack__` caller accepts the versioned capsule: its `max_version` is a
/// `(major, minor)` of DLPack 1.0 or later.
pub fn accepts_versioned(py: Python<'_>, max_version: Option<Py<PyAny>>) -> bool {
    max_version.is_some_and(|version| version.bind(py).extract::<(u32, u32)>().is_ok_and(|(major, _)| major >= 1))
}

/// A capsule of a 1-D uint8 CPU tensor over `region`, which it keeps alive: "dltensor_versioned"
/// (DLPack 1.0, flagged writable) when the consumer accepts `versioned`, else the legacy
/// "dltensor" (which some consumers, numpy among them, import read-only).
pub fn export_dlpack<'py>(py: Python<'py>, region: &DmaRegion, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
    let len = i64::try_from(region.len()).map_err(|_| pyo3::exceptions::PyOverflowError::new_err("a region too large for DLPack"))?;
    let context = Box::into_raw(Box::new(ExportContext { _region: region.clone(), shape: [len] }));
    let tensor = DlTensor {
        data: region.host_address() as *mut c_void,
        device: DlDevice { device_type: DLPACK_CPU, device_id: 0 },
        ndim: 1,
        dtype: DlDataType { code: DLPACK_UINT, bits: 8, lanes: 1 },
        // SAFETY: `context` is a live Box (just made); the field's address stays valid until
        // the deleter frees it.
        shape: unsafe { (*context).shape.as_mut_ptr() },
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    if versioned {
        let managed = Box::into_raw(Box::new(DlManagedTensorVersioned {
            version: DlPackVersion { major: 1, minor: 0 },
            manager_ctx: context as *mut c_void,
            deleter: Some(export_versioned_deleter),
            flags: 0,
            dl_tensor: tensor,
        }));
        // SAFETY: a capsule over our own Box pointer (just made, owned by nobody else) with a
        // static C-string name that outlives it and a destructor that frees the struct only if
        // no consumer took it (see `export_versioned_capsule_destructor`).
        let capsule =
            unsafe { ffi::PyCapsule_New(managed as *mut c_void, DLTENSOR_VERSIONED.as_ptr(), Some(export_versioned_capsule_destructor)) };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so the struct is still only ours.
            unsafe { export_versioned_deleter(managed) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: PyCapsule_New returned a new (owned) reference.
        return Ok(unsafe { Bound::from_owned_ptr(py, capsule) });
    }
    let managed =
        Box::into_raw(Box::new(DlManagedTensor { dl_tensor: tensor, manager_ctx: context as *mut c_void, deleter: Some(export_deleter) }));
    // SAFETY: a capsule over our Box pointer with a static name and a destructor that frees it
    // only if unconsumed (see `export_capsule_destructor`).
    let capsule = unsafe { ffi::PyCapsule_New(managed as *mut c_void, DLTENSOR.as_ptr(), Some(export_capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so the struct is still only ours.
        unsafe { export_deleter(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new (owned) reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// Proof that no queue pair of a store can use memory registered with it any more: its
/// executor's pairs were deleted (`KvStore::close` answered true), or it never had one.
pub struct QueuesGone(());

impl QueuesGone {
    /// `KvStore::close`'s answer: `Some` when every queue pair was deleted.
    pub fn after_close(deleted: bool) -> Option<QueuesGone> {
        deleted.then_some(QueuesGone(()))
    }

    /// The memory was mapped but no store was built over it (registration refused).
    pub fn never_used() -> QueuesGone {
        QueuesGone(())
    }
}

/// A caller's memory mapped for the store's devices, with what keeps it alive (`keep`: the
/// DLPack tensor, the buffer export, the owner object). Dropped without [`CallerMemory::release`]
/// it is leaked, mapping and owner both: the safe default while a queue pair may still write it.
pub struct CallerMemory<K> {
    region: Option<DmaRegion>,
    keep: Option<K>,
    /// The IOVA of the tensor's first byte (inside the page-rounded mapping).
    iova: Iova,
}

impl<K> CallerMemory<K> {
    pub fn iova(&self) -> Iova {
        self.iova
    }

    /// Unmaps, then hands back the owner to let go of: only once no queue pair can still move
    /// its bytes. (The caller drops it where no lock a Python thread may wait for is held: a
    /// DLPack producer's deleter may take the GIL.)
    #[must_use = "the owner is dropped by the caller, outside the store's lock"]
    pub fn release(mut self, _proof: &QueuesGone) -> Option<K> {
        drop(self.region.take());
        self.keep.take()
    }
}

impl<K> Drop for CallerMemory<K> {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            let bytes = region.leak();
            tracing::error!(bytes, "tutti: registered KV memory leaked (mapped and kept for good): a queue pair may still use it");
            std::mem::forget(self.keep.take());
        }
    }
}

/// Maps `len` bytes of the caller's memory at `address` for `dma`'s devices, keeping `keep` (what
/// keeps the memory alive) with the mapping. The mapping covers the whole pages the range
/// touches (the devices map pages); only bytes inside `address..address + len` are ever named
/// in a command, because every address the store issues comes from the registration, whose
/// tensors `tensor::check_layout` placed inside their ranges. A failure hands `keep` back (no
/// device was given the memory): the caller drops it where a deleter may take the GIL.
pub fn map_caller_memory<K>(dma: &Arc<dyn DmaAllocator>, address: u64, len: u64, keep: K) -> Result<CallerMemory<K>, (HwError, K)> {
    match map_pages(dma, address, len) {
        Ok((region, iova)) => Ok(CallerMemory { region: Some(region), keep: Some(keep), iova }),
        Err(error) => Err((error, keep)),
    }
}

/// The pages holding `address..address + len` mapped for `dma`'s devices, and the IOVA of
/// `address` (see `map_caller_memory`, whose `keep` keeps them alive).
fn map_pages(dma: &Arc<dyn DmaAllocator>, address: u64, len: u64) -> Result<(DmaRegion, Iova), HwError> {
    let start = address & !(PAGE_BYTES - 1);
    let end = address
        .checked_add(len)
        .and_then(|end| end.checked_next_multiple_of(PAGE_BYTES))
        .ok_or(HwError::Misaligned { offset: 0, align: PAGE_BYTES as usize })?;
    let mapped = usize::try_from(end - start).map_err(|_| HwError::ZeroLength)?;
    // SAFETY: map_external's contract holds: `start..end` is memory of this process, readable and
    // writable: it covers the pages of a live, writable allocation the producer described (a
    // DLPack tensor we consumed, a writable buffer export, or a RawMemory whose caller promised
    // it), and a page holding a byte of a live allocation stays mapped while it lives (allocators
    // unmap whole pages only). It stays valid as long as the region: `keep`, which keeps the
    // allocation alive, is dropped only after the region and every use a device can make of it
    // (`CallerMemory::release` takes the QueuesGone proof; otherwise both are leaked). The start
    // is page aligned by construction. No Rust reference into it exists: the store reads and
    // writes it only through DMA (the software controller's copies).
    let region = unsafe { dma.map_external(start as *mut u8, mapped)? };
    let iova = region.iova().checked_add(address - start).ok_or(HwError::ZeroLength)?;
    Ok((region, iova))
}

/// Runs `handler` in the child of every `fork()` of this process, before `fork()` returns there
/// (`pthread_atfork(3)`; registered once per call: the caller registers once). The parent may be
/// multi-threaded, so `handler` may do only async-signal-safe work (`fd_identity`, `close_fd`,
/// atomics).
pub fn at_fork_in_child(handler: extern "C" fn()) -> std::io::Result<()> {
    extern "C" {
        fn pthread_atfork(
            prepare: Option<extern "C" fn()>,
            parent: Option<extern "C" fn()>,
            child: Option<extern "C" fn()>,
        ) -> std::ffi::c_int;
    }
    // SAFETY: pthread_atfork only records the three function pointers (None: no handler); the
    // handler is a plain `extern "C" fn()` with no arguments, valid for the process's life.
    let status = unsafe { pthread_atfork(None, None, Some(handler)) };
    match status {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

/// Which open file a descriptor names, to tell a number reused for another file from the one
/// recorded: (device, inode), and for an anon-inode file the kind the kernel gives it. Every
/// eventfd, epoll, timerfd, signalfd and VFIO device fd (`anon_inode:[vfio-device]`) shares
/// the one anon inode, so (device, inode) alone cannot tell them apart; their link text in
/// `/proc/self/fd` names the kind. A path's link text is not compared: it changes while the
/// file stays the same (renamed, or " (deleted)" once unlinked), and (device, inode) already
/// names one file while it is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdIdentity {
    pub device: u64,
    pub inode: u64,
    /// A hash (FNV-1a, never 0) of an anon-inode file's link text (`anon_inode:[eventfd]`);
    /// 0 for any other file, or when the link cannot be read (no /proc).
    pub anon_kind: u64,
}

/// The identity of the open file `fd` names, None when `fd` is not open. Async-signal-safe
/// (`fstat(2)`, `readlink(2)`, no allocation): it runs in a forked child's handler.
pub fn fd_identity(fd: std::os::fd::RawFd) -> Option<FdIdentity> {
    if fd < 0 {
        return None;
    }
    // SAFETY: the borrow lives only for the fstat below; a number that is not open makes fstat
    // fail with EBADF (no file is touched).
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let stat = nix::sys::stat::fstat(borrowed).ok()?;
    Some(FdIdentity { device: stat.st_dev, inode: stat.st_ino, anon_kind: anon_kind_of(fd) })
}

/// `FdIdentity::anon_kind` of `fd` (not negative): `/proc/self/fd/<fd>` read with
/// `readlink(2)`, which never follows the link. Async-signal-safe: stack buffers only, no
/// formatting machinery, no allocation, no panic (every index is within its buffer).
fn anon_kind_of(fd: std::os::fd::RawFd) -> u64 {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    const ANON: &[u8] = b"anon_inode:";
    // The prefix, at most 10 digits (i32::MAX) and the NUL (the buffer starts zeroed).
    let mut path = [0u8; 32];
    let mut digits = [0u8; 10];
    let mut count = 0;
    let mut rest = fd.unsigned_abs();
    for digit in digits.iter_mut() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
        count += 1;
        if rest == 0 {
            break;
        }
    }
    let spelled = PREFIX.iter().chain(digits.iter().take(count).rev());
    for (byte, spelled) in path.iter_mut().zip(spelled) {
        *byte = *spelled;
    }
    // Anon-inode kinds are short ("anon_inode:[vfio-device]"); a longer text is cut here,
    // the same way every time.
    let mut link = [0u8; 64];
    // SAFETY: `path` is NUL-terminated (14 + 10 bytes written into 32 zeroed ones); readlink
    // writes at most `link.len()` bytes into `link` and returns how many, or -1.
    let length = unsafe { nix::libc::readlink(path.as_ptr().cast(), link.as_mut_ptr().cast(), link.len()) };
    let Ok(length) = usize::try_from(length) else { return 0 };
    let Some(text) = link.get(..length) else { return 0 };
    if !text.starts_with(ANON) {
        return 0;
    }
    // FNV-1a, 64 bits.
    let hash = text.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3));
    hash.max(1)
}

/// Closes the descriptor `fd` (`close(2)`, nothing else: never `shutdown(2)`, which would act
/// on the open file shared with other processes) if it still names the file `identity`
/// (`fd_identity`); returns whether it did. Async-signal-safe. Only for the copies a forked child
/// inherited of descriptors its parent's sessions own (`process::close_inherited`): whatever
/// owns them in the child is leaked and never uses the number again.
pub fn close_inherited_copy(fd: std::os::fd::RawFd, identity: FdIdentity) -> bool {
    use std::os::fd::FromRawFd;
    if fd_identity(fd) != Some(identity) {
        return false;
    }
    // SAFETY: `fd` is open (fstat just answered for it) and its owner in this process is
    // leaked (the contract above), so this OwnedFd is its only user; dropping it at once is one
    // close(2).
    drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    true
}

/// Tests: forks; the child runs `check` (async-signal-safe work only) and exits with what it
/// returned; the parent waits for it (at most 10 s) and returns that exit status.
#[cfg(test)]
pub fn fork_for_tests(check: impl FnOnce() -> i32) -> i32 {
    extern "C" {
        fn fork() -> std::ffi::c_int;
        fn _exit(status: std::ffi::c_int) -> !;
        fn waitpid(pid: std::ffi::c_int, status: *mut std::ffi::c_int, options: std::ffi::c_int) -> std::ffi::c_int;
    }
    // SAFETY: the child runs only `check` (async-signal-safe by contract) and _exit.
    let pid = unsafe { fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let status = check();
        // SAFETY: leaves the child at once, running no destructor or atexit handler.
        unsafe { _exit(status) };
    }
    // Bounded: asked without blocking (WNOHANG) until a deadline; a child that hangs fails the test.
    const WNOHANG: std::ffi::c_int = 1;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut status = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer for the call.
        let reaped = unsafe { waitpid(pid, &mut status, WNOHANG) };
        if reaped == pid {
            return (status >> 8) & 0xff;
        }
        assert_eq!(reaped, 0, "waitpid");
        assert!(std::time::Instant::now() < deadline, "the forked child did not exit within 10 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
