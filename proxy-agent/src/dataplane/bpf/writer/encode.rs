//! The model's values as the map ABI spells them: scheduler codes.

use proxy_common::sched;

use crate::model::schedule::Scheduler;

/// The `ServiceValue::scheduler` code of a scheduler.
pub fn scheduler_code(s: Scheduler) -> u8 {
    match s {
        Scheduler::Random => sched::RANDOM,
        Scheduler::Rr => sched::RR,
        Scheduler::Wrr => sched::WRR,
        Scheduler::Sh => sched::SH,
        Scheduler::Dh => sched::DH,
        Scheduler::Mh => sched::MH,
        Scheduler::Lc => sched::LC,
        Scheduler::Wlc => sched::WLC,
        Scheduler::Sed => sched::SED,
        Scheduler::Nq => sched::NQ,
    }
}

/// The scheduler a `ServiceValue::scheduler` code names.
pub fn scheduler_of_code(code: u8) -> Option<Scheduler> {
    Scheduler::ALL
        .into_iter()
        .find(|&s| scheduler_code(s) == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_codes_round_trip() {
        for s in Scheduler::ALL {
            assert_eq!(scheduler_of_code(scheduler_code(s)), Some(s));
        }
        assert_eq!(scheduler_of_code(0xff), None);
    }
}
