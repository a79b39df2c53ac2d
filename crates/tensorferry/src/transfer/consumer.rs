//! Handing a tensor whose copy may still be running to another library's CUDA stream:
//! that stream is made to wait for the copy on the GPU, and the caller does not wait at
//! all — what DLPack's `__dlpack__(stream=…)` asks of a producer.

use cudarc::driver::sys;

use crate::backend::event::Progress;
use crate::error::Result;
use crate::tensor::Tensor;

/// Orders the work a consumer queues on the CUDA `stream` after the copy that fills
/// `tensor`'s memory, without waiting for it: on the GPU (`cuStreamWaitEvent` on the event
/// recorded after the copy) when the copy is queued on a GPU. `Ok(true)` when the stream is
/// ordered (or nothing is pending); `Ok(false)` when the copy is not on a GPU yet (it waits
/// for host work, such as a staging ring): the caller must wait for it on the host
/// ([`Tensor::wait`]). The copy's failure, when known by now, is the error; a copy that
/// fails after the consumer's stream was ordered behind it leaves the consumer's data
/// undefined, as any failed asynchronous CUDA copy does.
///
/// # Safety
/// `stream` must be a live CUDA stream of this process usable with the tensor's GPU (a
/// stream of its primary context, as PyTorch, JAX and CuPy create them), or a default-stream
/// constant (1: legacy, 2: per-thread): the driver does not validate every handle.
pub unsafe fn order_stream_after(tensor: &Tensor, stream: usize) -> Result<bool> {
    let Some(event) = tensor.storage().pending() else {
        return Ok(true);
    };
    match event.progress() {
        // SAFETY: the stream is valid for the tensor's GPU (this function's contract), whose
        // primary context recorded the mark.
        Progress::Queued(mark) => unsafe { mark.order(stream as sys::CUstream) }.map(|()| true),
        Progress::Done(_) => event.wait().map(|()| true),
        Progress::Pending => Ok(false),
    }
}

/// Waits at most `timeout` until the copy filling `tensor` is queued on a GPU or has
/// finished, whichever comes first: `true` then (nothing pending counts), `false` on
/// timeout. A staged upload is queued once a host thread has queued its last chunk, long
/// before it finishes: a caller of [`order_stream_after`] that got `Ok(false)` waits with
/// this, in slices, and asks again.
pub fn wait_queued_timeout(tensor: &Tensor, timeout: std::time::Duration) -> bool {
    tensor
        .storage()
        .pending()
        .is_none_or(|event| event.wait_queued_timeout(timeout))
}
