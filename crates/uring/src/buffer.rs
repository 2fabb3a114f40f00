//! Page-aligned heap buffers.

use crate::error::UringError;
use crate::sys::Allocation;

/// Page-aligned, zero-initialised heap memory of a fixed capacity (a multiple of 4 KiB), as
/// `O_DIRECT` transfers need. `AlignedBuffer::default()` is empty and allocates nothing. Moving a
/// buffer does not move its memory, which is why a [`crate::Ring`] can hold it while the kernel
/// uses it.
#[derive(Default)]
pub struct AlignedBuffer {
    allocation: Option<Allocation>,
}

impl std::fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuffer").field("capacity_bytes", &self.capacity_bytes()).finish()
    }
}

impl AlignedBuffer {
    /// The alignment of the first byte, and the granularity of the capacity.
    pub const ALIGNMENT_BYTES: usize = 4096;

    /// A zeroed buffer of at least `len_bytes` (rounded up to whole pages); an error, not an
    /// abort, when the memory cannot be had.
    pub fn with_capacity(len_bytes: usize) -> Result<Self, UringError> {
        if len_bytes == 0 {
            return Ok(Self::default());
        }
        let rounded = len_bytes.checked_next_multiple_of(Self::ALIGNMENT_BYTES).ok_or(UringError::Allocation { len_bytes })?;
        let allocation = Allocation::zeroed(rounded, Self::ALIGNMENT_BYTES).ok_or(UringError::Allocation { len_bytes })?;
        Ok(Self { allocation: Some(allocation) })
    }

    /// Bytes held (what keeping this buffer in a pool costs).
    pub fn capacity_bytes(&self) -> usize {
        self.allocation.as_ref().map_or(0, Allocation::len)
    }

    /// Makes the capacity at least `len_bytes`: a fresh zeroed allocation when it grows (the old
    /// contents are not kept).
    pub fn try_reserve(&mut self, len_bytes: usize) -> Result<(), UringError> {
        if self.capacity_bytes() < len_bytes {
            *self = Self::with_capacity(len_bytes)?;
        }
        Ok(())
    }

    /// The first `len` bytes, writable; the buffer grows (zeroed) when smaller. Contents of an
    /// earlier use may remain. Aborts, as `Vec` does, when memory for the growth cannot be had
    /// ([`AlignedBuffer::try_reserve`] first to get an error instead).
    pub fn slice(&mut self, len: usize) -> &mut [u8] {
        if let Err(error) = self.try_reserve(len) {
            tracing::error!(%error, "aligned buffer growth failed");
            let layout =
                std::alloc::Layout::from_size_align(len.max(1), Self::ALIGNMENT_BYTES).unwrap_or_else(|_| std::alloc::Layout::new::<u8>());
            std::alloc::handle_alloc_error(layout);
        }
        match self.allocation.as_mut() {
            Some(allocation) => &mut allocation.as_mut_slice()[..len],
            None => &mut [],
        }
    }

    /// The first `len` bytes, read only; empty when the buffer holds fewer.
    pub fn bytes(&self, len: usize) -> &[u8] {
        self.allocation.as_ref().and_then(|allocation| allocation.as_slice().get(..len)).unwrap_or(&[])
    }

    /// The allocation itself, for the ring (None when empty).
    pub(crate) fn allocation_mut(&mut self) -> Option<&mut Allocation> {
        self.allocation.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_grow_on_demand() {
        // Goal: every non-empty buffer starts on a page, is zeroed when made or grown, and an
        // empty one allocates nothing.
        let empty = AlignedBuffer::default();
        assert_eq!(empty.capacity_bytes(), 0);
        assert!(empty.bytes(1).is_empty());
        let mut buffer = AlignedBuffer::with_capacity(100).unwrap();
        assert_eq!(buffer.capacity_bytes(), 4096, "rounded up to a page");
        let data = buffer.slice(100);
        assert_eq!(data.as_ptr() as usize % AlignedBuffer::ALIGNMENT_BYTES, 0);
        assert!(data.iter().all(|&byte| byte == 0));
        data[..3].copy_from_slice(&[1, 2, 3]);
        assert_eq!(buffer.bytes(3), &[1, 2, 3]);
        assert_eq!(buffer.slice(3), &[1, 2, 3], "contents kept while it fits");
        let grown = buffer.slice(3 * 4096 + 1);
        assert_eq!(grown.len(), 3 * 4096 + 1);
        assert_eq!(grown.as_ptr() as usize % AlignedBuffer::ALIGNMENT_BYTES, 0);
        assert!(grown.iter().all(|&byte| byte == 0), "a grown buffer is fresh zeroed memory");
        assert_eq!(buffer.capacity_bytes(), 4 * 4096);
        assert!(buffer.bytes(5 * 4096).is_empty());
        assert!(matches!(AlignedBuffer::with_capacity(usize::MAX), Err(UringError::Allocation { .. })));
        let mut empty = AlignedBuffer::default();
        assert!(empty.slice(0).is_empty());
        assert_eq!(empty.capacity_bytes(), 0);
    }
}
