//! One ranged GET of an object: asked for, checked against the version the read started
//! with, and its body written into place as it arrives.

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use object_store::{GetOptions, GetRange, GetResult, ObjectStore};
use tokio::task::JoinHandle;

use super::failure::{failed, from_store, Cause};
use super::location::Location;
use super::runtime;
use crate::error::Result;

/// What every GET of one load must find: the object the first GET found.
#[derive(Clone, Debug)]
pub(super) struct Version {
    pub(super) etag: Option<String>,
    pub(super) size: u64,
}

/// Writes `src` into `into`, of the same length.
pub(super) fn write_into(into: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(
        into.len(),
        src.len(),
        "a copy between slices of unequal lengths"
    );
    // SAFETY: both slices hold `src.len()` bytes (checked above), `into` writable; a
    // shared and an exclusive borrow never overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), into.as_mut_ptr().cast::<u8>(), src.len())
    };
}

/// One ranged GET into `into`, checked against the version the load started with.
pub(super) async fn fetch_part(
    at: &Location,
    range: Range<u64>,
    into: &mut [MaybeUninit<u8>],
    version: &Version,
) -> Result<()> {
    let answer = request_part(at, range.clone(), version).await?;
    drain_into(at, range, answer, into).await
}

/// A ranged GET asked for ahead of its turn: begun on the runtime, cancelled if dropped
/// before its answer is taken (the read failed or stopped).
pub(super) struct Asked(JoinHandle<Result<GetResult>>);

impl Asked {
    /// Asks for `range` now, as [`request_part`] does; [`Asked::answer`] gives the answer.
    pub(super) fn begin(at: &Location, range: Range<u64>, version: &Version) -> Result<Asked> {
        let (at, version) = (at.clone(), version.clone());
        Ok(Asked(runtime::spawn(async move {
            request_part(&at, range, &version).await
        })?))
    }

    /// The answer (status and headers checked; the body still to come).
    pub(super) async fn answer(mut self, at: &Location) -> Result<GetResult> {
        (&mut self.0)
            .await
            .map_err(|e| failed("read", at.url(), Cause::Other, e.to_string()))?
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The answer to a GET of `range` (all of the object for None), of the version `etag`
/// names if given, once it has begun (status and headers): its body is still to come.
pub(super) async fn answer(
    at: &Location,
    range: Option<GetRange>,
    etag: Option<String>,
) -> Result<GetResult> {
    let store: &dyn ObjectStore = at.store();
    let options = GetOptions {
        range,
        if_match: etag,
        ..Default::default()
    };
    (store.get_opts(at.key(), options).await).map_err(|e| from_store("read", at.url(), e))
}

/// A ranged GET of `range`, once its answer has begun (status and headers, checked
/// against `version`): its body is still to come ([`drain_into`]).
pub(super) async fn request_part(
    at: &Location,
    range: Range<u64>,
    version: &Version,
) -> Result<GetResult> {
    let result = answer(at, Some(GetRange::Bounded(range)), version.etag.clone()).await?;
    let changed = result.meta.size != version.size
        || (version.etag.is_some() && result.meta.e_tag != version.etag);
    if changed {
        return Err(failed(
            "read",
            at.url(),
            Cause::Changed,
            format!(
                "first read found ETag {:?} and {} bytes, a later one {:?} and {} bytes",
                version.etag, version.size, result.meta.e_tag, result.meta.size
            ),
        ));
    }
    Ok(result)
}

/// Writes the body of `answer` (the GET of `range`) into `into`, which must be exactly
/// as long.
pub(super) async fn drain_into(
    at: &Location,
    range: Range<u64>,
    answer: GetResult,
    into: &mut [MaybeUninit<u8>],
) -> Result<()> {
    let mut body = Body::of(range, answer.into_stream());
    body.fill(at, into).await?;
    body.end(at).await
}

/// The body of a GET as it arrives, taken in pieces of the lengths asked.
pub(super) struct Body {
    /// The bytes the GET asked for, for messages.
    range: Range<u64>,
    /// How many bytes were taken so far.
    taken: u64,
    stream: BoxStream<'static, object_store::Result<Bytes>>,
    /// Bytes that arrived and were not taken yet.
    pending: Bytes,
}

impl Body {
    /// The body `stream` of the GET of `range`.
    pub(super) fn of(
        range: Range<u64>,
        stream: BoxStream<'static, object_store::Result<Bytes>>,
    ) -> Body {
        Body {
            range,
            taken: 0,
            stream,
            pending: Bytes::new(),
        }
    }

    /// The next bytes to arrive (empty at the body's end).
    async fn next_chunk(&mut self, at: &Location) -> Result<Bytes> {
        while self.pending.is_empty() {
            match self.stream.next().await {
                Some(chunk) => self.pending = chunk.map_err(|e| from_store("read", at.url(), e))?,
                None => break,
            }
        }
        Ok(std::mem::take(&mut self.pending))
    }

    /// Fills `into` with the body's next bytes; a body that ends first is an error.
    pub(super) async fn fill(&mut self, at: &Location, into: &mut [MaybeUninit<u8>]) -> Result<()> {
        let mut filled = 0;
        while filled < into.len() {
            let mut chunk = self.next_chunk(at).await?;
            if chunk.is_empty() {
                let asked = self.range.end - self.range.start;
                let detail = format!(
                    "bytes {:?}: the server sent {} of {asked} bytes",
                    self.range, self.taken
                );
                return Err(failed("read", at.url(), Cause::Other, detail));
            }
            let n = chunk.len().min(into.len() - filled);
            write_into(&mut into[filled..filled + n], &chunk.split_to(n));
            self.pending = chunk;
            filled += n;
            self.taken += n as u64;
        }
        Ok(())
    }

    /// Checks that the body ends here.
    pub(super) async fn end(&mut self, at: &Location) -> Result<()> {
        match self.next_chunk(at).await?.is_empty() {
            true => Ok(()),
            false => Err(failed(
                "read",
                at.url(),
                Cause::Other,
                "the server sent more bytes than asked",
            )),
        }
    }
}
