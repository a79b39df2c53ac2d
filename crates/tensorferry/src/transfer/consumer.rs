//! Handing a tensor whose copy may still be running to another library's CUDA stream:
//! that stream is made to wait for the copy on the GPU, and the caller does not wait at
//! all — what DLPack's `__dlpack__(stream=…)` asks of a producer.

use crate::backend::event::Progress;
use crate::backend::StreamHandle;
use crate::error::Result;
use crate::tensor::Tensor;

/// Orders the work a consumer queues on `stream` after the copy that fills `tensor`'s
/// memory, without waiting for it: on the device (behind the copy's [`crate::backend::Fence`]; on CUDA,
/// `cuStreamWaitEvent` on the event recorded after the copy) when the copy is queued on one. `Ok(true)` when the stream is ordered
/// (or nothing is pending); `Ok(false)` when the copy is not on a GPU yet (it waits for
/// host work, such as a staging ring): the caller must wait for it on the host
/// ([`Tensor::wait`]), or until it is queued ([`wait_queued_timeout`]) and ask again. The
/// copy's failure, when known by now, is the error; a copy that fails after the consumer's
/// stream was ordered behind it leaves the consumer's data undefined, as any failed
/// asynchronous CUDA copy does.
pub fn order_stream_after(tensor: &Tensor, stream: StreamHandle) -> Result<bool> {
    let Some(event) = tensor.storage().pending() else {
        return Ok(true);
    };
    match event.progress() {
        Progress::Queued(mark) => mark.order_stream(stream).map(|()| true),
        Progress::Done(_) => event.wait().map(|()| true),
        Progress::Pending => Ok(false),
    }
}

/// A tensor whose memory its consumer may read now: the copy filling it has finished, or
/// the consumer's stream waits for it on the GPU. What a DLPack export takes
/// ([`crate::dlpack::export_versioned`]), so that no memory a copy is still filling is
/// handed out unordered.
///
/// ```
/// use tensorferry::internal::transfer::Readable;
/// use tensorferry::Tensor;
///
/// let t = Tensor::from_slice(&[1u8, 2], &[2])?;
/// let ready = Readable::wait(&t)?;
/// assert_eq!(ready.tensor().nbytes(), 2);
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Readable<'a> {
    tensor: &'a Tensor,
    /// The consumer's stream, when it was ordered after the copy.
    stream: Option<StreamHandle>,
}

impl<'a> Readable<'a> {
    /// Waits on the host until the copy filling `tensor` has finished (any consumer may
    /// read it then); the copy's failure is the error.
    pub fn wait(tensor: &'a Tensor) -> Result<Readable<'a>> {
        tensor.wait()?;
        Ok(Readable {
            tensor,
            stream: None,
        })
    }

    /// Makes `stream` wait on the GPU for the copy filling `tensor` ([`order_stream_after`]),
    /// for a consumer that reads it on that stream only: `Ok(None)` when the copy is not on
    /// a GPU yet (wait for it with [`wait_queued_timeout`] and ask again, or use
    /// [`Readable::wait`]).
    pub fn ordered(tensor: &'a Tensor, stream: StreamHandle) -> Result<Option<Readable<'a>>> {
        Ok(order_stream_after(tensor, stream)?.then_some(Readable {
            tensor,
            stream: Some(stream),
        }))
    }

    /// `tensor`, taken by a consumer that reads none of its memory before the copy filling
    /// it has finished ([`Tensor::wait`] returns `Ok`), nor hands anything that could read
    /// it to anyone before then: views prepared over memory still arriving (a load from
    /// object storage whose GETs go on: [`crate::internal::io::object::load_url_arriving`]),
    /// so that preparing them overlaps the copy.
    ///
    /// # Safety
    /// The consumer must keep that promise: a read before the copy finished races with the
    /// writes still landing (a data race, undefined behaviour), and sees bytes that are not
    /// the tensor's.
    pub unsafe fn promised(tensor: &'a Tensor) -> Readable<'a> {
        Readable {
            tensor,
            stream: None,
        }
    }

    /// `other`, readable by the same consumer when it views the same memory (the same
    /// storage): one wait, or one ordering of a stream, covers every view of a buffer.
    pub fn view(&self, other: &'a Tensor) -> Option<Readable<'a>> {
        std::sync::Arc::ptr_eq(self.tensor.storage(), other.storage()).then_some(Readable {
            tensor: other,
            stream: self.stream,
        })
    }

    /// The tensor.
    pub fn tensor(&self) -> &'a Tensor {
        self.tensor
    }

    /// The stream the consumer reads on, when it named one ([`Readable::ordered`]).
    pub fn stream(&self) -> Option<StreamHandle> {
        self.stream
    }
}

/// Waits at most `timeout` until the copy filling `tensor` is queued on a GPU or has
/// finished, whichever comes first: `true` then (nothing pending counts), `false` on
/// timeout. A staged upload is queued once a host thread has queued its last chunk, long
/// before it finishes: a caller of `order_stream_after` that got `Ok(false)` waits with
/// this, in slices, and asks again.
pub fn wait_queued_timeout(tensor: &Tensor, timeout: std::time::Duration) -> bool {
    tensor
        .storage()
        .pending()
        .is_none_or(|event| event.wait_queued_timeout(timeout))
}
