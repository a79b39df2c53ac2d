//! A fake CUDA driver: the subset of `libcuda`'s driver API that tensorferry calls,
//! implemented on host memory, so that the CUDA backend's code runs in CI on machines
//! without a GPU.
//!
//! It is stricter than a real driver where that finds bugs, and no faster. Each rule below
//! follows the driver's documented behaviour (the driver API reference, its "API
//! synchronization behavior" page, and the Programming Guide's multi-device and implicit
//! synchronisation sections), and each can be switched off for one run with
//! `TF_FAKE_CUDA_LENIENT=<rule>,…` so that the test proving it can be seen to fail:
//! - always: calls before `cuInit`, or without a current context where one is needed, fail
//!   as the driver's do; every device range a copy names must lie inside one live
//!   `cuMemAlloc` allocation and no host range may overlap device memory (checked when the
//!   copy is queued and again when it runs: a copy meeting freed memory is a sticky
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`); asynchronous copies run later, on a thread per stream,
//!   after a delay (`TF_FAKE_CUDA_DELAY_US`, default 20 µs per copy), so reading a
//!   destination before synchronising reads stale bytes; `cuMemcpyBatchAsync` exists only
//!   on a 12.8 or newer "driver" (calling it on an older one is a sticky error).
//! - `contexts`: streams and events belong to the context current when they were made; an
//!   event recorded on a stream of another context is `CUDA_ERROR_INVALID_HANDLE` (as
//!   `cuEventRecord` documents). Copies on another device's stream, waits on another
//!   device's event and queries of it succeed, as the Programming Guide says they do.
//! - `pageable`: a copy from device memory into pageable host memory (neither allocated by
//!   `cuMemHostAlloc` nor registered) returns only once the copy is done, also as
//!   `cuMemcpy*Async` ("for transfers from device to either pageable or pinned host memory,
//!   the function returns only once the copy has completed").
//! - `implicit-sync`: `cuMemFree` and `cuMemFreeHost` wait for all work queued in the
//!   context (of the allocation; of the current context) before returning; `cuMemHostAlloc`
//!   is a barrier on the device: work queued after it on any stream of the context waits
//!   for the work queued before it on every other ("two commands from different streams
//!   cannot run concurrently if a page-locked host memory allocation is issued in-between").
//! - `capture`: stream capture (`cuStreamBeginCapture_v2` … `cuStreamEndCapture`) is
//!   modelled: a potentially unsafe call (allocating or freeing device or pinned memory,
//!   registering host memory) on a thread with its own capture in progress (not relaxed),
//!   or on a thread in the global mode while another thread captures in the global mode,
//!   fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture, whose
//!   end then fails with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`; `cuCtxSynchronize` of a
//!   context with a capturing stream fails in any mode. Work queued on a capturing stream
//!   is captured, never run.
//! - `sticky`: an error that corrupts a context (a copy meeting freed memory, the missing
//!   batched entry point, an injected fault) makes every later call in that context fail
//!   with it — calls with it current, and calls on its streams and events — while other
//!   contexts go on working.
//! - `peer`: a copy between two devices is direct only when the stream's context has
//!   enabled access to the other device's (`cuCtxEnablePeerAccess`, refused for devices
//!   that cannot reach each other: `TF_FAKE_CUDA_PEER=0`); otherwise it is staged through
//!   the host, still correct, and counted as such ([`tf_fake_cuda_peer_copies`]).
//! - `hazards`: freeing device, pinned or registered memory that a queued copy still reads
//!   or writes (by address range over every queued copy, after the free's own implicit
//!   synchronisation), and a copy that runs while a copy queued before it on another
//!   stream, and not ordered before it, still reads or writes the same bytes (memory
//!   reused too early), and page-locked host memory that a queued copy still has to read
//!   changing before that copy runs (the host reused it: checked by a fingerprint of the
//!   bytes, taken when the copy is queued and after each driver copy that writes them),
//!   abort the process with a message: a GPU would corrupt data silently, and an abort
//!   fails any CI run.
//! - `legacy`: an event recorded on the legacy default stream (`CU_STREAM_LEGACY` or the
//!   null handle) completes only once every blocking stream of its context (made without
//!   `CU_STREAM_NON_BLOCKING`) has run the work queued on it before the record, as the
//!   legacy stream waits for blocking streams ("Programming Guide: implicit
//!   synchronization"); non-blocking streams are not waited for.
//!
//! A driver call that blocks the calling thread longer than `TF_FAKE_CUDA_HANG_S` (default
//! 120 s; a deadlock, such as a thread waiting for a stream it holds itself) aborts the
//! process with a message instead of hanging.
//!
//! Configuration, read once: `TF_FAKE_CUDA_DEVICES` (default 1), `TF_FAKE_CUDA_VERSION`
//! (default 12080), `TF_FAKE_CUDA_CAPACITY` (bytes per device, default 1 GiB),
//! `TF_FAKE_CUDA_DELAY_US`, `TF_FAKE_CUDA_PEER` (default 1: devices can access each other),
//! `TF_FAKE_CUDA_LENIENT`, `TF_FAKE_CUDA_HANG_S`, `TF_FAKE_CUDA_STUB=1` (behave as the
//! toolkit's stub library: `cuInit` fails with `CUDA_ERROR_STUB_LIBRARY`), and for fault
//! injection `TF_FAKE_CUDA_FAIL_COPY`: a list of call numbers (`3` or `3,14`, counted from 1
//! over every copy call of the process: `cuMemcpy*`, `cuMemcpy*Async`,
//! `cuMemcpyBatchAsync`) that fail with `CUDA_ERROR_UNKNOWN`, not sticky. A failing
//! `cuMemcpyBatchAsync` first queues the first half of its copies and reports the middle one
//! as `fail_idx`, as a driver failing part-way through a batch may.
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
//!   other; `tf_fake_cuda_clear_faults()` forgets this thread's settings;
//! - `tf_fake_cuda_fault_context(ordinal, code)`: a sticky error in that device's context;
//! - `tf_fake_cuda_forbid_implicit_sync(on)`: on this thread, a call that synchronises
//!   implicitly (`cuMemFree`, `cuMemFreeHost`, a copy into pageable memory) is refused with
//!   `CUDA_ERROR_NOT_PERMITTED` and counted (`tf_fake_cuda_implicit_sync_refusals()`): such
//!   a thread stands for a Python thread holding the GIL;
//! - `tf_fake_cuda_waiting()`: how many threads are blocked inside a driver call now;
//! - `tf_fake_cuda_peer_copies(direct, staged)`: copies between devices so far.
//!
//! Not a model of performance, of the legacy default stream's implicit synchronisation
//! beyond "the null stream runs copies at once" and the `legacy` rule's events, or of
//! anything tensorferry does not call.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

type CUresult = c_uint;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const STUB_LIBRARY: CUresult = 34;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
const INVALID_HANDLE: CUresult = 400;
const NOT_READY: CUresult = 600;
const ILLEGAL_ADDRESS: CUresult = 700;
const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
const NOT_PERMITTED: CUresult = 800;
const STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
const STREAM_CAPTURE_INVALIDATED: CUresult = 901;
const STREAM_CAPTURE_UNMATCHED: CUresult = 903;
const STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
const UNKNOWN: CUresult = 999;

/// `CU_STREAM_NON_BLOCKING`: a stream the legacy default stream does not wait for.
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_STREAM_LEGACY`, the legacy default stream (the null handle names it too).
const STREAM_LEGACY: usize = 0x1;

/// Stream-capture modes (`CUstreamCaptureMode`).
const CAPTURE_GLOBAL: c_uint = 0;
const CAPTURE_RELAXED: c_uint = 2;

/// Device allocations are aligned like the driver's.
const DEVICE_ALIGNMENT: usize = 256;

/// A rule of the fake that `TF_FAKE_CUDA_LENIENT` can switch off (see the crate docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    Contexts,
    Pageable,
    ImplicitSync,
    Capture,
    Sticky,
    Peer,
    Hazards,
    Legacy,
}

/// The names `TF_FAKE_CUDA_LENIENT` takes.
const RULES: [(&str, Rule); 8] = [
    ("contexts", Rule::Contexts),
    ("pageable", Rule::Pageable),
    ("implicit-sync", Rule::ImplicitSync),
    ("capture", Rule::Capture),
    ("sticky", Rule::Sticky),
    ("peer", Rule::Peer),
    ("hazards", Rule::Hazards),
    ("legacy", Rule::Legacy),
];

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
    /// Devices can access each other's memory (`cuDeviceCanAccessPeer`).
    peer: bool,
    /// Rules switched off.
    lenient: Vec<Rule>,
    /// How long a driver call may block its caller before the fake calls it a deadlock.
    hang: Duration,
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
        let lenient = std::env::var("TF_FAKE_CUDA_LENIENT").unwrap_or_default();
        Config {
            devices: var("TF_FAKE_CUDA_DEVICES", 1) as usize,
            version: var("TF_FAKE_CUDA_VERSION", 12080) as c_int,
            capacity: var("TF_FAKE_CUDA_CAPACITY", 1 << 30) as usize,
            delay: Duration::from_micros(var("TF_FAKE_CUDA_DELAY_US", 20)),
            fail_copy: fail_list(&std::env::var("TF_FAKE_CUDA_FAIL_COPY").unwrap_or_default()),
            stub: var("TF_FAKE_CUDA_STUB", 0) == 1,
            peer: var("TF_FAKE_CUDA_PEER", 1) == 1,
            lenient: lenient_rules(&lenient).unwrap_or_else(|bad| {
                fatal(&format!(
                    "TF_FAKE_CUDA_LENIENT names no rule {bad:?} (rules: {})",
                    RULES.map(|r| r.0).join(", ")
                ))
            }),
            hang: Duration::from_secs(var("TF_FAKE_CUDA_HANG_S", 120)),
        }
    })
}

/// The rules of a `TF_FAKE_CUDA_LENIENT` value (`"pageable,hazards"`, `"all"`); the first
/// unknown name otherwise (a typo must not leave a rule on unnoticed, or off).
fn lenient_rules(text: &str) -> Result<Vec<Rule>, String> {
    let mut out = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name == "all" {
            out.extend(RULES.map(|r| r.1));
            continue;
        }
        match RULES.iter().find(|r| r.0 == name) {
            Some(r) => out.push(r.1),
            None => return Err(name.to_string()),
        }
    }
    Ok(out)
}

/// True unless `TF_FAKE_CUDA_LENIENT` switched the rule off.
fn strict(rule: Rule) -> bool {
    !config().lenient.contains(&rule)
}

/// Ends the process with a message: what a GPU would leave as silent corruption or a hang
/// must fail the run that met it, whatever the caller does with error codes.
fn fatal(message: &str) -> ! {
    eprintln!("tf-fake-cuda: {message}");
    std::process::abort()
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
    static FAULTS: RefCell<Faults> = RefCell::new(Faults::default());
    /// Set by [`tf_fake_cuda_forbid_implicit_sync`].
    static NO_IMPLICIT_SYNC: Cell<bool> = const { Cell::new(false) };
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

/// Test hook: a sticky error `code` in device `ordinal`'s context, as a fault there leaves.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_fault_context(ordinal: c_int, code: CUresult) -> CUresult {
    if ordinal < 0 || ordinal as usize >= config().devices || code == SUCCESS {
        return INVALID_VALUE;
    }
    state().sticky.insert(ordinal as usize, code);
    SUCCESS
}

/// Implicit synchronisations refused on a thread marked by the hook below.
static IMPLICIT_SYNC_REFUSALS: AtomicU64 = AtomicU64::new(0);

/// Test hook: with `on`, the calling thread stands for one that must never wait for the
/// GPU (a Python thread holding the GIL): a call that synchronises implicitly is refused
/// with `CUDA_ERROR_NOT_PERMITTED`, counted, and named on stderr.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_forbid_implicit_sync(on: c_int) -> CUresult {
    NO_IMPLICIT_SYNC.with(|f| f.set(on != 0));
    SUCCESS
}

/// Test hook: how many implicit synchronisations were refused so far (see above).
#[no_mangle]
pub extern "C" fn tf_fake_cuda_implicit_sync_refusals() -> u64 {
    IMPLICIT_SYNC_REFUSALS.load(Ordering::SeqCst)
}

/// Fails a call that synchronises implicitly on a thread that must not wait.
fn implicit_sync_allowed(what: &str) -> Result<(), CUresult> {
    if NO_IMPLICIT_SYNC.with(Cell::get) {
        IMPLICIT_SYNC_REFUSALS.fetch_add(1, Ordering::SeqCst);
        eprintln!(
            "tf-fake-cuda: {what} would wait for the GPU on thread {:?}, which must not wait",
            std::thread::current().name().unwrap_or("unnamed")
        );
        return Err(NOT_PERMITTED);
    }
    Ok(())
}

/// Threads blocked inside a driver call now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Test hook: how many threads are blocked inside a driver call now.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_waiting() -> u64 {
    WAITING.load(Ordering::SeqCst) as u64
}

/// Copies between devices: direct (peer access enabled) and staged through the host.
static PEER_DIRECT: AtomicU64 = AtomicU64::new(0);
static PEER_STAGED: AtomicU64 = AtomicU64::new(0);

/// Test hook: the copies between two devices so far, direct and staged through the host.
///
/// # Safety
/// Both pointers must be valid for a write of a `u64`.
#[no_mangle]
pub unsafe extern "C" fn tf_fake_cuda_peer_copies(direct: *mut u64, staged: *mut u64) -> CUresult {
    if direct.is_null() || staged.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: valid, non-null out pointers (the hook's contract).
    unsafe {
        *direct = PEER_DIRECT.load(Ordering::SeqCst);
        *staged = PEER_STAGED.load(Ordering::SeqCst);
    }
    SUCCESS
}

// ---------------------------------------------------------------- the state

struct DeviceAlloc {
    len: usize,
    device: usize,
    _backing: Vec<u8>,
}

/// Page-locked host memory: from `cuMemHostAlloc` (owned) or registered.
struct Pinned {
    len: usize,
    owned: Option<Vec<u8>>,
}

/// A copy queued on a stream that has not run yet.
struct QueuedCopy {
    stream: usize,
    dst: (usize, usize),
    src: (usize, usize),
    /// For a copy out of page-locked host memory: a fingerprint of the bytes it will read,
    /// taken when it was queued and again whenever the driver itself writes them (a copy
    /// ordered before it). The host may not write them meanwhile (the `hazards` rule).
    src_print: Option<u64>,
}

/// A capture in progress on a stream.
struct Capture {
    thread: std::thread::ThreadId,
    mode: c_uint,
    context: usize,
    invalidated: bool,
}

#[derive(Default)]
struct State {
    initialised: bool,
    /// Live device allocations by start address.
    device: BTreeMap<usize, DeviceAlloc>,
    used: BTreeMap<usize, usize>,
    pinned: BTreeMap<usize, Pinned>,
    /// Live streams by handle.
    streams: HashMap<usize, Arc<Stream>>,
    /// The sticky error of each context that has one.
    sticky: HashMap<usize, CUresult>,
    /// Primary contexts retained (and not released) per device.
    retained: HashMap<usize, usize>,
    /// (context, peer): the context may access the peer's memory directly.
    peer: HashSet<(usize, usize)>,
    /// Copies queued and not yet run, in the order they were queued.
    queued: BTreeMap<u64, QueuedCopy>,
    next_copy: u64,
    /// Captures in progress, by stream handle.
    captures: HashMap<usize, Capture>,
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
    static CAPTURE_MODE: Cell<c_uint> = const { Cell::new(CAPTURE_GLOBAL) };
    /// Contexts under the current one, pushed by `cuCtxPushCurrent_v2`.
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn context_handle(ordinal: usize) -> *mut c_void {
    (0x1000 * (ordinal + 1)) as *mut c_void
}

fn context_of(ctx: *mut c_void) -> Option<usize> {
    (0..config().devices).find(|&d| context_handle(d) == ctx)
}

/// The current context's device ordinal, if one is current.
fn current() -> Option<usize> {
    CURRENT.with(Cell::get).checked_sub(1)
}

/// Fails with `context`'s sticky error, if it has one.
fn healthy(s: &State, context: usize) -> Result<(), CUresult> {
    match s.sticky.get(&context) {
        Some(&e) if strict(Rule::Sticky) => Err(e),
        _ => Ok(()),
    }
}

/// The checks every call starts with: `cuInit`, and the current context's sticky error;
/// the current context, if any.
fn enter(s: &State) -> Result<Option<usize>, CUresult> {
    if !s.initialised {
        return Err(NOT_INITIALIZED);
    }
    let current = current();
    if let Some(c) = current {
        healthy(s, c)?;
    }
    Ok(current)
}

/// As [`enter`], for calls that need a current context: its device ordinal.
fn enter_context(s: &State) -> Result<usize, CUresult> {
    enter(s)?.ok_or(INVALID_CONTEXT)
}

/// Marks a context as corrupted (see the `sticky` rule).
fn corrupt(s: &mut State, context: usize, code: CUresult) {
    s.sticky.entry(context).or_insert(code);
}

macro_rules! try_cu {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

/// Refuses a potentially unsafe call (allocating, freeing, registering memory) while a
/// capture forbids it, invalidating the captures it would have broken.
fn capture_allows(s: &mut State) -> Result<(), CUresult> {
    if !strict(Rule::Capture) || s.captures.is_empty() {
        return Ok(());
    }
    let me = std::thread::current().id();
    let mode = CAPTURE_MODE.with(Cell::get);
    let mut refused = false;
    for c in s.captures.values_mut() {
        let own = c.thread == me && c.mode != CAPTURE_RELAXED;
        let global = mode == CAPTURE_GLOBAL && c.mode == CAPTURE_GLOBAL;
        if own || global {
            c.invalidated = true;
            refused = true;
        }
    }
    if refused {
        Err(STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Device,
    Host,
    /// Either (batched and generic copies infer it from the address).
    Any,
}

/// The live allocation holding `addr`, if any.
fn allocation_at(s: &State, addr: usize) -> Option<(usize, &DeviceAlloc)> {
    s.device
        .range(..=addr)
        .next_back()
        .filter(|(&start, a)| addr < start + a.len.max(1))
        .map(|(&start, a)| (start, a))
}

/// Checks that `[addr, addr + len)` is inside one live allocation (device side), or
/// overlaps no device memory (host side).
fn check_range(s: &State, addr: usize, len: usize, side: Side) -> Result<(), CUresult> {
    if len == 0 {
        return Ok(());
    }
    let end = addr.checked_add(len).ok_or(INVALID_VALUE)?;
    let containing = allocation_at(s, addr);
    let overlaps_device = containing.is_some() || s.device.range(addr..end).next().is_some();
    match (side, containing) {
        (Side::Device, Some((start, a))) | (Side::Any, Some((start, a))) => {
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

/// True when `[addr, addr + len)` lies in page-locked memory the driver knows.
fn is_pinned(s: &State, addr: usize, len: usize) -> bool {
    s.pinned
        .range(..=addr)
        .next_back()
        .is_some_and(|(&start, p)| addr.saturating_add(len) <= start + p.len.max(1))
}

/// True for a copy from device memory into pageable host memory, which the driver does
/// synchronously.
fn into_pageable(s: &State, dst: usize, src: usize, len: usize) -> bool {
    len > 0
        && strict(Rule::Pageable)
        && allocation_at(s, src).is_some()
        && allocation_at(s, dst).is_none()
        && !is_pinned(s, dst, len)
}

/// Counts a copy on a stream of `context` between devices: direct where that context has
/// enabled access to the other device, staged through the host otherwise.
fn count_peer(s: &State, context: usize, dst: usize, src: usize) {
    let others = [src, dst]
        .into_iter()
        .filter_map(|a| allocation_at(s, a).map(|(_, a)| a.device))
        .filter(|&d| d != context)
        .collect::<Vec<_>>();
    if others.is_empty() {
        return;
    }
    let direct = others
        .iter()
        .all(|&d| s.peer.contains(&(context, d)) || !strict(Rule::Peer));
    if direct {
        PEER_DIRECT.fetch_add(1, Ordering::SeqCst);
    } else {
        PEER_STAGED.fetch_add(1, Ordering::SeqCst);
    }
}

fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
}

/// A copy queued before copy `seq` on another stream that reads or writes what `seq`
/// writes, or writes what it reads: nothing orders them (`seq`'s stream cannot have waited
/// for it, or it would have run), so the two race.
fn racing(
    s: &State,
    seq: u64,
    stream: usize,
    dst: (usize, usize),
    src: (usize, usize),
) -> Option<String> {
    s.queued.range(..seq).find_map(|(_, q)| {
        let conflict = q.stream != stream
            && (overlap(dst, q.src) || overlap(dst, q.dst) || overlap(src, q.dst));
        conflict.then(|| {
            format!(
                "a copy of {} bytes from {:#x} to {:#x} on stream {stream:#x} runs while a copy \
                 queued before it on stream {:#x} ({} bytes from {:#x} to {:#x}) still uses the \
                 same memory: memory reused (or freed and reallocated) before that copy ran",
                dst.1, src.0, dst.0, q.stream, q.dst.1, q.src.0, q.dst.0
            )
        })
    })
}

/// Aborts if a queued copy still uses `[addr, addr + len)`, about to be freed by `what`.
fn check_free(s: &State, what: &str, addr: usize, len: usize) {
    if !strict(Rule::Hazards) {
        return;
    }
    let freed = (addr, len.max(1));
    if let Some(q) = s
        .queued
        .values()
        .find(|q| overlap(freed, q.src) || overlap(freed, q.dst))
    {
        fatal(&format!(
            "use after free: {what} of {len} bytes at {addr:#x} while a copy queued on stream \
             {:#x} ({} bytes from {:#x} to {:#x}) still uses them",
            q.stream, q.dst.1, q.src.0, q.dst.0
        ))
    }
}

/// A fingerprint of `len` bytes of host memory at `addr`.
///
/// # Safety
/// `[addr, addr + len)` must be readable host memory (page-locked memory the driver knows).
unsafe fn fingerprint(addr: usize, len: usize) -> u64 {
    // SAFETY: the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ len as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(23);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The fingerprint a copy queued now from `src` keeps: page-locked sources only (a copy
/// from pageable memory is staged by the driver before the call returns).
fn source_print(s: &State, src: usize, len: usize) -> Option<u64> {
    (strict(Rule::Hazards) && len > 0 && is_pinned(s, src, len))
        // SAFETY: page-locked memory the driver knows, `len` bytes from `src`.
        .then(|| unsafe { fingerprint(src, len) })
}

/// After the driver wrote `[dst, dst + len)`: the queued copies reading those bytes take
/// their new fingerprint (a write the driver ordered before them is no hazard).
fn refresh_prints(s: &mut State, dst: usize, len: usize) {
    for q in s.queued.values_mut() {
        if q.src_print.is_some() && overlap((dst, len), q.src) {
            // SAFETY: the source was page-locked memory when queued; freeing it with the
            // copy queued aborts the process (`check_free`).
            q.src_print = Some(unsafe { fingerprint(q.src.0, q.src.1) });
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

struct Event {
    /// (generation recorded, generation completed)
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
    /// Set by fault injection: queries and synchronisations fail.
    fails: AtomicBool,
    /// The context the event was made in.
    context: usize,
}

impl Event {
    fn new(context: usize) -> Event {
        Event {
            gens: Mutex::new((0, 0)),
            cv: Condvar::new(),
            fails: AtomicBool::new(false),
            context,
        }
    }

    fn complete(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        g.1 = g.1.max(generation);
        self.cv.notify_all();
    }

    /// Waits (a stream thread, for a gate or another stream) as long as it takes.
    fn wait_for(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        while g.1 < generation {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits in a driver call made by a caller: counted in [`WAITING`], and fatal after
    /// `TF_FAKE_CUDA_HANG_S` (a caller waiting for work that can never run).
    fn block_for(&self, generation: u64, what: &str) {
        WAITING.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + config().hang;
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        while g.1 < generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                fatal(&format!(
                    "{what} has blocked thread {:?} for {:?}: a deadlock (a thread waiting for a \
                     stream it holds itself?)",
                    std::thread::current().name().unwrap_or("unnamed"),
                    config().hang
                ));
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        WAITING.fetch_sub(1, Ordering::SeqCst);
    }

    /// Records the next generation: what waiting for the event now waits for.
    fn next_generation(&self) -> u64 {
        let mut g = self.gens.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        g.0
    }

    fn recorded(&self) -> u64 {
        self.gens.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

enum Op {
    Copy {
        seq: u64,
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
    context: usize,
    /// Made without `CU_STREAM_NON_BLOCKING`: the legacy default stream waits for it.
    blocking: bool,
    ops: Mutex<Sender<Op>>,
}

impl Stream {
    /// A stream of `context`, its thread started; its handle is its address.
    fn spawn(context: usize, blocking: bool) -> Arc<Stream> {
        let (tx, rx) = channel::<Op>();
        let stream = Arc::new(Stream {
            context,
            blocking,
            ops: Mutex::new(tx),
        });
        let handle = Arc::as_ptr(&stream) as usize;
        std::thread::spawn(move || {
            for op in rx {
                match op {
                    Op::Copy {
                        seq,
                        dst,
                        dst_side,
                        src,
                        src_side,
                        len,
                    } => {
                        std::thread::sleep(config().delay);
                        let mut s = state();
                        let queued = s.queued.remove(&seq);
                        if healthy(&s, context).is_err() {
                            continue; // a corrupted context runs nothing more
                        }
                        if strict(Rule::Hazards) {
                            if let Some(race) = racing(&s, seq, handle, (dst, len), (src, len)) {
                                fatal(&race);
                            }
                            if let Some(print) = queued.and_then(|q| q.src_print) {
                                // SAFETY: page-locked memory, still live (see `refresh_prints`).
                                if unsafe { fingerprint(src, len) } != print {
                                    fatal(&format!(
                                        "page-locked host memory was overwritten while a copy \
                                         queued on stream {handle:#x} still had to read it ({len} \
                                         bytes from {src:#x} to {dst:#x}): memory reused before \
                                         that copy ran"
                                    ));
                                }
                            }
                        }
                        // SAFETY: host ranges are valid until the stream passes this
                        // copy (the caller's contract for asynchronous copies).
                        if unsafe { copy_now(&s, dst, dst_side, src, src_side, len) }.is_err() {
                            corrupt(&mut s, context, ILLEGAL_ADDRESS);
                        } else {
                            refresh_prints(&mut s, dst, len);
                        }
                    }
                    Op::Record(e, g) => e.complete(g),
                    Op::Wait(e, g) => e.wait_for(g),
                }
            }
        });
        stream
    }

    fn handle(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }

    fn push(&self, op: Op) {
        let _ = self.ops.lock().unwrap_or_else(|p| p.into_inner()).send(op);
    }

    /// An event that completes once the work queued on the stream so far has run.
    fn mark(&self) -> (Arc<Event>, u64) {
        let e = Arc::new(Event::new(self.context));
        let g = e.next_generation();
        self.push(Op::Record(e.clone(), g));
        (e, g)
    }

    /// Blocks the caller (a driver call: see [`Event::block_for`]) until the work queued
    /// so far has run.
    fn synchronize(&self, what: &str) {
        let (e, g) = self.mark();
        e.block_for(g, what);
    }
}

/// What a stream handle names.
enum Target {
    /// The default stream (null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) of the current
    /// context, whose device ordinal this is: copies on it run at once.
    Default(usize),
    Stream(Arc<Stream>),
}

impl Target {
    fn context(&self) -> usize {
        match self {
            Target::Default(c) => *c,
            Target::Stream(st) => st.context,
        }
    }
}

/// The stream behind a handle, if it is one of ours. Like a real driver, the default
/// handles name the current context's default stream: with no context current they are an
/// error.
fn stream_of(s: &State, handle: *mut c_void) -> Result<Target, CUresult> {
    if (handle as usize) <= 2 {
        return current().map(Target::Default).ok_or(INVALID_CONTEXT);
    }
    s.streams
        .get(&(handle as usize))
        .cloned()
        .map(Target::Stream)
        .ok_or(INVALID_HANDLE)
}

/// The streams of `context`, to wait for.
fn streams_of(s: &State, context: usize) -> Vec<Arc<Stream>> {
    s.streams
        .values()
        .filter(|st| st.context == context)
        .cloned()
        .collect()
}

/// Blocks until the work queued so far on every stream of `context` has run (the lock on
/// the state is not held meanwhile).
fn synchronize_context(streams: Vec<Arc<Stream>>, what: &str) {
    let marks: Vec<_> = streams.iter().map(|st| st.mark()).collect();
    for (e, g) in marks {
        e.block_for(g, what);
    }
}

/// True when work queued on `handle` is captured rather than run.
fn capturing(s: &State, handle: usize) -> bool {
    strict(Rule::Capture) && s.captures.contains_key(&handle)
}

/// Queues a checked copy on `st` (or captures it), numbered for the hazard checks.
fn queue_copy(
    s: &mut State,
    st: &Arc<Stream>,
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
) {
    if capturing(s, st.handle()) {
        return;
    }
    count_peer(s, st.context, dst, src);
    s.next_copy += 1;
    let seq = s.next_copy;
    let src_print = source_print(s, src, len);
    s.queued.insert(
        seq,
        QueuedCopy {
            stream: st.handle(),
            dst: (dst, len),
            src: (src, len),
            src_print,
        },
    );
    st.push(Op::Copy {
        seq,
        dst,
        dst_side,
        src,
        src_side,
        len,
    });
}

/// A copy that runs at once (synchronous copies, the default stream): checked against the
/// copies still queued, then done.
///
/// # Safety
/// As [`copy_now`].
unsafe fn copy_at_once(
    s: &State,
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
) -> Result<(), CUresult> {
    if strict(Rule::Hazards) {
        if let Some(race) = racing(s, u64::MAX, 0, (dst, len), (src, len)) {
            fatal(&race);
        }
    }
    // SAFETY: forwarded contract.
    unsafe { copy_now(s, dst, dst_side, src, src_side, len) }
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
    try_cu!(enter_context(&s));
    if injected_copy_failure() {
        return UNKNOWN;
    }
    // SAFETY: forwarded contract of the driver API.
    try_cu!(unsafe { copy_at_once(&s, dst, dst_side, src, src_side, len) });
    SUCCESS
}

/// Queues a copy on `stream` (checked now and again when it runs), or runs it at once on
/// the default stream. Into pageable memory, returns once the copy has run.
unsafe fn copy_async(
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    len: usize,
    stream: *mut c_void,
) -> CUresult {
    let mut s = state();
    try_cu!(enter_context(&s));
    if injected_copy_failure() {
        return UNKNOWN;
    }
    try_cu!(check_range(&s, src, len, src_side));
    try_cu!(check_range(&s, dst, len, dst_side));
    let target = try_cu!(stream_of(&s, stream));
    try_cu!(healthy(&s, target.context()));
    let synchronous = into_pageable(&s, dst, src, len);
    if synchronous {
        try_cu!(implicit_sync_allowed("a copy into pageable memory"));
    }
    match target {
        Target::Default(_) => {
            // SAFETY: forwarded contract of the driver API.
            try_cu!(unsafe { copy_at_once(&s, dst, dst_side, src, src_side, len) });
        }
        Target::Stream(st) => {
            queue_copy(&mut s, &st, dst, dst_side, src, src_side, len);
            if synchronous {
                drop(s);
                st.synchronize("a copy into pageable memory");
                return healthy(&state(), st.context).err().unwrap_or(SUCCESS);
            }
        }
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

/// The device ordinal `dev` names, if it is one.
fn device_ordinal(dev: c_int) -> Result<usize, CUresult> {
    usize::try_from(dev)
        .ok()
        .filter(|&d| d < config().devices)
        .ok_or(INVALID_DEVICE)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    try_cu!(enter(&state()));
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *n = config().devices as c_int };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    try_cu!(enter(&state()));
    try_cu!(device_ordinal(ordinal));
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *dev = ordinal };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    try_cu!(enter(&state()));
    try_cu!(device_ordinal(dev));
    let text = format!("tensorferry fake CUDA device {dev}\0");
    let n = text.len().min(len.max(0) as usize);
    // SAFETY: `name` holds `len` bytes (driver API contract); at most that many are written.
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, name, n) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    let d = try_cu!(device_ordinal(dev));
    *s.retained.entry(d).or_default() += 1;
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *ctx = context_handle(d) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    let d = try_cu!(device_ordinal(dev));
    match s.retained.get_mut(&d) {
        Some(n) if *n > 0 => {
            *n -= 1;
            SUCCESS
        }
        _ => INVALID_CONTEXT,
    }
}

/// Whether `dev`'s primary context is active (retained by someone): flags are always 0.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: c_int,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s));
    let d = try_cu!(device_ordinal(dev));
    let is_active = s.retained.get(&d).is_some_and(|&n| n > 0);
    // SAFETY: valid out pointers (driver API contract).
    unsafe {
        *flags = 0;
        *active = c_int::from(is_active);
    }
    SUCCESS
}

/// Swaps the calling thread's stream-capture mode (0 global, the default; 1 thread-local;
/// 2 relaxed), which decides what a capture in progress forbids it (the `capture` rule).
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    if !state().initialised {
        return NOT_INITIALIZED;
    }
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
    if !state().initialised {
        return NOT_INITIALIZED;
    }
    if ctx.is_null() {
        CURRENT.with(|c| c.set(0));
        return SUCCESS;
    }
    match context_of(ctx) {
        Some(d) => {
            CURRENT.with(|c| c.set(d + 1));
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(out: *mut *mut c_void) -> CUresult {
    if !state().initialised {
        return NOT_INITIALIZED;
    }
    let handle = current().map_or(std::ptr::null_mut(), context_handle);
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CUresult {
    if !state().initialised {
        return NOT_INITIALIZED;
    }
    let Some(d) = context_of(ctx) else {
        return INVALID_CONTEXT;
    };
    STACK.with(|s| s.borrow_mut().push(CURRENT.with(Cell::get)));
    CURRENT.with(|c| c.set(d + 1));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(out: *mut *mut c_void) -> CUresult {
    if !state().initialised {
        return NOT_INITIALIZED;
    }
    let Some(current) = current() else {
        return INVALID_CONTEXT;
    };
    let below = STACK.with(|s| s.borrow_mut().pop()).unwrap_or(0);
    CURRENT.with(|c| c.set(below));
    if !out.is_null() {
        // SAFETY: valid out pointer when not null (driver API contract).
        unsafe { *out = context_handle(current) };
    }
    SUCCESS
}

/// Waits for all work queued in the current context. Refused while a stream of the
/// context captures (that synchronisation would necessarily conflict with the capture).
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    let mut s = state();
    let ctx = try_cu!(enter_context(&s));
    if strict(Rule::Capture) {
        let mut conflicting = false;
        for c in s.captures.values_mut().filter(|c| c.context == ctx) {
            c.invalidated = true;
            conflicting = true;
        }
        if conflicting {
            return STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    let streams = streams_of(&s, ctx);
    drop(s);
    synchronize_context(streams, "cuCtxSynchronize");
    healthy(&state(), ctx).err().unwrap_or(SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut c_int,
    dev: c_int,
    peer: c_int,
) -> CUresult {
    try_cu!(enter(&state()));
    let (d, p) = (try_cu!(device_ordinal(dev)), try_cu!(device_ordinal(peer)));
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *can = c_int::from(d != p && config().peer) };
    SUCCESS
}

/// Lets the current context access `peer`'s memory directly (one direction).
#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, flags: c_uint) -> CUresult {
    let mut s = state();
    let ctx = try_cu!(enter_context(&s));
    let Some(p) = context_of(peer) else {
        return INVALID_CONTEXT;
    };
    if flags != 0 {
        return INVALID_VALUE;
    }
    if p == ctx {
        return INVALID_DEVICE;
    }
    if !config().peer {
        return PEER_ACCESS_UNSUPPORTED;
    }
    if !s.peer.insert((ctx, p)) {
        return PEER_ACCESS_ALREADY_ENABLED;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, len: usize) -> CUresult {
    let mut s = state();
    let dev = try_cu!(enter_context(&s));
    try_cu!(capture_allows(&mut s));
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

/// The memory type and the device ordinal are known: an address inside a live allocation
/// gives its GPU; any other address is `CUDA_ERROR_INVALID_VALUE`, as the driver answers
/// for host memory it does not know. Needs a current context (the driver answers in the
/// current context's unified address space: `CUDA_ERROR_INVALID_CONTEXT` without one).
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    out: *mut c_void,
    attribute: c_int,
    address: u64,
) -> CUresult {
    let s = state();
    try_cu!(enter_context(&s));
    let address = address as usize;
    let owner = allocation_at(&s, address).filter(|(start, a)| address < start + a.len);
    if attribute == POINTER_ATTRIBUTE_MEMORY_TYPE {
        let kind = match (is_pinned(&s, address, 1), owner) {
            (true, _) => MEMORYTYPE_HOST,
            (_, Some(_)) => MEMORYTYPE_DEVICE,
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
    match owner {
        Some((_, a)) => {
            // SAFETY: the attribute is an int; valid out pointer (driver API contract).
            unsafe { *(out as *mut c_int) = a.device as c_int };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

/// Frees device memory, first waiting for all work queued in its context (the
/// `implicit-sync` rule); a copy still queued elsewhere on it is a use after free.
#[no_mangle]
pub extern "C" fn cuMemFree_v2(address: u64) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    try_cu!(capture_allows(&mut s));
    let address = address as usize;
    let Some(device) = s.device.get(&address).map(|a| a.device) else {
        return INVALID_VALUE;
    };
    try_cu!(healthy(&s, device));
    if strict(Rule::ImplicitSync) {
        try_cu!(implicit_sync_allowed("cuMemFree"));
        let streams = streams_of(&s, device);
        drop(s);
        synchronize_context(streams, "cuMemFree");
        s = state();
    }
    let Some(len) = s.device.get(&address).map(|a| a.len) else {
        return INVALID_VALUE; // freed meanwhile by another thread
    };
    check_free(&s, "cuMemFree", address, len);
    s.device.remove(&address);
    *s.used.entry(device).or_default() -= len;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let s = state();
    let dev = try_cu!(enter_context(&s));
    let used = s.used.get(&dev).copied().unwrap_or(0);
    // SAFETY: valid out pointers (driver API contract).
    unsafe {
        *free = config().capacity - used;
        *total = config().capacity;
    }
    SUCCESS
}

/// Pins new host memory; a barrier between the work queued in the current context before
/// it and after it (the `implicit-sync` rule).
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    out: *mut *mut c_void,
    len: usize,
    _flags: c_uint,
) -> CUresult {
    let mut s = state();
    let ctx = try_cu!(enter_context(&s));
    try_cu!(capture_allows(&mut s));
    if thread_fault(FAULT_PIN) {
        return OUT_OF_MEMORY;
    }
    let mut backing = vec![0u8; len.max(1)];
    let ptr = backing.as_mut_ptr();
    s.pinned.insert(
        ptr as usize,
        Pinned {
            len,
            owned: Some(backing),
        },
    );
    if strict(Rule::ImplicitSync) {
        // Every stream's later work waits for every other stream's earlier work.
        let streams = streams_of(&s, ctx);
        let marks: Vec<_> = streams.iter().map(|st| st.mark()).collect();
        for (i, st) in streams.iter().enumerate() {
            for (j, (e, g)) in marks.iter().enumerate() {
                if i != j {
                    st.push(Op::Wait(e.clone(), *g));
                }
            }
        }
    }
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = ptr as *mut c_void };
    SUCCESS
}

/// Unpins (and frees) or unregisters host memory at `ptr`: `owned` says which. With a
/// context current, first waits for all work queued in it (the `implicit-sync` rule); a
/// copy still queued elsewhere on the memory is a use after free.
fn release_host(ptr: *mut c_void, owned: bool, what: &str) -> CUresult {
    let mut s = state();
    let ctx = try_cu!(enter(&s));
    try_cu!(capture_allows(&mut s));
    let address = ptr as usize;
    match s.pinned.get(&address) {
        Some(p) if p.owned.is_some() == owned => {}
        _ => return INVALID_VALUE,
    }
    if let (Some(ctx), true) = (ctx, strict(Rule::ImplicitSync)) {
        try_cu!(implicit_sync_allowed(what));
        let streams = streams_of(&s, ctx);
        drop(s);
        synchronize_context(streams, what);
        s = state();
    }
    let Some(len) = s.pinned.get(&address).map(|p| p.len) else {
        return INVALID_VALUE; // released meanwhile by another thread
    };
    check_free(&s, what, address, len);
    s.pinned.remove(&address);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CUresult {
    release_host(ptr, true, "cuMemFreeHost")
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(ptr: *mut c_void, len: usize, _flags: c_uint) -> CUresult {
    let mut s = state();
    try_cu!(enter_context(&s));
    try_cu!(capture_allows(&mut s));
    if len == 0 || check_range(&s, ptr as usize, len, Side::Host).is_err() {
        return INVALID_VALUE;
    }
    s.pinned.insert(ptr as usize, Pinned { len, owned: None });
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(ptr: *mut c_void) -> CUresult {
    release_host(ptr, false, "cuMemHostUnregister")
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
    let ctx = try_cu!(enter_context(&s));
    if config().version < 12080 {
        // A driver older than 12.8 has no such entry point: calling it is fatal.
        corrupt(&mut s, ctx, ILLEGAL_ADDRESS);
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
    let Target::Stream(st) = try_cu!(stream_of(&s, stream)) else {
        return INVALID_VALUE; // the default stream is not allowed for batched copies
    };
    try_cu!(healthy(&s, st.context));
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
    let queued = fails_at.unwrap_or(count);
    let synchronous =
        (0..queued).any(|i| into_pageable(&s, dsts[i] as usize, srcs[i] as usize, sizes[i]));
    if synchronous {
        try_cu!(implicit_sync_allowed("a batched copy into pageable memory"));
    }
    for i in 0..queued {
        let (dst, src) = (dsts[i] as usize, srcs[i] as usize);
        queue_copy(&mut s, &st, dst, Side::Any, src, Side::Any, sizes[i]);
    }
    if let Some(i) = fails_at {
        if !fail_idx.is_null() {
            // SAFETY: valid out pointer when not null (driver API contract).
            unsafe { *fail_idx = i };
        }
        return UNKNOWN;
    }
    if synchronous {
        drop(s);
        st.synchronize("a batched copy into pageable memory");
        return healthy(&state(), st.context).err().unwrap_or(SUCCESS);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: c_uint) -> CUresult {
    let mut s = state();
    let ctx = try_cu!(enter_context(&s));
    let stream = Stream::spawn(ctx, flags & STREAM_NON_BLOCKING == 0);
    let handle = stream.handle();
    s.streams.insert(handle, stream);
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle as *mut c_void };
    SUCCESS
}

/// Destroys a stream (from any context, even a corrupted one); its queued work still runs.
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    s.captures.remove(&(stream as usize));
    match s.streams.remove(&(stream as usize)) {
        Some(_) => SUCCESS, // its thread ends once its queued work has run
        None => INVALID_HANDLE,
    }
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s));
    let target = try_cu!(stream_of(&s, stream));
    try_cu!(healthy(&s, target.context()));
    drop(s);
    if let Target::Stream(st) = &target {
        st.synchronize("cuStreamSynchronize");
    }
    healthy(&state(), target.context()).err().unwrap_or(SUCCESS)
}

/// Begins capturing `stream` in `mode`: its work is captured, not run, until
/// `cuStreamEndCapture`; what the capture forbids meanwhile is the `capture` rule.
#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, mode: c_uint) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    let Target::Stream(st) = try_cu!(stream_of(&s, stream)) else {
        return INVALID_VALUE; // the default stream cannot be captured
    };
    if mode > 2 || s.captures.contains_key(&st.handle()) {
        return INVALID_VALUE;
    }
    let capture = Capture {
        thread: std::thread::current().id(),
        mode,
        context: st.context,
        invalidated: false,
    };
    s.captures.insert(st.handle(), capture);
    SUCCESS
}

/// Ends a capture: a graph handle (an opaque placeholder: nothing here launches graphs), or
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` when a forbidden call broke it.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    graph: *mut *mut c_void,
) -> CUresult {
    let mut s = state();
    try_cu!(enter(&s));
    let handle = stream as usize;
    let Some(c) = s.captures.get(&handle) else {
        return STREAM_CAPTURE_UNMATCHED;
    };
    if c.mode != CAPTURE_RELAXED && c.thread != std::thread::current().id() {
        return STREAM_CAPTURE_WRONG_THREAD;
    }
    let c = s.captures.remove(&handle).expect("present");
    let (code, out) = if c.invalidated {
        (STREAM_CAPTURE_INVALIDATED, std::ptr::null_mut())
    } else {
        (SUCCESS, 0x9_0000 as *mut c_void)
    };
    if !graph.is_null() {
        // SAFETY: valid out pointer when not null (driver API contract).
        unsafe { *graph = out };
    }
    code
}

/// The event behind a handle (null is no event).
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
    let ctx = try_cu!(enter_context(&state()));
    let handle = Box::into_raw(Box::new(Arc::new(Event::new(ctx)))) as *mut c_void;
    // SAFETY: valid out pointer (driver API contract).
    unsafe { *out = handle };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    try_cu!(enter(&state()));
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: see `event_of`; destroyed once (the caller's contract).
    drop(unsafe { Box::from_raw(event as *mut Arc<Event>) });
    SUCCESS
}

/// Records `event` on `stream`: both must belong to one context (the `contexts` rule).
#[no_mangle]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s));
    let e = try_cu!(event_of(event));
    let target = try_cu!(stream_of(&s, stream));
    if strict(Rule::Contexts) && target.context() != e.context {
        return INVALID_HANDLE;
    }
    try_cu!(healthy(&s, target.context()));
    if thread_fault(FAULT_RECORD) {
        return UNKNOWN;
    }
    if thread_fault(FAULT_QUERY) {
        e.fails.store(true, Ordering::SeqCst);
    }
    let generation = e.next_generation();
    match target {
        Target::Stream(st) if capturing(&s, st.handle()) => {}
        Target::Stream(st) => st.push(Op::Record(e.clone(), generation)),
        Target::Default(ctx) if (stream as usize) <= STREAM_LEGACY && strict(Rule::Legacy) => {
            record_on_legacy(&s, ctx, e.clone(), generation)
        }
        Target::Default(_) => e.complete(generation),
    }
    SUCCESS
}

/// Records `e` on the legacy default stream of `context`: work there runs after the work
/// queued so far on every blocking stream of the context (the `legacy` rule), so the event
/// completes once each of them has run it.
fn record_on_legacy(s: &State, context: usize, e: Arc<Event>, generation: u64) {
    let marks: Vec<_> = streams_of(s, context)
        .iter()
        .filter(|st| st.blocking)
        .map(|st| st.mark())
        .collect();
    if marks.is_empty() {
        return e.complete(generation);
    }
    std::thread::spawn(move || {
        for (m, g) in marks {
            m.wait_for(g);
        }
        e.complete(generation);
    });
}

/// Whether the work an event captured has run; asked from any context.
#[no_mangle]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CUresult {
    let s = state();
    try_cu!(enter(&s));
    let e = try_cu!(event_of(event));
    try_cu!(healthy(&s, e.context));
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
    try_cu!(enter(&s));
    let e = try_cu!(event_of(event));
    try_cu!(healthy(&s, e.context));
    drop(s);
    e.block_for(e.recorded(), "cuEventSynchronize");
    if e.fails.load(Ordering::SeqCst) {
        return UNKNOWN;
    }
    healthy(&state(), e.context).err().unwrap_or(SUCCESS)
}

/// Test hook: holds `stream` (nothing queued on it after this call runs) until the
/// returned gate is passed to [`tf_fake_cuda_open`]; null when `stream` is not one of ours.
#[no_mangle]
pub extern "C" fn tf_fake_cuda_gate(stream: *mut c_void) -> *mut c_void {
    let s = state();
    let Ok(Target::Stream(st)) = stream_of(&s, stream) else {
        return std::ptr::null_mut();
    };
    let gate = Arc::new(Event::new(st.context));
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

/// Makes `stream` wait for `event`, which may belong to another context (as documented).
#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    let s = state();
    try_cu!(enter(&s));
    let e = try_cu!(event_of(event));
    let target = try_cu!(stream_of(&s, stream));
    try_cu!(healthy(&s, target.context()));
    let generation = e.recorded();
    match target {
        Target::Stream(st) if capturing(&s, st.handle()) => {}
        Target::Stream(st) => st.push(Op::Wait(e.clone(), generation)),
        Target::Default(_) => {
            drop(s);
            e.block_for(generation, "cuStreamWaitEvent on the default stream");
        }
    }
    SUCCESS
}

#[cfg(test)]
mod tests;
