//! gputrace: follows every NVIDIA GPU memory allocation and free through the driver's ioctls.
//!
//! Data flows one way: kernel records -> [`decode`] -> [`event`]s -> [`trace`] file -> [`model`]
//! -> summaries and reports.
pub mod abi;
pub mod analysis;
pub mod btf;
pub mod decode;
pub mod devices;
pub mod dir;
pub mod doctor;
pub mod event;
pub mod export;
pub mod files;
pub mod flight;
pub mod gpus;
pub mod http;
pub mod litellm;
pub mod mark;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod privileges;
pub mod probe;
pub mod procfs;
pub mod record;
pub mod redact;
pub mod report;
pub mod serving;
pub mod session;
pub mod signals;
pub mod startup;
pub mod trace;
pub mod tracefs;
pub mod units;
pub mod user;
pub mod watch;
