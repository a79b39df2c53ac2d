//! A batch of copies: the runs of each source in a packed layout, planned as one batch of
//! copy operations, and submitted to a backend with everything they touch held until it
//! has run.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::backend::{Backend, CopyBatch, CopyOp, Direction, Event, Failure};
use crate::consolidate::PackedLayout;
use crate::error::Result;
use crate::storage::Storage;
use crate::tensor::Tensor;

/// One contiguous run of a source, and where it goes in the packed layout: a source by
/// its index and an offset in its storage, not an address, so that the run is plain data
/// on any thread and its address is taken only where a copy is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    /// Which source (an index into the transfer's sources).
    pub source: usize,
    /// Where the run begins in that source's storage.
    pub src_offset: usize,
    /// Where it goes in the packed layout.
    pub dst_offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Run {
    /// The run's address in `sources` (a host or device address, for a copy).
    pub(crate) fn src_address(&self, sources: &[Tensor]) -> *const u8 {
        sources[self.source]
            .storage()
            .as_ptr()
            .wrapping_add(self.src_offset)
    }
}

/// Every source's runs in C order with their offsets in `layout`, and the events of the
/// copies filling any source that are still running or have failed (a copy from a
/// source whose copy failed must fail too, not copy what the failed copy left).
pub(crate) fn runs(sources: &[Tensor], layout: &PackedLayout) -> Result<(Vec<Run>, Vec<Event>)> {
    let mut out = Vec::with_capacity(sources.len());
    let mut waits = Vec::new();
    for (source, (t, &at)) in sources.iter().zip(&layout.offsets).enumerate() {
        if let Some(e) = t.storage().pending() {
            if e.peek() != Some(Ok(())) {
                waits.push(e.clone());
            }
        }
        let mut i = at;
        t.run_offsets(|offset, len| {
            out.push(Run {
                source,
                src_offset: offset,
                dst_offset: i,
                len,
            });
            i += len;
            Ok(())
        })?;
    }
    Ok((out, waits))
}

/// The batch copying each source's runs (C order) into `dest` at the plan's offsets,
/// waiting first for the copies that still fill any source.
fn plan(
    direction: Direction,
    sources: &[Tensor],
    layout: &PackedLayout,
    dest: &Storage,
) -> Result<CopyBatch> {
    let (runs, waits) = runs(sources, layout)?;
    Ok(CopyBatch {
        direction,
        ops: ops_into(&runs, sources, dest.as_ptr().cast_mut(), 0),
        waits,
    })
}

/// The copies of `runs` (of `sources`) to `dst`, each at its packed offset less `start`.
pub(crate) fn ops_into(
    runs: &[Run],
    sources: &[Tensor],
    dst: *mut u8,
    start: usize,
) -> Vec<CopyOp> {
    runs.iter()
        .map(|r| CopyOp {
            src: r.src_address(sources),
            dst: dst.wrapping_add(r.dst_offset - start),
            len: r.len,
        })
        .collect()
}

/// Queues `batch` after the events it waits for, without blocking: the backend honours
/// waits on GPU work on the GPU and chains waits on host work ([`Backend::submit`]), so no
/// thread ever blocks on another transfer, and chained non-blocking transfers (and staging
/// rings, which feed a stream over time) cannot deadlock a stream. A panic in the backend
/// fails `event` instead of reaching the caller. Not `ordered`: a staging ring's chunk
/// ([`Backend::queue`]).
///
/// # Safety
/// As [`Backend::submit`]: `keep` must hold everything the ops address until `event`
/// completes.
pub(crate) unsafe fn submit_when_ready(
    backend: Arc<dyn Backend>,
    batch: CopyBatch,
    keep: Box<dyn Any + Send>,
    event: Event,
    ordered: bool,
) {
    let device = backend.device();
    // SAFETY: forwarded contract.
    let submitted = catch_unwind(AssertUnwindSafe(|| unsafe {
        backend.queue(batch, keep, &event, ordered)
    }));
    if let Err(panic) = submitted {
        event.complete(Err(Failure::internal(device, &*panic)));
    }
}

/// Copies `sources` into `dst` (by `layout`) as one batch, queued with everything it
/// touches held until `event` completes.
pub(super) fn copy_direct(
    backend: &Arc<dyn Backend>,
    direction: Direction,
    sources: Vec<Tensor>,
    layout: &PackedLayout,
    dst: Arc<Storage>,
    event: &Event,
) -> Result<()> {
    let batch = plan(direction, &sources, layout, &dst)?;
    let keep: Box<dyn Any + Send> = Box::new((sources, dst));
    // SAFETY: the ops address the sources' elements (inside their storages, by
    // `run_offsets`) and the new destination storage (inside its length, by the plan);
    // `keep` holds all of them until the event completes. The destination is new: nothing
    // else writes it, and every reader waits for its event, which is `event`.
    unsafe { submit_when_ready(backend.clone(), batch, keep, event.clone(), true) };
    Ok(())
}
