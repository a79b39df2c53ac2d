//! A fast hash of tensor names: FxHash's multiply-rotate over eight bytes at a time.
//!
//! Not resistant to chosen collisions: use it only where the names are the caller's own
//! (the tree being saved). Names read from a file go into std's randomly keyed sets.

/// The hasher; [`std::hash::BuildHasherDefault`] builds it for hash maps.
#[derive(Default)]
pub(crate) struct NameHasher(u64);

impl std::hash::Hasher for NameHasher {
    /// The state rotated: the multiply leaves its best-mixed bits at the top, and hash
    /// tables pick buckets with the low ones (without it, names of one length that
    /// differ only past their first bytes all share a bucket).
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let word = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
        }
        let mut tail = [0u8; 8];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        let word = u64::from_le_bytes(tail) ^ ((rest.len() as u64) << 56);
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}
