//! gputrace: follows every NVIDIA GPU memory allocation and free through the driver's ioctls.
//!
//! Data flows one way: kernel records -> [`decode`] -> [`event`]s -> [`trace`] file -> [`model`]
//! -> summaries and reports.
pub mod abi;
pub mod decode;
pub mod event;
pub mod model;
pub mod trace;
pub mod probe;
pub mod files;
pub mod pipeline;
pub mod gpus;
pub mod report;
pub mod record;
pub mod btf;
pub mod analysis;
pub mod mark;
pub mod export;
