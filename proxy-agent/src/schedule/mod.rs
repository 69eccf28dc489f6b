//! IPVS's schedulers as map lookups: which one a frontend uses (the node's
//! `ipvs.scheduler`, or a Service's annotation), the weights an annotation gives, and
//! the slot list the agent writes for each: the programs then only pick a slot
//! (`proxy_common::sched`).

pub mod maglev;
pub mod wrr;

use std::{collections::BTreeMap, net::IpAddr, net::SocketAddr, sync::Arc};

use proxy_common::sched;
use serde::Serialize;

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
    pub fn parse(name: &str) -> Result<(Self, Option<String>), String> {
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
            _ => Err(format!(
                "unknown scheduler {name:?} (one of random, rr, wrr, lc, wlc, lblc, lblcr, \
                 sh, dh, sed, nq, mh)"
            )),
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

    /// The `ServiceValue::scheduler` code.
    pub fn code(self) -> u8 {
        match self {
            Self::Random => sched::RANDOM,
            Self::Rr => sched::RR,
            Self::Wrr => sched::WRR,
            Self::Sh => sched::SH,
            Self::Dh => sched::DH,
            Self::Mh => sched::MH,
            Self::Lc => sched::LC,
            Self::Wlc => sched::WLC,
            Self::Sed => sched::SED,
            Self::Nq => sched::NQ,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() == code)
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

/// How one frontend schedules new flows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Schedule {
    pub scheduler: Scheduler,
    /// Endpoint address → weight, from the annotation; an address not here weighs 1.
    /// Shared by the frontends of one Service.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: Arc<BTreeMap<IpAddr, u32>>,
    /// Maglev table length (hashing schedulers; 0 for the others).
    #[serde(skip_serializing_if = "is_zero")]
    pub table_len: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Schedule {
    pub fn new(scheduler: Scheduler, weights: Arc<BTreeMap<IpAddr, u32>>, table_len: u32) -> Self {
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

    /// What the agent writes: the slots, as indexes into `endpoints` — every endpoint
    /// that takes new connections (weight above 0) once, or, for weighted round robin,
    /// the interleaved sequence of its weights, or for `dh` only the endpoint the
    /// frontend's own address hashes to in the Maglev table (every flow to it goes
    /// there) — and for `sh` and `mh` the Maglev table, as indexes into the slots.
    pub fn layout(&self, endpoints: &[SocketAddr], frontend_ip: IpAddr) -> Layout {
        if !matches!(self.scheduler, Scheduler::Sh | Scheduler::Mh) {
            return Layout {
                slots: self.slots(endpoints, frontend_ip),
                table: Vec::new(),
            };
        }
        // The slots are the eligible endpoints, so the table's indexes into them are
        // the slot numbers (fewer than 65,536: the view refuses larger sets).
        let slots = self.eligible(endpoints);
        let table = self
            .maglev_table(endpoints, &slots)
            .into_iter()
            .map(|k| k as u16)
            .collect();
        Layout { slots, table }
    }

    /// The scheduler's choices as endpoints: every endpoint that takes new connections
    /// once, the weighted sequence (`wrr`), the whole Maglev table (`sh`, `mh`), or the
    /// one endpoint of `dh`; as indexes into `endpoints`.
    pub fn slots(&self, endpoints: &[SocketAddr], frontend_ip: IpAddr) -> Vec<u32> {
        let eligible = self.eligible(endpoints);
        if eligible.is_empty() {
            return eligible;
        }
        match self.scheduler {
            Scheduler::Wrr => {
                let weights: Vec<u32> = eligible
                    .iter()
                    .map(|&i| self.capped_weight(endpoints, i))
                    .collect();
                wrr::sequence(&weights)
                    .into_iter()
                    .map(|k| eligible[k])
                    .collect()
            }
            Scheduler::Sh | Scheduler::Mh | Scheduler::Dh => {
                let table: Vec<u32> = self
                    .maglev_table(endpoints, &eligible)
                    .into_iter()
                    .map(|k| eligible[k as usize])
                    .collect();
                if self.scheduler == Scheduler::Dh {
                    let (words, _) = crate::dataplane::bpf::sync::addr_words(frontend_ip);
                    let at = proxy_common::sched_hash(&words, 0) as usize % table.len();
                    vec![table[at]]
                } else {
                    table
                }
            }
            _ => eligible,
        }
    }

    /// The endpoints that take new connections (weight above 0), as indexes.
    fn eligible(&self, endpoints: &[SocketAddr]) -> Vec<u32> {
        (0..endpoints.len() as u32)
            .filter(|&i| self.weight(endpoints[i as usize].ip()) > 0)
            .collect()
    }

    fn capped_weight(&self, endpoints: &[SocketAddr], i: u32) -> u32 {
        self.weight(endpoints[i as usize].ip()).min(MAX_WEIGHT)
    }

    /// The Maglev table of the `eligible` endpoints, as indexes into `eligible`.
    fn maglev_table(&self, endpoints: &[SocketAddr], eligible: &[u32]) -> Vec<u32> {
        let members: Vec<maglev::Member> = eligible
            .iter()
            .map(|&i| maglev::Member {
                endpoint: endpoints[i as usize],
                weight: self.capped_weight(endpoints, i),
            })
            .collect();
        maglev::table(&members, self.table_len_for(members.len()))
    }

    /// The configured table length, or the next accepted one that holds every member.
    fn table_len_for(&self, members: usize) -> u32 {
        let want = self.table_len.max(MAGLEV_TABLE_LENS[0]);
        MAGLEV_TABLE_LENS
            .into_iter()
            .find(|&m| m >= want && m as usize >= members)
            .unwrap_or(MAGLEV_TABLE_LENS[MAGLEV_TABLE_LENS.len() - 1])
    }
}

/// A frontend's slots and, for the hashing schedulers, its Maglev table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Indexes into the endpoints, in slot order.
    pub slots: Vec<u32>,
    /// Indexes into `slots`; empty unless the scheduler is `sh` or `mh`.
    pub table: Vec<u16>,
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
pub fn check_table_len(len: u32) -> Result<u32, String> {
    if MAGLEV_TABLE_LENS.contains(&len) {
        Ok(len)
    } else {
        Err(format!(
            "maglevTableSize {len}: must be one of {MAGLEV_TABLE_LENS:?} (primes, as \
             Maglev's permutation needs)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: u8) -> Vec<SocketAddr> {
        (1..=n)
            .map(|i| SocketAddr::from(([10, 1, 0, i], 8080)))
            .collect()
    }

    #[test]
    fn names_round_trip_and_locality_schedulers_become_wlc() {
        for s in Scheduler::ALL {
            assert_eq!(Scheduler::parse(s.name()).unwrap(), (s, None));
            assert_eq!(Scheduler::from_code(s.code()), Some(s));
        }
        let (s, note) = Scheduler::parse("lblcr").unwrap();
        assert_eq!(s, Scheduler::Wlc);
        assert!(note.unwrap().contains("wlc"));
        assert!(Scheduler::parse("fastest").is_err());
    }

    #[test]
    fn weights_parse_and_zero_weight_takes_no_slot() {
        let (w, problems) = parse_weights("10.1.0.1=3, 10.1.0.2=0,bogus 10.1.0.3=999");
        assert_eq!(w.len(), 3);
        assert_eq!(w[&"10.1.0.3".parse::<IpAddr>().unwrap()], MAX_WEIGHT);
        assert_eq!(problems.len(), 2, "{problems:?}");
        let s = Schedule::new(Scheduler::Rr, Arc::new(w), 0);
        let fe: IpAddr = "10.96.0.1".parse().unwrap();
        assert_eq!(s.slots(&eps(3), fe), vec![0, 2]);
        assert!(!s.weighted(&eps(3)), "rr ignores weights other than 0");
    }

    #[test]
    fn wrr_slots_repeat_by_weight_and_dh_has_one_slot() {
        let (w, _) = parse_weights("10.1.0.1=3,10.1.0.2=1");
        let fe: IpAddr = "10.96.0.1".parse().unwrap();
        let s = Schedule::new(Scheduler::Wrr, Arc::new(w.clone()), 0);
        assert_eq!(s.slots(&eps(2), fe), vec![0, 0, 0, 1]);
        let dh = Schedule::new(Scheduler::Dh, Arc::new(w), DEFAULT_MAGLEV_TABLE_LEN);
        let one = dh.slots(&eps(2), fe);
        assert_eq!(one.len(), 1);
        let mh = Schedule::new(Scheduler::Mh, Arc::default(), DEFAULT_MAGLEV_TABLE_LEN);
        assert_eq!(
            mh.slots(&eps(2), fe).len(),
            DEFAULT_MAGLEV_TABLE_LEN as usize
        );
    }
}
