//! One object's bytes uploaded: the header, then the tensors' bytes in file order, cut
//! into parts of one size. Host tensors' bytes go into the parts without a copy (slices
//! that keep their memory alive); device tensors stream through the staging ring, each
//! chunk copied into the part being filled, so host memory stays bounded by the ring plus
//! the parts in flight ([`ObjectOptions::concurrency`] × the part size) whatever the
//! tensors' size. An object that fits one part is one PUT; a larger one a multipart
//! upload whose parts go up several at once while the next are filled, completed last (the
//! object appears whole) or aborted on any failure (the previous object stays as it was,
//! and the store drops the parts sent).

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use object_store::{MultipartUpload, PutPayload};
use tokio::task::JoinHandle;

use super::failure::from_store;
use super::location::Location;
use super::options::ObjectOptions;
use super::{plan, runtime};
use crate::error::{Error, Result};
use crate::io::write::device_stretches;
use crate::storage::Storage;
use crate::tensor::Tensor;
use crate::transfer::staging::Ring;
use crate::transfer::stream_to_sink;

/// Uploads `header` then the bytes of `tensors` (in file order; device tensors only when
/// `ring` is given) as the object at `at`, replacing it when complete.
pub(super) fn upload(
    at: &Location,
    header: Vec<u8>,
    tensors: &[Tensor],
    ring: Option<Ring>,
    options: &ObjectOptions,
) -> Result<()> {
    let total = header.len() as u64 + tensors.iter().map(|t| t.nbytes() as u64).sum::<u64>();
    let part = plan::upload_part_bytes(total, options.part_bytes as u64) as usize;
    if total <= part as u64 {
        let mut whole = None;
        let mut parts = Parts::new(part, |payload| {
            whole = Some(payload);
            Ok(())
        });
        feed(&mut parts, header, tensors, ring)?;
        parts.finish()?;
        return put(at, whole.unwrap_or_default());
    }
    let upload = runtime::block_on(at.store().put_multipart_opts(at.key(), Default::default()))?
        .map_err(|e| from_store("write", at.url(), e))?;
    let mut sender = Sender {
        at,
        upload,
        in_flight: VecDeque::new(),
        concurrency: options.concurrency.max(1),
    };
    let sent = (|| {
        let mut parts = Parts::new(part, |payload| sender.send(payload));
        feed(&mut parts, header, tensors, ring)?;
        parts.finish()
    })();
    match sent {
        Ok(()) => sender.complete(),
        Err(e) => {
            sender.abort();
            Err(e)
        }
    }
}

/// Feeds the header and the tensors' bytes, in order, to `parts`: host tensors as slices of
/// their memory, each stretch of tensors on one device through `ring`.
fn feed(
    parts: &mut Parts<impl FnMut(PutPayload) -> Result<()>>,
    header: Vec<u8>,
    tensors: &[Tensor],
    ring: Option<Ring>,
) -> Result<()> {
    parts.push(Bytes::from(header))?;
    for (device, stretch) in device_stretches(tensors) {
        match ring {
            Some(ring) if !device.is_host() => {
                let refs: Vec<&Tensor> = stretch.iter().collect();
                stream_to_sink(device, &refs, ring, |bytes| parts.copy(bytes))?;
            }
            _ => {
                for t in stretch {
                    push_host(parts, t)?;
                }
            }
        }
    }
    Ok(())
}

/// Pushes the bytes of host tensor `t` to `parts`, without a copy.
fn push_host(parts: &mut Parts<impl FnMut(PutPayload) -> Result<()>>, t: &Tensor) -> Result<()> {
    t.wait()?;
    let storage = t.storage().clone();
    if storage.try_host_bytes()?.is_none() {
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: format!(
                "a tensor on {} cannot be uploaded without a ring",
                t.device()
            ),
        });
    }
    t.run_offsets(|offset, len| {
        parts.push(Bytes::from_owner(HostRun {
            storage: storage.clone(),
            offset,
            len,
        }))
    })
}

/// Bytes cut into parts of `part` bytes (the last shorter), each handed to `emit` once
/// full: slices of what is pushed without a copy, or what is copied in.
struct Parts<F: FnMut(PutPayload) -> Result<()>> {
    part: usize,
    /// The part being filled.
    current: Vec<Bytes>,
    /// Bytes in `current` and `copied`.
    filled: usize,
    /// Bytes copied in since the last pushed slice, becoming one slice of the part.
    copied: Vec<u8>,
    emit: F,
}

impl<F: FnMut(PutPayload) -> Result<()>> Parts<F> {
    fn new(part: usize, emit: F) -> Self {
        Parts {
            part: part.max(1),
            current: Vec::new(),
            filled: 0,
            copied: Vec::new(),
            emit,
        }
    }

    /// Appends `segment` (sliced, never copied).
    fn push(&mut self, mut segment: Bytes) -> Result<()> {
        self.seal_copied();
        while !segment.is_empty() {
            let take = segment.len().min(self.part - self.filled);
            self.current.push(segment.split_to(take));
            self.filled += take;
            if self.filled == self.part {
                self.emit_current()?;
            }
        }
        Ok(())
    }

    /// Appends a copy of `bytes` (which the caller may reuse once this returns).
    fn copy(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let room = self.part - self.filled;
            let take = bytes.len().min(room);
            if self.copied.capacity() == 0 {
                self.copied.reserve_exact(room);
            }
            self.copied.extend_from_slice(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled == self.part {
                self.seal_copied();
                self.emit_current()?;
            }
        }
        Ok(())
    }

    /// Emits the last part, if it holds anything.
    fn finish(mut self) -> Result<()> {
        self.seal_copied();
        match self.filled {
            0 => Ok(()),
            _ => self.emit_current(),
        }
    }

    fn seal_copied(&mut self) {
        if !self.copied.is_empty() {
            self.current
                .push(Bytes::from(std::mem::take(&mut self.copied)));
        }
    }

    fn emit_current(&mut self) -> Result<()> {
        let payload: PutPayload = std::mem::take(&mut self.current).into_iter().collect();
        self.filled = 0;
        (self.emit)(payload)
    }
}

/// How long an aborted upload waits for its parts in flight to end before cancelling them.
const PARTS_SETTLE: std::time::Duration = std::time::Duration::from_secs(5);

/// The parts of one multipart upload on their way: at most `concurrency` at once.
struct Sender<'a> {
    at: &'a Location,
    upload: Box<dyn MultipartUpload>,
    in_flight: VecDeque<JoinHandle<object_store::Result<()>>>,
    concurrency: usize,
}

impl Sender<'_> {
    /// Starts the upload of the next part, once fewer than `concurrency` are in flight.
    fn send(&mut self, payload: PutPayload) -> Result<()> {
        while self.in_flight.len() >= self.concurrency {
            self.wait_oldest()?;
        }
        let part = self.upload.put_part(payload);
        self.in_flight.push_back(runtime::spawn(part)?);
        Ok(())
    }

    /// Waits for the oldest part in flight.
    fn wait_oldest(&mut self) -> Result<()> {
        let Some(oldest) = self.in_flight.pop_front() else {
            return Ok(());
        };
        match runtime::block_on(oldest)? {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(from_store("write", self.at.url(), e)),
            Err(joined) => Err(Error::io(
                "write",
                self.at.url(),
                std::io::Error::other(format!("a part's upload did not finish: {joined}")),
            )),
        }
    }

    /// Waits for every part, then completes the upload: the object appears whole.
    fn complete(mut self) -> Result<()> {
        let waited = (|| {
            while !self.in_flight.is_empty() {
                self.wait_oldest()?;
            }
            runtime::block_on(self.upload.complete())?
                .map(drop)
                .map_err(|e| from_store("write", self.at.url(), e))
        })();
        if waited.is_err() {
            self.abort();
        }
        waited
    }

    /// Gives the upload up: the store is told to drop the parts it holds (as far as it can
    /// be reached); the object stays as it was. A part still on its way when the abort
    /// arrives may be stored after it, and kept (S3 documents as much), so the parts in
    /// flight are first waited for, together for at most [`PARTS_SETTLE`], and only then
    /// cancelled.
    fn abort(&mut self) {
        let deadline = std::time::Instant::now() + PARTS_SETTLE;
        for part in self.in_flight.drain(..) {
            let cancel = part.abort_handle();
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let ended = runtime::block_on(async move { tokio::time::timeout(left, part).await });
            if !matches!(ended, Ok(Ok(_))) {
                cancel.abort();
            }
        }
        let _ = runtime::block_on(self.upload.abort());
    }
}

/// One PUT of a whole object.
pub(super) fn put(at: &Location, payload: PutPayload) -> Result<()> {
    runtime::block_on(at.store().put_opts(at.key(), payload, Default::default()))?
        .map(|_| ())
        .map_err(|e| from_store("write", at.url(), e))
}

/// A run of a host tensor's bytes, kept alive by its storage while the upload holds it.
struct HostRun {
    storage: Arc<Storage>,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for HostRun {
    fn as_ref(&self) -> &[u8] {
        let bytes = self
            .storage
            .host_bytes()
            .expect("checked to be host memory, filled, before the upload");
        &bytes[self.offset..self.offset + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_and_copied_bytes_are_cut_into_parts_of_the_part_size_in_order() {
        let mut got: Vec<Vec<u8>> = Vec::new();
        let mut parts = Parts::new(4, |p: PutPayload| {
            got.push(p.iter().flat_map(|b| b.to_vec()).collect());
            Ok(())
        });
        parts.push(Bytes::from_static(b"abc")).unwrap();
        parts.copy(b"defghij").unwrap();
        parts.push(Bytes::from_static(b"")).unwrap();
        parts.push(Bytes::from_static(b"k")).unwrap();
        parts.copy(b"lm").unwrap();
        parts.finish().unwrap();
        assert_eq!(
            got,
            vec![
                b"abcd".to_vec(),
                b"efgh".to_vec(),
                b"ijkl".to_vec(),
                b"m".to_vec()
            ]
        );
    }

    #[test]
    fn nothing_pushed_emits_no_part_and_a_failing_emit_is_the_error() {
        let mut count = 0;
        Parts::new(4, |_| {
            count += 1;
            Ok(())
        })
        .finish()
        .unwrap();
        assert_eq!(count, 0);
        let mut parts = Parts::new(2, |_| {
            Err(Error::InvalidValue {
                key: String::new(),
                reason: "refused".into(),
            })
        });
        assert!(parts.copy(b"abc").is_err());
    }
}
