//! The rows of the statistics: a frontend's and a backend's totals (connections, packets,
//! bytes), as `dump --stats` and the metrics read them.

use std::{net::SocketAddr, ops::AddAssign};

use proxy_common::LbStats;
use proxy_model::{Frontend, Protocol};
use serde::Serialize;

/// Connections, packets and bytes, summed over CPUs (and over scopes or frontends).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub conns: u64,
    pub packets_in: u64,
    pub packets_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl AddAssign<&LbStats> for Totals {
    fn add_assign(&mut self, s: &LbStats) {
        // Wrapping, as the programs' own counters do: a wrapped sum is still a counter.
        self.conns = self.conns.wrapping_add(s.conns);
        self.packets_in = self.packets_in.wrapping_add(s.packets_in);
        self.packets_out = self.packets_out.wrapping_add(s.packets_out);
        self.bytes_in = self.bytes_in.wrapping_add(s.bytes_in);
        self.bytes_out = self.bytes_out.wrapping_add(s.bytes_out);
    }
}

impl AddAssign<Totals> for Totals {
    fn add_assign(&mut self, t: Totals) {
        *self += &LbStats::from(t);
    }
}

impl From<Totals> for LbStats {
    fn from(t: Totals) -> Self {
        LbStats {
            conns: t.conns,
            packets_in: t.packets_in,
            bytes_in: t.bytes_in,
            packets_out: t.packets_out,
            bytes_out: t.bytes_out,
        }
    }
}

impl<'a> std::iter::Sum<&'a LbStats> for Totals {
    fn sum<I: Iterator<Item = &'a LbStats>>(per_cpu: I) -> Self {
        let mut t = Totals::default();
        for s in per_cpu {
            t += s;
        }
        t
    }
}

/// One frontend (a virtual service): both scopes' entries in one row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FrontendStats {
    pub address: SocketAddr,
    #[serde(serialize_with = "as_display")]
    pub protocol: Protocol,
    /// `Scheduler::name` of the external (or only) scope.
    pub scheduler: &'static str,
    /// The service entries (one per scope) whose counts are summed here.
    pub service_ids: Vec<u32>,
    pub stats: Totals,
    /// Each backend once, however many slots (and scopes) it fills, by address.
    pub backends: Vec<BackendStats>,
}

impl FrontendStats {
    pub fn frontend(&self) -> Frontend {
        Frontend {
            ip: self.address.ip(),
            port: self.address.port(),
            protocol: self.protocol,
        }
    }
}

/// One backend (a real server) of a frontend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendStats {
    pub address: SocketAddr,
    pub id: u32,
    /// `WEIGHTS` for weighted least-connection entries; for `wrr` the backend's share of
    /// the slots (its weight over the weights' common divisor); else 1.
    pub weight: u32,
    /// Connections open now, as the collector last counted them (every 10 s).
    pub active_conns: u64,
    /// Under this frontend (both scopes), as IPVS counts a real server per virtual
    /// service.
    pub stats: Totals,
}

fn as_display<S: serde::Serializer>(v: &Protocol, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}
