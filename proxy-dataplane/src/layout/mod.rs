//! A schedule as the slot list the dataplane writes for a frontend: every endpoint that
//! takes new connections, the weighted round-robin sequence, or a Maglev table. The
//! programs then only pick a slot (`proxy_common::sched`).

pub mod maglev;
pub mod wrr;

use std::net::{IpAddr, SocketAddr};

use proxy_model::schedule::{MAGLEV_TABLE_LENS, MAX_WEIGHT, Schedule, Scheduler};

/// The most slots one frontend has (a service entry's 16-bit backend count).
pub const MAX_SLOTS: usize = proxy_common::MAX_BACKENDS_PER_SERVICE as usize;

/// A frontend's slots and, for the hashing schedulers, its Maglev table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Indexes into the endpoints, in slot order.
    pub slots: Vec<u32>,
    /// Indexes into `slots`; empty unless the scheduler is `sh` or `mh`.
    pub table: Vec<u16>,
    /// Weighted round robin whose sequence would not fit `MAX_SLOTS`: the weights were
    /// scaled down to fit (`wrr::fit`); this many slots were wanted.
    pub scaled_from: Option<usize>,
}

/// What the agent writes: the slots, as indexes into `endpoints` — every endpoint
/// that takes new connections (weight above 0) once, or, for weighted round robin,
/// the interleaved sequence of its weights, or for `dh` only the endpoint the
/// frontend's own address hashes to in the Maglev table (every flow to it goes
/// there) — and for `sh` and `mh` the Maglev table, as indexes into the slots.
pub fn layout(schedule: &Schedule, endpoints: &[SocketAddr], frontend_ip: IpAddr) -> Layout {
    if !matches!(schedule.scheduler, Scheduler::Sh | Scheduler::Mh) {
        let (slots, scaled_from) = slots_scaled(schedule, endpoints, frontend_ip);
        return Layout {
            slots,
            table: Vec::new(),
            scaled_from,
        };
    }
    // The slots are the eligible endpoints, so the table's indexes into them are
    // the slot numbers (fewer than 65,536: the view refuses larger sets).
    let slots = eligible(schedule, endpoints);
    let table = maglev_table(schedule, endpoints, &slots)
        .into_iter()
        .map(|k| k as u16)
        .collect();
    Layout {
        slots,
        table,
        scaled_from: None,
    }
}

/// The scheduler's choices as endpoints: every endpoint that takes new connections
/// once, the weighted sequence (`wrr`), the whole Maglev table (`sh`, `mh`), or the
/// one endpoint of `dh`; as indexes into `endpoints`.
pub fn slots(schedule: &Schedule, endpoints: &[SocketAddr], frontend_ip: IpAddr) -> Vec<u32> {
    slots_scaled(schedule, endpoints, frontend_ip).0
}

/// `slots`, and for weighted round robin whose sequence would not fit `MAX_SLOTS`, how
/// many slots its weights wanted before they were scaled down to fit.
fn slots_scaled(
    schedule: &Schedule,
    endpoints: &[SocketAddr],
    frontend_ip: IpAddr,
) -> (Vec<u32>, Option<usize>) {
    let eligible = eligible(schedule, endpoints);
    if eligible.is_empty() {
        return (eligible, None);
    }
    let slots = match schedule.scheduler {
        Scheduler::Wrr => {
            let mut weights: Vec<u32> = eligible
                .iter()
                .map(|&i| capped_weight(schedule, endpoints, i))
                .collect();
            let scaled_from = wrr::fit(&mut weights, MAX_SLOTS);
            let slots = wrr::sequence(&weights)
                .into_iter()
                .map(|k| eligible[k])
                .collect();
            return (slots, scaled_from);
        }
        Scheduler::Sh | Scheduler::Mh | Scheduler::Dh => {
            let table: Vec<u32> = maglev_table(schedule, endpoints, &eligible)
                .into_iter()
                .map(|k| eligible[k as usize])
                .collect();
            if schedule.scheduler == Scheduler::Dh {
                let (words, _) = proxy_common::addr::to_words(frontend_ip);
                let at = proxy_common::sched_hash(&words, 0) as usize % table.len();
                vec![table[at]]
            } else {
                table
            }
        }
        _ => eligible,
    };
    (slots, None)
}

/// The endpoints that take new connections (weight above 0), as indexes.
fn eligible(schedule: &Schedule, endpoints: &[SocketAddr]) -> Vec<u32> {
    (0..endpoints.len() as u32)
        .filter(|&i| schedule.weight(endpoints[i as usize].ip()) > 0)
        .collect()
}

fn capped_weight(schedule: &Schedule, endpoints: &[SocketAddr], i: u32) -> u32 {
    schedule.weight(endpoints[i as usize].ip()).min(MAX_WEIGHT)
}

/// The Maglev table of the `eligible` endpoints, as indexes into `eligible`.
fn maglev_table(schedule: &Schedule, endpoints: &[SocketAddr], eligible: &[u32]) -> Vec<u32> {
    let members: Vec<maglev::Member> = eligible
        .iter()
        .map(|&i| maglev::Member {
            endpoint: endpoints[i as usize],
            weight: capped_weight(schedule, endpoints, i),
        })
        .collect();
    maglev::table(&members, table_len_for(schedule, members.len()))
}

/// The configured table length, or the next accepted one that holds every member.
fn table_len_for(schedule: &Schedule, members: usize) -> u32 {
    let want = schedule.table_len.max(MAGLEV_TABLE_LENS[0]);
    MAGLEV_TABLE_LENS
        .into_iter()
        .find(|&m| m >= want && m as usize >= members)
        .unwrap_or(MAGLEV_TABLE_LENS[MAGLEV_TABLE_LENS.len() - 1])
}

#[cfg(test)]
mod tests {

    use super::*;
    use proxy_model::schedule::{DEFAULT_MAGLEV_TABLE_LEN, parse_weights};

    fn eps(n: u8) -> Vec<SocketAddr> {
        (1..=n)
            .map(|i| SocketAddr::from(([10, 1, 0, i], 8080)))
            .collect()
    }

    #[test]
    fn zero_weight_takes_no_slot() {
        let (w, _) = parse_weights("10.1.0.1=3, 10.1.0.2=0,bogus 10.1.0.3=999");
        let s = Schedule::new(Scheduler::Rr, w.into(), 0);
        let fe: IpAddr = "10.96.0.1".parse().unwrap();
        assert_eq!(slots(&s, &eps(3), fe), vec![0, 2]);
        assert!(!s.weighted(&eps(3)), "rr ignores weights other than 0");
    }

    /// `wrr` weights of 255 and 256 over 1,000 endpoints (legal objects) expanded to
    /// 255,500 slots, which no frontend holds: the layout scales them to fit and says so.
    #[test]
    fn wrr_weights_past_a_frontends_slots_are_scaled_to_fit_and_said() {
        let endpoints: Vec<SocketAddr> = (0..1000u32)
            .map(|i| SocketAddr::from(([10, 1, (i / 250) as u8, (i % 250) as u8 + 1], 8080)))
            .collect();
        let text: Vec<String> = endpoints
            .iter()
            .enumerate()
            .map(|(i, sa)| format!("{}={}", sa.ip(), 255 + i % 2))
            .collect();
        let (w, problems) = parse_weights(&text.join(","));
        assert!(problems.is_empty(), "{problems:?}");
        let s = Schedule::new(Scheduler::Wrr, w.into(), 0);
        let fe: IpAddr = "10.96.0.1".parse().unwrap();
        let l = layout(&s, &endpoints, fe);
        assert_eq!(l.scaled_from, Some(255_500));
        assert!(l.slots.len() <= MAX_SLOTS, "{}", l.slots.len());
        assert!(
            l.slots.len() >= endpoints.len(),
            "every endpoint keeps a slot"
        );
        // Weights that fit are laid out as they are, and not said to be scaled.
        let (w, _) = parse_weights("10.1.0.1=256,10.1.0.2=255");
        let small = layout(&Schedule::new(Scheduler::Wrr, w.into(), 0), &eps(2), fe);
        assert_eq!((small.slots.len(), small.scaled_from), (511, None));
    }

    #[test]
    fn wrr_slots_repeat_by_weight_and_dh_has_one_slot() {
        let (w, _) = parse_weights("10.1.0.1=3,10.1.0.2=1");
        let fe: IpAddr = "10.96.0.1".parse().unwrap();
        let s = Schedule::new(Scheduler::Wrr, w.clone().into(), 0);
        assert_eq!(slots(&s, &eps(2), fe), vec![0, 0, 0, 1]);
        let dh = Schedule::new(Scheduler::Dh, w.into(), DEFAULT_MAGLEV_TABLE_LEN);
        let one = slots(&dh, &eps(2), fe);
        assert_eq!(one.len(), 1);
        let mh = Schedule::new(Scheduler::Mh, Default::default(), DEFAULT_MAGLEV_TABLE_LEN);
        assert_eq!(
            slots(&mh, &eps(2), fe).len(),
            DEFAULT_MAGLEV_TABLE_LEN as usize
        );
    }
}
