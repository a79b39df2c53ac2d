//! Tensors whose bytes lie in many small runs (a transposed matrix is one run per
//! element) would each become thousands of tiny device copies. Such sources are gathered
//! on the host instead, where a run costs nanoseconds, not microseconds:
//! - from the host to a device: packed into one contiguous host copy first;
//! - from a device to the host: the span of device memory holding all their elements is
//!   fetched in one copy, and the elements are gathered from it on the host — when that
//!   span is not much larger than the tensor (else the runs are copied as they are).
//!
//! Neither blocks a non-blocking move: a source still being filled is packed, and a
//! fetched span gathered, on a host worker thread once its copy has run
//! ([`super::host_copy`]). Between devices, runs are copied as they are (no gather kernel).

use std::sync::Arc;

use super::host_copy::pack_when_ready;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// More runs than this, each shorter than [`SMALL_RUN_BYTES`], make a tensor fragmented.
pub(crate) const MAX_RUNS: usize = 64;
/// Runs shorter than this cost more as a device copy than their bytes do.
pub(crate) const SMALL_RUN_BYTES: usize = 16 << 10;
/// A device span up to this many times the tensor's bytes is fetched whole.
const MAX_SPAN_RATIO: usize = 4;
/// ... or up to this many bytes, whatever the ratio.
const SMALL_SPAN_BYTES: usize = 4 << 20;

/// `(runs, bytes per run)` of the tensor's layout in C order.
fn runs(t: &Tensor) -> (usize, usize) {
    let mut count = 0usize;
    let mut len = 0usize;
    let _ = t.run_offsets(|_, l| {
        count += 1;
        len = l;
        // Enough to decide: stop counting past the threshold.
        if count > MAX_RUNS {
            Err(crate::error::Error::Layout {
                reason: String::new(),
            })
        } else {
            Ok(())
        }
    });
    (count, len)
}

/// True when copying `t` run by run would mean many small device copies.
pub(crate) fn is_fragmented(t: &Tensor) -> bool {
    if t.is_contiguous() {
        return false;
    }
    let (count, len) = runs(t);
    count > MAX_RUNS && len < SMALL_RUN_BYTES
}

/// The source to plan instead of `t` for a move to `target`, when `t` is fragmented and
/// a host gather serves it: a contiguous host copy (host → device), or a strided view of
/// a host copy of its device span (device → host). `None`: plan `t` as it is. Neither
/// waits for copies still filling `t`: the result depends on them instead. `fetch` brings
/// a device span to the host (the engine's move, which this module does not know of).
pub(crate) fn prepare(
    t: &Tensor,
    target: Device,
    fetch: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let from = t.device();
    if from.is_host() == target.is_host() || !is_fragmented(t) {
        return Ok(None);
    }
    if from.is_host() {
        let (mut packed, _) = pack_when_ready(vec![t.clone()])?;
        return Ok(packed.pop());
    }
    let (start, end) = t.span_in_storage();
    let span = end - start;
    if span > (t.nbytes() * MAX_SPAN_RATIO).max(SMALL_SPAN_BYTES) {
        return Ok(None);
    }
    let whole = Tensor::contiguous_view(t.storage().clone(), start, DType::U8, vec![span])?;
    let on_host = fetch(&whole)?;
    let offset = on_host.offset() + (t.offset() - start);
    Tensor::from_storage(
        Arc::clone(on_host.storage()),
        offset,
        t.dtype(),
        t.shape().to_vec(),
        t.strides().to_vec(),
    )
    .map(Some)
}
