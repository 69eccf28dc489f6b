//! The commands of `proxy-agent`, one module each.

pub mod agent_client;
pub mod cleanup;
pub mod dump;
pub mod log;
pub mod run;
pub mod trace;
