//! What a device offers. For now: the CUDA driver probe, loaded at run time, so that
//! the library builds and runs with no CUDA toolkit and reports why a GPU is unusable.

pub mod cuda;
