//! The contract between the transfer engine and a device backend: the [`Backend`] trait,
//! the batches of copies it is handed, and the device memory it hands out.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use super::event::Event;
use super::fence::StreamHandle;
use crate::device::Device;
use crate::error::Result;

/// One contiguous copy of `len` bytes from `src` to `dst` (host or device addresses,
/// as the batch's [`Direction`] says).
///
/// Its fields are the crate's: the transfer engine builds ops from storages it holds (the
/// elements of a tensor, inside its storage as its layout was checked to be when it was
/// made, and a slot of a destination it allocated for the plan's total), and code outside
/// the crate only through the `unsafe` [`CopyOp::new`]. The one thing that dereferences
/// an op's addresses is [`Backend::submit`], an `unsafe fn` too, whose caller keeps every
/// storage the ops address alive until the batch's event completes. So no safe code can
/// make a copy touch freed or foreign memory through a `CopyOp`:
///
/// ```compile_fail,E0451
/// use tensorferry::internal::backend::CopyOp;
///
/// let op = CopyOp { src: std::ptr::null(), dst: std::ptr::null_mut(), len: 1 };
/// ```
#[derive(Clone, Copy, Debug)]
pub struct CopyOp {
    /// Source address.
    pub(crate) src: *const u8,
    /// Destination address.
    pub(crate) dst: *mut u8,
    /// Bytes to copy.
    pub(crate) len: usize,
}

impl CopyOp {
    /// A copy of `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// `src` and `dst` must each address `len` bytes of memory of the kinds the batch's
    /// [`Direction`] names, live and not otherwise written until the batch has run.
    pub unsafe fn new(src: *const u8, dst: *mut u8, len: usize) -> CopyOp {
        CopyOp { src, dst, len }
    }
}

/// Which memories a batch copies between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host memory to device memory.
    HostToDevice,
    /// Device memory to host memory.
    DeviceToHost,
    /// Device memory to device memory (the same device, or a peer).
    DeviceToDevice,
}

/// Copies queued together: one operation on a stream for a whole dictionary's share.
#[derive(Debug)]
pub struct CopyBatch {
    /// Which memories the copies go between.
    pub direction: Direction,
    /// The copies, run in order.
    pub ops: Vec<CopyOp>,
    /// Events the batch must wait for first (copies that fill its sources).
    pub waits: Vec<Event>,
}

// SAFETY: a batch is plain data; the addresses are only dereferenced by `Backend::submit`,
// whose contract makes them valid until the batch's event completes.
unsafe impl Send for CopyBatch {}

impl CopyBatch {
    /// Total bytes the batch moves.
    pub fn bytes(&self) -> usize {
        self.ops.iter().map(|op| op.len).sum()
    }
}

/// Seals [`Backend`]: implemented for the crate's own devices (in the backend's `mod.rs`)
/// and nowhere else, so that code outside the crate can use a backend but never supply one
/// (the engine trusts a backend's promises about memory and ordering).
pub(super) mod sealed {
    /// Only the crate's own backends implement it.
    pub trait Sealed {}
}

/// A device's memory and stream, as the transfer engine needs them. Sealed: only the
/// crate's own devices implement it.
///
/// Every method is given below, so that the one error is the seal's (E0277, `Mine` is
/// not `Sealed`): without it this example compiles.
///
/// ```compile_fail,E0277
/// use std::sync::Arc;
/// use tensorferry::internal::backend::{Backend, CopyBatch, DeviceMemory, Event};
/// use tensorferry::internal::memory::PinnedPool;
/// use tensorferry::{Device, Result};
///
/// #[derive(Debug)]
/// struct Mine;
/// impl Backend for Mine {
///     fn device(&self) -> Device { Device::Emulated(7) }
///     fn alloc(&self, _len: usize) -> Result<DeviceMemory> { unimplemented!() }
///     fn pinned_pool(&self) -> Result<Arc<PinnedPool>> { unimplemented!() }
///     unsafe fn queue(&self, _: CopyBatch, _: Box<dyn std::any::Any + Send>, _: &Event, _: bool) {}
/// }
/// ```
pub trait Backend: sealed::Sealed + Send + Sync + fmt::Debug {
    /// The device this backend drives.
    fn device(&self) -> Device;

    /// Allocates `len` bytes of device memory; out-of-memory gives bytes asked, free, total.
    fn alloc(&self, len: usize) -> Result<DeviceMemory>;

    /// The pool of pinned host buffers that copies to the host can land in.
    fn pinned_pool(&self) -> Result<std::sync::Arc<crate::memory::PinnedPool>>;

    /// True when copies between this device and ordinary host memory go faster through
    /// pinned staging buffers (the transfer engine's ring) than directly.
    fn prefers_pinned_staging(&self) -> bool {
        false
    }

    /// True when the host memory at `address` is page-locked for this device's copies
    /// (pinned or registered by another library, such as PyTorch's `pin_memory()`), so
    /// that the device copies it directly, at the bus's speed, without the staging ring.
    fn is_page_locked(&self, _address: *const u8) -> bool {
        false
    }

    /// Makes this device's copies from another device's memory, queued from now on, wait
    /// for the work queued so far on the stream that `source`'s reads run on: the stream
    /// producers of that memory were ordered before (DLPack's `stream`, a framework's
    /// stream). A device whose copies run on the source's own queue needs nothing.
    fn order_after_device(&self, _source: Device) -> Result<()> {
        Ok(())
    }

    /// Makes this device's copies queued from now on wait, on the device, for the work
    /// queued so far on another library's `stream` (a producer's): the caller does not
    /// wait. A device that has no streams of other libraries refuses.
    fn order_after_stream(&self, _stream: StreamHandle) -> Result<()> {
        Err(no_foreign_streams(self.device()))
    }

    /// Blocks until the work queued so far on another library's `stream` (a producer's)
    /// has run, for reads that no device stream orders (host copies).
    fn synchronize_stream(&self, _stream: StreamHandle) -> Result<()> {
        Err(no_foreign_streams(self.device()))
    }

    /// Drops `keep` (memory lent to another library, coming back) once the device has run
    /// the work queued so far on that library's `stream` — `None`: the device's default
    /// stream (CUDA's legacy default stream, which work on every blocking stream of the
    /// context precedes) — on the device's completer, never waiting on the calling thread.
    /// A device that runs no work of other libraries drops it at once.
    fn release_after_stream(&self, _stream: Option<StreamHandle>, keep: Box<dyn Any + Send>) {
        drop(keep);
    }

    /// The stream a producer of memory this device reads should order its work before
    /// (DLPack's `__dlpack__(stream=…)`), when the device has one another library can use.
    fn producer_stream(&self) -> Option<StreamHandle> {
        None
    }

    /// Queues `batch` on the device's stream for its direction, after everything submitted
    /// to that stream before it (and after its `waits`), completing `event` when every
    /// copy is done, or with the first failure: a wait's own failure as it is, else one
    /// naming this device. `keep` is held until the copies are done, and dropped before
    /// `event` completes.
    ///
    /// Never blocks the caller on other work: `waits` may still be pending. Waits on work
    /// queued on a GPU are honoured on the GPU; waits on host work defer the batch (and
    /// the later batches of its stream) until that work completes. Uploads and copies that
    /// read device memory run on separate streams and overlap: whatever must run in order
    /// across them is a wait. `event` may complete on another thread (the device's
    /// completer), which then also drops `keep`.
    ///
    /// # Safety
    /// Every op's `src` must be readable and `dst` writable for `len` bytes, in the
    /// memories the direction names, until `event` completes (`keep` is how the caller
    /// ensures that), and nothing else may write the destinations or read them before
    /// `event` completes.
    unsafe fn submit(&self, batch: CopyBatch, keep: Box<dyn Any + Send>, event: &Event) {
        // SAFETY: forwarded contract.
        unsafe { self.queue(batch, keep, event, true) }
    }

    /// [`Backend::submit`] when `ordered`; else the batch does not queue behind batches of
    /// its stream that still wait for host work: it runs as soon as its own waits allow.
    /// For work that feeds a stream over time on behalf of a transfer those batches may be
    /// waiting for (a staging ring's chunks), which would never run behind them.
    ///
    /// # Safety
    /// As [`Backend::submit`].
    unsafe fn queue(
        &self,
        batch: CopyBatch,
        keep: Box<dyn Any + Send>,
        event: &Event,
        ordered: bool,
    );
}

/// The error of a device asked about another library's streams, which it has none of.
pub(crate) fn no_foreign_streams(device: Device) -> crate::error::Error {
    crate::error::Error::DeviceUnavailable {
        device: device.to_string(),
        reason: "it shares no streams with other libraries".into(),
    }
}

/// Memory of a device, freed through its backend's `release` when dropped — which the
/// engine arranges to happen only after every queued copy using it has completed (the
/// copies hold it). Memory lent to another library (`DeviceMemory::lend`) is freed only
/// once its consumers' streams have run the work they queued on it.
pub struct DeviceMemory {
    device: Device,
    address: *mut u8,
    len: usize,
    written: Event,
    /// Frees the memory when dropped (taken in `drop` when the memory was lent).
    release: Option<Box<dyn Any + Send + Sync>>,
    /// The consumers the memory was lent to: each one's backend and stream.
    lent: Mutex<Vec<Consumer>>,
}

/// A consumer of lent device memory: the backend that fences its stream, and the stream.
type Consumer = (Arc<dyn Backend>, Option<StreamHandle>);

// SAFETY: the address only names memory owned through `_release`; writes to it happen in
// copies that complete `written`, which every reader waits for.
unsafe impl Send for DeviceMemory {}
// SAFETY: see `Send`.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Wraps `len` bytes at `address` on `device`; dropping `release` frees them.
    ///
    /// # Safety
    /// `address` must be the start of `len` bytes of `device`'s memory that stay allocated
    /// (and are used by nothing else) until `release` is dropped; dropping `release` must
    /// free them exactly once. The transfer engine copies into and out of that memory.
    pub unsafe fn new(
        device: Device,
        address: *mut u8,
        len: usize,
        release: Box<dyn Any + Send + Sync>,
    ) -> Self {
        DeviceMemory {
            device,
            address,
            len,
            written: Event::ready(),
            release: Some(release),
            lent: Mutex::new(Vec::new()),
        }
    }

    /// Marks the memory as lent to another library whose device work on it runs on
    /// `stream` (`None`: unknown, the device's default stream stands for it): when dropped,
    /// it is freed only behind `backend`'s fence on that stream
    /// ([`Backend::release_after_stream`]).
    pub(crate) fn lend(&self, backend: Arc<dyn Backend>, stream: Option<StreamHandle>) {
        self.lent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((backend, stream));
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The device address.
    pub fn as_ptr(&self) -> *const u8 {
        self.address
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the memory holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The event completed when the copy filling this memory finished.
    pub fn written(&self) -> &Event {
        &self.written
    }

    /// Sets the event of the copy that fills this memory (before the memory is shared).
    pub(crate) fn set_written(&mut self, event: Event) {
        self.written = event;
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let lent = std::mem::take(self.lent.get_mut().unwrap_or_else(|p| p.into_inner()));
        let Some(release) = self.release.take() else {
            return;
        };
        if lent.is_empty() {
            return drop(release);
        }
        // Freed when the last consumer's fence has passed.
        let release: Arc<Box<dyn Any + Send + Sync>> = Arc::new(release);
        for (backend, stream) in lent {
            backend.release_after_stream(stream, Box::new(release.clone()));
        }
    }
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMemory({} bytes on {})", self.len, self.device)
    }
}
