//! The memory behind tensors: owned, mapped from a file, or borrowed from a foreign
//! producer (NumPy, PyTorch, JAX, …) that a handle keeps alive.

use std::any::Any;
use std::fmt;
use std::time::Duration;

use memmap2::{Mmap, MmapMut};

use crate::backend::{DeviceMemory, Event};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{AlignedBuffer, HostBuffer};

/// Memory owned by someone else, kept alive by `owner` for as long as this value lives.
pub(crate) struct ForeignMemory {
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
    /// `ptr` must be valid for reads of `len` initialised bytes on `device` (and for
    /// writes unless `read_only`), from any thread, for as long as `owner` is alive, and
    /// nobody may write to them while tensorferry reads them — including while a slice of
    /// them that [`Storage::try_host_bytes`] (or a tensor's byte accessors) handed out is
    /// alive. `owner` is dropped exactly once, after the last use of `ptr`.
    pub(crate) unsafe fn new(
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

/// A block of memory that tensors view: host memory tensorferry owns, a file mapped into
/// memory, memory borrowed from another producer, or device memory.
///
/// Opaque: the bytes are reachable only through accessors that wait for any copy still
/// filling them ([`Storage::try_host_bytes`]), and device memory is never handed out as a
/// slice.
///
/// ```
/// use std::sync::Arc;
/// use tensorferry::internal::memory::AlignedBuffer;
/// use tensorferry::{DType, Storage, Tensor};
///
/// let storage = Arc::new(Storage::owned(AlignedBuffer::copy_from(&[1, 0, 2, 0])?));
/// let t = Tensor::contiguous_view(storage.clone(), 0, DType::U16, vec![2])?;
/// assert_eq!(t.to_vec::<u16>()?, vec![1, 2]);
/// assert_eq!(storage.try_host_bytes()?, Some(&[1u8, 0, 2, 0][..]));
/// # Ok::<(), tensorferry::Error>(())
/// ```
pub struct Storage(Inner);

/// What a [`Storage`] holds; private, so no safe code outside the crate can reach memory a
/// queued copy may still be writing.
enum Inner {
    /// Host memory tensorferry allocated, 64-byte aligned.
    Owned(AlignedBuffer),
    /// A read-only memory map of a file.
    Mapped(Mmap),
    /// A private, writable (copy-on-write) memory map of a file.
    MappedCopyOnWrite(MmapMut),
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
    /// Host memory tensorferry owns: `buffer`, which the storage keeps.
    pub fn owned(buffer: AlignedBuffer) -> Storage {
        Storage(Inner::Owned(buffer))
    }

    /// Memory of another producer (a NumPy array, a DLPack or CUDA Array Interface
    /// import), on the host or a device: made by [`crate::Tensor::from_foreign`], where
    /// the producer's promises are taken.
    pub(crate) fn foreign(memory: ForeignMemory) -> Storage {
        Storage(Inner::Foreign(memory))
    }

    /// A read-only map of a file.
    pub(crate) fn mapped(map: Mmap) -> Storage {
        Storage(Inner::Mapped(map))
    }

    /// A private, copy-on-write map of a file: writable, its writes never reach the file.
    pub(crate) fn mapped_copy_on_write(map: MmapMut) -> Storage {
        Storage(Inner::MappedCopyOnWrite(map))
    }

    /// True for a memory map of a file (read-only or copy-on-write): its bytes are the
    /// file's until written.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Inner::Mapped(_) | Inner::MappedCopyOnWrite(_))
    }

    /// Device memory that the copy completing `memory.written()` fills.
    pub(crate) fn device_memory(memory: DeviceMemory) -> Storage {
        Storage(Inner::Device(memory))
    }

    /// Host memory that a queued copy is filling; `ready` completes when it is done.
    pub(crate) fn incoming(buffer: HostBuffer, ready: Event) -> Storage {
        Storage(Inner::Incoming { buffer, ready })
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        match &self.0 {
            Inner::Owned(_)
            | Inner::Mapped(_)
            | Inner::MappedCopyOnWrite(_)
            | Inner::Incoming { .. } => Device::Cpu,
            Inner::Foreign(f) => f.device,
            Inner::Device(b) => b.device(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Inner::Owned(b) => b.len(),
            Inner::Mapped(m) => m.len(),
            Inner::MappedCopyOnWrite(m) => m.len(),
            Inner::Foreign(f) => f.len,
            Inner::Device(b) => b.len(),
            Inner::Incoming { buffer, .. } => buffer.len(),
        }
    }

    /// True when the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True for host memory of a pinned pool (the device copies it at the bus's speed).
    pub fn is_pinned(&self) -> bool {
        matches!(
            self.0,
            Inner::Incoming {
                buffer: HostBuffer::Pinned(_),
                ..
            }
        )
    }

    /// Marks the memory as lent to another library (a DLPack or CUDA Array Interface
    /// consumer), whose device work on it tensorferry cannot see: device memory is then
    /// freed only behind an event on `consumer`'s stream (the device's default stream when
    /// the consumer named none), and a pinned result's buffer returns to its pool only
    /// behind events on the default streams of the GPUs in use (a consumer of host memory
    /// names no stream). Other memory needs nothing.
    pub fn lend(&self, consumer: Option<crate::backend::StreamHandle>) {
        match &self.0 {
            Inner::Incoming { buffer, .. } => buffer.lend(),
            Inner::Device(memory) => {
                if let Ok(backend) = crate::backend::backend_for(memory.device()) {
                    memory.lend(backend, consumer);
                }
            }
            _ => {}
        }
    }

    /// True when the memory must not be written (a mapped file, a read-only array).
    pub fn is_read_only(&self) -> bool {
        match &self.0 {
            Inner::Owned(_)
            | Inner::Device(_)
            | Inner::Incoming { .. }
            | Inner::MappedCopyOnWrite(_) => false,
            Inner::Mapped(_) => true,
            Inner::Foreign(f) => f.read_only,
        }
    }

    /// The start address (a device address for device memory). It does not wait: the
    /// memory may still be being filled until [`Storage::wait`] returns `Ok`.
    pub fn as_ptr(&self) -> *const u8 {
        match &self.0 {
            Inner::Owned(b) => b.as_slice().as_ptr(),
            Inner::Mapped(m) => m.as_ptr(),
            Inner::MappedCopyOnWrite(m) => m.as_ptr(),
            Inner::Foreign(f) => f.ptr,
            Inner::Device(b) => b.as_ptr(),
            Inner::Incoming { buffer, .. } => buffer.as_ptr(),
        }
    }

    /// The event of the copy that fills this memory, if one may still be running.
    pub(crate) fn pending(&self) -> Option<&Event> {
        match &self.0 {
            Inner::Device(b) => Some(b.written()),
            Inner::Incoming { ready, .. } => Some(ready),
            _ => None,
        }
    }

    /// Waits until the memory holds its data; the failure of the copy that fills it, if
    /// any, naming the device whose copy failed.
    pub fn wait(&self) -> Result<()> {
        match self.pending() {
            Some(e) => e.wait(),
            None => Ok(()),
        }
    }

    /// Waits at most `timeout` for the memory to hold its data: `Ok(true)` when it does,
    /// `Ok(false)` when the copy filling it is still running, the copy's failure otherwise.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
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
    /// being filled by a queued copy is waited for; the failure of that copy is an error
    /// (and no bytes are handed out).
    pub fn try_host_bytes(&self) -> Result<Option<&[u8]>> {
        Ok(match &self.0 {
            Inner::Owned(b) => Some(b.as_slice()),
            Inner::Incoming { buffer, ready } => {
                // Only once the copy has completed (and with it every write to `buffer`:
                // backends drop what the copy uses before completing its event) may the
                // bytes be shared.
                ready.wait()?;
                Some(buffer.as_slice())
            }
            Inner::Device(_) => None,
            Inner::Mapped(m) => Some(&m[..]),
            Inner::MappedCopyOnWrite(m) => Some(&m[..]),
            Inner::Foreign(f) if f.device.is_host() => {
                if f.len == 0 {
                    return Ok(Some(&[]));
                }
                // SAFETY: `ForeignMemory::new`'s contract: `ptr` is valid for reads of `len`
                // host bytes while `_owner` lives, which is at least as long as `&self`.
                Some(unsafe { std::slice::from_raw_parts(f.ptr, f.len) })
            }
            Inner::Foreign(_) => None,
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
        let kind = match self.0 {
            Inner::Owned(_) => "owned",
            Inner::Mapped(_) => "mapped",
            Inner::MappedCopyOnWrite(_) => "mapped copy-on-write",
            Inner::Foreign(_) => "foreign",
            Inner::Device(_) => "device",
            Inner::Incoming { .. } => "incoming",
        };
        write!(
            f,
            "Storage({kind}, {} bytes on {})",
            self.len(),
            self.device()
        )
    }
}
