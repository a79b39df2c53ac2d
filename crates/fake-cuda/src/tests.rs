//! The fake must catch what it claims to catch, or the suite run against it proves
//! nothing. Each rule has a test whose scenario runs in a child process with two devices
//! (the configuration is read once per process, and a sticky error or an abort must reach
//! no other test); [`each_rule_test_fails_with_its_rule_switched_off`] runs each of them
//! again with its rule off (`TF_FAKE_CUDA_LENIENT`), where it must fail.

use super::*;
use std::process::{Command, Output};

/// Set in the child processes that run a scenario.
const CHILD: &str = "TF_FAKE_CUDA_TEST_CHILD";
/// What a scenario prints once it has run to the end.
const PASSED: &str = "scenario ran to the end";
/// Longer than any correct wait here takes.
const PATIENCE: Duration = Duration::from_secs(20);
/// How long a negative check ("has not run") gives the work to run wrongly.
const SETTLE: Duration = Duration::from_millis(200);

fn in_child() -> bool {
    std::env::var(CHILD).is_ok()
}

/// Runs test `name` of this module alone in a child process with two devices.
fn child(name: &str, env: &[(&str, &str)]) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([
            &format!("tests::{name}"),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("TF_FAKE_CUDA_DEVICES", "2")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs the scenario of test `name` in a child; it must run to the end.
fn passes(name: &str, env: &[(&str, &str)]) {
    let out = child(name, env);
    assert!(
        out.status.success() && text(&out).contains(PASSED),
        "{name}:\n{}",
        text(&out)
    );
}

/// Runs the scenario of test `name` in a child; the fake must abort it with `message`.
fn aborts_with(name: &str, message: &str) {
    let out = child(name, &[]);
    let said = text(&out);
    assert!(
        !out.status.success() && !said.contains(PASSED) && said.contains(message),
        "{name} was meant to abort with {message:?}:\n{said}"
    );
}

/// Runs the enclosing test's scenario in a child process, unless this is that child.
macro_rules! in_a_child {
    ($name:ident) => {
        if !in_child() {
            return passes(stringify!($name), &[]);
        }
    };
    ($name:ident, aborts with $message:expr) => {
        if !in_child() {
            return aborts_with(stringify!($name), $message);
        }
    };
}

// ------------------------------------------------------------- safe wrappers for scenarios

fn ok(code: CUresult) {
    assert_eq!(code, SUCCESS);
}

/// `cuInit`, and both devices' primary contexts retained.
fn init() {
    ok(cuInit(0));
    for d in 0..2 {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live out pointer.
        ok(unsafe { cuDevicePrimaryCtxRetain(&mut ctx, d) });
    }
}

/// Makes device `d`'s context current on this thread.
fn on(d: usize) {
    ok(cuCtxSetCurrent(context_handle(d)));
}

fn alloc(len: usize) -> u64 {
    let mut d = 0;
    // SAFETY: a live out pointer.
    ok(unsafe { cuMemAlloc_v2(&mut d, len) });
    d
}

fn pin(len: usize) -> usize {
    let mut p = std::ptr::null_mut();
    // SAFETY: a live out pointer.
    ok(unsafe { cuMemHostAlloc(&mut p, len, 0) });
    p as usize
}

fn stream() -> *mut c_void {
    let mut s = std::ptr::null_mut();
    // SAFETY: a live out pointer.
    ok(unsafe { cuStreamCreate(&mut s, 0) });
    s
}

fn event() -> *mut c_void {
    let mut e = std::ptr::null_mut();
    // SAFETY: a live out pointer.
    ok(unsafe { cuEventCreate(&mut e, 0) });
    e
}

/// Fills `len` bytes of device memory at `dst` with `byte`, synchronously.
fn fill(dst: u64, len: usize, byte: u8) {
    let host = vec![byte; len];
    // SAFETY: `host` holds `len` bytes for the synchronous call.
    ok(unsafe { cuMemcpyHtoD_v2(dst, host.as_ptr().cast(), len) });
}

/// Queues a host → device copy; `src` must stay valid until the stream has run it.
fn upload(dst: u64, src: usize, len: usize, stream: *mut c_void) -> CUresult {
    // SAFETY: the caller keeps `src` valid until the copy has run (the driver's contract).
    unsafe { cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream) }
}

/// Queues a device → host copy; `dst` must stay valid until the stream has run it.
fn download(dst: usize, src: u64, len: usize, stream: *mut c_void) -> CUresult {
    // SAFETY: the caller keeps `dst` valid until the copy has run (the driver's contract).
    unsafe { cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream) }
}

/// A held stream, opened when dropped.
struct Gate(*mut c_void);

fn hold(stream: *mut c_void) -> Gate {
    let g = tf_fake_cuda_gate(stream);
    assert!(!g.is_null());
    Gate(g)
}

impl Drop for Gate {
    fn drop(&mut self) {
        // SAFETY: from `tf_fake_cuda_gate`, opened once.
        unsafe { tf_fake_cuda_open(self.0) };
    }
}

/// Whether a call made on another thread (which sets `returned` when it does) blocks in
/// the driver (`true`) or returns at once (`false`).
fn blocks(returned: &AtomicBool) -> bool {
    let start = Instant::now();
    loop {
        if returned.load(Ordering::SeqCst) {
            return false;
        }
        if tf_fake_cuda_waiting() > 0 {
            return true;
        }
        assert!(start.elapsed() < PATIENCE, "neither blocked nor returned");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `call` on a thread with device `d`'s context current; whether it blocked in the
/// driver until `release` ran (released after it was seen blocking), and its result.
fn blocking_call(
    d: usize,
    call: impl FnOnce() -> CUresult + Send + 'static,
    release: impl FnOnce(),
) -> (bool, CUresult) {
    let returned = Arc::new(AtomicBool::new(false));
    let r = returned.clone();
    let t = std::thread::spawn(move || {
        on(d);
        let code = call();
        r.store(true, Ordering::SeqCst);
        code
    });
    let blocked = blocks(&returned);
    release();
    (blocked, t.join().unwrap())
}

// --------------------------------------------------------------------- always-on rules

#[test]
fn the_copy_calls_to_fail_are_a_list_of_call_numbers() {
    assert_eq!(fail_list("3"), [3]);
    assert_eq!(fail_list(" 3, 14 "), [3, 14]);
    assert_eq!(fail_list(""), Vec::<u64>::new());
    assert_eq!(fail_list("x,2"), [2]);
}

#[test]
fn lenient_rules_are_named_and_a_wrong_name_is_refused() {
    assert_eq!(
        lenient_rules(" pageable, hazards ").unwrap(),
        [Rule::Pageable, Rule::Hazards]
    );
    assert_eq!(lenient_rules("all").unwrap().len(), RULES.len());
    assert_eq!(lenient_rules("").unwrap(), []);
    assert_eq!(lenient_rules("pagable").unwrap_err(), "pagable");
}

#[test]
fn copies_land_late_and_ranges_are_checked() {
    in_a_child!(copies_land_late_and_ranges_are_checked);
    // SAFETY: a live out pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut 0, 16) }, NOT_INITIALIZED);
    init();
    // SAFETY: a live out pointer.
    let no_context = unsafe { cuMemAlloc_v2(&mut 0, 16) };
    assert_eq!(no_context, INVALID_CONTEXT);
    on(0);
    let dev = alloc(4096);
    let host = vec![7u8; 4096];
    // A device range past the allocation is refused.
    // SAFETY: `host` holds 4096 bytes.
    let past = unsafe { cuMemcpyHtoD_v2(dev + 1, host.as_ptr().cast(), 4096) };
    assert_eq!(past, INVALID_VALUE);
    // Asynchronous copies land late: reading before synchronising sees old bytes. Pinned
    // memory, so that the copy is asynchronous for the host too.
    fill(dev, 4096, 7);
    let s = stream();
    let back = pin(4096);
    let held = hold(s);
    ok(download(back, dev, 4096, s));
    // SAFETY: `back` is 4096 pinned bytes; the queued copy has not run (the stream is held).
    let early = unsafe { *(back as *const u8) };
    assert_eq!(early, 0, "the copy is still queued");
    drop(held);
    ok(cuStreamSynchronize(s));
    // SAFETY: as above, and the copy has run.
    let landed = unsafe { std::slice::from_raw_parts(back as *const u8, 4096) };
    assert_eq!(landed, &host[..]);
    println!("{PASSED}");
}

// ---------------------------------------------------------------------- the rules

#[test]
fn events_record_only_on_streams_of_their_own_context() {
    in_a_child!(events_record_only_on_streams_of_their_own_context);
    init();
    on(0);
    let (s0, e0, d0) = (stream(), event(), alloc(64));
    on(1);
    let (s1, e1) = (stream(), event());
    assert_eq!(
        cuEventRecord(e0, s1),
        INVALID_HANDLE,
        "event of 0, stream of 1"
    );
    assert_eq!(
        cuEventRecord(e0, std::ptr::null_mut()),
        INVALID_HANDLE,
        "the default stream is the current context's"
    );
    ok(cuEventRecord(e1, s1));
    // What the Programming Guide allows across devices: waits, queries, copies.
    ok(cuStreamWaitEvent(s1, e1, 0));
    on(0);
    ok(cuEventRecord(e0, s0));
    ok(cuEventRecord(e0, std::ptr::null_mut()));
    on(1);
    ok(cuStreamWaitEvent(s1, e0, 0));
    assert!(matches!(cuEventQuery(e0), SUCCESS | NOT_READY));
    let host = [3u8; 64];
    ok(upload(d0, host.as_ptr() as usize, 64, s0));
    ok(cuStreamSynchronize(s0));
    println!("{PASSED}");
}

#[test]
fn a_copy_into_pageable_memory_returns_only_once_it_is_done() {
    in_a_child!(a_copy_into_pageable_memory_returns_only_once_it_is_done);
    init();
    on(0);
    let dev = alloc(4096);
    fill(dev, 4096, 9);
    let s = stream();
    // Into pinned memory the call returns at once, the copy still queued.
    let pinned = pin(4096);
    let held = hold(s);
    ok(download(pinned, dev, 4096, s));
    assert_eq!(tf_fake_cuda_waiting(), 0);
    drop(held);
    ok(cuStreamSynchronize(s));
    // Into pageable memory the call waits until the copy has run.
    let pageable = vec![0u8; 4096];
    let at = pageable.as_ptr() as usize;
    let (s_, held) = (s as usize, hold(s));
    let (blocked, code) = blocking_call(
        0,
        move || download(at, dev, 4096, s_ as *mut c_void),
        || drop(held),
    );
    assert!(
        blocked,
        "the copy into pageable memory returned before it ran"
    );
    ok(code);
    assert!(
        pageable.iter().all(|&b| b == 9),
        "returned before the bytes were there"
    );
    println!("{PASSED}");
}

#[test]
fn freeing_memory_waits_for_the_work_queued_in_its_context() {
    in_a_child!(freeing_memory_waits_for_the_work_queued_in_its_context);
    init();
    on(0);
    let (s, busy) = (stream(), alloc(4096));
    let source = vec![1u8; 4096];
    for free_host in [false, true] {
        let (dev, host) = (alloc(64), pin(64));
        let held = hold(s);
        ok(upload(busy, source.as_ptr() as usize, 4096, s));
        let (blocked, code) = blocking_call(
            0,
            move || match free_host {
                false => cuMemFree_v2(dev),
                true => cuMemFreeHost(host as *mut c_void),
            },
            || drop(held),
        );
        let what = if free_host {
            "cuMemFreeHost"
        } else {
            "cuMemFree"
        };
        assert!(
            blocked,
            "{what} did not wait for the copy queued in its context"
        );
        ok(code);
        ok(match free_host {
            false => cuMemFreeHost(host as *mut c_void),
            true => cuMemFree_v2(dev),
        });
    }
    println!("{PASSED}");
}

#[test]
fn pinning_memory_orders_later_work_after_earlier_work_on_every_stream() {
    in_a_child!(pinning_memory_orders_later_work_after_earlier_work_on_every_stream);
    init();
    on(0);
    let (a, b, dev) = (stream(), stream(), alloc(4096));
    let source = vec![1u8; 4096];
    let done_on_b = |pin_between: bool| {
        let held = hold(a);
        ok(upload(dev, source.as_ptr() as usize, 4096, a));
        if pin_between {
            pin(64);
        }
        let e = event();
        ok(cuEventRecord(e, b));
        std::thread::sleep(SETTLE);
        let done = cuEventQuery(e) == SUCCESS;
        drop(held);
        ok(cuCtxSynchronize());
        done
    };
    assert!(
        done_on_b(false),
        "streams wait for each other without a pin"
    );
    assert!(
        !done_on_b(true),
        "work queued after cuMemHostAlloc ran before work queued before it"
    );
    println!("{PASSED}");
}

#[test]
fn a_capture_forbids_unsafe_calls_as_its_mode_says() {
    in_a_child!(a_capture_forbids_unsafe_calls_as_its_mode_says);
    init();
    on(0);
    let s = stream();
    let capture = |mode: c_uint| ok(cuStreamBeginCapture_v2(s, mode));
    let end = || {
        let mut graph = std::ptr::null_mut();
        // SAFETY: a live out pointer.
        unsafe { cuStreamEndCapture(s, &mut graph) }
    };
    // Allocating and freeing device and pinned memory, on another thread in `mode`.
    let elsewhere = |mode: c_uint| {
        std::thread::spawn(move || {
            on(0);
            let mut m = mode;
            // SAFETY: a live in/out integer.
            ok(unsafe { cuThreadExchangeStreamCaptureMode(&mut m) });
            let (mut dev, mut host) = (0u64, std::ptr::null_mut());
            // SAFETY: live out pointers; what is allocated is freed just after.
            unsafe {
                [
                    cuMemAlloc_v2(&mut dev, 64),
                    cuMemFree_v2(dev),
                    cuMemHostAlloc(&mut host, 64, 0),
                    cuMemFreeHost(host),
                ]
            }
        })
        .join()
        .unwrap()
    };
    // A global capture forbids them to another thread in the global mode, and is broken.
    capture(CAPTURE_GLOBAL);
    assert_eq!(elsewhere(CAPTURE_GLOBAL)[0], STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(end(), STREAM_CAPTURE_INVALIDATED);
    // Relaxed or thread-local threads may make them; the capture survives.
    capture(CAPTURE_GLOBAL);
    assert_eq!(elsewhere(CAPTURE_RELAXED), [SUCCESS; 4]);
    assert_eq!(elsewhere(1), [SUCCESS; 4]);
    ok(end());
    // The capturing thread itself may not (unless its capture is relaxed).
    capture(1);
    // SAFETY: a live out pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut 0, 64) },
        STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(end(), STREAM_CAPTURE_INVALIDATED);
    // Synchronising the capturing context conflicts with the capture in any mode.
    capture(CAPTURE_RELAXED);
    assert_eq!(cuCtxSynchronize(), STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(end(), STREAM_CAPTURE_INVALIDATED);
    println!("{PASSED}");
}

#[test]
fn a_sticky_error_fails_every_later_call_in_its_context_only() {
    in_a_child!(a_sticky_error_fails_every_later_call_in_its_context_only);
    init();
    on(1);
    let (s1, e1, d1) = (stream(), event(), alloc(64));
    ok(cuEventRecord(e1, s1));
    on(0);
    let (s0, d0) = (stream(), alloc(64));
    ok(tf_fake_cuda_fault_context(1, ILLEGAL_ADDRESS));
    // Calls on the context's streams and events fail from any context.
    assert_eq!(cuEventQuery(e1), ILLEGAL_ADDRESS);
    assert_eq!(cuStreamSynchronize(s1), ILLEGAL_ADDRESS);
    let host = [1u8; 64];
    assert_eq!(upload(d0, host.as_ptr() as usize, 64, s1), ILLEGAL_ADDRESS);
    // Calls with it current fail.
    on(1);
    // SAFETY: a live out pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut 0, 64) }, ILLEGAL_ADDRESS);
    assert_eq!(cuEventRecord(e1, s1), ILLEGAL_ADDRESS);
    assert_eq!(cuMemFree_v2(d1), ILLEGAL_ADDRESS);
    assert_eq!(cuCtxSynchronize(), ILLEGAL_ADDRESS);
    // The other context works on.
    on(0);
    ok(upload(d0, host.as_ptr() as usize, 64, s0));
    ok(cuStreamSynchronize(s0));
    ok(cuMemFree_v2(alloc(64)));
    println!("{PASSED}");
}

#[test]
fn a_copy_between_devices_is_direct_only_once_peer_access_is_enabled() {
    in_a_child!(a_copy_between_devices_is_direct_only_once_peer_access_is_enabled);
    init();
    on(0);
    let d0 = alloc(4096);
    fill(d0, 4096, 5);
    on(1);
    let (s1, d1) = (stream(), alloc(4096));
    let counts = || {
        let (mut direct, mut staged) = (0, 0);
        // SAFETY: live out pointers.
        ok(unsafe { tf_fake_cuda_peer_copies(&mut direct, &mut staged) });
        (direct, staged)
    };
    let copy = || {
        // SAFETY: both ranges are live device allocations.
        ok(unsafe { cuMemcpyAsync(d1, d0, 4096, s1) });
        ok(cuStreamSynchronize(s1));
    };
    copy();
    assert_eq!(
        counts(),
        (0, 1),
        "staged through the host without peer access"
    );
    let mut can = 0;
    // SAFETY: a live out pointer.
    ok(unsafe { cuDeviceCanAccessPeer(&mut can, 1, 0) });
    assert_eq!(can, 1);
    ok(cuCtxEnablePeerAccess(context_handle(0), 0));
    assert_eq!(
        cuCtxEnablePeerAccess(context_handle(0), 0),
        PEER_ACCESS_ALREADY_ENABLED
    );
    assert_eq!(cuCtxEnablePeerAccess(context_handle(1), 0), INVALID_DEVICE);
    copy();
    assert_eq!(counts(), (1, 1));
    let mut back = vec![0u8; 4096];
    // SAFETY: `back` holds 4096 bytes.
    ok(unsafe { cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d1, 4096) });
    assert!(back.iter().all(|&b| b == 5));
    println!("{PASSED}");
}

#[test]
fn devices_that_cannot_reach_each_other_refuse_peer_access() {
    if !in_child() {
        return passes(
            "devices_that_cannot_reach_each_other_refuse_peer_access",
            &[("TF_FAKE_CUDA_PEER", "0")],
        );
    }
    init();
    let mut can = 1;
    // SAFETY: a live out pointer.
    ok(unsafe { cuDeviceCanAccessPeer(&mut can, 1, 0) });
    assert_eq!(can, 0);
    on(1);
    assert_eq!(
        cuCtxEnablePeerAccess(context_handle(0), 0),
        PEER_ACCESS_UNSUPPORTED
    );
    println!("{PASSED}");
}

#[test]
fn freeing_device_memory_a_copy_on_another_device_still_reads_aborts() {
    in_a_child!(freeing_device_memory_a_copy_on_another_device_still_reads_aborts, aborts with "use after free: cuMemFree");
    init();
    on(0);
    let d0 = alloc(4096);
    on(1);
    let (s1, d1) = (stream(), alloc(4096));
    let _held = hold(s1);
    // SAFETY: both ranges are live device allocations.
    ok(unsafe { cuMemcpyAsync(d1, d0, 4096, s1) });
    on(0);
    // The free waits for device 0's work only: the copy queued on device 1 reads freed memory.
    cuMemFree_v2(d0);
    println!("{PASSED}");
}

#[test]
fn freeing_pinned_memory_a_queued_copy_still_reads_aborts() {
    in_a_child!(freeing_pinned_memory_a_queued_copy_still_reads_aborts, aborts with "use after free: cuMemFreeHost");
    init();
    on(1);
    let (s1, d1) = (stream(), alloc(4096));
    let host = pin(4096);
    let _held = hold(s1);
    ok(upload(d1, host, 4096, s1));
    on(0);
    cuMemFreeHost(host as *mut c_void);
    println!("{PASSED}");
}

#[test]
fn a_copy_overwriting_memory_a_copy_queued_before_it_still_reads_aborts() {
    in_a_child!(a_copy_overwriting_memory_a_copy_queued_before_it_still_reads_aborts, aborts with "still uses the same memory");
    init();
    on(0);
    let (consumer, ours) = (stream(), stream());
    let (theirs, source) = (alloc(4096), alloc(4096));
    let block = pin(4096);
    // A consumer's copy out of a pinned block, held on its stream…
    let _held = hold(consumer);
    ok(upload(theirs, block, 4096, consumer));
    // …and the block reused at once for a download on another stream.
    ok(download(block, source, 4096, ours));
    ok(cuStreamSynchronize(ours));
    println!("{PASSED}");
}

#[test]
fn a_pinned_block_overwritten_while_a_queued_copy_still_reads_it_aborts() {
    in_a_child!(a_pinned_block_overwritten_while_a_queued_copy_still_reads_it_aborts, aborts with "was overwritten while a copy");
    init();
    on(0);
    let (consumer, theirs) = (stream(), alloc(4096));
    let block = pin(4096);
    // A consumer's copy out of a pinned block, held on its stream…
    let held = hold(consumer);
    ok(upload(theirs, block, 4096, consumer));
    // …and the block reused at once by the host (a staging buffer filled for a new upload).
    // SAFETY: `block` is 4096 bytes of pinned memory this test owns.
    unsafe { std::ptr::write_bytes(block as *mut u8, 7, 4096) };
    drop(held);
    ok(cuStreamSynchronize(consumer));
    println!("{PASSED}");
}

#[test]
fn a_pinned_block_written_by_a_copy_ordered_before_the_copy_reading_it_is_no_hazard() {
    in_a_child!(a_pinned_block_written_by_a_copy_ordered_before_the_copy_reading_it_is_no_hazard);
    init();
    on(0);
    let (s, source, target) = (stream(), alloc(4096), alloc(4096));
    fill(source, 4096, 9);
    let block = pin(4096);
    // Staged through the host on one stream: the download fills the block the upload reads.
    let held = hold(s);
    ok(download(block, source, 4096, s));
    ok(upload(target, block, 4096, s));
    drop(held);
    ok(cuStreamSynchronize(s));
    let mut seen = vec![0u8; 4096];
    // SAFETY: `seen` holds 4096 bytes for the synchronous call.
    ok(unsafe { cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), target, 4096) });
    assert!(seen.iter().all(|&b| b == 9));
    println!("{PASSED}");
}

#[test]
fn an_event_on_the_legacy_stream_waits_for_the_blocking_streams_of_its_context() {
    in_a_child!(an_event_on_the_legacy_stream_waits_for_the_blocking_streams_of_its_context);
    init();
    on(0);
    let blocking = stream();
    let mut non_blocking = std::ptr::null_mut();
    // SAFETY: a live out pointer.
    ok(unsafe { cuStreamCreate(&mut non_blocking, STREAM_NON_BLOCKING) });
    let (e, f) = (event(), event());
    // Work held on a non-blocking stream: the legacy stream does not wait for it.
    let other = hold(non_blocking);
    ok(cuEventRecord(e, STREAM_LEGACY as *mut c_void));
    ok(cuEventSynchronize(e));
    // Work held on a blocking stream: it does, and so does the null handle.
    let held = hold(blocking);
    ok(cuEventRecord(e, STREAM_LEGACY as *mut c_void));
    ok(cuEventRecord(f, std::ptr::null_mut()));
    std::thread::sleep(SETTLE);
    assert_eq!(cuEventQuery(e), NOT_READY);
    assert_eq!(cuEventQuery(f), NOT_READY);
    drop(held);
    ok(cuEventSynchronize(e));
    ok(cuEventSynchronize(f));
    drop(other);
    println!("{PASSED}");
}

/// Each rule and a test that proves it.
const PROOFS: [(&str, &str); 12] = [
    (
        "contexts",
        "events_record_only_on_streams_of_their_own_context",
    ),
    (
        "pageable",
        "a_copy_into_pageable_memory_returns_only_once_it_is_done",
    ),
    (
        "implicit-sync",
        "freeing_memory_waits_for_the_work_queued_in_its_context",
    ),
    (
        "implicit-sync",
        "pinning_memory_orders_later_work_after_earlier_work_on_every_stream",
    ),
    ("capture", "a_capture_forbids_unsafe_calls_as_its_mode_says"),
    (
        "sticky",
        "a_sticky_error_fails_every_later_call_in_its_context_only",
    ),
    (
        "peer",
        "a_copy_between_devices_is_direct_only_once_peer_access_is_enabled",
    ),
    (
        "hazards",
        "freeing_device_memory_a_copy_on_another_device_still_reads_aborts",
    ),
    (
        "hazards",
        "freeing_pinned_memory_a_queued_copy_still_reads_aborts",
    ),
    (
        "hazards",
        "a_copy_overwriting_memory_a_copy_queued_before_it_still_reads_aborts",
    ),
    (
        "hazards",
        "a_pinned_block_overwritten_while_a_queued_copy_still_reads_it_aborts",
    ),
    (
        "legacy",
        "an_event_on_the_legacy_stream_waits_for_the_blocking_streams_of_its_context",
    ),
];

#[test]
fn each_rule_test_fails_with_its_rule_switched_off() {
    if in_child() {
        return;
    }
    for (rule, test) in PROOFS {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([&format!("tests::{test}"), "--exact", "--test-threads=1"])
            .env("TF_FAKE_CUDA_LENIENT", rule)
            .env("TF_FAKE_CUDA_HANG_S", "30")
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "{test} passes with the rule {rule} switched off: it proves nothing"
        );
    }
}
