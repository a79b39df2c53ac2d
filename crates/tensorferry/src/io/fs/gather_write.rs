//! Writing many byte runs (the tensors of a dictionary) with few system calls.
//!
//! A dictionary of 20,000 tensors of 4 KiB written run by run through a `BufWriter`
//! copies every byte once more into the buffer and still makes one call per buffer; here
//! the runs are handed to `writev` straight from the tensors' memory, up to
//! [`MAX_SLICES`] runs or [`BATCH_BYTES`] bytes per call.

use std::io::{self, IoSlice, Write};

/// Runs handed to one `writev` at most (Linux's `IOV_MAX`).
const MAX_SLICES: usize = 1024;
/// Bytes gathered before a batch is written, at most (a larger run goes alone).
const BATCH_BYTES: usize = 8 << 20;

/// Gathers runs and writes them in batches; [`GatherWriter::finish`] writes the last one.
pub(crate) struct GatherWriter<'a, W: Write> {
    out: W,
    pending: Vec<IoSlice<'a>>,
    pending_bytes: usize,
}

impl<'a, W: Write> GatherWriter<'a, W> {
    /// A writer into `out`.
    pub(crate) fn new(out: W) -> Self {
        GatherWriter {
            out,
            pending: Vec::with_capacity(MAX_SLICES),
            pending_bytes: 0,
        }
    }

    /// Queues `run`, writing the queue first when it is full.
    pub(crate) fn push(&mut self, run: &'a [u8]) -> io::Result<()> {
        if run.is_empty() {
            return Ok(());
        }
        if self.pending.len() == MAX_SLICES || self.pending_bytes + run.len() > BATCH_BYTES {
            self.flush_pending()?;
        }
        self.pending.push(IoSlice::new(run));
        self.pending_bytes += run.len();
        Ok(())
    }

    /// Writes what is queued and returns the inner writer.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.flush_pending()?;
        Ok(self.out)
    }

    /// Writes every queued run, however the calls split them.
    fn flush_pending(&mut self) -> io::Result<()> {
        let mut slices = &mut self.pending[..];
        while !slices.is_empty() {
            match self.out.write_vectored(slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most 5 bytes per call, from the first slice only.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(5);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_byte_arrives_in_order_however_the_calls_split_them() {
        let runs: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| (0..(i % 13) as u8).map(|b| b ^ i as u8).collect())
            .collect();
        let mut w = GatherWriter::new(Trickle(Vec::new()));
        for r in &runs {
            w.push(r).unwrap();
        }
        let out = w.finish().unwrap().0;
        assert_eq!(out, runs.concat());
    }
}
