//! The ordering rules of the backends, proved with gates instead of sleeps: a stream is
//! held (the emulated device's worker, or the fake CUDA driver's stream through its test
//! hook), work is queued, and what may and may not have run is checked before the gate
//! opens. Every rule runs on the emulated device, and on CUDA when the fake driver is
//! loaded (its hooks are looked up by name; on a real driver the CUDA variants skip).
//! Fault injection (fake driver only) covers a copy call failing half-way through a batch
//! and CUDA event calls failing. Last, on CUDA: the context and capture mode a user's
//! thread had are what it has after tensorferry's calls.
//!
//! A module of its own at the crate's root, since it reaches into the backends and the
//! engine above them: no module below the engine imports it (`backend::serial` is the
//! lock the tests of both take).

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cuda;
use crate::backend::event::Progress;
use crate::backend::{
    backend_for, serial, Backend, CopyBatch, CopyOp, Direction, Event, StreamHandle,
};
use crate::device::Device;
use crate::transfer::{move_tensors, MoveOptions, Readable};
use crate::Tensor;

/// How long a negative check ("has not run") gives the work to run wrongly.
const SETTLE: Duration = Duration::from_millis(30);
/// Longer than any correct run takes.
const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `done` until it holds; fails saying `never` after [`PATIENCE`].
fn eventually(never: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "{never}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A held stream; opened when dropped (also when a test fails with it held).
struct Gate(Option<Box<dyn FnOnce()>>);

impl Gate {
    /// Opens the gate, as dropping it does.
    fn open(self) {}
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A fake-driver test hook, if the loaded driver is the fake.
fn hook<T: Copy>(name: &[u8]) -> Option<T> {
    use cudarc::driver::sys;
    if !matches!(cuda::status(), cuda::CudaStatus::Available { .. }) {
        return None;
    }
    // SAFETY: the driver library is loaded (status is Available); the symbol, when the
    // fake exports it, has the type the caller names (the fake's test hooks).
    unsafe { sys::culib().get::<T>(name).ok().map(|s| *s) }
}

type GateFn = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type OpenFn = unsafe extern "C" fn(*mut c_void) -> u32;
type FailFn = unsafe extern "C" fn(i32, u64) -> u32;
type ClearFn = unsafe extern "C" fn() -> u32;

/// Holds `device`'s stream for `direction`; `None` when it cannot be held (a real GPU).
fn gate(device: Device, direction: Direction) -> Option<Gate> {
    match device {
        Device::Emulated(i) => {
            let held = crate::backend::emulated::device(i).unwrap().gate(direction);
            Some(Gate(Some(Box::new(move || held.complete(Ok(()))))))
        }
        Device::Cuda(i) => gate_stream(cuda::device::device(i).ok()?.stream_of(direction)),
        Device::Cpu => None,
    }
}

/// Holds the CUDA stream `stream` of this process (the fake driver's gate); `None` on a
/// real GPU.
fn gate_stream(stream: usize) -> Option<Gate> {
    let (gate, open) = (
        hook::<GateFn>(b"tf_fake_cuda_gate\0")?,
        hook::<OpenFn>(b"tf_fake_cuda_open\0")?,
    );
    // SAFETY: a stream of this process (the fake checks it and gives null if not).
    let g = unsafe { gate(stream as *mut c_void) } as usize;
    assert_ne!(g, 0, "the fake refused to gate a stream of this process");
    // SAFETY: `g` came from the gate hook and is opened once.
    Some(Gate(Some(Box::new(move || unsafe {
        open(g as *mut c_void);
    }))))
}

/// A stream of another library (as PyTorch creates them: on the GPU's primary context),
/// destroyed when dropped.
struct ForeignStream {
    raw: cudarc::driver::sys::CUstream,
    context: cuda::driver::Context,
    device: Device,
}

impl ForeignStream {
    fn new(device: Device) -> ForeignStream {
        ForeignStream::with_flags(device, 0)
    }

    /// A stream created `CU_STREAM_NON_BLOCKING`, as PyTorch creates its side streams
    /// (`torch.cuda.Stream()`): the legacy default stream does not order after it.
    fn non_blocking(device: Device) -> ForeignStream {
        ForeignStream::with_flags(device, 1)
    }

    fn with_flags(device: Device, flags: std::ffi::c_uint) -> ForeignStream {
        use cudarc::driver::sys;
        let Device::Cuda(ordinal) = device else {
            unreachable!("a CUDA device")
        };
        let context = cuda::device::device(ordinal).unwrap().context;
        let _current = context.enter(device).unwrap();
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the GPU's context is current; `raw` is a live out pointer.
        assert_eq!(
            unsafe { sys::cuStreamCreate(&mut raw, flags) },
            sys::CUresult::CUDA_SUCCESS
        );
        ForeignStream {
            raw,
            context,
            device,
        }
    }

    /// The `words` u32s at device address `target`, read once the work queued on this
    /// stream so far has run (the consumer's own view of what its copies wrote).
    fn read_after(&self, target: usize, words: usize) -> Vec<u32> {
        use cudarc::driver::sys;
        let mut seen = vec![0u32; words];
        let _current = self.context.enter(self.device).unwrap();
        // SAFETY: the stream is live and its context current; `seen` holds `words` u32s;
        // the caller's `target` is at least that many bytes of the GPU's memory, alive
        // until this returns.
        let codes = unsafe {
            [
                sys::cuStreamSynchronize(self.raw),
                sys::cuMemcpyDtoH_v2(
                    seen.as_mut_ptr().cast(),
                    target as sys::CUdeviceptr,
                    std::mem::size_of_val(seen.as_slice()),
                ),
            ]
        };
        assert_eq!(codes, [sys::CUresult::CUDA_SUCCESS; 2]);
        seen
    }

    /// An event recorded on this stream now, checked not to pass while the upload the
    /// stream was ordered after is held.
    fn mark_held(&self) -> cuda::event::CudaEvent {
        let after = self.mark();
        std::thread::sleep(SETTLE);
        let ran = after.query().unwrap();
        assert!(!ran, "the consumer's stream ran past the held upload");
        after
    }

    /// This stream, as another library names it to tensorferry.
    fn stream(&self) -> StreamHandle {
        // SAFETY: a live stream of the GPU's primary context, alive while `self` is.
        unsafe { StreamHandle::new(self.raw as usize) }
    }

    /// An event recorded on this stream now: it passes once the work queued on the
    /// stream so far (and whatever that was made to wait for) has run.
    fn mark(&self) -> cuda::event::CudaEvent {
        let _current = self.context.enter(self.device).unwrap();
        cuda::event::CudaEvent::record(self.context, self.device, self.raw).unwrap()
    }
}

impl Drop for ForeignStream {
    fn drop(&mut self) {
        if let Ok(_current) = self.context.enter(self.device) {
            // SAFETY: created by `cuStreamCreate` in this context and destroyed once; the
            // driver defers the release of a stream with work still queued.
            unsafe { cudarc::driver::sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// Fault kinds of the fake's `tf_fake_cuda_fail_on_this_thread`.
const FAULT_COPY: i32 = 0;
const FAULT_RECORD: i32 = 1;
const FAULT_QUERY: i32 = 2;
const FAULT_PIN: i32 = 3;

/// Makes the `n`th calls of `kind` on this thread fail (fake driver); forgotten on drop.
struct Faults;

impl Faults {
    fn inject(kind: i32, calls: &[u64]) -> Option<Faults> {
        let fail = hook::<FailFn>(b"tf_fake_cuda_fail_on_this_thread\0")?;
        for &n in calls {
            // SAFETY: the hook takes plain integers.
            assert_eq!(unsafe { fail(kind, n) }, 0);
        }
        Some(Faults)
    }
}

impl Drop for Faults {
    fn drop(&mut self) {
        if let Some(clear) = hook::<ClearFn>(b"tf_fake_cuda_clear_faults\0") {
            // SAFETY: no arguments.
            unsafe { clear() };
        }
    }
}

/// The devices each rule runs on: the emulated device, and the fake driver's second GPU
/// when it is loaded (so that held streams disturb no other test's GPU more than needed).
fn devices() -> Vec<Device> {
    let mut out = vec![Device::Emulated(1)];
    if is_fake() {
        out.push(last_gpu());
    }
    out
}

/// Whether the loaded driver is the fake (its test hooks are there).
fn is_fake() -> bool {
    hook::<GateFn>(b"tf_fake_cuda_gate\0").is_some()
}

/// The one-at-a-time lock and the fake driver's last GPU, when the fake is loaded.
fn fake_gpu() -> Option<(std::sync::MutexGuard<'static, ()>, Device)> {
    let serial = serial();
    fake_driver(1).then(|| (serial, last_gpu()))
}

/// Whether the fake driver is loaded with at least `gpus` GPUs; says why not otherwise.
fn fake_driver(gpus: usize) -> bool {
    let ok = is_fake() && (gpus < 2 || last_gpu() != Device::Cuda(0));
    if !ok {
        eprintln!("skipped: needs the fake CUDA driver with {gpus} GPU(s)");
    }
    ok
}

fn last_gpu() -> Device {
    match cuda::status() {
        cuda::CudaStatus::Available { gpus, .. } => Device::Cuda(gpus.len() - 1),
        _ => unreachable!("checked by the caller"),
    }
}

/// A non-blocking copy with the default (`Auto`) staging: a small one takes the ring on CUDA.
fn auto_ring() -> MoveOptions {
    MoveOptions {
        copy: true,
        non_blocking: true,
        ..Default::default()
    }
}

/// A ring that holds a sample in one chunk.
const ONE_CHUNK_RING: crate::Staging = crate::Staging::Ring {
    chunk_bytes: 1 << 20,
    depth: 1,
};

/// Non-blocking copies straight on the streams (the rules here are the streams'; a small
/// non-blocking move would otherwise take the staging ring on CUDA), results on the host in
/// pinned memory: a copy from a GPU into pageable memory returns only once it is done,
/// which a stream held by the test would make wait forever.
fn non_blocking() -> MoveOptions {
    MoveOptions {
        copy: true,
        non_blocking: true,
        staging: crate::Staging::Off,
        pinned: true,
        ..Default::default()
    }
}

fn moved(t: &Tensor, to: Device, options: MoveOptions) -> Tensor {
    move_tensors(&[t], to, options).unwrap().remove(0)
}

fn move_one(t: &Tensor, to: Device) -> Tensor {
    moved(t, to, non_blocking())
}

/// `t` moved to `to` with the default options (blocking).
fn put(t: &Tensor, to: Device) -> Tensor {
    moved(t, to, MoveOptions::default())
}

fn sample(seed: u32) -> (Tensor, Vec<u32>) {
    let data: Vec<u32> = (0..4096).map(|x| x * 7 + seed).collect();
    (Tensor::from_slice(&data, &[4096]).unwrap(), data)
}

#[test]
fn a_download_waiting_for_an_upload_on_the_other_stream_runs_after_it() {
    let _serial = serial();
    for dev in devices() {
        let (host, data) = sample(1);
        let held = gate(dev, Direction::HostToDevice).unwrap();
        let there = move_one(&host, dev);
        let back = move_one(&there, Device::Cpu);
        if matches!(dev, Device::Cuda(_)) {
            // The upload is queued on the GPU: the download waits for it there, not on a
            // host thread.
            let written = there.storage().pending().unwrap();
            assert!(matches!(written.progress(), Progress::Queued(_)), "{dev}");
        }
        assert!(
            !back.wait_timeout(SETTLE).unwrap(),
            "{dev}: ran before the upload"
        );
        held.open();
        assert!(back.wait_timeout(PATIENCE).unwrap(), "{dev}");
        // Run before the upload, the download would have read what the allocation held.
        assert_eq!(back.to_vec::<u32>().unwrap(), data, "{dev}");
    }
}

#[test]
fn an_upload_and_a_download_overlap() {
    let _serial = serial();
    for dev in devices() {
        let (host, data) = sample(2);
        let resident = put(&host, dev);
        let held = gate(dev, Direction::HostToDevice).unwrap();
        let up = move_one(&host, dev);
        // Into pageable memory: nothing is pinned meanwhile (on a GPU, pinning memory is
        // a barrier between the work queued before and after it on every stream).
        let pageable = MoveOptions {
            pinned: false,
            ..non_blocking()
        };
        let down = moved(&resident, Device::Cpu, pageable);
        // On one stream the download would wait behind the held upload.
        assert!(down.wait_timeout(PATIENCE).unwrap(), "{dev}: download held");
        assert!(!up.is_ready(), "{dev}: the upload ran through its gate");
        assert_eq!(down.to_vec::<u32>().unwrap(), data);
        held.open();
        assert!(up.wait_timeout(PATIENCE).unwrap(), "{dev}");
    }
}

#[test]
fn a_dictionary_split_over_two_devices_moves_on_both_at_once() {
    let _serial = serial();
    let mut pairs = vec![(Device::Emulated(0), Device::Emulated(1))];
    if is_fake() && last_gpu() != Device::Cuda(0) {
        pairs.push((Device::Cuda(0), last_gpu()));
    }
    for (a, b) in pairs {
        let (host, data) = sample(3);
        let on_a = put(&host, a);
        let on_b = put(&host, b);
        let held = gate(a, Direction::DeviceToHost).unwrap();
        let back = move_tensors(&[&on_a, &on_b], Device::Cpu, non_blocking()).unwrap();
        assert!(
            back[1].wait_timeout(PATIENCE).unwrap(),
            "{b} waited for {a}"
        );
        assert!(!back[0].is_ready(), "{a} ran through its gate");
        held.open();
        assert_eq!(back[0].to_vec::<u32>().unwrap(), data);
        assert_eq!(back[1].to_vec::<u32>().unwrap(), data);
    }
}

/// What a batch holds, checking when it is dropped: after the gate opened (so after its
/// copies ran) and before its event completed.
struct Probe {
    opened: Arc<AtomicBool>,
    event: Event,
    dropped: Arc<AtomicBool>,
    in_order: Arc<AtomicBool>,
    _held: Box<dyn Any + Send>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        let ok = self.opened.load(Ordering::SeqCst) && !self.event.is_ready();
        self.in_order.store(ok, Ordering::SeqCst);
        self.dropped.store(true, Ordering::SeqCst);
    }
}

/// A copy of `len` bytes between `device` memory and `host` memory, in `direction`.
fn copy_op(direction: Direction, device: *const u8, host: *mut u8, len: usize) -> CopyOp {
    let device = device as *mut u8;
    let (src, dst) = match direction {
        Direction::DeviceToHost => (device, host),
        _ => (host, device),
    };
    CopyOp { src, dst, len }
}

/// A batch of `ops` in `direction` that waits for nothing.
fn batch(direction: Direction, ops: Vec<CopyOp>) -> CopyBatch {
    CopyBatch {
        direction,
        ops,
        waits: Vec::new(),
    }
}

/// Submits a batch of `n` copies of 4 KiB from `dev` to a pinned buffer (or from it, for
/// uploads) with its stream held, and checks that what it holds is released only after the
/// gate opens and before its event completes; the event's outcome.
fn held_batch(dev: Device, direction: Direction, n: usize, before: impl FnOnce()) -> Event {
    let backend = backend_for(dev).unwrap();
    let memory = backend.alloc(n * 4096).unwrap();
    let pool = backend.pinned_pool().unwrap();
    let buffer = pool.take(n * 4096).unwrap();
    let ops = (0..n)
        .map(|i| {
            let at = |p: *const u8| p.wrapping_add(i * 4096) as *mut u8;
            copy_op(direction, at(memory.as_ptr()), at(buffer.as_ptr()), 4096)
        })
        .collect();
    let event = Event::pending();
    let (opened, dropped, in_order) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let probe = Probe {
        opened: opened.clone(),
        event: event.clone(),
        dropped: dropped.clone(),
        in_order: in_order.clone(),
        _held: Box::new((memory, buffer)),
    };
    let held = gate(dev, direction).unwrap();
    before();
    let batch = batch(direction, ops);
    // SAFETY: the ops address `memory` and `buffer`, which the probe (the batch's keep)
    // holds until the event completes; nothing else touches them.
    unsafe { backend.submit(batch, Box::new(probe), &event) };
    assert!(
        !event.wait_timeout(SETTLE).unwrap_or(true),
        "{dev}: done through its gate"
    );
    assert!(
        !dropped.load(Ordering::SeqCst),
        "{dev}: released before its copies ran"
    );
    opened.store(true, Ordering::SeqCst);
    held.open();
    let _ = event.wait_timeout(PATIENCE);
    assert!(event.is_ready(), "{dev}");
    assert!(
        in_order.load(Ordering::SeqCst),
        "{dev}: released out of order"
    );
    event
}

#[test]
fn what_a_batch_holds_is_released_after_its_copies_and_before_its_event() {
    let _serial = serial();
    for dev in devices() {
        for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
            held_batch(dev, direction, 4, || {}).wait().unwrap();
        }
    }
}

#[test]
fn a_copy_call_failing_half_way_releases_nothing_before_the_queued_copies_ran() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let Device::Cuda(i) = dev else { unreachable!() };
    let batched = cuda::device::device(i).unwrap().copy_path() == cuda::device::CopyPath::Batched;
    let mut faults = None;
    // An upload: the fault is injected on this thread, which queues uploads (downloads are
    // queued on their lane's own thread).
    let event = held_batch(dev, Direction::HostToDevice, 8, || {
        // Batched: the batch call fails with half its copies queued, and the copies are
        // queued again one by one, the third of which fails. Per copy: the fourth fails.
        let calls: &[u64] = if batched { &[1, 4] } else { &[4] };
        faults = Faults::inject(FAULT_COPY, calls);
    });
    drop(faults);
    let err = event.wait().unwrap_err().to_string();
    assert!(
        err.contains(&dev.to_string()) && err.contains("of 8"),
        "{err}"
    );
}

#[test]
fn an_event_that_cannot_be_recorded_waits_for_the_stream_before_releasing() {
    let _serial = serial();
    let true = fake_driver(1) else { return };
    let mut faults = None;
    let event = held_batch(last_gpu(), Direction::HostToDevice, 3, || {
        faults = Faults::inject(FAULT_RECORD, &[1]);
    });
    drop(faults);
    let err = event.wait().unwrap_err().to_string();
    assert!(err.contains("cuEventRecord"), "{err}");
}

#[test]
fn a_failed_event_fails_every_batch_that_waited_for_it_on_the_gpu() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let (host, _) = sample(4);
    let held = gate(dev, Direction::HostToDevice).unwrap();
    let faults = Faults::inject(FAULT_QUERY, &[1]);
    let there = move_one(&host, dev);
    drop(faults);
    // Queued on the GPU behind the upload, before anyone knows it will fail.
    let back = move_one(&there, Device::Cpu);
    let copy = move_one(&there, dev);
    let later = move_one(&copy, Device::Cpu);
    held.open();
    for t in [&there, &back, &copy, &later] {
        let err = t.wait().unwrap_err().to_string();
        assert!(err.contains("cuEventQuery"), "{err}");
    }
}

#[test]
fn a_batch_waiting_for_host_work_holds_later_batches_of_its_stream_but_never_the_caller() {
    let _serial = serial();
    for dev in devices() {
        let (host, data) = sample(5);
        // A host result still being filled: its event is host work (the emulated device
        // has no GPU events), which no stream can wait for on its own.
        let source = Device::Emulated(0);
        let on_source = put(&host, source);
        let held = gate(source, Direction::DeviceToHost).unwrap();
        let pending = move_one(&on_source, Device::Cpu);
        // Both calls return with the gate still closed: the caller never waits.
        let first = move_one(&pending, dev);
        let second = move_one(&host, dev);
        assert!(
            !second.wait_timeout(SETTLE).unwrap(),
            "{dev}: a later batch overtook a deferred one on its stream"
        );
        assert!(!first.is_ready());
        held.open();
        for t in [&first, &second] {
            assert_eq!(put(t, Device::Cpu).to_vec::<u32>().unwrap(), data, "{dev}");
        }
    }
}

#[test]
fn a_consumer_stream_waits_for_a_pending_upload_on_the_gpu_and_the_caller_not_at_all() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let consumer = ForeignStream::new(dev);
    let (host, data) = sample(9);
    let held = gate(dev, Direction::HostToDevice).unwrap();
    let there = move_one(&host, dev);
    assert!(crate::transfer::order_stream_after(&there, consumer.stream()).unwrap());
    // The call returned with the upload still held: the consumer's next work waits on the GPU.
    assert!(!there.is_ready(), "the caller waited for the upload");
    let after = consumer.mark_held();
    held.open();
    eventually("the consumer's stream never ran", || after.query().unwrap());
    assert_eq!(move_one(&there, Device::Cpu).to_vec::<u32>().unwrap(), data);
}

#[test]
fn ordering_a_stream_after_a_ready_or_host_tensor_needs_no_gpu_call() {
    let _serial = serial();
    let (host, _) = sample(10);
    // SAFETY: host memory has no pending copy, so the handle is never used.
    let nowhere = unsafe { StreamHandle::new(usize::MAX) };
    assert!(crate::transfer::order_stream_after(&host, nowhere).unwrap());
}

#[test]
fn copies_wait_for_a_producer_stream_on_the_gpu_and_the_caller_not_at_all() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let producer = ForeignStream::new(dev);
    let (host, data) = sample(11);
    let there = move_one(&host, dev);
    there.wait().unwrap();
    // The producer's stream is busy (held): our copies must not run before it is done.
    let held = gate_stream(producer.raw as usize).unwrap();
    backend_for(dev)
        .unwrap()
        .order_after_stream(producer.stream())
        .unwrap();
    let back = move_one(&there, Device::Cpu);
    std::thread::sleep(SETTLE);
    assert!(
        !back.is_ready(),
        "the download ran before the producer's stream"
    );
    held.open();
    assert_eq!(back.to_vec::<u32>().unwrap(), data);
}

#[test]
fn a_copy_to_another_gpu_waits_for_the_producer_of_its_source() {
    let _serial = serial();
    let true = fake_driver(2) else { return };
    let (from, to) = (Device::Cuda(0), last_gpu());
    let producer = ForeignStream::new(from);
    let (host, data) = sample(12);
    let there = move_one(&host, from);
    there.wait().unwrap();
    // The producer of GPU 0's tensor is still writing it (its stream is held): the copy to
    // the other GPU, which runs on that GPU's stream, must not run before it either.
    let held = gate_stream(producer.raw as usize).unwrap();
    backend_for(Device::Cuda(0))
        .unwrap()
        .order_after_stream(producer.stream())
        .unwrap();
    let across = move_one(&there, to);
    std::thread::sleep(SETTLE);
    assert!(
        !across.is_ready(),
        "the copy to {to} ran before the producer's stream on {from}"
    );
    held.open();
    assert_eq!(
        move_one(&across, Device::Cpu).to_vec::<u32>().unwrap(),
        data
    );
}

#[test]
fn a_staged_upload_orders_a_consumer_on_the_gpu_once_its_last_chunk_is_queued() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let consumer = ForeignStream::new(dev);
    let (host, data) = sample(13);
    let held = gate(dev, Direction::HostToDevice).unwrap();
    // Through the ring (one chunk): a staging thread queues the copy, later than the call.
    let staged = MoveOptions {
        staging: ONE_CHUNK_RING,
        ..non_blocking()
    };
    let there = moved(&host, dev, staged);
    assert!(
        crate::transfer::wait_queued_timeout(&there, PATIENCE),
        "the staged upload was never queued on the GPU"
    );
    assert!(!there.is_ready(), "the held upload finished");
    assert!(
        crate::transfer::order_stream_after(&there, consumer.stream()).unwrap(),
        "a queued staged upload still needs a host wait"
    );
    consumer.mark_held();
    held.open();
    assert_eq!(move_one(&there, Device::Cpu).to_vec::<u32>().unwrap(), data);
}

#[test]
fn an_automatic_ring_that_gets_no_pinned_memory_copies_directly_an_explicit_one_fails() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let pool = backend_for(dev).unwrap().pinned_pool().unwrap();
    let (host, data) = sample(14);
    // Hold every cached buffer of the ring's size class, so that the ring must pin anew.
    let cached = pool.hold_cached(host.nbytes());
    let _refused = Faults::inject(FAULT_PIN, &[1, 2, 3]).unwrap();
    // A small non-blocking move: `Auto` takes the ring, which gets no pinned memory.
    let auto = auto_ring();
    let misses = pool.stats().misses;
    let there = moved(&host, dev, auto);
    let back = moved(&there, Device::Cpu, auto);
    assert_eq!(back.to_vec::<u32>().unwrap(), data);
    assert_eq!(
        pool.stats().misses,
        misses + 2,
        "each move asked for pinned memory"
    );
    let explicit = MoveOptions {
        staging: ONE_CHUNK_RING,
        ..auto
    };
    assert!(move_tensors(&[&host], dev, explicit).is_err());
    drop(cached);
}

#[test]
fn memory_freed_on_the_freeing_thread_is_there_for_the_next_allocation() {
    let _serial = serial();
    let true = fake_driver(1) else { return };
    let backend = backend_for(last_gpu()).unwrap();
    let free = match backend.alloc(1 << 50) {
        Err(crate::Error::OutOfMemory { free, .. }) => free,
        other => panic!("expected OutOfMemory, got {other:?}"),
    };
    // Over half the device, dropped and asked for again at once: its free is still queued
    // on the freeing thread, which the next allocation waits for instead of failing.
    let most = free / 2 + (1 << 20);
    for _ in 0..5 {
        drop(backend.alloc(most).unwrap());
    }
}

#[test]
fn automatic_rings_in_flight_are_bounded_and_the_rest_copy_directly() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let pool = backend_for(dev).unwrap().pinned_pool().unwrap();
    let (host, data) = sample(15);
    // Uploads held on the GPU: each ring's thread stays until its copy is done.
    let held = gate(dev, Direction::HostToDevice).unwrap();
    let before = pool.stats();
    let auto = auto_ring();
    let moved: Vec<Tensor> = (0..3 * crate::transfer::MAX_AUTO_RINGS)
        .map(|_| moved(&host, dev, auto))
        .collect();
    let after = pool.stats();
    let rings = (after.hits + after.misses) - (before.hits + before.misses);
    assert!(
        (1..=crate::transfer::MAX_AUTO_RINGS as u64).contains(&rings),
        "{rings} rings at once"
    );
    held.open();
    for t in &moved {
        assert_eq!(move_one(t, Device::Cpu).to_vec::<u32>().unwrap(), data);
    }
}

/// What a batch holds, panicking when it is released: a bug in a completion.
struct PanicsWhenReleased;

impl Drop for PanicsWhenReleased {
    fn drop(&mut self) {
        panic!("a completion fails");
    }
}

#[test]
fn a_panic_in_a_completion_fails_its_event_on_every_backend() {
    let _serial = serial();
    for dev in devices() {
        let backend = backend_for(dev).unwrap();
        let memory = backend.alloc(4096).unwrap();
        let pool = backend.pinned_pool().unwrap();
        let buffer = pool.take(4096).unwrap();
        let op = copy_op(
            Direction::HostToDevice,
            memory.as_ptr(),
            buffer.as_ptr(),
            4096,
        );
        let batch = batch(Direction::HostToDevice, vec![op]);
        let event = Event::pending();
        let keep = Box::new((memory, buffer, PanicsWhenReleased));
        // SAFETY: the op addresses `memory` and `buffer`, which the batch holds (`keep`)
        // until its copies are done; nothing else touches them.
        unsafe { backend.submit(batch, keep, &event) };
        let outcome = event.wait_timeout(PATIENCE);
        let err = match outcome {
            Err(e) => e.to_string(),
            Ok(done) => panic!(
                "{dev}: the event {}",
                if done { "succeeded" } else { "never completed" }
            ),
        };
        assert!(
            err.contains(&dev.to_string()) && err.contains("internal error: a completion fails"),
            "{dev}: {err}"
        );
        // The device goes on working.
        let (host, data) = sample(16);
        let back = move_one(&move_one(&host, dev), Device::Cpu);
        assert_eq!(back.to_vec::<u32>().unwrap(), data, "{dev}");
    }
}

// ------------------------------------------ scenarios the fake driver may end: in a child

/// Set in the child processes that run a scenario which corrupts a GPU's context for good
/// (a sticky fault) or that the fake driver aborts when the engine is wrong.
const CHILD_VAR: &str = "TENSORFERRY_ORDERING_CHILD";
/// What a child scenario prints once it has run to the end.
const CHILD_RAN: &str = "child scenario ran to the end";

fn in_child() -> bool {
    std::env::var(CHILD_VAR).as_deref() == Ok("1")
}

/// Runs the test `name` of this module alone in a child process (with `env` set: the fake
/// driver reads its settings once), and checks that it ran to the end (the fake driver
/// aborts a process that uses memory too early).
fn run_in_child(name: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            &format!("ordering_tests::{name}"),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains(CHILD_RAN),
        "child {name}:\n{text}"
    );
}

type FaultContextFn = unsafe extern "C" fn(i32, u32) -> u32;

#[test]
fn memory_a_gpu_may_still_use_is_kept_when_its_synchronisation_fails() {
    let true = fake_driver(2) else { return };
    run_in_child(
        "child_a_failed_synchronisation_keeps_the_batchs_memory",
        &[],
    );
}

#[test]
fn child_a_failed_synchronisation_keeps_the_batchs_memory() {
    if !in_child() {
        return;
    }
    let (faulty, healthy) = (last_gpu(), Device::Cuda(0));
    let Device::Cuda(ordinal) = faulty else {
        unreachable!()
    };
    // The pinned pool pins through the healthy GPU (the first to ask).
    let pool = backend_for(healthy).unwrap().pinned_pool().unwrap();
    // A download into a pinned buffer of the pool, held on the faulty GPU's stream…
    let backend = backend_for(faulty).unwrap();
    let memory = backend.alloc(1 << 16).unwrap();
    let buffer = pool.take(1 << 16).unwrap();
    let op = copy_op(
        Direction::DeviceToHost,
        memory.as_ptr(),
        buffer.as_ptr(),
        1 << 16,
    );
    let batch = batch(Direction::DeviceToHost, vec![op]);
    let held = gate(faulty, Direction::DeviceToHost).unwrap();
    let event = Event::pending();
    // SAFETY: the op addresses `memory` and `buffer`, which the batch holds until its copy
    // is done; nothing else touches them.
    unsafe { backend.submit(batch, Box::new((memory, buffer)), &event) };
    // …when a fault corrupts that GPU's context: its event can no longer be queried, nor its
    // stream synchronised, and the copy may still run (DMA in flight).
    let fault = hook::<FaultContextFn>(b"tf_fake_cuda_fault_context\0").unwrap();
    // SAFETY: plain integers: the GPU's ordinal and CUDA_ERROR_ILLEGAL_ADDRESS.
    assert_eq!(unsafe { fault(ordinal as i32, 700) }, 0);
    let err = event.wait_timeout(PATIENCE).unwrap_err().to_string();
    assert!(err.contains(&faulty.to_string()), "{err}");
    // The buffer must not serve the next download (on the healthy GPU) while the held copy
    // may still write it: the fake driver aborts the process if it does.
    let (host, data) = sample(17);
    let elsewhere = put(&host, healthy);
    let back = move_tensors(
        &[&elsewhere],
        Device::Cpu,
        MoveOptions {
            pinned: true,
            ..Default::default()
        },
    )
    .unwrap()
    .remove(0);
    assert_eq!(back.to_vec::<u32>().unwrap(), data);
    // The faulty GPU is marked failed: later work there fails at once, naming why.
    let refused = backend.alloc(64).unwrap_err().to_string();
    assert!(refused.contains(&faulty.to_string()), "{refused}");
    held.open();
    println!("{CHILD_RAN}");
}

type ForbidFn = unsafe extern "C" fn(i32) -> u32;
type RefusalsFn = unsafe extern "C" fn() -> u64;

/// Marks the calling thread as one that must never wait for a GPU (a Python thread holding
/// the GIL, in a DLPack deleter): the fake driver refuses and counts a call that would
/// synchronise implicitly there. Unmarked when dropped.
struct MustNotWait;

impl MustNotWait {
    fn mark() -> MustNotWait {
        let forbid = hook::<ForbidFn>(b"tf_fake_cuda_forbid_implicit_sync\0").unwrap();
        // SAFETY: a plain integer.
        assert_eq!(unsafe { forbid(1) }, 0);
        MustNotWait
    }

    /// The implicit synchronisations refused so far, on any thread.
    fn refusals() -> u64 {
        let count = hook::<RefusalsFn>(b"tf_fake_cuda_implicit_sync_refusals\0").unwrap();
        // SAFETY: no arguments.
        unsafe { count() }
    }
}

impl Drop for MustNotWait {
    fn drop(&mut self) {
        if let Some(forbid) = hook::<ForbidFn>(b"tf_fake_cuda_forbid_implicit_sync\0") {
            // SAFETY: a plain integer.
            unsafe { forbid(0) };
        }
    }
}

/// Releases `capsule` as its consumer does (`del t`), on a thread marked as one that must
/// not wait for the GPU, and checks that the release did not.
fn release_without_waiting(capsule: *mut crate::dlpack::DLManagedTensorVersioned) {
    let refusals = MustNotWait::refusals();
    {
        let _marked = MustNotWait::mark();
        // SAFETY: the capsule came from `export_versioned` and is released once, by its
        // consumer (DLPack's contract).
        unsafe { ((*capsule).deleter.unwrap())(capsule) };
    }
    assert_eq!(MustNotWait::refusals(), refusals, "the release waited");
}

#[test]
fn pinned_memory_is_unpinned_on_the_freeing_thread_never_where_it_is_dropped() {
    use crate::memory::pinned::{PinnedPool, MIN_CLASS};
    let _serial = serial();
    let true = fake_driver(1) else { return };
    let Device::Cuda(ordinal) = last_gpu() else {
        unreachable!()
    };
    // A pool that keeps one block: a second one given back is unpinned, and asking for
    // another size unpins the cached one first.
    let gpu = cuda::device::device(ordinal).unwrap();
    let allocator = cuda::pinned::CudaPinnedAllocator::new(
        gpu.context,
        Device::Cuda(ordinal),
        gpu.freer().clone(),
        drop,
    );
    let pool = PinnedPool::new(Box::new(allocator), MIN_CLASS);
    let (a, b) = (pool.take(MIN_CLASS).unwrap(), pool.take(MIN_CLASS).unwrap());
    let before = MustNotWait::refusals();
    {
        // cuMemFreeHost waits for the GPU: a thread that drops a pinned result (a Python
        // thread in a DLPack deleter) must not be the one that calls it.
        let _marked = MustNotWait::mark();
        drop(a);
        drop(b);
        drop(pool.take(2 * MIN_CLASS).unwrap());
    }
    assert_eq!(
        MustNotWait::refusals(),
        before,
        "pinned memory was unpinned on the thread that dropped it"
    );
}

#[test]
fn a_pinned_result_lent_through_dlpack_is_not_reused_while_its_consumer_may_read_it() {
    let true = fake_driver(1) else { return };
    // On the consumer's blocking stream, and on a non-blocking one.
    for child in [
        "child_a_lent_pinned_block_comes_back_behind_its_consumers_copy",
        "child_a_lent_pinned_block_comes_back_behind_a_non_blocking_consumers_copy",
    ] {
        run_in_child(child, &[]);
    }
}

#[test]
fn child_a_lent_pinned_block_comes_back_behind_a_non_blocking_consumers_copy() {
    if in_child() {
        lent_pinned_block_comes_back_behind_its_consumers_copy(ForeignStream::non_blocking);
    }
}

#[test]
fn child_a_lent_pinned_block_comes_back_behind_its_consumers_copy() {
    if in_child() {
        lent_pinned_block_comes_back_behind_its_consumers_copy(ForeignStream::new);
    }
}

/// A pinned result lent as host memory, copied to the GPU by its consumer on a stream
/// `consumer_stream` makes (held busy), then dropped: the pool must not hand the block out
/// again, nor a later download land in it, while that copy may still read it.
fn lent_pinned_block_comes_back_behind_its_consumers_copy(
    consumer_stream: fn(Device) -> ForeignStream,
) {
    use cudarc::driver::sys;
    let dev = last_gpu();
    let pinned = MoveOptions {
        pinned: true,
        ..Default::default()
    };
    let (host, data) = sample(18);
    let there = put(&host, dev);
    // A pinned result, handed to another library through DLPack (`torch.from_dlpack`)…
    let lent = moved(&there, Device::Cpu, pinned);
    lent.wait().unwrap();
    let (address, len) = (lent.data_ptr() as usize, lent.nbytes());
    let capsule = crate::dlpack::export_versioned(Readable::wait(&lent).unwrap());
    drop(lent);
    // …which copies it to the GPU on its own stream (`t.cuda(non_blocking=True)`), a stream
    // still busy with earlier work (held here)…
    let consumer = consumer_stream(dev);
    let target = backend_for(dev).unwrap().alloc(len).unwrap();
    let held = gate_stream(consumer.raw as usize).unwrap();
    {
        let _current = consumer.context.enter(dev).unwrap();
        // SAFETY: `address` is the lent block's `len` bytes, alive while the capsule is,
        // pinned, and only read; `target` is `len` bytes of the GPU's memory, which the
        // test holds until the copy is done; the stream is the consumer's, in this context.
        let code = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                target.as_ptr() as sys::CUdeviceptr,
                address as *const c_void,
                len,
                consumer.raw,
            )
        };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
    // …and releases it at once (`del t`), on a thread that must not wait for the GPU.
    release_without_waiting(capsule);
    // The next pinned download of that size must not land in the lent block while the
    // consumer's copy may still read it: the fake driver aborts the process if it does.
    let (other, other_data) = sample(19);
    let next_source = put(&other, dev);
    // A buffer of that size from the pool, filled by the host (a staging buffer), must not
    // be the lent block either: the fake driver aborts when bytes a queued copy still has
    // to read change. (Pinning a new block orders later copies after the held stream, as
    // `cuMemHostAlloc` does: the blocking upload above comes first.)
    let pool = backend_for(dev).unwrap().pinned_pool().unwrap();
    let reused = pool.take(len).unwrap();
    // SAFETY: the pool's buffer holds at least `len` bytes, owned by this test.
    unsafe { std::ptr::write_bytes(reused.as_ptr(), 0xAB, len) };
    let next = move_tensors(
        &[&next_source],
        Device::Cpu,
        MoveOptions {
            non_blocking: true,
            ..pinned
        },
    )
    .unwrap()
    .remove(0);
    held.open();
    assert_eq!(next.to_vec::<u32>().unwrap(), other_data);
    // The consumer read what it was lent.
    let seen = consumer.read_after(target.as_ptr() as usize, data.len());
    assert_eq!(seen, data, "the consumer read another download's bytes");
    drop(reused);
    println!("{CHILD_RAN}");
}

#[test]
fn device_memory_lent_through_dlpack_is_freed_only_after_its_consumers_stream_work() {
    let true = fake_driver(1) else { return };
    // `cuMemFree` waits for the whole context on a real GPU, which hides a missing fence:
    // the fake is told not to, so that only the fence keeps the memory alive.
    run_in_child(
        "child_a_lent_device_buffer_is_freed_behind_its_consumers_stream",
        &[("TF_FAKE_CUDA_LENIENT", "implicit-sync")],
    );
}

/// Free device memory of `dev` as the driver reports it.
fn free_memory(dev: Device) -> usize {
    use cudarc::driver::sys;
    let Device::Cuda(ordinal) = dev else {
        unreachable!("a CUDA device")
    };
    let gpu = cuda::device::device(ordinal).unwrap();
    let _current = gpu.context.enter(dev).unwrap();
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the GPU's context is current; live out pointers.
    let code = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    free
}

#[test]
fn child_a_lent_device_buffer_is_freed_behind_its_consumers_stream() {
    use cudarc::driver::sys;
    if !in_child() {
        return;
    }
    let dev = last_gpu();
    let Device::Cuda(ordinal) = dev else {
        unreachable!()
    };
    let (host, data) = sample(20);
    let lent = move_one(&host, dev);
    lent.wait().unwrap();
    let (address, len) = (lent.data_ptr() as usize, lent.nbytes());
    // A device result handed to another library through DLPack for its stream
    // (`torch.from_dlpack(t)` passes `stream=`), a stream still busy (held here)…
    let consumer = ForeignStream::new(dev);
    let target = backend_for(dev).unwrap().alloc(len).unwrap();
    let held = gate_stream(consumer.raw as usize).unwrap();
    let ready = Readable::ordered(&lent, consumer.stream())
        .unwrap()
        .unwrap();
    let capsule = crate::dlpack::export_versioned(ready);
    drop(lent);
    // …which copies out of it on that stream…
    {
        let _current = consumer.context.enter(dev).unwrap();
        // SAFETY: `address` is the lent memory's `len` bytes, alive while the capsule is;
        // `target` is `len` bytes of the GPU's memory, held until the copy is done; the
        // stream is the consumer's, in this context.
        let code = unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                target.as_ptr() as sys::CUdeviceptr,
                address as sys::CUdeviceptr,
                len,
                consumer.raw,
            )
        };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
    let before = free_memory(dev);
    // …and releases it at once, on a thread that must not wait for the GPU.
    release_without_waiting(capsule);
    // Whatever frees were handed to the freeing thread have run: freeing the lent memory
    // while the consumer's copy is queued aborts the process (a use after free).
    let gpu = cuda::device::device(ordinal).unwrap();
    assert!(gpu.freer().wait_idle(PATIENCE));
    std::thread::sleep(SETTLE);
    assert!(gpu.freer().wait_idle(PATIENCE));
    assert_eq!(
        free_memory(dev),
        before,
        "freed while the consumer may read it"
    );
    held.open();
    // Once the consumer's copy has run, the memory is freed (not leaked).
    eventually("the lent memory was never freed", || {
        free_memory(dev) >= before + len
    });
    let seen = consumer.read_after(target.as_ptr() as usize, data.len());
    assert_eq!(seen, data, "the consumer read freed memory");
    println!("{CHILD_RAN}");
}

type PeerCopiesFn = unsafe extern "C" fn(*mut u64, *mut u64) -> u32;

/// The fake driver's copies between GPUs so far: (direct, staged through the host).
fn peer_copies() -> (u64, u64) {
    let count = hook::<PeerCopiesFn>(b"tf_fake_cuda_peer_copies\0").unwrap();
    let (mut direct, mut staged) = (0, 0);
    // SAFETY: live out pointers.
    assert_eq!(unsafe { count(&mut direct, &mut staged) }, 0);
    (direct, staged)
}

/// Moves a tensor from GPU 0 to the last GPU; the copies between GPUs it made, direct and
/// staged.
fn move_across() -> (u64, u64) {
    let (from, to) = (Device::Cuda(0), last_gpu());
    let (host, data) = sample(20);
    let there = put(&host, from);
    let before = peer_copies();
    let across = put(&there, to);
    let after = peer_copies();
    assert_eq!(across.device(), to);
    assert_eq!(
        move_one(&across, Device::Cpu).to_vec::<u32>().unwrap(),
        data
    );
    (after.0 - before.0, after.1 - before.1)
}

#[test]
fn a_copy_between_gpus_goes_direct_where_they_can_reach_each_other() {
    let _serial = serial();
    let true = fake_driver(2) else { return };
    let (direct, staged) = move_across();
    assert!(
        direct > 0 && staged == 0,
        "{direct} direct, {staged} staged through the host"
    );
    run_in_child(
        "child_gpus_that_cannot_reach_each_other_copy_through_the_host",
        &[("TF_FAKE_CUDA_PEER", "0")],
    );
}

#[test]
fn child_gpus_that_cannot_reach_each_other_copy_through_the_host() {
    if !in_child() {
        return;
    }
    let (direct, staged) = move_across();
    assert!(
        direct == 0 && staged > 0,
        "{direct} direct, {staged} staged through the host"
    );
    println!("{CHILD_RAN}");
}

#[test]
fn tensorferry_never_breaks_a_graph_another_thread_is_capturing() {
    use cudarc::driver::sys;
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let captured = ForeignStream::new(dev);
    // This thread captures a graph in the global mode (PyTorch's default for CUDA graphs):
    // a potentially unsafe call (allocating or freeing memory) on any thread still in the
    // global mode would fail and invalidate it.
    {
        let _current = captured.context.enter(dev).unwrap();
        // SAFETY: a live stream of this context; the mode is a valid enum value.
        let code = unsafe {
            sys::cuStreamBeginCapture_v2(
                captured.raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
    // Meanwhile another thread, in the global mode too, moves tensors both ways (device
    // and pinned allocations, the staging ring) and drops them (frees on the freeing
    // thread, which it waits for).
    std::thread::spawn(move || {
        let (host, data) = sample(23);
        let auto = MoveOptions {
            non_blocking: true,
            ..Default::default()
        };
        let there = moved(&host, dev, auto);
        let pinned = MoveOptions {
            pinned: true,
            ..auto
        };
        let back = moved(&there, Device::Cpu, pinned);
        assert_eq!(back.to_vec::<u32>().unwrap(), data);
        drop((there, back));
        let Device::Cuda(i) = dev else { unreachable!() };
        let freer = cuda::device::device(i).unwrap().freer().clone();
        assert!(freer.wait_idle(PATIENCE));
    })
    .join()
    .unwrap();
    let _current = captured.context.enter(dev).unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing, begun on this thread; a live out pointer.
    let code = unsafe { sys::cuStreamEndCapture(captured.raw, &mut graph) };
    assert_eq!(
        code,
        sys::CUresult::CUDA_SUCCESS,
        "tensorferry broke the capture"
    );
}

#[test]
fn a_dlpack_export_hands_out_memory_only_once_the_copy_filling_it_is_done() {
    let _serial = serial();
    for dev in devices() {
        let (host, data) = sample(20);
        let resident = put(&host, dev);
        let held = gate(dev, Direction::DeviceToHost).unwrap();
        let back = move_one(&resident, Device::Cpu);
        let (tx, rx) = std::sync::mpsc::channel();
        let exporting = back.clone();
        let exporter = std::thread::spawn(move || {
            let p = crate::dlpack::export_versioned(Readable::wait(&exporting).unwrap());
            tx.send(()).unwrap();
            p as usize
        });
        // The consumer (a CPU library here) reads the memory as soon as it has it.
        assert!(
            rx.recv_timeout(SETTLE).is_err(),
            "{dev}: exported while the download was still held"
        );
        held.open();
        let p = exporter.join().unwrap() as *mut crate::dlpack::DLManagedTensorVersioned;
        // SAFETY: `p` was exported above and is handed over whole.
        let managed = unsafe { crate::dlpack::ManagedTensor::versioned(p) };
        // SAFETY: a managed tensor of our own producer.
        let seen = unsafe { crate::dlpack::import(managed, |m| Box::new(m)) }.unwrap();
        assert_eq!(seen.to_vec::<u32>().unwrap(), data, "{dev}");
    }
}

#[test]
fn a_pageable_download_held_by_its_stream_blocks_no_other_submission() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let (host, data) = sample(21);
    let resident = put(&host, dev);
    let held = gate(dev, Direction::DeviceToHost).unwrap();
    // A download into pageable memory, which the driver copies synchronously: the call that
    // queues it returns only once the held stream has run it.
    let pageable = MoveOptions {
        pinned: false,
        ..non_blocking()
    };
    let source = resident.clone();
    let slow = std::thread::spawn(move || moved(&source, Device::Cpu, pageable));
    std::thread::sleep(SETTLE);
    // Meanwhile, non-blocking work on both of the GPU's streams is queued at once, and the
    // upload (on the stream that is not held) runs.
    let (tx, rx) = std::sync::mpsc::channel();
    let (source, upload) = (resident.clone(), host.clone());
    let others = std::thread::spawn(move || {
        let down = move_one(&source, Device::Cpu);
        let up = move_one(&upload, dev);
        tx.send(()).unwrap();
        (down, up)
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(2)).is_ok(),
        "queuing work waited for a pageable download held by its stream"
    );
    let (down, up) = others.join().unwrap();
    assert!(up.wait_timeout(PATIENCE).unwrap(), "the upload was held");
    assert!(!down.is_ready(), "the download ran through its gate");
    held.open();
    assert_eq!(slow.join().unwrap().to_vec::<u32>().unwrap(), data);
    assert_eq!(down.to_vec::<u32>().unwrap(), data);
}

#[test]
fn a_queued_copy_hands_back_a_fence_that_polls_and_waits_with_no_driver_type() {
    let Some((_serial, dev)) = fake_gpu() else {
        return;
    };
    let (host, data) = sample(22);
    let held = gate(dev, Direction::HostToDevice).unwrap();
    let there = move_one(&host, dev);
    let Progress::Queued(fence) = there.storage().pending().unwrap().progress() else {
        panic!("the held upload is not queued on {dev}");
    };
    assert_eq!(fence.device(), dev);
    assert!(!fence.poll().unwrap(), "passed through its gate");
    let waiting = std::thread::spawn({
        let fence = fence.clone();
        move || fence.wait()
    });
    std::thread::sleep(SETTLE);
    assert!(
        !waiting.is_finished(),
        "the wait returned with the upload held"
    );
    held.open();
    waiting.join().unwrap().unwrap();
    assert!(fence.poll().unwrap());
    assert_eq!(move_one(&there, Device::Cpu).to_vec::<u32>().unwrap(), data);
}

#[test]
fn a_device_without_foreign_streams_refuses_to_order_after_one() {
    let emu = backend_for(Device::Emulated(0)).unwrap();
    // SAFETY: the emulated device never uses the handle.
    let stream = unsafe { StreamHandle::new(1) };
    let err = emu.order_after_stream(stream).unwrap_err().to_string();
    assert!(err.contains("emu:0") && err.contains("no streams"), "{err}");
    assert!(emu.synchronize_stream(stream).is_err());
    assert!(emu.producer_stream().is_none());
}

// Contexts and capture modes: what tensorferry's driver calls leave on a user's thread.

fn current() -> cudarc::driver::sys::CUcontext {
    let mut ctx: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is loaded (the caller checked); live out pointer.
    unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
    ctx
}

#[test]
fn a_users_thread_keeps_its_current_context() {
    if cuda::device::device(0).is_err() {
        eprintln!("skipped: no CUDA driver");
        return;
    }
    // A thread with no context, as PyTorch leaves its workers until they touch a GPU.
    std::thread::spawn(|| {
        assert!(current().is_null());
        let host = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
        let there = host.to(Device::Cuda(0), false).unwrap();
        let back = there.to(Device::Cpu, false).unwrap();
        drop(there);
        assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        assert!(current().is_null(), "tensorferry left a context current");
    })
    .join()
    .unwrap();
}

#[test]
fn the_gpu_of_a_foreign_pointer_is_found_from_a_thread_with_no_context() {
    let cuda::CudaStatus::Available { gpus, .. } = cuda::status() else {
        return eprintln!("skipped: no CUDA driver");
    };
    let last = gpus.len() - 1;
    let memory = cuda::device::device(last).unwrap().alloc(256).unwrap();
    let address = memory.as_ptr() as usize;
    // A thread with no context current, as a Python thread importing an array through
    // the CUDA Array Interface may be.
    std::thread::spawn(move || {
        assert!(current().is_null());
        assert_eq!(cuda::driver::pointer_device(address).unwrap(), last);
        assert!(current().is_null(), "tensorferry left a context current");
    })
    .join()
    .unwrap();
}

#[test]
fn driver_calls_run_relaxed_and_leave_the_threads_capture_mode_as_it_was() {
    const CU_STREAM_CAPTURE_MODE_GLOBAL: std::ffi::c_uint = 0;
    const CU_STREAM_CAPTURE_MODE_RELAXED: std::ffi::c_uint = cuda::driver::RELAXED;
    let Ok(gpu) = cuda::device::device(0) else {
        eprintln!("skipped: no CUDA driver");
        return;
    };
    std::thread::spawn(move || {
        // A user's thread in the default (global) mode, as PyTorch's graph capture uses.
        assert_eq!(
            cuda::driver::exchange_capture_mode(CU_STREAM_CAPTURE_MODE_GLOBAL),
            Some(CU_STREAM_CAPTURE_MODE_GLOBAL)
        );
        {
            let _current = gpu.context.enter(Device::Cuda(0)).unwrap();
            let inside = cuda::driver::exchange_capture_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
            assert_eq!(inside, Some(CU_STREAM_CAPTURE_MODE_RELAXED));
        }
        let host = Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        let back = host
            .to(Device::Cuda(0), false)
            .unwrap()
            .to(Device::Cpu, false)
            .unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 2.0]);
        assert_eq!(
            cuda::driver::exchange_capture_mode(CU_STREAM_CAPTURE_MODE_GLOBAL),
            Some(CU_STREAM_CAPTURE_MODE_GLOBAL),
            "tensorferry left the thread's capture mode changed"
        );
    })
    .join()
    .unwrap();
}
