//! IPVS's schedulers as the view names them: which one a frontend uses (the node's
//! `ipvs.scheduler`, or a Service's annotation) and the weights an annotation gives.
//! Turning a schedule into slots and Maglev tables is the dataplane's
//! (`dataplane::layout`).

use std::{collections::BTreeMap, net::IpAddr, net::SocketAddr, sync::Arc};

use serde::Serialize;

use crate::error::SettingError;

/// Per-Service scheduler (`rr`, `mh`, ... as `ipvs.scheduler`, or `random`).
pub const SCHEDULER_ANNOTATION: &str = "ebpf.proxy.k8s.io/scheduler";
/// Per-Service endpoint weights: `10.1.0.5=3,10.1.0.6=0` (by endpoint address; an
/// endpoint not named weighs 1, weight 0 takes no new connections).
pub const WEIGHTS_ANNOTATION: &str = "ebpf.proxy.k8s.io/weights";

/// IPVS's default Maglev table length (`CONFIG_IP_VS_MH_TAB_INDEX` 12).
pub const DEFAULT_MAGLEV_TABLE_LEN: u32 = 4093;
/// The table lengths accepted: primes, as Maglev's permutation needs; the largest fits
/// the 16-bit slot count of a service entry.
pub const MAGLEV_TABLE_LENS: [u32; 9] = [251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521];
/// A weight above this is cut to it (IPVS's own limit is 65535; ours keeps a weighted
/// round-robin sequence within a service entry's slots).
pub const MAX_WEIGHT: u32 = 256;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
    /// Uniformly random (iptables' and nftables' modes).
    #[default]
    Random,
    Rr,
    Wrr,
    Sh,
    Dh,
    Mh,
    Lc,
    Wlc,
    Sed,
    Nq,
}

impl Scheduler {
    pub const ALL: [Scheduler; 10] = [
        Self::Random,
        Self::Rr,
        Self::Wrr,
        Self::Sh,
        Self::Dh,
        Self::Mh,
        Self::Lc,
        Self::Wlc,
        Self::Sed,
        Self::Nq,
    ];

    /// Reads a scheduler name as `ipvs.scheduler` and `ipvsadm -s` spell it; the second
    /// part says when the name was taken for another (IPVS's locality-based ones, which
    /// balance cache clusters by destination, become `wlc`).
    pub fn parse(name: &str) -> Result<(Self, Option<String>), SettingError> {
        let name = name.trim();
        if let Some(s) = Self::ALL.into_iter().find(|s| s.name() == name) {
            return Ok((s, None));
        }
        match name {
            "lblc" | "lblcr" => Ok((
                Self::Wlc,
                Some(format!(
                    "scheduler {name:?} (locality-based, for cache clusters) is served as wlc"
                )),
            )),
            _ => Err(SettingError::UnknownScheduler(name.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Rr => "rr",
            Self::Wrr => "wrr",
            Self::Sh => "sh",
            Self::Dh => "dh",
            Self::Mh => "mh",
            Self::Lc => "lc",
            Self::Wlc => "wlc",
            Self::Sed => "sed",
            Self::Nq => "nq",
        }
    }

    /// Picks from a Maglev table: the slots are the table.
    pub fn hashing(self) -> bool {
        matches!(self, Self::Sh | Self::Dh | Self::Mh)
    }

    /// Reads `WEIGHTS` in the programs (the least-connection family).
    pub fn least_connection(self) -> bool {
        matches!(self, Self::Lc | Self::Wlc | Self::Sed | Self::Nq)
    }
}

/// Endpoint address → weight, from the weights annotation; shared by a Service and its
/// frontends. The default (no annotation: every Service but a few) is one empty map
/// shared by all, where each Service and each programmed frontend allocated its own (8
/// MiB at 100k Services).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Weights(Arc<BTreeMap<IpAddr, u32>>);

impl Weights {
    pub fn new(w: BTreeMap<IpAddr, u32>) -> Self {
        if w.is_empty() {
            return Self::default();
        }
        Self(Arc::new(w))
    }
}

impl Default for Weights {
    fn default() -> Self {
        static NONE: std::sync::OnceLock<Arc<BTreeMap<IpAddr, u32>>> = std::sync::OnceLock::new();
        Self(Arc::clone(NONE.get_or_init(Arc::default)))
    }
}

impl From<BTreeMap<IpAddr, u32>> for Weights {
    fn from(w: BTreeMap<IpAddr, u32>) -> Self {
        Self::new(w)
    }
}

impl std::ops::Deref for Weights {
    type Target = BTreeMap<IpAddr, u32>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// How one frontend schedules new flows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Schedule {
    pub scheduler: Scheduler,
    /// Endpoint address → weight, from the annotation; an address not here weighs 1.
    /// Shared by the frontends of one Service.
    #[serde(skip_serializing_if = "no_weights")]
    pub weights: Weights,
    /// Maglev table length (hashing schedulers; 0 for the others).
    #[serde(skip_serializing_if = "is_zero")]
    pub table_len: u32,
}

fn no_weights(w: &Weights) -> bool {
    w.is_empty()
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Schedule {
    pub fn new(scheduler: Scheduler, weights: Weights, table_len: u32) -> Self {
        Self {
            scheduler,
            weights,
            table_len: if scheduler.hashing() { table_len } else { 0 },
        }
    }

    pub fn weight(&self, ip: IpAddr) -> u32 {
        self.weights.get(&ip).copied().unwrap_or(1)
    }

    /// Whether the programs must read `WEIGHTS` for this frontend's backends.
    pub fn weighted(&self, endpoints: &[SocketAddr]) -> bool {
        matches!(
            self.scheduler,
            Scheduler::Wlc | Scheduler::Sed | Scheduler::Nq
        ) && endpoints.iter().any(|sa| self.weight(sa.ip()) != 1)
    }
}

/// Reads the weights annotation: `addr=weight` pairs, comma or space separated. What
/// cannot be read is skipped and named in the error list.
pub fn parse_weights(text: &str) -> (BTreeMap<IpAddr, u32>, Vec<String>) {
    let mut weights = BTreeMap::new();
    let mut problems = Vec::new();
    for item in text.split([',', ' ', '\n']).filter(|s| !s.is_empty()) {
        let parsed = item.split_once('=').and_then(|(a, w)| {
            Some((
                a.trim().parse::<IpAddr>().ok()?,
                w.trim().parse::<u32>().ok()?,
            ))
        });
        match parsed {
            Some((ip, w)) => {
                if w > MAX_WEIGHT {
                    problems.push(format!("weight {w} of {ip} cut to {MAX_WEIGHT}"));
                }
                weights.insert(ip, w.min(MAX_WEIGHT));
            }
            None => problems.push(format!(
                "{WEIGHTS_ANNOTATION}: {item:?} is not ADDRESS=WEIGHT, ignored"
            )),
        }
    }
    (weights, problems)
}

/// Checks `ebpf.maglevTableSize`.
pub fn check_table_len(len: u32) -> Result<u32, SettingError> {
    if MAGLEV_TABLE_LENS.contains(&len) {
        Ok(len)
    } else {
        Err(SettingError::MaglevTableLen {
            len,
            allowed: &MAGLEV_TABLE_LENS,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_locality_schedulers_become_wlc() {
        for s in Scheduler::ALL {
            assert_eq!(Scheduler::parse(s.name()).unwrap(), (s, None));
        }
        let (s, note) = Scheduler::parse("lblcr").unwrap();
        assert_eq!(s, Scheduler::Wlc);
        assert!(note.unwrap().contains("wlc"));
        assert!(Scheduler::parse("fastest").is_err());
    }

    #[test]
    fn weights_parse_cut_and_name_what_they_skip() {
        let (w, problems) = parse_weights("10.1.0.1=3, 10.1.0.2=0,bogus 10.1.0.3=999");
        assert_eq!(w.len(), 3);
        assert_eq!(w[&"10.1.0.3".parse::<IpAddr>().unwrap()], MAX_WEIGHT);
        assert_eq!(problems.len(), 2, "{problems:?}");
    }
}
