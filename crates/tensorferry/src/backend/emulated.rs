//! The emulated device `emu:N`: device memory is a separate host allocation, its one
//! stream is a worker thread that runs copies in order, and events complete as CUDA's
//! do. Capacity, bandwidth and per-copy latency are configurable, and faults can be
//! injected (fail the Nth allocation or the Nth copy).
//!
//! It exists so that machines without a GPU (CI among them) run the very same transfer
//! engine, and so that users can test their pipelines on CPU-only machines.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use std::any::Any;

use super::stream::{Job, StreamThread};
use super::{Backend, CopyBatch, DeviceMemory, Event};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::pinned::PageableAllocator;
use crate::memory::{AlignedBuffer, PinnedPool};

/// Most bytes the pinned pool of an emulated device keeps.
const PINNED_POOL_CAP: usize = 4 << 30;

/// How many emulated devices exist (`emu:0` … `emu:{EMULATED_DEVICES - 1}`).
pub const EMULATED_DEVICES: usize = 2;

/// The environment variable read when an emulated device is first used.
pub const ENV_VAR: &str = "TENSORFERRY_EMU";

const KEYS: &str = "capacity_bytes, bandwidth_gbps, latency_us, fail_alloc, fail_copy";

/// Settings of an emulated device.
#[derive(Clone, Debug, PartialEq)]
pub struct EmuConfig {
    /// Bytes of device memory (default 8 GiB; memory is only taken when allocated).
    pub capacity_bytes: usize,
    /// Copy bandwidth in GB/s; `None` copies at host speed.
    pub bandwidth_gbps: Option<f64>,
    /// Added to every copy, in microseconds.
    pub latency_us: u64,
    /// The Nth allocation from now fails with out-of-memory (1-based).
    pub fail_alloc: Option<u64>,
    /// The Nth copy from now fails (1-based).
    pub fail_copy: Option<u64>,
}

impl Default for EmuConfig {
    fn default() -> Self {
        EmuConfig {
            capacity_bytes: 8 << 30,
            bandwidth_gbps: None,
            latency_us: 0,
            fail_alloc: None,
            fail_copy: None,
        }
    }
}

impl EmuConfig {
    /// Parses comma-separated `key=value` pairs, e.g. `latency_us=20000,capacity_bytes=1000000`.
    pub fn parse(text: &str) -> Result<EmuConfig> {
        let mut c = EmuConfig::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = |why: &str| Error::InvalidValue {
                key: ENV_VAR.into(),
                reason: format!("{pair:?}: {why} (keys: {KEYS})"),
            };
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad("expected key=value"))?;
            let int = || {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| bad("expected an integer"))
            };
            match k.trim() {
                "capacity_bytes" => c.capacity_bytes = int()? as usize,
                "latency_us" => c.latency_us = int()?,
                "fail_alloc" => c.fail_alloc = Some(int()?),
                "fail_copy" => c.fail_copy = Some(int()?),
                "bandwidth_gbps" => {
                    let g: f64 = v.trim().parse().map_err(|_| bad("expected a number"))?;
                    if g.is_nan() || g <= 0.0 {
                        return Err(bad("must be positive"));
                    }
                    c.bandwidth_gbps = Some(g);
                }
                _ => return Err(bad("unknown key")),
            }
        }
        Ok(c)
    }
}

/// One emulated device: its memory accounting, its settings and its stream.
pub struct EmulatedDevice {
    index: usize,
    config: Mutex<EmuConfig>,
    used: Arc<AtomicUsize>,
    allocations: AtomicU64,
    copies: AtomicU64,
    ops: AtomicU64,
    stream: StreamThread,
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

fn registry() -> &'static Mutex<HashMap<usize, Arc<EmulatedDevice>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<EmulatedDevice>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The emulated device `emu:index`, created (reading `TENSORFERRY_EMU`) on first use.
pub fn device(index: usize) -> Result<Arc<EmulatedDevice>> {
    if index >= EMULATED_DEVICES {
        return Err(Error::DeviceUnavailable {
            device: Device::Emulated(index).to_string(),
            reason: format!(
                "only {EMULATED_DEVICES} emulated devices exist (emu:0 … emu:{})",
                EMULATED_DEVICES - 1
            ),
        });
    }
    let mut devices = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&index) {
        return Ok(d.clone());
    }
    let config = match std::env::var(ENV_VAR) {
        Ok(text) => EmuConfig::parse(&text)?,
        Err(_) => EmuConfig::default(),
    };
    let stream = StreamThread::spawn(Device::Emulated(index), || {})?;
    let d = Arc::new(EmulatedDevice {
        index,
        config: Mutex::new(config),
        used: Arc::new(AtomicUsize::new(0)),
        allocations: AtomicU64::new(0),
        copies: AtomicU64::new(0),
        ops: AtomicU64::new(0),
        stream,
        pool: PinnedPool::new(Box::new(PageableAllocator), PINNED_POOL_CAP),
    });
    devices.insert(index, d.clone());
    Ok(d)
}

/// Replaces the settings of `emu:index`; fault counters start again from zero.
pub fn configure(index: usize, config: EmuConfig) -> Result<()> {
    let d = device(index)?;
    *d.config.lock().unwrap_or_else(|p| p.into_inner()) = config;
    d.allocations.store(0, Ordering::SeqCst);
    d.copies.store(0, Ordering::SeqCst);
    Ok(())
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

    fn config(&self) -> EmuConfig {
        self.config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
        let config = self.config();
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
        Ok(DeviceMemory::new(
            Backend::device(self),
            address,
            len,
            Box::new(release),
        ))
    }

    /// Runs on the stream thread, in order: waits, then the configured latency and
    /// bandwidth, then the copies; `fail_copy` completes the event with an error instead.
    unsafe fn submit(&self, batch: CopyBatch, keep: Box<dyn Any + Send>, event: &Event) {
        let done = event.clone();
        let config = self.config();
        let n = self.copies.fetch_add(1, Ordering::SeqCst) + 1;
        self.ops.fetch_add(batch.ops.len() as u64, Ordering::SeqCst);
        let name = Backend::device(self).to_string();
        let job: Job = Box::new(move || {
            let result = (|| {
                for e in &batch.waits {
                    e.wait(&name).map_err(|e| e.to_string())?;
                }
                let mut delay = Duration::from_micros(config.latency_us);
                if let Some(g) = config.bandwidth_gbps {
                    delay += Duration::from_secs_f64(batch.bytes() as f64 / (g * 1e9));
                }
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                if config.fail_copy == Some(n) {
                    return Err(format!("injected fault: copy {n} fails (fail_copy={n})"));
                }
                for op in &batch.ops {
                    // SAFETY: `submit`'s contract: both ranges are valid for `len` bytes
                    // until the event completes (`keep` holds their owners), emulated
                    // device memory is host memory, and the destination is written by
                    // this batch alone.
                    unsafe { std::ptr::copy_nonoverlapping(op.src, op.dst, op.len) };
                }
                Ok(())
            })();
            // What the batch held goes first (buffers back to their pool), so that anyone
            // woken by the event finds the pool as the batch left it.
            drop(keep);
            done.complete(result);
        });
        self.stream.queue(job, event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_every_key_and_rejects_unknown_ones() {
        let c = EmuConfig::parse(
            "latency_us=20000, capacity_bytes=1000000,bandwidth_gbps=12.5,fail_alloc=2,fail_copy=3",
        )
        .unwrap();
        assert_eq!(c.latency_us, 20000);
        assert_eq!(c.capacity_bytes, 1_000_000);
        assert_eq!(c.bandwidth_gbps, Some(12.5));
        assert_eq!((c.fail_alloc, c.fail_copy), (Some(2), Some(3)));
        let err = EmuConfig::parse("speed=3").unwrap_err().to_string();
        assert!(
            err.contains("unknown key") && err.contains("latency_us"),
            "{err}"
        );
        assert!(EmuConfig::parse("latency_us=x").is_err());
        assert_eq!(EmuConfig::parse("").unwrap(), EmuConfig::default());
    }

    #[test]
    fn an_unknown_index_is_unavailable() {
        assert!(matches!(
            device(EMULATED_DEVICES),
            Err(Error::DeviceUnavailable { .. })
        ));
    }
}
