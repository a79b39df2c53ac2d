//! What a device offers: the CUDA driver (loaded at run time, probed for now) and the
//! emulated device that runs the transfer engine on any machine; completion events.

pub mod cuda;
pub mod emulated;
pub mod event;

pub use event::Event;
