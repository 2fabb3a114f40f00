//! Thin wrappers over the system calls VFIO needs: open, ioctl, pread/pwrite, getrlimit.
//!
//! They return `io::Error` with errno intact so the callers can classify failures.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Opens a device node read/write, close-on-exec.
pub fn open_read_write(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `path` is a valid NUL-terminated string for the duration of the call; open has no
    // other preconditions.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open, is valid and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An ioctl whose argument is a plain integer (or none); returns the ioctl's non-negative result.
pub fn ioctl_value(fd: &impl AsRawFd, request: libc::c_ulong, value: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: the VFIO requests passed here (GET_API_VERSION, CHECK_EXTENSION, SET_IOMMU,
    // DEVICE_RESET) take an integer argument or none and never dereference it.
    let result = unsafe { libc::ioctl(fd.as_raw_fd(), request, value) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}

/// An ioctl whose argument is a pointer to `T`.
///
/// # Safety
/// `request` must be an ioctl that reads and/or writes at most `size_of::<T>()` bytes at its
/// argument pointer (for VFIO: a struct whose `argsz` is no larger than `T`), or exactly a value
/// of type `T` when it takes a pointer to a scalar (the group's container fd).
pub unsafe fn ioctl_with_mut<T>(fd: &impl AsRawFd, request: libc::c_ulong, argument: &mut T) -> io::Result<libc::c_int> {
    // SAFETY: `argument` is a valid, exclusive pointer to a `T`, and by this function's contract
    // the kernel touches no more than `size_of::<T>()` bytes behind it.
    let result = unsafe { libc::ioctl(fd.as_raw_fd(), request, std::ptr::from_mut(argument)) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}

/// An ioctl whose argument is a byte buffer (VFIO info queries with capability chains, device
/// names). The buffer's first four bytes must hold `argsz` = its length for VFIO queries.
///
/// # Safety
/// `request` must touch no more than `buffer.len()` bytes at its argument.
pub unsafe fn ioctl_with_buffer(fd: &impl AsRawFd, request: libc::c_ulong, buffer: &mut [u8]) -> io::Result<libc::c_int> {
    // SAFETY: `buffer` is valid for `buffer.len()` bytes and exclusively borrowed; the caller
    // guarantees the kernel stays inside it.
    let result = unsafe { libc::ioctl(fd.as_raw_fd(), request, buffer.as_mut_ptr()) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(result)
}

/// Reads exactly `buffer.len()` bytes at `offset` (VFIO region access).
pub fn pread_exact(fd: &impl AsRawFd, buffer: &mut [u8], offset: u64) -> io::Result<()> {
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `buffer` is valid for writes of `buffer.len()` bytes.
    let read = unsafe { libc::pread(fd.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len(), offset) };
    if read < 0 {
        return Err(io::Error::last_os_error());
    }
    if read as usize != buffer.len() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("short read: {read} of {} bytes", buffer.len())));
    }
    Ok(())
}

/// Writes exactly `buffer.len()` bytes at `offset`.
pub fn pwrite_exact(fd: &impl AsRawFd, buffer: &[u8], offset: u64) -> io::Result<()> {
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `buffer` is valid for reads of `buffer.len()` bytes.
    let written = unsafe { libc::pwrite(fd.as_raw_fd(), buffer.as_ptr().cast(), buffer.len(), offset) };
    if written < 0 {
        return Err(io::Error::last_os_error());
    }
    if written as usize != buffer.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, format!("short write: {written} of {} bytes", buffer.len())));
    }
    Ok(())
}

/// The soft RLIMIT_MEMLOCK in bytes, `None` when unlimited or unreadable.
pub fn memlock_limit_bytes() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit struct.
    let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (result == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}
