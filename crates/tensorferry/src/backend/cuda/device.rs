//! The [`Backend`] of one GPU: device memory and copies through the driver API, in the
//! GPU's primary context so that pointers from PyTorch, JAX and CuPy in the same process
//! are valid here.
//!
//! Its two streams (uploads; copies that read device memory) are *non-blocking*: the legacy
//! default stream (PyTorch's) neither waits for their copies nor makes them wait, so a save
//! or an upload overlaps a training step. Every order with another library's work is
//! therefore explicit: DLPack producers are passed the read stream, PyTorch's current
//! stream is waited for by an event ([`Backend::order_after_stream`]), memory from the CUDA
//! Array Interface without a stream is ordered after its GPU's legacy default stream, and
//! a copy from another GPU waits for that GPU's read stream (and goes over the GPUs' link
//! where they can reach each other, `CudaDevice::reach`; else the driver stages it).
//!
//! A batch is queued from the calling thread, the context pushed for the call and popped
//! after: its waits on CUDA work become `cuStreamWaitEvent` on the GPU, its copies are
//! queued without waiting in between (`copy`), and a `CUevent` recorded after them marks
//! its host [`Event`] (so later CUDA batches wait on the GPU too). A batch that waits for
//! host work is deferred by its lane (`crate::backend::lane`): the caller never blocks.
//! The completer (`crate::backend::completer`) releases what a batch held once its event
//! has passed, then completes the host event. A copy call that fails part-way through a
//! batch still has the copies queued before it waited for (through the event, or by
//! synchronising the stream) before anything is released.
//!
//! NOTE: exercised against the fake driver in `crates/fake-cuda` (which checks contexts,
//! address ranges and stream order); it has not run on a real GPU yet.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use super::driver::{check, cu_device, primary_is_active, retain_primary, Context};
use super::event::CudaEvent;
use super::freer::Freer;
use crate::backend::completer::{Completer, Drain, Entry, Health};
use crate::backend::event::Progress;
use crate::backend::lane::{lane_of, submit_to, Lane, Refused, Submitted, LANES};

use cudarc::driver::sys::{self, CUresult};

use super::copy::CopyQueue;
pub use super::copy::{CopyPath, BATCHED_COPY_DRIVER, COPY_PATH_VAR};
use super::pinned::CudaPinnedAllocator;
use super::{status, CudaStatus};
use crate::backend::event::Event;
use crate::backend::event::Failure;
use crate::backend::fence::StreamHandle;
use crate::backend::interface::{Backend, CopyBatch, DeviceMemory, Direction};
use crate::backend::process::{backends_started_here, same_process};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::PinnedPool;

/// Most bytes the pinned pool keeps pinned (pinning is slow; so is holding too much).
const PINNED_POOL_CAP: usize = 8 << 30;

/// One GPU: its primary context, its streams (each with its submission order), and its
/// completer.
pub struct CudaDevice {
    ordinal: usize,
    pub(crate) context: Context,
    queue: Arc<CopyQueue>,
    lanes: [Arc<Lane>; LANES],
    freer: Arc<Freer>,
    health: Arc<Health>,
    /// What the lanes share: the completer that also returns lent memory.
    shared: Arc<Shared>,
    /// By GPU ordinal: whether this GPU reads that GPU's memory directly (peer access),
    /// settled the first time a copy from there is queued.
    peers: Box<[OnceLock<bool>]>,
}

/// What queuing a batch needs, shared by the GPU's lanes.
struct Shared {
    device: Device,
    context: Context,
    queue: Arc<CopyQueue>,
    completer: Completer,
    health: Arc<Health>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

/// The backend of `cuda:ordinal`, set up on first use.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static REGISTRY: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let name = Device::Cuda(ordinal);
    same_process(name)?;
    let (driver_version, gpus) = super::gpu_present(ordinal)?;
    let mut devices = REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let context = Context(retain_primary(cu_device(ordinal)?, name)?);
    let queue = {
        let _current = context.enter(name)?;
        Arc::new(CopyQueue::new(name, driver_version)?)
    };
    let health = Arc::new(Health::default());
    let shared = Arc::new(Shared {
        device: name,
        context,
        queue: queue.clone(),
        completer: Completer::spawn(
            name,
            move || {
                let _ = context.make_current(name);
            },
            health.clone(),
        )?,
        health: health.clone(),
    });
    let lane = |index: usize| {
        let shared = shared.clone();
        // SAFETY (of what the lane dispatches): lanes are reached only through
        // `Backend::submit`, whose contract covers every batch they queue.
        Lane::new(
            format!("cuda{ordinal}-lane{index}"),
            true,
            may_block,
            move |s| unsafe { dispatch(&shared, index, s) },
        )
    };
    let d = Arc::new(CudaDevice {
        ordinal,
        context,
        queue,
        lanes: [lane(0), lane(1)],
        freer: Arc::new(spawn_freer(name, context)?),
        health,
        shared,
        peers: (0..gpus).map(|_| OnceLock::new()).collect(),
    });
    devices.insert(ordinal, d.clone());
    backends_started_here();
    Ok(d)
}

/// Device memory from `cuMemAlloc`, handed to the GPU's freeing thread when dropped
/// (`cuMemFree` waits for the whole device: see [`super::cuda_freer`]).
struct Allocation {
    address: sys::CUdeviceptr,
    len: usize,
    context: Context,
    device: Device,
    freer: Arc<Freer>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let (address, context, device) = (self.address, self.context, self.device);
        self.freer.run(
            self.len,
            Box::new(move || {
                if let Ok(_current) = context.enter(device) {
                    // SAFETY: `address` came from `cuMemAlloc_v2` in this context and is
                    // freed once (its `Allocation` was dropped once); the engine drops an
                    // allocation only after every batch using it has completed, and nothing
                    // else holds it.
                    unsafe {
                        sys::cuMemFree_v2(address);
                    }
                }
            }),
        );
    }
}

/// The freeing thread of GPU `device`, whose context it makes current.
fn spawn_freer(device: Device, context: Context) -> Result<Freer> {
    Freer::spawn(device, move || {
        let _ = context.make_current(device);
    })
}

/// `CU_STREAM_LEGACY`: the legacy default stream of the current context.
const LEGACY_STREAM: usize = 1;

/// Hands `keep` (a lent pinned block coming back, whose consumer named no stream) to the
/// completer of every GPU whose primary context is active — the GPUs any library of the
/// process can have queued work on — behind an event on that GPU's legacy default stream;
/// the last of them to pass drops it. Work on another library's *non-blocking* streams is
/// not covered: see README, "What only a real GPU can show". When the GPUs cannot be
/// listed, `keep` is kept for good.
fn release_after_every_legacy_stream(keep: Arc<dyn Any + Send + Sync>) {
    let CudaStatus::Available { gpus, .. } = status() else {
        return; // no driver: no device work can read the block
    };
    for ordinal in 0..gpus.len() {
        let name = Device::Cuda(ordinal);
        let active = cu_device(ordinal).and_then(|dev| primary_is_active(dev, name));
        match active.and_then(|active| active.then(|| device(ordinal)).transpose()) {
            Ok(None) => {} // no context: no work
            Ok(Some(gpu)) => gpu.release_after_stream(None, Box::new(keep.clone())),
            Err(_) => return std::mem::forget(keep),
        }
    }
}

/// How long an allocation that found the device full waits for queued frees.
const FREES_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

impl Backend for CudaDevice {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// One process-wide pool: PORTABLE pinned memory serves every GPU.
    fn pinned_pool(&self) -> Result<Arc<PinnedPool>> {
        static POOL: OnceLock<Arc<PinnedPool>> = OnceLock::new();
        if let Some(p) = POOL.get() {
            return Ok(p.clone());
        }
        let allocator = CudaPinnedAllocator::new(
            self.context,
            Backend::device(self),
            self.freer.clone(),
            release_after_every_legacy_stream,
        );
        Ok(POOL
            .get_or_init(|| PinnedPool::new(Box::new(allocator), PINNED_POOL_CAP))
            .clone())
    }

    /// The driver copies ordinary host memory through its own small pinned buffers, one
    /// synchronous piece at a time: the engine's ring overlaps that with host copies.
    fn prefers_pinned_staging(&self) -> bool {
        true
    }

    /// A copy from another GPU's memory runs on this GPU's stream, while the producers of
    /// that memory ordered the source GPU's read stream: an event recorded there (in the
    /// source's context) is waited for on this GPU's stream for such copies.
    fn order_after_device(&self, source: Device) -> Result<()> {
        let Device::Cuda(from) = source else {
            return Ok(());
        };
        if from == self.ordinal {
            return Ok(());
        }
        let src = device(from)?;
        self.reach(&src);
        let lane = lane_of(Direction::DeviceToDevice);
        let mark = {
            let _current = src.context.enter(source)?;
            super::event::CudaEvent::record(src.context, source, src.queue.stream(lane))?
        };
        let here = Backend::device(self);
        let _current = self.context.enter(here)?;
        mark.wait_on(self.queue.stream(lane), here)
    }

    /// The stream this GPU's copies that read device memory (to the host, to a device) run
    /// on: a producer that makes it wait for its own stream (DLPack's
    /// `__dlpack__(stream=handle)`) needs no host synchronisation before tensorferry reads
    /// its tensors. Uploads run on a second stream, so that they overlap downloads.
    fn producer_stream(&self) -> Option<StreamHandle> {
        let read = self.queue.stream(lane_of(Direction::DeviceToHost));
        // SAFETY: one of this GPU's own streams, created in its primary context and kept
        // for the life of the process.
        Some(unsafe { StreamHandle::new(read as usize) })
    }

    /// Records an event on `stream` (in this GPU's context, whose default stream the
    /// handles 1 and 2 name) and makes each of this GPU's streams wait for it.
    ///
    /// Only the GPU is ordered: a copy that host threads make (from host memory, or through
    /// the staging ring from pageable memory) is not; callers that read host memory a
    /// producer's stream may still be writing synchronise with
    /// [`Backend::synchronize_stream`].
    fn order_after_stream(&self, stream: StreamHandle) -> Result<()> {
        let device = Backend::device(self);
        let _current = self.context.enter(device)?;
        // `StreamHandle::new`'s contract: a live stream usable with this GPU (the driver
        // does not validate every handle).
        let raw = stream.handle() as sys::CUstream;
        let mark = CudaEvent::record(self.context, device, raw)?;
        (0..LANES).try_for_each(|lane| mark.wait_on(self.queue.stream(lane), device))
    }

    /// Records an event on `stream` (the legacy default stream for `None`; in this GPU's
    /// context, whose default stream the handles 1 and 2 name) on the calling thread —
    /// recording never waits — and hands it with `keep` to the completer, which drops
    /// `keep` once the GPU has passed it. An event that cannot be recorded makes the
    /// completer synchronise the stream instead; when that fails too, `keep` is kept for
    /// good (memory the GPU may still read is never reused).
    fn release_after_stream(&self, stream: Option<StreamHandle>, keep: Box<dyn Any + Send>) {
        let (device, context) = (Backend::device(self), self.context);
        let raw = stream.map_or(LEGACY_STREAM, StreamHandle::handle);
        let fence = context
            .enter(device)
            .and_then(|_current| CudaEvent::record(context, device, raw as sys::CUstream));
        let drain: Drain = Box::new(move || {
            let what = "cuStreamSynchronize (a consumer's stream)";
            // SAFETY: a live stream of this process or a default-stream constant
            // (`StreamHandle::new`'s contract).
            unsafe { context.synchronize(device, raw, what) }
        });
        self.shared.completer.push(Entry {
            done: fence
                .ok()
                .map(|e| Arc::new(e) as Arc<dyn crate::backend::fence::Fence>),
            drain,
            keep,
            event: Event::pending(),
            outcome: Ok(()),
            device_waits: Vec::new(),
        });
    }

    /// Runs in this GPU's primary context: the default-stream handles (1 and 2) name that
    /// context's default stream, and with no context current the driver would refuse them.
    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        let (device, what) = (Backend::device(self), "cuStreamSynchronize");
        // SAFETY: a live stream of this process or a default-stream constant
        // (`StreamHandle::new`'s contract).
        unsafe { self.context.synchronize(device, stream.handle(), what) }
    }

    /// Asks the driver: host memory it knows (`cuMemHostAlloc`, `cuMemHostRegister`, by
    /// any library of the process) has the memory type HOST; pageable memory is an error.
    fn is_page_locked(&self, address: *const u8) -> bool {
        let Ok(_current) = self.context.enter(Backend::device(self)) else {
            return false;
        };
        let mut kind: std::ffi::c_uint = 0;
        // SAFETY: the driver is loaded and this GPU's context is current; the out pointer
        // is a live unsigned int, the size the memory-type attribute writes; an address
        // the driver does not know is an error code, nothing is read at it.
        let result = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut std::ffi::c_uint).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                address as sys::CUdeviceptr,
            )
        };
        result == sys::CUresult::CUDA_SUCCESS
            && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as std::ffi::c_uint
    }

    fn alloc(&self, len: usize) -> Result<DeviceMemory> {
        let name = Backend::device(self);
        self.health.check(name)?;
        if len == 0 {
            // SAFETY: zero bytes: nothing is ever read or written at the null address.
            return Ok(unsafe { DeviceMemory::new(name, std::ptr::null_mut(), 0, Box::new(())) });
        }
        let _current = self.context.enter(name)?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `address` is a live out pointer.
        let mut code = unsafe { sys::cuMemAlloc_v2(&mut address, len) };
        let mem_info = || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: live out pointers; the context is current.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
            (free, total)
        };
        // Frees still queued on the freeing thread that would make room: wait for them,
        // then once more (an allocation they cannot make room for fails at once).
        let queued = self.freer.pending_bytes();
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY
            && queued > 0
            && mem_info().0.saturating_add(queued) >= len
            && self.freer.wait_idle(FREES_PATIENCE)
        {
            // SAFETY: as above.
            code = unsafe { sys::cuMemAlloc_v2(&mut address, len) };
        }
        if code == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let (free, total) = mem_info();
            return Err(Error::OutOfMemory {
                device: name.to_string(),
                requested: len,
                free,
                total,
            });
        }
        check(code, name, "cuMemAlloc")?;
        let release = Allocation {
            address,
            len,
            context: self.context,
            device: name,
            freer: self.freer.clone(),
        };
        // SAFETY: `cuMemAlloc` succeeded: `address` is `len` bytes of this device's memory,
        // freed once, by `release`'s drop.
        Ok(unsafe { DeviceMemory::new(name, address as *mut u8, len, Box::new(release)) })
    }

    /// Queues the batch from the calling thread on its direction's stream (see the module
    /// documentation); never blocks on other work.
    unsafe fn queue(
        &self,
        batch: CopyBatch,
        keep: Box<dyn Any + Send>,
        event: &Event,
        ordered: bool,
    ) {
        submit_to(&self.lanes, batch, keep, event, 0, ordered);
    }
}

/// Whether queuing `batch` may block until its copies have run: a download may land in
/// pageable memory, which the driver copies synchronously (waiting for the stream). Which
/// memory is page-locked would take a driver call per destination; a download that lands
/// in pinned memory only takes the lane's thread for the microseconds of queuing it.
fn may_block(batch: &CopyBatch) -> bool {
    batch.direction == Direction::DeviceToHost
}

/// Queues one batch whose waits are all complete or queued on a GPU: its waits on the
/// GPU, its copies, and the event after them, handed to the completer; or refuses it (nothing
/// of it queued) when a wait failed or the context cannot be entered.
///
/// # Safety
/// As [`Backend::submit`]: the ops' ranges stay valid while `keep` lives, which the completer
/// drops only once the stream has passed the copies.
unsafe fn dispatch(shared: &Shared, lane: usize, submitted: Submitted) -> Option<Refused> {
    let Submitted {
        batch, keep, event, ..
    } = submitted;
    let device = shared.device;
    let refuse = |keep, event, failure| {
        Some(Refused {
            keep,
            event,
            outcome: Err(failure),
        })
    };
    let current = match shared
        .health
        .check(device)
        .and_then(|()| shared.context.enter(device))
    {
        Ok(c) => c,
        Err(e) => return refuse(keep, event, Failure::from_error(device, &e)),
    };
    let stream = shared.queue.stream(lane);
    let mut device_waits = Vec::new();
    for w in &batch.waits {
        match w.progress() {
            Progress::Done(Ok(())) => {}
            // Only waits are queued so far: nothing uses the batch's memory.
            Progress::Done(Err(f)) => return refuse(keep, event, f),
            Progress::Queued(mark) => {
                // Only CUDA work is queued behind a fence the lane counts as ready.
                let Some(mark) = mark.as_any().downcast_ref::<CudaEvent>() else {
                    let why = "internal error: a wait on another backend's fence";
                    return refuse(keep, event, Failure::new(device, why));
                };
                if let Err(e) = mark.wait_on(stream, device) {
                    return refuse(keep, event, Failure::from_error(device, &e));
                }
                device_waits.push(w.clone());
            }
            Progress::Pending => {
                let why = "internal error: a batch was queued before its waits";
                return refuse(keep, event, Failure::new(device, why));
            }
        }
    }
    // SAFETY: forwarded contract; the context is current.
    let queued = catch_unwind(AssertUnwindSafe(|| unsafe { shared.queue.enqueue(&batch) }));
    let mut outcome = match queued {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Failure::from_error(device, &e)),
        Err(panic) => Err(Failure::internal(device, &*panic)),
    };
    let done = match CudaEvent::record(shared.context, device, stream) {
        Ok(e) => Some(Arc::new(e) as Arc<dyn crate::backend::fence::Fence>),
        Err(e) => {
            outcome = outcome.and(Err(Failure::from_error(device, &e)));
            None
        }
    };
    if let (Ok(()), Some(done)) = (&outcome, &done) {
        // Later CUDA batches may now wait for this one on the GPU.
        event.set_mark(done.clone());
    }
    let (context, stream_id) = (shared.context, stream as usize);
    // SAFETY: one of this GPU's own streams, in its context, never destroyed.
    let drain: Drain =
        Box::new(move || unsafe { context.synchronize(device, stream_id, "cuStreamSynchronize") });
    shared.completer.push(Entry {
        done,
        drain,
        keep,
        event,
        outcome,
        device_waits,
    });
    drop(current);
    None
}

impl CudaDevice {
    /// Lets this GPU read `src`'s memory directly (peer access, one direction), once, where
    /// the two can reach each other: copies from there then go over the GPUs' link instead
    /// of being staged through the host by the driver. Whether they do; a refusal only
    /// leaves the copies staged.
    fn reach(&self, src: &CudaDevice) -> bool {
        let Some(slot) = self.peers.get(src.ordinal) else {
            return false;
        };
        *slot.get_or_init(|| {
            let here = Backend::device(self);
            let (mut dev, mut peer, mut can) = (0, 0, 0);
            // SAFETY: the driver is loaded and initialised (both GPUs are set up); the out
            // pointers are live locals of the right types.
            let reachable = unsafe {
                sys::cuDeviceGet(&mut dev, self.ordinal as i32) == CUresult::CUDA_SUCCESS
                    && sys::cuDeviceGet(&mut peer, src.ordinal as i32) == CUresult::CUDA_SUCCESS
                    && sys::cuDeviceCanAccessPeer(&mut can, dev, peer) == CUresult::CUDA_SUCCESS
            };
            if !reachable || can != 1 {
                return false;
            }
            let Ok(_current) = self.context.enter(here) else {
                return false;
            };
            // SAFETY: this GPU's context is current; `src.context` is the other GPU's
            // primary context, retained for the life of the process.
            let code = unsafe { sys::cuCtxEnablePeerAccess(src.context.0, 0) };
            // Another library of the process (PyTorch) may have enabled it already.
            matches!(
                code,
                CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            )
        })
    }

    /// The raw stream handle of `direction`'s copies (tests hold it with the fake
    /// driver's gate).
    #[cfg(test)]
    pub(crate) fn stream_of(&self, direction: Direction) -> usize {
        self.queue.stream(lane_of(direction)) as usize
    }

    /// The GPU's freeing thread, where calls that wait for the GPU run.
    #[cfg(test)]
    pub(crate) fn freer(&self) -> &Arc<Freer> {
        &self.freer
    }

    /// Why this GPU gave up batched copies, if a batched call failed.
    pub fn copy_fallback(&self) -> Option<String> {
        self.queue.path().1
    }

    /// How this GPU's batches are queued: batched where the driver allows it.
    pub fn copy_path(&self) -> CopyPath {
        self.queue.path().0
    }
}
