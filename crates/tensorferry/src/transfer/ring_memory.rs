//! The host memory of a ring (a staging ring, a stream to or from a device): its slots, one
//! per chunk in flight, carved out of as few of the pinned pool's buffers as the pool's
//! size classes allow. The pool hands out powers of two from 64 KiB, so a ring of small
//! chunks would otherwise pin 64 KiB a slot whatever it asked for (a ring of 4 KiB chunks
//! pinned sixteen times its size); carved, a ring pins at most twice its slots' bytes.
//!
//! A ring that `Staging::Auto` chose falls back to one ordinary (pageable) buffer when no
//! pinned memory is to be had: the device then copies to and from ordinary memory, as with
//! `Staging::Off`, and host memory stays bounded by the ring.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use crate::error::Result;
use crate::memory::pinned::size_class;
use crate::memory::{AlignedBuffer, HostBuffer, PinnedPool, HOST_ALIGNMENT};

/// The slots of a ring, each `slot_bytes` long, starting at a multiple of the alignment
/// asked for, one after another at a multiple of 64 bytes ([`HOST_ALIGNMENT`]) or of that
/// alignment. A slot is named by its chunk, never by a raw address the ring would have to
/// vouch for on other threads: the ring owns its memory, and hands out a slot's address
/// only to build a device copy, and its bytes only under the ring's protocol (one chunk per
/// slot at a time). Dropping it gives pinned memory back to its pool.
pub(crate) struct RingMemory {
    /// Each slot: the block it lies in and its offset there.
    slots: Vec<(usize, usize)>,
    slot_bytes: usize,
    /// Owns the memory every slot lies in.
    blocks: Vec<HostBuffer>,
}

impl RingMemory {
    /// `count` slots of `slot_bytes`, each aligned to `align` (a power of two; 1 where the
    /// memory's own alignment will do), from `pool`: slots share a pool buffer as long as
    /// they fit in one slot's size class.
    pub(crate) fn pinned(
        pool: &Arc<PinnedPool>,
        slot_bytes: usize,
        count: usize,
        align: usize,
    ) -> Result<RingMemory> {
        let stride = stride(slot_bytes, align);
        let per_block = (size_class(stride) / stride).clamp(1, count.max(1));
        let mut blocks = Vec::with_capacity(count.div_ceil(per_block));
        let mut slots = Vec::with_capacity(count);
        while slots.len() < count {
            let n = per_block.min(count - slots.len());
            let mut buffer = pool.take(n * stride)?;
            if buffer.as_ptr() as usize % align != 0 {
                // Pinned memory is page aligned already; where it is not, a larger buffer
                // is taken and its start rounded up.
                drop(buffer);
                buffer = pool.take(n * stride + align)?;
            }
            let start = buffer.as_ptr().align_offset(align);
            let block = blocks.len();
            slots.extend((0..n).map(|i| (block, start + i * stride)));
            blocks.push(HostBuffer::Pinned(buffer));
        }
        Ok(RingMemory {
            slots,
            slot_bytes,
            blocks,
        })
    }

    /// `count` slots of `slot_bytes` in one buffer of ordinary memory, page aligned (so
    /// any alignment up to 4096 holds).
    pub(crate) fn pageable(slot_bytes: usize, count: usize, align: usize) -> Result<RingMemory> {
        let stride = stride(slot_bytes, align);
        let buffer = AlignedBuffer::zeroed_page_aligned(stride * count)?;
        let slots = (0..count).map(|i| (0, i * stride)).collect();
        Ok(RingMemory {
            slots,
            slot_bytes,
            blocks: vec![HostBuffer::Pageable(buffer)],
        })
    }

    /// [`RingMemory::pinned`], or where `fall_back` (a ring `Staging::Auto` chose) and no
    /// pinned memory is to be had, [`RingMemory::pageable`].
    pub(crate) fn pinned_else_pageable(
        pool: Result<Arc<PinnedPool>>,
        slot_bytes: usize,
        count: usize,
        align: usize,
        fall_back: bool,
    ) -> Result<RingMemory> {
        match pool.and_then(|pool| RingMemory::pinned(&pool, slot_bytes, count, align)) {
            Err(_) if fall_back => RingMemory::pageable(slot_bytes, count, align),
            taken => taken,
        }
    }

    /// Slots in the ring.
    pub(crate) fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of each slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The address of the slot chunk `j` uses (`j % depth`), `slot_bytes` writable bytes:
    /// for a device copy to or from it, never dereferenced here.
    pub(crate) fn slot_address(&self, j: usize) -> *mut u8 {
        let (block, offset) = self.slots[j % self.slots.len()];
        self.blocks[block].as_ptr().cast_mut().wrapping_add(offset)
    }

    /// The first `len` bytes of chunk `j`'s slot.
    ///
    /// # Safety
    /// Nothing may write the slot while the slice lives (its chunk's copy has completed and
    /// the next one using the slot is not queued yet), and its first `len` bytes must have
    /// been written (the memory is zeroed or filled before any read).
    pub(crate) unsafe fn bytes(&self, j: usize, len: usize) -> &[u8] {
        assert!(
            len <= self.slot_bytes,
            "a slot holds {} bytes",
            self.slot_bytes
        );
        // SAFETY: the slot lies inside a block the ring owns for `slot_bytes` bytes; the
        // caller's contract covers writers and initialisation.
        unsafe { std::slice::from_raw_parts(self.slot_address(j), len) }
    }

    /// Bytes `range` of chunk `j`'s slot, to be written.
    ///
    /// # Safety
    /// Nothing else may read or write those bytes while the slice lives: the copy of the
    /// last chunk that used the slot has completed, this chunk's is not queued yet, and
    /// whoever else writes the slot meanwhile writes other bytes of it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slot_mut(&self, j: usize, range: Range<usize>) -> &mut [MaybeUninit<u8>] {
        assert!(
            range.start <= range.end && range.end <= self.slot_bytes,
            "a slot holds {} bytes",
            self.slot_bytes
        );
        // SAFETY: the range lies inside the slot, inside a block the ring owns, which
        // `&self` keeps alive; the caller's contract makes the access exclusive; any bytes
        // may be written as `MaybeUninit`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.slot_address(j).wrapping_add(range.start).cast(),
                range.len(),
            )
        }
    }
}

/// The distance between two slots of `slot_bytes` aligned to `align`.
fn stride(slot_bytes: usize, align: usize) -> usize {
    slot_bytes
        .max(1)
        .next_multiple_of(align.max(HOST_ALIGNMENT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::backend_for;
    use crate::device::Device;

    #[test]
    fn small_slots_share_a_size_class_instead_of_taking_one_each() {
        let pool = crate::memory::PinnedPool::new(
            Box::new(crate::memory::pinned::PageableAllocator),
            1 << 30,
        );
        let ring = RingMemory::pinned(&pool, 4096, 64, 1).unwrap();
        assert_eq!(ring.depth(), 64);
        assert_eq!(
            pool.stats().pinned_bytes,
            64 * 4096,
            "what was asked, no more"
        );
        let mut starts: Vec<usize> = (0..64).map(|j| ring.slot_address(j) as usize).collect();
        starts.sort();
        assert!(
            starts.windows(2).all(|w| w[1] - w[0] >= 4096),
            "slots overlap"
        );
        drop(ring);
        // Large slots take a buffer each, of the slot's size class (at most twice it).
        let ring = RingMemory::pinned(&pool, (3 << 20) + 1, 2, 4096).unwrap();
        assert!(
            ring.slot_address(0) as usize % 4096 == 0 && ring.slot_address(1) as usize % 4096 == 0
        );
        assert_eq!(
            pool.stats().pinned_bytes - pool.stats().cached_bytes,
            2 * (4 << 20)
        );
    }

    #[test]
    fn an_automatic_ring_without_pinned_memory_takes_ordinary_memory_an_explicit_one_fails() {
        let refused = || {
            Err(crate::Error::OutOfMemory {
                device: "cpu (pinned)".into(),
                requested: 0,
                free: 0,
                total: 0,
            })
        };
        let ring = RingMemory::pinned_else_pageable(refused(), 5000, 3, 4096, true).unwrap();
        assert_eq!(ring.depth(), 3);
        assert_eq!(
            ring.slot_address(1) as usize - ring.slot_address(0) as usize,
            8192
        );
        assert!(RingMemory::pinned_else_pageable(refused(), 5000, 3, 4096, false).is_err());
        let pool = backend_for(Device::Emulated(0)).unwrap().pinned_pool();
        RingMemory::pinned_else_pageable(pool, 5000, 3, 4096, false).unwrap();
    }
}
