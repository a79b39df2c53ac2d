//! The emulated device `emu:N`, so that machines without a GPU (CI among them) run the
//! very same transfer engine: device memory is a separate host allocation, its two streams
//! (uploads; copies that read device memory, as on a GPU) are threads that run copies in
//! submission order (`super::lane`), and the stream thread that ran a batch releases it
//! and completes its event with the completer's code (`super::completer`). Capacity,
//! speed and faults are set by [`EmuConfig`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use std::any::Any;

use super::completer::{finish_passed, Drain, Entry, Health};
use super::event::{guarded, Event};
use super::event::{Failure, Outcome};
use super::fence::{Fence, StreamHandle};
use super::interface::{Backend, CopyBatch, DeviceMemory};
use super::lane::{submit_to, Lane, Refused, Submitted, LANES};
use super::process::{backends_started_here, same_process};
use super::stream::{Job, StreamThread, STREAM};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::pinned::{HostBlock, PageableAllocator, PinnedAllocator};
use crate::memory::{AlignedBuffer, PinnedPool};

/// Most bytes the pinned pool of an emulated device keeps.
const PINNED_POOL_CAP: usize = 4 << 30;

/// How many emulated devices exist (`emu:0` … `emu:{EMULATED_DEVICES - 1}`).
pub const EMULATED_DEVICES: usize = 2;

/// The environment variable read when an emulated device is first used.
pub const ENV_VAR: &str = "TENSORFERRY_EMU";

/// The slowest bandwidth accepted, in GB/s (1 kB/s): even a copy of `usize::MAX` bytes
/// then takes a delay that a `Duration` holds.
pub const MIN_BANDWIDTH_GBPS: f64 = 1e-6;

/// The longest latency accepted, in microseconds (one minute).
pub const MAX_LATENCY_US: u64 = 60_000_000;

const KEYS: &str =
    "capacity_bytes, bandwidth_gbps, latency_us, fail_alloc, fail_copy, fail_pin, panic_copy";

/// Settings of an emulated device.
#[derive(Clone, Debug, PartialEq)]
pub struct EmuConfig {
    /// Bytes of device memory (default 8 GiB; memory is only taken when allocated).
    pub capacity_bytes: usize,
    /// Copy bandwidth in GB/s, at least [`MIN_BANDWIDTH_GBPS`]; `None` copies at host
    /// speed.
    pub bandwidth_gbps: Option<f64>,
    /// Added to every copy, in microseconds (at most [`MAX_LATENCY_US`]).
    pub latency_us: u64,
    /// Fault injection: the Nth allocation from now fails with out-of-memory (1-based).
    pub fail_alloc: Option<u64>,
    /// Fault injection: the Nth copy from now fails (1-based).
    pub fail_copy: Option<u64>,
    /// Fault injection: the Nth copy from now panics on the stream thread (1-based), to
    /// test that a bug in a job becomes an error for its waiters, not a hang.
    pub panic_copy: Option<u64>,
    /// Fault injection: the Nth buffer the pinned pool pins from now (a buffer it had
    /// cached is reused without pinning) is refused with out-of-memory (1-based), as a GPU
    /// machine's locked-memory limit refuses it.
    pub fail_pin: Option<u64>,
}

impl Default for EmuConfig {
    fn default() -> Self {
        EmuConfig {
            capacity_bytes: 8 << 30,
            bandwidth_gbps: None,
            latency_us: 0,
            fail_alloc: None,
            fail_copy: None,
            panic_copy: None,
            fail_pin: None,
        }
    }
}

/// The error for a bad setting: it names the key and the value.
fn bad_setting(key: &str, value: impl std::fmt::Display, why: &str) -> Error {
    Error::InvalidValue {
        key: ENV_VAR.into(),
        reason: format!("{key}={value}: {why} (keys: {KEYS})"),
    }
}

impl EmuConfig {
    /// Parses comma-separated `key=value` pairs, e.g. `latency_us=20000,capacity_bytes=1000000`.
    /// Keys: `capacity_bytes`, `bandwidth_gbps`, `latency_us`, and the fault-injection keys
    /// `fail_alloc`, `fail_copy`, `fail_pin` and `panic_copy`. An unknown key or a value out of range
    /// (see [`EmuConfig::validate`]) is refused, naming the key.
    pub fn parse(text: &str) -> Result<EmuConfig> {
        let mut c = EmuConfig::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| Error::InvalidValue {
                key: ENV_VAR.into(),
                reason: format!("{pair:?}: expected key=value (keys: {KEYS})"),
            })?;
            let (k, v) = (k.trim(), v.trim());
            let int = || {
                v.parse::<u64>()
                    .map_err(|_| bad_setting(k, v, "expected a whole number"))
            };
            match k {
                "capacity_bytes" => {
                    c.capacity_bytes = usize::try_from(int()?)
                        .map_err(|_| bad_setting(k, v, "does not fit in this machine's memory"))?
                }
                "latency_us" => c.latency_us = int()?,
                "fail_alloc" => c.fail_alloc = Some(int()?),
                "fail_copy" => c.fail_copy = Some(int()?),
                "panic_copy" => c.panic_copy = Some(int()?),
                "fail_pin" => c.fail_pin = Some(int()?),
                "bandwidth_gbps" => {
                    c.bandwidth_gbps = Some(
                        v.parse()
                            .map_err(|_| bad_setting(k, v, "expected a number"))?,
                    )
                }
                _ => {
                    return Err(Error::InvalidValue {
                        key: ENV_VAR.into(),
                        reason: format!("unknown key {k:?} in {pair:?} (keys: {KEYS})"),
                    })
                }
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks every setting is in range: a finite bandwidth of at least
    /// [`MIN_BANDWIDTH_GBPS`], a latency of at most [`MAX_LATENCY_US`], fault counts of
    /// at least 1 (they are 1-based). The error names the key.
    pub fn validate(&self) -> Result<()> {
        if let Some(g) = self.bandwidth_gbps {
            if !g.is_finite() || g < MIN_BANDWIDTH_GBPS {
                return Err(bad_setting(
                    "bandwidth_gbps",
                    format!("{g:?}"),
                    &format!("must be a finite number of at least {MIN_BANDWIDTH_GBPS} (GB/s)"),
                ));
            }
        }
        if self.latency_us > MAX_LATENCY_US {
            return Err(bad_setting(
                "latency_us",
                self.latency_us,
                &format!("must be at most {MAX_LATENCY_US} (one minute)"),
            ));
        }
        for (key, count) in [
            ("fail_alloc", self.fail_alloc),
            ("fail_copy", self.fail_copy),
            ("panic_copy", self.panic_copy),
            ("fail_pin", self.fail_pin),
        ] {
            if count == Some(0) {
                return Err(bad_setting(key, 0, "counts from 1 (the first is 1)"));
            }
        }
        Ok(())
    }

    /// How long a copy of `bytes` takes: the latency plus the bytes at the bandwidth,
    /// saturating (a valid setting never comes near `Duration::MAX`).
    fn delay(&self, bytes: usize) -> Duration {
        let latency = Duration::from_micros(self.latency_us);
        match self.bandwidth_gbps {
            Some(g) => {
                let transfer =
                    Duration::try_from_secs_f64(bytes as f64 / (g * 1e9)).unwrap_or(Duration::MAX);
                latency.saturating_add(transfer)
            }
            None => latency,
        }
    }
}

/// One emulated device: its memory accounting, its settings and its stream.
pub struct EmulatedDevice {
    index: usize,
    config: Arc<Mutex<EmuConfig>>,
    used: Arc<AtomicUsize>,
    allocations: AtomicU64,
    copies: AtomicU64,
    ops: AtomicU64,
    /// Buffers pinned since the settings were made (for `fail_pin`).
    pins: Arc<AtomicU64>,
    lanes: [Arc<Lane>; LANES],
    #[cfg_attr(not(test), allow(dead_code))]
    streams: Arc<[StreamThread; LANES]>,
    pool: Arc<PinnedPool>,
}

impl std::fmt::Debug for EmulatedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EmulatedDevice(emu:{}, {} bytes used)",
            self.index,
            self.used()
        )
    }
}

/// The emulated device `emu:index`, created (reading `TENSORFERRY_EMU`) on first use.
pub fn device(index: usize) -> Result<Arc<EmulatedDevice>> {
    same_process(Device::Emulated(index))?;
    if index >= EMULATED_DEVICES {
        return Err(Error::DeviceUnavailable {
            device: Device::Emulated(index).to_string(),
            reason: format!(
                "only {EMULATED_DEVICES} emulated devices exist (emu:0 … emu:{})",
                EMULATED_DEVICES - 1
            ),
        });
    }
    static REGISTRY: OnceLock<Mutex<HashMap<usize, Arc<EmulatedDevice>>>> = OnceLock::new();
    let registry = REGISTRY.get_or_init(Default::default);
    let mut devices = registry.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&index) {
        return Ok(d.clone());
    }
    let config = match std::env::var(ENV_VAR) {
        Ok(text) => EmuConfig::parse(&text)?,
        Err(_) => EmuConfig::default(),
    };
    let name = Device::Emulated(index);
    let streams = Arc::new([
        StreamThread::spawn(name, STREAM, || {})?,
        StreamThread::spawn(name, STREAM, || {})?,
    ]);
    let config = Arc::new(Mutex::new(config));
    let health = Arc::new(Health::default());
    let lane = |index: usize| {
        let (streams, config, health) = (streams.clone(), config.clone(), health.clone());
        // SAFETY (of what the lane dispatches): lanes are reached only through
        // `Backend::submit`, whose contract covers every batch they queue.
        Lane::new(
            format!("{name}-lane{index}"),
            false,
            |_| false,
            move |s| unsafe { dispatch(name, &streams[index], &config, &health, s) },
        )
    };
    let pins = Arc::new(AtomicU64::new(0));
    let pinning = EmuPinned {
        config: config.clone(),
        pins: pins.clone(),
    };
    let d = Arc::new(EmulatedDevice {
        index,
        lanes: [lane(0), lane(1)],
        streams,
        config,
        used: Arc::new(AtomicUsize::new(0)),
        allocations: AtomicU64::new(0),
        copies: AtomicU64::new(0),
        ops: AtomicU64::new(0),
        pins,
        pool: PinnedPool::new(Box::new(pinning), PINNED_POOL_CAP),
    });
    devices.insert(index, d.clone());
    backends_started_here();
    Ok(d)
}

/// Replaces the settings of `emu:index`; fault counters start again from zero. Settings
/// out of range are refused ([`EmuConfig::validate`]).
pub fn configure(index: usize, config: EmuConfig) -> Result<()> {
    config.validate()?;
    let d = device(index)?;
    *d.config.lock().unwrap_or_else(|p| p.into_inner()) = config;
    d.allocations.store(0, Ordering::SeqCst);
    d.copies.store(0, Ordering::SeqCst);
    d.pins.store(0, Ordering::SeqCst);
    Ok(())
}

/// The emulated device's "pinned" memory: ordinary memory ([`PageableAllocator`]), refused
/// on the injected `fail_pin`.
struct EmuPinned {
    config: Arc<Mutex<EmuConfig>>,
    pins: Arc<AtomicU64>,
}

// SAFETY: every block comes from `PageableAllocator`, whose promise this passes on.
unsafe impl PinnedAllocator for EmuPinned {
    fn alloc(&self, len: usize) -> Result<HostBlock> {
        let n = self.pins.fetch_add(1, Ordering::SeqCst) + 1;
        let refused = self
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fail_pin
            == Some(n);
        if refused {
            return Err(Error::OutOfMemory {
                device: format!("cpu (pinned; injected fault: fail_pin={n})"),
                requested: len,
                free: 0,
                total: 0,
            });
        }
        PageableAllocator.alloc(len)
    }
}

/// The host allocation standing in for device memory; returns its bytes to the device's
/// capacity when dropped.
struct Allocation {
    _memory: AlignedBuffer,
    len: usize,
    used: Arc<AtomicUsize>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.used.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl EmulatedDevice {
    /// Bytes allocated now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Batches submitted since the device was created or last configured.
    pub fn batches(&self) -> u64 {
        self.copies.load(Ordering::SeqCst)
    }

    /// Copy operations submitted since the device was created (never reset).
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }
}

impl Backend for EmulatedDevice {
    fn device(&self) -> Device {
        Device::Emulated(self.index)
    }

    /// The pool's bookkeeping with ordinary memory: nothing needs pinning here.
    fn pinned_pool(&self) -> Result<Arc<PinnedPool>> {
        Ok(self.pool.clone())
    }

    /// Fails with out-of-memory past the capacity, or on the injected `fail_alloc`.
    fn alloc(&self, len: usize) -> Result<DeviceMemory> {
        let config = self
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let n = self.allocations.fetch_add(1, Ordering::SeqCst) + 1;
        let used = self.used.fetch_add(len, Ordering::SeqCst);
        let free = config.capacity_bytes.saturating_sub(used);
        let oom = Error::OutOfMemory {
            device: Backend::device(self).to_string(),
            requested: len,
            free,
            total: config.capacity_bytes,
        };
        if config.fail_alloc == Some(n) || len > free {
            self.used.fetch_sub(len, Ordering::SeqCst);
            return Err(oom);
        }
        let mut memory = match AlignedBuffer::zeroed(len) {
            Ok(m) => m,
            Err(e) => {
                self.used.fetch_sub(len, Ordering::SeqCst);
                return Err(e);
            }
        };
        let address = memory.as_mut_slice().as_mut_ptr();
        let release = Allocation {
            _memory: memory,
            len,
            used: self.used.clone(),
        };
        // SAFETY: `address` is the start of `memory`'s `len` bytes, which `release` owns and
        // frees (once) when dropped; nothing else holds them.
        Ok(unsafe { DeviceMemory::new(Backend::device(self), address, len, Box::new(release)) })
    }

    /// Runs on the direction's stream thread (in submission order when `ordered`): the
    /// configured latency and bandwidth, then the copies; `fail_copy` completes the event
    /// with an error instead, and `panic_copy` panics on the stream thread.
    unsafe fn queue(
        &self,
        batch: CopyBatch,
        keep: Box<dyn Any + Send>,
        event: &Event,
        ordered: bool,
    ) {
        let n = self.copies.fetch_add(1, Ordering::SeqCst) + 1;
        self.ops.fetch_add(batch.ops.len() as u64, Ordering::SeqCst);
        submit_to(&self.lanes, batch, keep, event, n, ordered);
    }
}

impl EmulatedDevice {
    /// Holds `direction`'s stream (test only): nothing queued on it runs until the
    /// returned event completes.
    #[cfg(test)]
    pub(crate) fn gate(&self, direction: super::interface::Direction) -> Event {
        let gate = Event::pending();
        let held = gate.clone();
        let job: Job = Box::new(move || drop(held.wait_outcome()));
        let _ = self.streams[super::lane::lane_of(direction)].try_queue(job, &Event::pending());
        gate
    }
}

/// Queues a batch whose waits are complete on `stream`, to run with the settings of now
/// as the `seq`th copy since they were made.
///
/// # Safety
/// As [`Backend::submit`].
unsafe fn dispatch(
    device: Device,
    stream: &StreamThread,
    config: &Mutex<EmuConfig>,
    health: &Arc<Health>,
    submitted: Submitted,
) -> Option<Refused> {
    let Submitted {
        batch,
        keep,
        event,
        seq,
    } = submitted;
    let config = config.lock().unwrap_or_else(|p| p.into_inner()).clone();
    // The copies' fence, passed by the stream thread once it has run them, which then
    // completes the batch itself with the completer's code (no hop to another thread).
    let ran = Event::pending();
    let fence = Arc::new(EmuFence {
        device,
        ran: ran.clone(),
    });
    let waited = ran.clone();
    // The fence is passed only after the job ran: nothing is left on the queue before it.
    let drain: Drain = Box::new(move || {
        let _ = waited.wait_outcome();
        Ok(())
    });
    let (health, done) = (health.clone(), event.clone());
    let job: Job = Box::new(move || {
        // The whole batch (it is `Send`), not its fields.
        let batch = batch;
        // SAFETY: `submit`'s contract, passed on: `keep` holds what the ops address until
        // `finish_passed` releases it, after `run`.
        let outcome = guarded(device, || unsafe { run(&batch, &config, seq, device) });
        ran.complete(outcome.clone());
        let entry = Entry {
            done: Some(fence),
            drain,
            keep,
            event: done,
            outcome,
            device_waits: Vec::new(),
        };
        finish_passed(device, &health, entry);
    });
    match stream.try_queue(job, &event) {
        Ok(()) => None,
        Err(job) => {
            // What the batch held goes with the job, unrun.
            drop(job);
            Some(Refused {
                keep: Box::new(()),
                event,
                outcome: Err(stream.stopped()),
            })
        }
    }
}

/// The fence of a batch on an emulated stream: passed, with the copies' outcome, once the
/// stream thread has run them.
#[derive(Debug)]
struct EmuFence {
    device: Device,
    ran: Event,
}

/// A failure as the error a fence reports (which the completer turns back into it).
fn fence_error(f: Failure) -> Error {
    Error::DeviceUnavailable {
        device: f.device,
        reason: f.reason,
    }
}

impl Fence for EmuFence {
    fn device(&self) -> Device {
        self.device
    }

    fn poll(&self) -> Result<bool> {
        match self.ran.peek() {
            None => Ok(false),
            Some(outcome) => outcome.map(|()| true).map_err(fence_error),
        }
    }

    fn wait(&self) -> Result<()> {
        self.ran.wait_outcome().map_err(fence_error)
    }

    fn order_stream(&self, _stream: StreamHandle) -> Result<()> {
        Err(super::interface::no_foreign_streams(self.device))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One batch on the stream thread of `device`, the `n`th since the settings were made.
///
/// # Safety
/// As [`Backend::submit`]: every op's ranges are valid host memory (emulated device memory
/// is host memory) for `len` bytes, and nothing else touches the destinations.
unsafe fn run(batch: &CopyBatch, config: &EmuConfig, n: u64, device: Device) -> Outcome {
    for e in &batch.waits {
        e.wait_outcome()?;
    }
    let delay = config.delay(batch.bytes());
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    if config.panic_copy == Some(n) {
        panic!("injected panic: copy {n} panics (panic_copy={n})");
    }
    if config.fail_copy == Some(n) {
        return Err(Failure::new(
            device,
            format!(
                "injected fault: copy {n} fails (fail_copy={n}), {} bytes not copied",
                batch.bytes()
            ),
        ));
    }
    for op in &batch.ops {
        // SAFETY: the caller's contract: both ranges are valid for `len` bytes and the
        // destination is written by this batch alone.
        unsafe { std::ptr::copy_nonoverlapping(op.src, op.dst, op.len) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_every_key_and_rejects_unknown_ones() {
        let c = EmuConfig::parse(
            "latency_us=20000, capacity_bytes=1000000,bandwidth_gbps=12.5,fail_alloc=2,fail_copy=3,panic_copy=4,fail_pin=5",
        )
        .unwrap();
        assert_eq!(c.fail_pin, Some(5));
        assert_eq!(c.latency_us, 20000);
        assert_eq!(c.capacity_bytes, 1_000_000);
        assert_eq!(c.bandwidth_gbps, Some(12.5));
        assert_eq!((c.fail_alloc, c.fail_copy), (Some(2), Some(3)));
        assert_eq!(c.panic_copy, Some(4));
        let err = EmuConfig::parse("speed=3").unwrap_err().to_string();
        assert!(
            err.contains("unknown key \"speed\"") && err.contains("latency_us"),
            "{err}"
        );
        assert!(EmuConfig::parse("latency_us=x").is_err());
        assert_eq!(EmuConfig::parse("").unwrap(), EmuConfig::default());
    }

    #[test]
    fn settings_out_of_range_are_refused_naming_the_key() {
        for (text, key) in [
            ("bandwidth_gbps=1e-300", "bandwidth_gbps"),
            ("bandwidth_gbps=0", "bandwidth_gbps"),
            ("bandwidth_gbps=-1", "bandwidth_gbps"),
            ("bandwidth_gbps=nan", "bandwidth_gbps"),
            ("bandwidth_gbps=inf", "bandwidth_gbps"),
            ("latency_us=18446744073709551615", "latency_us"),
            ("latency_us=60000001", "latency_us"),
            ("capacity_bytes=18446744073709551616", "capacity_bytes"),
            ("capacity_bytes=-1", "capacity_bytes"),
            ("fail_alloc=0", "fail_alloc"),
            ("fail_copy=0", "fail_copy"),
            ("panic_copy=0", "panic_copy"),
            ("fail_pin=0", "fail_pin"),
        ] {
            let err = EmuConfig::parse(text).unwrap_err().to_string();
            assert!(err.contains(&format!("{key}=")), "{text}: {err}");
        }
        let bad = EmuConfig {
            bandwidth_gbps: Some(1e-300),
            ..EmuConfig::default()
        };
        let err = configure(0, bad).unwrap_err().to_string();
        assert!(err.contains("bandwidth_gbps"), "{err}");
    }

    #[test]
    fn the_slowest_valid_settings_give_a_finite_delay_for_any_copy() {
        let slowest = EmuConfig::parse(&format!(
            "bandwidth_gbps={MIN_BANDWIDTH_GBPS},latency_us={MAX_LATENCY_US}"
        ))
        .unwrap();
        let delay = slowest.delay(usize::MAX);
        assert!(delay < Duration::MAX && delay > Duration::from_secs(1 << 50));
        let quick = EmuConfig::parse("bandwidth_gbps=1").unwrap();
        assert_eq!(quick.delay(1_000_000), Duration::from_millis(1));
        // Even a setting that bypassed validation saturates instead of panicking.
        let broken = EmuConfig {
            bandwidth_gbps: Some(1e-300),
            latency_us: u64::MAX,
            ..EmuConfig::default()
        };
        assert_eq!(broken.delay(usize::MAX), Duration::MAX);
    }

    #[test]
    fn an_unknown_index_is_unavailable() {
        assert!(matches!(
            device(EMULATED_DEVICES),
            Err(Error::DeviceUnavailable { .. })
        ));
    }
}
