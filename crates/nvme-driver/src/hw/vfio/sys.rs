//! The system calls VFIO needs, through typed wrappers: std for `open`, nix for the ioctls
//! (generated with its ioctl macros from the request numbers in `uapi`), `pread`/`pwrite` and
//! `getrlimit`. They return `io::Error` with errno intact so the callers can classify failures.

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use super::uapi::{request, vfio_device_info, vfio_group_status, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap, vfio_region_info};

// `_IO` requests whose argument is an integer (or nothing) ...
nix::ioctl_none_bad!(vfio_get_api_version, request::number(request::GET_API_VERSION));
nix::ioctl_write_int_bad!(vfio_check_extension, request::number(request::CHECK_EXTENSION));
nix::ioctl_write_int_bad!(vfio_set_iommu, request::number(request::SET_IOMMU));
nix::ioctl_none_bad!(vfio_device_reset, request::number(request::DEVICE_RESET));
// ... and those whose argument points at a struct (or a buffer) the kernel reads and/or writes.
nix::ioctl_readwrite_bad!(vfio_group_get_status, request::number(request::GROUP_GET_STATUS), vfio_group_status);
nix::ioctl_write_ptr_bad!(vfio_group_set_container, request::number(request::GROUP_SET_CONTAINER), libc::c_int);
nix::ioctl_write_ptr_bad!(vfio_group_get_device_fd, request::number(request::GROUP_GET_DEVICE_FD), libc::c_char);
nix::ioctl_readwrite_bad!(vfio_device_get_info, request::number(request::DEVICE_GET_INFO), vfio_device_info);
nix::ioctl_readwrite_bad!(vfio_device_get_region_info, request::number(request::DEVICE_GET_REGION_INFO), vfio_region_info);
nix::ioctl_readwrite_bad!(vfio_iommu_get_info, request::number(request::IOMMU_GET_INFO), u8);
nix::ioctl_write_ptr_bad!(vfio_iommu_map_dma, request::number(request::IOMMU_MAP_DMA), vfio_iommu_type1_dma_map);
nix::ioctl_readwrite_bad!(vfio_iommu_unmap_dma, request::number(request::IOMMU_UNMAP_DMA), vfio_iommu_type1_dma_unmap);

fn errno(error: nix::errno::Errno) -> io::Error {
    io::Error::from(error)
}

/// Opens a device node read/write (std opens close-on-exec).
pub fn open_read_write(path: &Path) -> io::Result<OwnedFd> {
    Ok(OwnedFd::from(OpenOptions::new().read(true).write(true).open(path)?))
}

/// `VFIO_GET_API_VERSION` on a container.
pub fn api_version(container: &impl AsRawFd) -> io::Result<i32> {
    // SAFETY: an `_IO` request with no argument on a descriptor the caller owns.
    unsafe { vfio_get_api_version(container.as_raw_fd()) }.map_err(errno)
}

/// `VFIO_CHECK_EXTENSION`: 1 when the container offers the IOMMU model `extension`.
pub fn check_extension(container: &impl AsRawFd, extension: u32) -> io::Result<i32> {
    let extension = libc::c_int::try_from(extension).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the argument is an integer, passed by value; the kernel dereferences nothing.
    unsafe { vfio_check_extension(container.as_raw_fd(), extension) }.map_err(errno)
}

/// `VFIO_SET_IOMMU` with the IOMMU model `model`.
pub fn set_iommu(container: &impl AsRawFd, model: u32) -> io::Result<()> {
    let model = libc::c_int::try_from(model).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the argument is an integer, passed by value.
    unsafe { vfio_set_iommu(container.as_raw_fd(), model) }.map(drop).map_err(errno)
}

/// `VFIO_DEVICE_RESET`.
pub fn device_reset(device: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: an `_IO` request with no argument.
    unsafe { vfio_device_reset(device.as_raw_fd()) }.map(drop).map_err(errno)
}

/// `VFIO_GROUP_GET_STATUS` into `status` (whose `argsz` the caller set).
pub fn group_status(group: &impl AsRawFd, status: &mut vfio_group_status) -> io::Result<()> {
    // SAFETY: the kernel writes at most `argsz` = size_of::<vfio_group_status>() bytes through a
    // pointer to an exclusively borrowed struct of that type.
    unsafe { vfio_group_get_status(group.as_raw_fd(), status) }.map(drop).map_err(errno)
}

/// `VFIO_GROUP_SET_CONTAINER`: attaches the group to `container`.
pub fn group_set_container(group: &impl AsRawFd, container: &impl AsRawFd) -> io::Result<()> {
    let container_fd: libc::c_int = container.as_raw_fd();
    // SAFETY: the kernel reads one int (the container fd) through a pointer to a live local.
    unsafe { vfio_group_set_container(group.as_raw_fd(), &container_fd) }.map(drop).map_err(errno)
}

/// `VFIO_GROUP_GET_DEVICE_FD` for the device named `name` (its PCI address).
pub fn group_device_fd(group: &impl AsRawFd, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: the kernel reads a NUL-terminated string at the pointer and nothing past its
    // terminator; `name` is one, alive for the call.
    let fd = unsafe { vfio_group_get_device_fd(group.as_raw_fd(), name.as_ptr()) }.map_err(errno)?;
    // SAFETY: on success the ioctl returned a new descriptor that nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// `VFIO_DEVICE_GET_INFO` into `info` (whose `argsz` the caller set).
pub fn device_info(device: &impl AsRawFd, info: &mut vfio_device_info) -> io::Result<()> {
    // SAFETY: the kernel reads and writes at most `argsz` = size_of::<vfio_device_info>() bytes
    // of the exclusively borrowed struct.
    unsafe { vfio_device_get_info(device.as_raw_fd(), info) }.map(drop).map_err(errno)
}

/// `VFIO_DEVICE_GET_REGION_INFO` for `info.index` (whose `argsz` the caller set).
pub fn region_info(device: &impl AsRawFd, info: &mut vfio_region_info) -> io::Result<()> {
    // SAFETY: as in `device_info`, for a vfio_region_info.
    unsafe { vfio_device_get_region_info(device.as_raw_fd(), info) }.map(drop).map_err(errno)
}

/// `VFIO_IOMMU_GET_INFO` into `buffer`, whose first four bytes hold `argsz` = its length (the
/// kernel writes the fixed header and, when it fits, the capability chain after it).
pub fn iommu_info(container: &impl AsRawFd, buffer: &mut [u8]) -> io::Result<()> {
    let argsz = buffer.get(0..4).and_then(|bytes| <[u8; 4]>::try_from(bytes).ok()).map(u32::from_le_bytes);
    if argsz.is_none_or(|argsz| argsz as usize > buffer.len()) || buffer.len() < std::mem::size_of::<super::uapi::vfio_iommu_type1_info>() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: the kernel writes at most `argsz` bytes, which was checked to be within `buffer`
    // (exclusively borrowed), and at least the fixed header fits.
    unsafe { vfio_iommu_get_info(container.as_raw_fd(), buffer.as_mut_ptr()) }.map(drop).map_err(errno)
}

/// `VFIO_IOMMU_MAP_DMA`.
///
/// # Safety
/// `request.vaddr .. + request.size` must be memory of this process that stays valid, and is
/// not freed or remapped, until the same range is unmapped (or the container is closed): the
/// device may read and write it at any time in between.
pub unsafe fn iommu_map_dma(container: &impl AsRawFd, request: &vfio_iommu_type1_dma_map) -> io::Result<()> {
    // SAFETY: the kernel reads the struct (argsz bytes, its size); the caller guarantees the
    // host range it names (this function's contract), which the kernel pins.
    unsafe { vfio_iommu_map_dma(container.as_raw_fd(), request) }.map(drop).map_err(errno)
}

/// `VFIO_IOMMU_UNMAP_DMA`; the kernel writes back in `request.size` how much it unmapped.
pub fn iommu_unmap_dma(container: &impl AsRawFd, request: &mut vfio_iommu_type1_dma_unmap) -> io::Result<()> {
    // SAFETY: the kernel reads and updates `argsz` = size_of::<vfio_iommu_type1_dma_unmap>()
    // bytes of the exclusively borrowed struct (no dirty-bitmap flag, so nothing past it).
    unsafe { vfio_iommu_unmap_dma(container.as_raw_fd(), request) }.map(drop).map_err(errno)
}

/// Reads exactly `buffer.len()` bytes at `offset` (VFIO region access).
pub fn pread_exact(fd: &impl AsFd, buffer: &mut [u8], offset: u64) -> io::Result<()> {
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let read = nix::sys::uio::pread(fd, buffer, offset).map_err(errno)?;
    if read != buffer.len() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("short read: {read} of {} bytes", buffer.len())));
    }
    Ok(())
}

/// Writes exactly `buffer.len()` bytes at `offset`.
pub fn pwrite_exact(fd: &impl AsFd, buffer: &[u8], offset: u64) -> io::Result<()> {
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let written = nix::sys::uio::pwrite(fd, buffer, offset).map_err(errno)?;
    if written != buffer.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, format!("short write: {written} of {} bytes", buffer.len())));
    }
    Ok(())
}

/// The soft RLIMIT_MEMLOCK in bytes, `None` when unlimited or unreadable.
pub fn memlock_limit_bytes() -> Option<u64> {
    let (soft, _hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK).ok()?;
    (soft != nix::sys::resource::RLIM_INFINITY).then_some(soft)
}
