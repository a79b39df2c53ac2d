//! Checkpoints of several files: the sharded layout and its index ([`index`], [`sharded`]),
//! and replacing a checkpoint as a whole, stale files of an interrupted save included
//! ([`commit`]).

pub(crate) mod commit;
pub(crate) mod index;
pub(crate) mod sharded;
