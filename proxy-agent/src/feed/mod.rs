//! The node-view feed, KPNG's split in one folder: `proxy-agent serve` watches the API
//! server once and streams each node its view (`server`), in the feed's wire format
//! (`wire`), over mutual TLS (`tls`). The agent's side is a source (`source::feed`).

pub mod server;
pub mod tls;
pub mod wire;
