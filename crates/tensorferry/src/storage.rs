//! The memory behind tensors: owned, mapped from a file, or borrowed from a foreign
//! producer (NumPy, PyTorch, JAX, …) that a handle keeps alive.

use std::any::Any;
use std::fmt;
use std::time::Duration;

use memmap2::Mmap;

use crate::backend::{DeviceMemory, Event};
use crate::device::Device;
use crate::memory::{AlignedBuffer, HostBuffer};

/// Memory owned by someone else, kept alive by `owner` for as long as this value lives.
pub struct ForeignMemory {
    ptr: *mut u8,
    len: usize,
    device: Device,
    read_only: bool,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the memory is owned by `_owner`, which is itself `Send + Sync`; the raw pointer is
// only an address into that memory, and tensorferry reads it only through `&self`.
unsafe impl Send for ForeignMemory {}
// SAFETY: see `Send`.
unsafe impl Sync for ForeignMemory {}

impl ForeignMemory {
    /// Wraps `len` bytes at `ptr` on `device`, alive while `owner` lives.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes on `device` (and for writes unless
    /// `read_only`) for as long as `owner` is alive, and nobody may write to it while
    /// tensorferry reads it.
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        device: Device,
        read_only: bool,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        ForeignMemory {
            ptr,
            len,
            device,
            read_only,
            _owner: owner,
        }
    }
}

/// A block of memory that tensors view.
pub enum Storage {
    /// Host memory tensorferry allocated, 64-byte aligned.
    Owned(AlignedBuffer),
    /// A read-only memory map of a file.
    Mapped(Mmap),
    /// Memory of another producer.
    Foreign(ForeignMemory),
    /// Memory of a device that tensorferry allocated (through the device's backend).
    Device(DeviceMemory),
    /// Host memory that a queued copy is filling: every read waits for `ready` first.
    Incoming {
        /// The memory being filled (pageable, or from the pinned pool).
        buffer: HostBuffer,
        /// Completed when the copy into `buffer` has finished.
        ready: Event,
    },
}

impl Storage {
    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        match self {
            Storage::Owned(_) | Storage::Mapped(_) | Storage::Incoming { .. } => Device::Cpu,
            Storage::Foreign(f) => f.device,
            Storage::Device(b) => b.device(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Storage::Owned(b) => b.len(),
            Storage::Mapped(m) => m.len(),
            Storage::Foreign(f) => f.len,
            Storage::Device(b) => b.len(),
            Storage::Incoming { buffer, .. } => buffer.len(),
        }
    }

    /// True when the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True for host memory of a pinned pool (the device copies it at the bus's speed).
    pub fn is_pinned(&self) -> bool {
        matches!(
            self,
            Storage::Incoming {
                buffer: crate::memory::HostBuffer::Pinned(_),
                ..
            }
        )
    }

    /// True when the memory must not be written (a mapped file, a read-only array).
    pub fn is_read_only(&self) -> bool {
        match self {
            Storage::Owned(_) | Storage::Device(_) | Storage::Incoming { .. } => false,
            Storage::Mapped(_) => true,
            Storage::Foreign(f) => f.read_only,
        }
    }

    /// The start address (a device address for device memory).
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            Storage::Owned(b) => b.as_slice().as_ptr(),
            Storage::Mapped(m) => m.as_ptr(),
            Storage::Foreign(f) => f.ptr,
            Storage::Device(b) => b.as_ptr(),
            Storage::Incoming { buffer, .. } => buffer.as_slice().as_ptr(),
        }
    }

    /// The event of the copy that fills this memory, if one may still be running.
    pub fn pending(&self) -> Option<&Event> {
        match self {
            Storage::Device(b) => Some(b.written()),
            Storage::Incoming { ready, .. } => Some(ready),
            _ => None,
        }
    }

    /// Waits until the memory holds its data; the failure of the copy that fills it, if
    /// any, naming the device whose copy failed.
    pub fn wait(&self) -> crate::Result<()> {
        match self.pending() {
            Some(e) => e.wait(),
            None => Ok(()),
        }
    }

    /// Waits at most `timeout` for the memory to hold its data: `Ok(true)` when it does,
    /// `Ok(false)` when the copy filling it is still running, the copy's failure otherwise.
    pub fn wait_timeout(&self, timeout: Duration) -> crate::Result<bool> {
        match self.pending() {
            Some(e) => e.wait_timeout(timeout),
            None => Ok(true),
        }
    }

    /// True when no copy into this memory is still running.
    pub fn is_ready(&self) -> bool {
        self.pending().is_none_or(Event::is_ready)
    }

    /// The bytes, when the memory is on the host (`None` for device memory). Memory still
    /// being filled by a queued copy is waited for; the failure of that copy is an error.
    pub fn try_host_bytes(&self) -> crate::Result<Option<&[u8]>> {
        Ok(match self {
            Storage::Owned(b) => Some(b.as_slice()),
            Storage::Incoming { buffer, ready } => {
                ready.wait()?;
                Some(buffer.as_slice())
            }
            Storage::Device(_) => None,
            Storage::Mapped(m) => Some(&m[..]),
            Storage::Foreign(f) if f.device.is_host() => {
                if f.len == 0 {
                    return Ok(Some(&[]));
                }
                // SAFETY: `ForeignMemory::new`'s contract: `ptr` is valid for reads of `len`
                // host bytes while `_owner` lives, which is at least as long as `&self`.
                Some(unsafe { std::slice::from_raw_parts(f.ptr, f.len) })
            }
            Storage::Foreign(_) => None,
        })
    }

    /// The bytes, when the memory is on the host. Memory still being filled by a queued
    /// copy is waited for; `None` also when that copy failed: [`Storage::try_host_bytes`]
    /// tells the failure apart.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        self.try_host_bytes().ok().flatten()
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Storage::Owned(_) => "owned",
            Storage::Mapped(_) => "mapped",
            Storage::Foreign(_) => "foreign",
            Storage::Device(_) => "device",
            Storage::Incoming { .. } => "incoming",
        };
        write!(
            f,
            "Storage({kind}, {} bytes on {})",
            self.len(),
            self.device()
        )
    }
}
