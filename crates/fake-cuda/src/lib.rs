//! A fake CUDA driver: the subset of `libcuda`'s driver API that tensorferry calls,
//! implemented on host memory, so that the CUDA backend's code runs in CI on machines
//! without a GPU.
//!
//! It is stricter than a real driver where that finds bugs, and no faster:
//! - calls before `cuInit`, or without a current context, fail as the driver's do;
//! - every device range a copy names must lie inside one live `cuMemAlloc` allocation, and
//!   no host range may overlap device memory — checked when the copy is queued *and* when
//!   it runs, so memory freed while a copy is still queued is caught (as a sticky
//!   `CUDA_ERROR_ILLEGAL_ADDRESS` that fails every later call, like a real fault);
//! - asynchronous copies run later, on a thread per stream, after a delay
//!   (`TF_FAKE_CUDA_DELAY_US`, default 20 µs per copy): reading a destination before
//!   synchronising reads stale bytes, as on a GPU;
//! - `cuMemcpyBatchAsync` exists only when the configured driver version is 12.8 or newer;
//!   calling it on an older "driver" is fatal (sticky error), as a missing entry point is.
//!
//! Configuration, read once: `TF_FAKE_CUDA_DEVICES` (default 1), `TF_FAKE_CUDA_VERSION`
//! (default 12080), `TF_FAKE_CUDA_CAPACITY` (bytes per device, default 1 GiB),
//! `TF_FAKE_CUDA_DELAY_US`, `TF_FAKE_CUDA_STUB=1` (behave as the toolkit's stub library:
//! `cuInit` fails with `CUDA_ERROR_STUB_LIBRARY`), and for fault injection `TF_FAKE_CUDA_FAIL_COPY`: a list of
//! call numbers (`3` or `3,14`, counted from 1 over every copy call of the process:
//! `cuMemcpy*`, `cuMemcpy*Async`, `cuMemcpyBatchAsync`) that fail with
//! `CUDA_ERROR_UNKNOWN`, not sticky. A failing `cuMemcpyBatchAsync` first queues the
//! first half of its copies and reports the middle one as `fail_idx`, as a driver failing
//! part-way through a batch may.
//!
//! Test hooks (exported C functions, looked up by name; not part of any CUDA API):
//! - `tf_fake_cuda_gate(stream)` holds a stream: nothing queued on it after the call runs
//!   until `tf_fake_cuda_open(gate)` releases it (ordering tests without sleeps);
//! - `tf_fake_cuda_fail_on_this_thread(kind, n)`: the `n`th call of `kind` made on the
//!   calling thread from now fails with `CUDA_ERROR_UNKNOWN` (not sticky). Kinds:
//!   [`FAULT_COPY`] (any copy call), [`FAULT_RECORD`] (`cuEventRecord`), [`FAULT_QUERY`]
//!   (the `n`th event recorded on this thread: its queries and synchronisations fail),
//!   [`FAULT_PIN`] (`cuMemHostAlloc`: pinned memory refused).
//!   Counted per thread, so tests running in parallel in one process do not disturb each
//!   other; `tf_fake_cuda_clear_faults()` forgets this thread's settings.
//!
//! Not a model of performance, of the legacy default stream's implicit synchronisation
//! beyond "the null stream runs copies at once", or of anything tensorferry does not call.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::{BTreeMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

type CUresult = c_uint;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const STUB_LIBRARY: CUresult = 34;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_READY: CUresult = 600;
const ILLEGAL_ADDRESS: CUresult = 700;
const UNKNOWN: CUresult = 999;

/// Device allocations are aligned like the driver's.
const DEVICE_ALIGNMENT: usize = 256;

struct Config {
    devices: usize,
    version: c_int,
    capacity: usize,
    delay: Duration,
    /// Copy calls (1-based) that fail.
    fail_copy: Vec<u64>,
    /// Behave as the CUDA toolkit's stub library: `cuInit` fails with
    /// `CUDA_ERROR_STUB_LIBRARY`.
    stub: bool,
}

fn config() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(|| {
        let var = |k: &str, d: u64| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        Config {
            devices: var("TF_FAKE_CUDA_DEVICES", 1) as usize,
            version: var("TF_FAKE_CUDA_VERSION", 12080) as c_int,
            capacity: var("TF_FAKE_CUDA_CAPACITY", 1 << 30) as usize,
            delay: Duration::from_micros(var("TF_FAKE_CUDA_DELAY_US", 20)),
            fail_copy: fail_list(&std::env::var("TF_FAKE_CUDA_FAIL_COPY").unwrap_or_default()),
            stub: var("TF_FAKE_CUDA_STUB", 0) == 1,
        }
    })
}

/// The call numbers of `TF_FAKE_CUDA_FAIL_COPY` (`"3,14"`); what does not parse is left out.
fn fail_list(text: &str) -> Vec<u64> {
    text.split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

/// Counts a copy call; true when it is one that `TF_FAKE_CUDA_FAIL_COPY` (or this thread's
/// test hook) makes fail.
fn injected_copy_failure() -> bool {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let n = CALLS.fetch_add(1, Ordering::SeqCst) + 1;
    let from_hook = thread_fault(FAULT_COPY);
    config().fail_copy.contains(&n) || from_hook
}

/// Fault kind of [`tf_fake_cuda_fail_on_this_thread`]: copy calls.
pub const FAULT_COPY: c_int = 0;
/// Fault kind: `cuEventRecord` calls.
pub const FAULT_RECORD: c_int = 1;
/// Fault kind: events recorded on this thread whose queries and synchronisations fail.
pub const FAULT_QUERY: c_int = 2;
/// Fault kind: `cuMemHostAlloc` calls (pinned memory refused: `CUDA_ERROR_OUT_OF_MEMORY`).
pub const FAULT_PIN: c_int = 3;

#[derive(Default)]
struct Faults {
    /// Per kind: calls counted since the kind was last set, and the call numbers to fail.
    calls: [u64; 4],
    fail: [Vec<u64>; 4],
}

thread_local! {
    static FAULTS: std::cell::RefCell<Faults> = std::cell::RefCell::new(Faults::default());
}

/// Counts a call of `kind` on this thread; true when the test hook makes it fail.
fn thread_fault(kind: c_int) -> bool {
    FAULTS.with(|f| {
        let mut f = f.borrow_mut();
        let k = kind as usize;
        if f.fail[k].is_empty() {
            return false;
        }
        f.calls[k] += 1;
        let n = f.calls[k];
        f.fail[k].contains(&n)
    })
}

/// Test hook: the `n`th call of `kind` (counted from 1, from this call on, on the calling
/// thread) fails. Calling it again for the same kind adds a call number, counted from the
/// first setting.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_fail_on_this_thread(kind: c_int, n: u64) -> CUresult {
    if !(FAULT_COPY..=FAULT_PIN).contains(&kind) || n == 0 {
        return INVALID_VALUE;
    }
    FAULTS.with(|f| f.borrow_mut().fail[kind as usize].push(n));
    SUCCESS
}

/// Test hook: forgets the calling thread's injected faults.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_clear_faults() -> CUresult {
    FAULTS.with(|f| *f.borrow_mut() = Faults::default());
    SUCCESS
}

struct DeviceAlloc {
    len: usize,
    device: usize,
    _backing: Vec<u8>,
}

#[derive(Default)]
struct State {
    initialised: bool,
    /// Live device allocations by start address.
    device: BTreeMap<usize, DeviceAlloc>,
    used: BTreeMap<usize, usize>,
    /// Pinned host memory: from `cuMemHostAlloc` (owned) or registered.
    pinned: BTreeMap<usize, (usize, Option<Vec<u8>>)>,
    streams: HashSet<usize>,
    sticky: Option<CUresult>,
}

fn state() -> MutexGuard<'static, State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// The current context: device ordinal + 1, or 0 for none.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    /// The thread's stream-capture mode (`cuThreadExchangeStreamCaptureMode`).
    static CAPTURE_MODE: Cell<c_uint> = const { Cell::new(0) };
    /// Contexts under the current one, pushed by `cuCtxPushCurrent_v2`.
    static STACK: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn context_handle(ordinal: usize) -> *mut c_void {
    (0x1000 * (ordinal + 1)) as *mut c_void
}

/// The checks every call starts with: the sticky error, `cuInit`, and (when `needs_ctx`)
/// a current context, whose device ordinal is returned.
fn enter(s: &State, needs_ctx: bool) -> Result<usize, CUresult> {
    if let Some(e) = s.sticky {
        return Err(e);
    }
    if !s.initialised {
        return Err(NOT_INITIALIZED);
    }
    let current = CURRENT.with(Cell::get);
    if needs_ctx && current == 0 {
        return Err(INVALID_CONTEXT);
    }
    Ok(current.saturating_sub(1))
}

macro_rules! try_cu {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Device,
    Host,
    /// Either (batched copies infer it from the address).
    Any,
}

/// Checks that `[addr, addr + len)` is inside one live allocation (device side), or
/// overlaps no device memory (host side).
fn check_range(s: &State, addr: usize, len: usize, side: Side) -> Result<(), CUresult> {
    if len == 0 {
        return Ok(());
    }
    let end = addr.checked_add(len).ok_or(INVALID_VALUE)?;
    let containing = s
        .device
        .range(..=addr)
        .next_back()
        .filter(|(&start, a)| addr < start + a.len.max(1));
    let overlaps_device = containing.is_some() || s.device.range(addr..end).next().is_some();
    match (side, containing) {
        (Side::Device, Some((&start, a))) | (Side::Any, Some((&start, a))) => {
            if end <= start + a.len {
                Ok(())
            } else {
                Err(INVALID_VALUE)
            }
        }
        (Side::Device, None) => Err(INVALID_VALUE),
        (Side::Host, _) | (Side::Any, None) => {
            if overlaps_device {
                Err(INVALID_VALUE)
            } else {
                Ok(())
            }
        }
    }
}

/// One copy, checked against the state, then done.
///
/// # Safety
/// Host ranges must be valid memory of the calling process (the driver's contract).
unsafe fn copy_now(
    s: &State,
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
) -> Result<(), CUresult> {
    check_range(s, src, len, src_side)?;
    check_range(s, dst, len, dst_side)?;
    if len > 0 {
        // SAFETY: device ranges were checked to lie inside live allocations this library
        // owns; host ranges are the caller's, valid by the driver API's contract.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
    }
    Ok(())
}

// ---------------------------------------------------------------- events and streams

#[derive(Default)]
struct Event {
    /// (generation recorded, generation completed)
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
    /// Set by fault injection: queries and synchronisations fail.
    fails: std::sync::atomic::AtomicBool,
}

impl Event {
    fn complete(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        g.1 = g.1.max(generation);
        self.cv.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        while g.1 < generation {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

enum Op {
    Copy {
        dst: usize,
        dst_side: Side,
        src: usize,
        src_side: Side,
        len: usize,
    },
    Record(Arc<Event>, u64),
    Wait(Arc<Event>, u64),
}

struct Stream {
    ops: Mutex<Sender<Op>>,
}

impl Stream {
    fn spawn() -> Stream {
        let (tx, rx) = channel::<Op>();
        std::thread::spawn(move || {
            for op in rx {
                match op {
                    Op::Copy {
                        dst,
                        dst_side,
                        src,
                        src_side,
                        len,
                    } => {
                        std::thread::sleep(config().delay);
                        let mut s = state();
                        if s.sticky.is_none() {
                            // SAFETY: host ranges are valid until the stream passes this
                            // copy (the caller's contract for asynchronous copies).
                            if unsafe { copy_now(&s, dst, dst_side, src, src_side, len) }.is_err() {
                                s.sticky = Some(ILLEGAL_ADDRESS);
                            }
                        }
                    }
                    Op::Record(e, g) => e.complete(g),
                    Op::Wait(e, g) => e.wait_for(g),
                }
            }
        });
        Stream {
            ops: Mutex::new(tx),
        }
    }

    fn push(&self, op: Op) {
        let _ = self.ops.lock().unwrap_or_else(|p| p.into_inner()).send(op);
    }

    fn synchronize(&self) {
        let e = Arc::new(Event::default());
        self.push(Op::Record(e.clone(), 1));
        e.wait_for(1);
    }
}

/// The stream behind a handle, if it is one of ours (null is the legacy stream: `None`).
fn stream_of(s: &State, handle: *mut c_void) -> Result<Option<&'static Stream>, CUresult> {
    // The default stream: null, CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2). Like a
    // real driver, these name the current context's default stream: with no context
    // current they are an error.
    if (handle as usize) <= 2 {
        if CURRENT.with(Cell::get) == 0 {
            return Err(INVALID_CONTEXT);
        }
        return Ok(None);
    }
    if !s.streams.contains(&(handle as usize)) {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: the handle is in the registry: it came from `Box::into_raw` in
    // `cuStreamCreate` and has not been destroyed (destroying removes it first).
    Ok(Some(unsafe { &*(handle as *const Stream) }))
}

/// A synchronous copy: checked, then done at once.
unsafe fn copy_sync(
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s, true));
    if injected_copy_failure() {
        return UNKNOWN;
    }
    // SAFETY: forwarded contract of the driver API.
    try_cu!(unsafe { copy_now(&s, dst, dst_side, src, src_side, len) });
    SUCCESS
}

/// Queues a copy on `stream` (checked now and again when it runs), or runs it at once on
/// the null stream.
unsafe fn copy_async(
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s, true));
    if injected_copy_failure() {
        return UNKNOWN;
    }
    try_cu!(check_range(&s, src, len, src_side));
    try_cu!(check_range(&s, dst, len, dst_side));
    match try_cu!(stream_of(&s, stream)) {
        None => {
            // SAFETY: forwarded contract of the driver API.
            try_cu!(unsafe { copy_now(&s, dst, dst_side, src, src_side, len) });
        }
        Some(st) => st.push(Op::Copy {
            dst,
            dst_side,
            src,
            src_side,
            len,
        }),
    }
    SUCCESS
}

// ---------------------------------------------------------------- the exported API

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    if config().stub {
        return STUB_LIBRARY;
    }
    state().initialised = true;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    // SAFETY: the caller passes a valid out pointer (driver API contract).
    unsafe { *v = config().version };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    try_cu!(enter(&state(), false));
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *n = config().devices as c_int };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    try_cu!(enter(&state(), false));
    if ordinal < 0 || ordinal as usize >= config().devices {
        return INVALID_DEVICE;
    }
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *dev = ordinal };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    try_cu!(enter(&state(), false));
    if dev < 0 || dev as usize >= config().devices {
        return INVALID_DEVICE;
    }
    let text = format!("tensorferry fake CUDA device {dev}\0");
    let n = text.len().min(len.max(0) as usize);
    // SAFETY: `name` holds `len` bytes (driver API contract); at most that many are written.
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, name, n) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    try_cu!(enter(&state(), false));
    if dev < 0 || dev as usize >= config().devices {
        return INVALID_DEVICE;
    }
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *ctx = context_handle(dev as usize) };
    SUCCESS
}

/// Swaps the calling thread's stream-capture mode (0 global, the default; 1 thread-local;
/// 2 relaxed). Nothing here captures: the mode is only kept, so that tests can check that
/// tensorferry restores a thread's mode.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    try_cu!(enter(&state(), false));
    if mode.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a valid in/out pointer (driver API contract), checked non-null above.
    let wanted = unsafe { *mode };
    if wanted > 2 {
        return INVALID_VALUE;
    }
    // SAFETY: as above.
    unsafe { *mode = CAPTURE_MODE.with(|m| m.replace(wanted)) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    try_cu!(enter(&state(), false));
    if ctx.is_null() {
        CURRENT.with(|c| c.set(0));
        return SUCCESS;
    }
    match (0..config().devices).find(|&d| context_handle(d) == ctx) {
        Some(d) => {
            CURRENT.with(|c| c.set(d + 1));
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

fn context_of(ctx: *mut c_void) -> Option<usize> {
    (0..config().devices).find(|&d| context_handle(d) == ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(out: *mut *mut c_void) -> CUresult {
    try_cu!(enter(&state(), false));
    let current = CURRENT.with(Cell::get);
    let handle = if current == 0 {
        std::ptr::null_mut()
    } else {
        context_handle(current - 1)
    };
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CUresult {
    try_cu!(enter(&state(), false));
    let Some(d) = context_of(ctx) else {
        return INVALID_CONTEXT;
    };
    STACK.with(|s| s.borrow_mut().push(CURRENT.with(Cell::get)));
    CURRENT.with(|c| c.set(d + 1));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(out: *mut *mut c_void) -> CUresult {
    try_cu!(enter(&state(), false));
    let current = CURRENT.with(Cell::get);
    if current == 0 {
        return INVALID_CONTEXT;
    }
    let below = STACK.with(|s| s.borrow_mut().pop()).unwrap_or(0);
    CURRENT.with(|c| c.set(below));
    if !out.is_null() {
        // SAFETY: valid out pointer when not null (driver API contract).
        unsafe { *out = context_handle(current - 1) };
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, len: usize) -> CUresult {
    let mut s = state();
    let dev = try_cu!(enter(&s, true));
    if len == 0 {
        return INVALID_VALUE;
    }
    let used = s.used.get(&dev).copied().unwrap_or(0);
    if len > config().capacity.saturating_sub(used) {
        return OUT_OF_MEMORY;
    }
    let backing = vec![0xA5u8; len + DEVICE_ALIGNMENT];
    let address = (backing.as_ptr() as usize).next_multiple_of(DEVICE_ALIGNMENT);
    s.device.insert(
        address,
        DeviceAlloc {
            len,
            device: dev,
            _backing: backing,
        },
    );
    *s.used.entry(dev).or_default() += len;
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = address as u64 };
    SUCCESS
}

/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`: the GPU that owns an address.
const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// Only the device ordinal is known: an address inside a live allocation gives its GPU;
/// any other address is `CUDA_ERROR_INVALID_VALUE`, as the driver answers for host memory
/// it does not know.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    out: *mut c_void,
    attribute: c_int,
    address: u64,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let address = address as usize;
    if attribute == POINTER_ATTRIBUTE_MEMORY_TYPE {
        let pinned = s
            .pinned
            .range(..=address)
            .next_back()
            .is_some_and(|(start, (len, _))| address < start + len);
        let on_device = s
            .device
            .range(..=address)
            .next_back()
            .is_some_and(|(start, a)| address < start + a.len);
        let kind = match (pinned, on_device) {
            (true, _) => MEMORYTYPE_HOST,
            (_, true) => MEMORYTYPE_DEVICE,
            // Pageable memory: the driver knows nothing of it.
            _ => return INVALID_VALUE,
        };
        // SAFETY: the attribute is an unsigned int; valid out pointer (driver API contract).
        unsafe { *(out as *mut u32) = kind };
        return SUCCESS;
    }
    if attribute != POINTER_ATTRIBUTE_DEVICE_ORDINAL {
        return INVALID_VALUE;
    }
    let owner = s
        .device
        .range(..=address)
        .next_back()
        .filter(|(start, a)| address < *start + a.len);
    match owner {
        Some((_, a)) => {
            // SAFETY: the attribute is an int; valid out pointer (driver API contract).
            unsafe { *(out as *mut c_int) = a.device as c_int };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(address: u64) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, false));
    match s.device.remove(&(address as usize)) {
        Some(a) => {
            *s.used.entry(a.device).or_default() -= a.len;
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let s = state();
    let dev = try_cu!(enter(&s, true));
    let used = s.used.get(&dev).copied().unwrap_or(0);
    // SAFETY: valid out pointers (driver API contract).
    unsafe {
        *free = config().capacity - used;
        *total = config().capacity;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    out: *mut *mut c_void,
    len: usize,
    _flags: c_uint,
) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, true));
    if thread_fault(FAULT_PIN) {
        return OUT_OF_MEMORY;
    }
    let mut backing = vec![0u8; len.max(1)];
    let ptr = backing.as_mut_ptr();
    s.pinned.insert(ptr as usize, (len, Some(backing)));
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = ptr as *mut c_void };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, false));
    match s.pinned.get(&(ptr as usize)) {
        Some((_, Some(_))) => {
            s.pinned.remove(&(ptr as usize));
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(ptr: *mut c_void, len: usize, _flags: c_uint) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, true));
    if len == 0 || check_range(&s, ptr as usize, len, Side::Host).is_err() {
        return INVALID_VALUE;
    }
    s.pinned.insert(ptr as usize, (len, None));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(ptr: *mut c_void) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, false));
    match s.pinned.get(&(ptr as usize)) {
        Some((_, None)) => {
            s.pinned.remove(&(ptr as usize));
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe { copy_sync(dst as usize, Side::Device, src as usize, Side::Host, len) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe { copy_sync(dst as usize, Side::Host, src as usize, Side::Device, len) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe { copy_sync(dst as usize, Side::Device, src as usize, Side::Device, len) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe {
        copy_async(
            dst as usize,
            Side::Device,
            src as usize,
            Side::Host,
            len,
            stream,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe {
        copy_async(
            dst as usize,
            Side::Host,
            src as usize,
            Side::Device,
            len,
            stream,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    // SAFETY: forwarded contract of the driver API.
    unsafe {
        copy_async(
            dst as usize,
            Side::Device,
            src as usize,
            Side::Device,
            len,
            stream,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: u64,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    // SAFETY: forwarded contract of the driver API (unified addressing: either side may be
    // host or device memory).
    unsafe {
        copy_async(
            dst as usize,
            Side::Any,
            src as usize,
            Side::Any,
            len,
            stream,
        )
    }
}

/// `CUmemcpyAttributes` as CUDA 12.8 lays it out.
#[repr(C)]
pub struct MemcpyAttributes {
    src_access_order: c_uint,
    src_loc: [c_int; 2],
    dst_loc: [c_int; 2],
    flags: c_uint,
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *mut u64,
    srcs: *mut u64,
    sizes: *mut usize,
    count: usize,
    attrs: *mut MemcpyAttributes,
    attr_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: *mut c_void,
) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, true));
    if config().version < 12080 {
        // A driver older than 12.8 has no such entry point: calling it is fatal.
        s.sticky = Some(ILLEGAL_ADDRESS);
        return ILLEGAL_ADDRESS;
    }
    if count == 0 || num_attrs == 0 || attrs.is_null() || attr_idxs.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller passes arrays of `count` and `num_attrs` elements (driver API
    // contract).
    let (dsts, srcs, sizes, attrs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(dsts, count),
            std::slice::from_raw_parts(srcs, count),
            std::slice::from_raw_parts(sizes, count),
            std::slice::from_raw_parts(attrs, num_attrs),
            std::slice::from_raw_parts(attr_idxs, num_attrs),
        )
    };
    if idxs[0] != 0 || attrs.iter().any(|a| !(1..=3).contains(&a.src_access_order)) {
        return INVALID_VALUE;
    }
    let Some(st) = try_cu!(stream_of(&s, stream)) else {
        return INVALID_VALUE; // the legacy stream is not allowed for batched copies
    };
    // An injected failure part-way through: the first half is queued already.
    let fails_at = injected_copy_failure().then_some(count / 2);
    for i in 0..count {
        let ok = check_range(&s, srcs[i] as usize, sizes[i], Side::Any)
            .and_then(|_| check_range(&s, dsts[i] as usize, sizes[i], Side::Any));
        if let Err(e) = ok {
            if !fail_idx.is_null() {
                // SAFETY: valid out pointer when not null (driver API contract).
                unsafe { *fail_idx = i };
            }
            return e;
        }
    }
    for i in 0..fails_at.unwrap_or(count) {
        st.push(Op::Copy {
            dst: dsts[i] as usize,
            dst_side: Side::Any,
            src: srcs[i] as usize,
            src_side: Side::Any,
            len: sizes[i],
        });
    }
    if let Some(i) = fails_at {
        if !fail_idx.is_null() {
            // SAFETY: valid out pointer when not null (driver API contract).
            unsafe { *fail_idx = i };
        }
        return UNKNOWN;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, _flags: c_uint) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, true));
    let handle = Box::into_raw(Box::new(Stream::spawn())) as *mut c_void;
    s.streams.insert(handle as usize);
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s, false));
    if stream.is_null() || !s.streams.remove(&(stream as usize)) {
        return INVALID_HANDLE;
    }
    drop(s);
    // SAFETY: the handle was in the registry (from `Box::into_raw`), and is removed from it
    // first, so it is freed once. Its thread ends when the sender drops.
    let st = unsafe { Box::from_raw(stream as *mut Stream) };
    st.synchronize();
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let st = try_cu!(stream_of(&s, stream));
    drop(s);
    if let Some(st) = st {
        st.synchronize();
    }
    let s = state();
    s.sticky.unwrap_or(SUCCESS)
}

fn event_of(handle: *mut c_void) -> Result<&'static Arc<Event>, CUresult> {
    if handle.is_null() {
        return Err(INVALID_HANDLE);
    }
    // SAFETY: non-null event handles come from `Box::into_raw` in `cuEventCreate` and are
    // valid until `cuEventDestroy_v2` (the driver API's contract for callers).
    Ok(unsafe { &*(handle as *const Arc<Event>) })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, _flags: c_uint) -> CUresult {
    try_cu!(enter(&state(), true));
    let handle = Box::into_raw(Box::new(Arc::new(Event::default()))) as *mut c_void;
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    try_cu!(enter(&state(), false));
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: see `event_of`; destroyed once (the caller's contract).
    drop(unsafe { Box::from_raw(event as *mut Arc<Event>) });
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let e = try_cu!(event_of(event));
    if thread_fault(FAULT_RECORD) {
        return UNKNOWN;
    }
    if thread_fault(FAULT_QUERY) {
        e.fails.store(true, Ordering::SeqCst);
    }
    let generation = {
        let mut g = e.gens.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        g.0
    };
    match try_cu!(stream_of(&s, stream)) {
        Some(st) => st.push(Op::Record(e.clone(), generation)),
        None => e.complete(generation),
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let e = try_cu!(event_of(event));
    if e.fails.load(Ordering::SeqCst) {
        return UNKNOWN;
    }
    let g = e.gens.lock().unwrap_or_else(|p| p.into_inner());
    if g.1 >= g.0 {
        SUCCESS
    } else {
        NOT_READY
    }
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let e = try_cu!(event_of(event));
    drop(s);
    let target = e.gens.lock().unwrap_or_else(|p| p.into_inner()).0;
    e.wait_for(target);
    if e.fails.load(Ordering::SeqCst) {
        return UNKNOWN;
    }
    state().sticky.unwrap_or(SUCCESS)
}

/// Test hook: holds `stream` (nothing queued on it after this call runs) until the
/// returned gate is passed to [`tf_fake_cuda_open`]; null when `stream` is not one of ours.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_gate(stream: *mut c_void) -> *mut c_void {
    let s = state();
    let Ok(Some(st)) = stream_of(&s, stream) else {
        return std::ptr::null_mut();
    };
    let gate = Arc::new(Event::default());
    st.push(Op::Wait(gate.clone(), 1));
    Box::into_raw(Box::new(gate)) as *mut c_void
}

/// Test hook: releases a gate from [`tf_fake_cuda_gate`] (once; the handle is freed).
///
/// # Safety
/// `gate` must come from `tf_fake_cuda_gate` and not have been opened yet.
#[no_mangle]
pub unsafe extern "C" fn tf_fake_cuda_open(gate: *mut c_void) -> CUresult {
    if gate.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: from `Box::into_raw` in `tf_fake_cuda_gate`, freed once (the contract).
    let gate = unsafe { Box::from_raw(gate as *mut Arc<Event>) };
    gate.complete(1);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s, false));
    let e = try_cu!(event_of(event));
    let target = e.gens.lock().unwrap_or_else(|p| p.into_inner()).0;
    match try_cu!(stream_of(&s, stream)) {
        Some(st) => st.push(Op::Wait(e.clone(), target)),
        None => {
            drop(s);
            e.wait_for(target);
        }
    }
    SUCCESS
}

#[cfg(test)]
mod tests {
    //! The fake must catch what it claims to catch, or the suite run against it proves
    //! nothing. One test of the driver calls: the sticky error it ends with is
    //! process-wide.
    use super::*;

    #[test]
    fn the_copy_calls_to_fail_are_a_list_of_call_numbers() {
        assert_eq!(fail_list("3"), [3]);
        assert_eq!(fail_list(" 3, 14 "), [3, 14]);
        assert_eq!(fail_list(""), Vec::<u64>::new());
        assert_eq!(fail_list("x,2"), [2]);
    }

    #[test]
    fn the_fake_catches_bad_ranges_early_reads_and_use_after_free() {
        unsafe {
            assert_eq!(cuMemAlloc_v2(&mut 0, 16), NOT_INITIALIZED);
            assert_eq!(cuInit(0), SUCCESS);
            let mut ctx = std::ptr::null_mut();
            assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), SUCCESS);
            assert_eq!(
                cuMemAlloc_v2(&mut 0, 16),
                INVALID_CONTEXT,
                "no current context"
            );
            assert_eq!(cuCtxSetCurrent(ctx), SUCCESS);
            let mut dev = 0u64;
            assert_eq!(cuMemAlloc_v2(&mut dev, 4096), SUCCESS);
            let host = vec![7u8; 4096];
            // A device range past the allocation is refused.
            assert_eq!(
                cuMemcpyHtoD_v2(dev + 1, host.as_ptr().cast(), 4096),
                INVALID_VALUE
            );
            // Asynchronous copies land late: reading before synchronising sees old bytes.
            // A gate holds the stream so that nothing here depends on timing.
            let mut stream = std::ptr::null_mut();
            assert_eq!(cuStreamCreate(&mut stream, 0), SUCCESS);
            let gate = || {
                let gate = Arc::new(Event::default());
                let s = state();
                let st = stream_of(&s, stream).unwrap().unwrap();
                st.push(Op::Wait(gate.clone(), 1));
                gate
            };
            let mut back = vec![0u8; 4096];
            assert_eq!(cuMemcpyHtoD_v2(dev, host.as_ptr().cast(), 4096), SUCCESS);
            let held = gate();
            assert_eq!(
                cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), dev, 4096, stream),
                SUCCESS
            );
            assert_eq!(back[0], 0, "the copy is still queued");
            held.complete(1);
            assert_eq!(cuStreamSynchronize(stream), SUCCESS);
            assert_eq!(back, host);
            // Freeing memory that a queued copy still reads is caught when it runs.
            let held = gate();
            cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), dev, 4096, stream);
            assert_eq!(cuMemFree_v2(dev), SUCCESS);
            held.complete(1);
            assert_eq!(cuStreamSynchronize(stream), ILLEGAL_ADDRESS);
            assert_eq!(cuMemAlloc_v2(&mut 0, 16), ILLEGAL_ADDRESS, "sticky");
        }
    }
}
