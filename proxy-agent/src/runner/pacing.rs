//! When the runner acts (kube-proxy's BoundedFrequencyRunner): applies no closer than a
//! minimum interval, so bursts coalesce; the periodic resync; retries with backoff after
//! a failed apply; and the audit's steps between changes. Bookkeeping on an injected
//! clock: the loop asks what is due, sleeps until then, and says what it did.

use std::time::{Duration, Instant};

use super::clock::Clock;

/// Timing of the runner (kube-proxy's minSyncPeriod / syncPeriod).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub min_interval: Duration,
    pub resync: Duration,
    /// First retry delay after a failed apply; doubles up to `resync`.
    pub retry: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            // kube-proxy's minSyncPeriod is 1 s because each iptables sync is costly; a
            // map update is not, so bursts are coalesced over a much shorter window: at
            // 100 changes/s a change waits at most this long (100 ms here made the p99
            // floor ~130 ms, issue 24's target is 50 ms).
            min_interval: Duration::from_millis(10),
            resync: Duration::from_secs(30),
            retry: Duration::from_secs(1),
        }
    }
}

/// Steps of the audit per resync period: each compares about 1/`AUDIT_STEPS` of what is
/// programmed (at 100k Services, a thousand frontends: milliseconds, not the seconds a
/// whole pass takes), so no change waits long behind one.
pub const AUDIT_STEPS: u32 = 100;

/// The most of a core the audit takes: a step that took `t` is followed by the next no
/// sooner than `t × AUDIT_DUTY_DIVISOR` later. (At 100k Services a step of 256 frontends
/// takes ~9 ms of lookups: every 300 ms, that was 3% of a core beside the traffic.)
const AUDIT_DUTY_DIVISOR: u32 = 100;

/// The shortest interval between audit steps, however short the resync period.
const AUDIT_MIN_EVERY: Duration = Duration::from_millis(5);

/// What is due when, and what the loop last did.
#[derive(Debug)]
pub struct Pacing<C> {
    clock: C,
    timing: Timing,
    /// When the last apply began: the next one waits the minimum interval after it.
    last_apply: Option<Instant>,
    next_resync: Instant,
    next_audit: Instant,
    audit: AuditPace,
    /// When a failed apply is tried again; the delay after the next failure.
    retry_at: Option<Instant>,
    retry_delay: Duration,
}

impl<C: Clock> Pacing<C> {
    /// The first resync a period from now, the first audit step an audit interval from now.
    pub fn new(timing: Timing, clock: C) -> Self {
        let now = clock.now();
        let every = (timing.resync / AUDIT_STEPS).max(AUDIT_MIN_EVERY);
        Self {
            clock,
            timing,
            last_apply: None,
            next_resync: now + timing.resync,
            next_audit: now + every,
            audit: AuditPace {
                every,
                period: timing.resync,
                pass_began: None,
            },
            retry_at: None,
            retry_delay: timing.retry,
        }
    }

    /// When the loop wakes if no change comes first: a retry, the resync or an audit step.
    pub fn next_wake(&self) -> Instant {
        self.retry_at
            .map_or(self.next_resync, |r| r.min(self.next_resync))
            .min(self.next_audit)
    }

    /// Woken by the clock: an audit step, when it is all that is due (a retry or the
    /// resync goes first). Returns when it began; the next step is then due an interval
    /// on (later if [`Self::audit_step_done`] says so), whether or not this one runs.
    pub fn start_audit_step(&mut self) -> Option<Instant> {
        let now = self.clock.now();
        let due = now >= self.next_audit
            && now < self.next_resync
            && self.retry_at.is_none_or(|r| now < r);
        if !due {
            return None;
        }
        self.next_audit = now + self.audit.every;
        Some(now)
    }

    /// The audit step that began at `began` ended now (`pass_done`: it ended a pass).
    pub fn audit_step_done(&mut self, began: Instant, pass_done: bool) {
        self.next_audit = self.audit.after_step(began, self.clock.now(), pass_done);
    }

    /// The earliest the next apply may begin (`None`: at once): the minimum interval
    /// after the last one, so a burst of changes coalesces into one apply.
    pub fn apply_not_before(&self) -> Option<Instant> {
        self.last_apply.map(|t| t + self.timing.min_interval)
    }

    /// Whether the periodic resync is due.
    pub fn resync_due(&self) -> bool {
        self.clock.now() >= self.next_resync
    }

    /// The resync was done: the next is a period from now.
    pub fn resynced(&mut self) {
        self.next_resync = self.clock.now() + self.timing.resync;
    }

    /// An apply begins now.
    pub fn apply_begins(&mut self) {
        self.last_apply = Some(self.clock.now());
    }

    /// The apply programmed everything: no retry is due, and the next failure's retry
    /// comes after the first delay again.
    pub fn apply_succeeded(&mut self) {
        self.retry_at = None;
        self.retry_delay = self.timing.retry;
    }

    /// The apply failed (or left frontends out): retried after the delay, which doubles
    /// for the next failure, up to the resync period.
    pub fn apply_failed(&mut self) {
        self.retry_at = Some(self.clock.now() + self.retry_delay);
        self.retry_delay = (self.retry_delay * 2).min(self.timing.resync);
    }
}

/// When the audit's steps run: one every `every` at most, spaced so the audit takes no
/// more than 1/`AUDIT_DUTY_DIVISOR` of a core, and a new pass no sooner than `period`
/// after the last one began. A small node's pass ends within a few steps, and each pass
/// walks every bucket of the maps (empty ones too: millions); back to back, those walks
/// kept an idle agent at one Service at 1.2% of a core (0.2% paced). A pass longer than `period`
/// (above ~25k frontends) is followed by the next at once.
#[derive(Debug)]
struct AuditPace {
    every: Duration,
    period: Duration,
    /// When the pass under way began (its first step).
    pass_began: Option<Instant>,
}

impl AuditPace {
    /// The next step's time, after a step that began at `began` and ended at `now`
    /// (`done`: it ended its pass).
    fn after_step(&mut self, began: Instant, now: Instant, done: bool) -> Instant {
        let pass_began = *self.pass_began.get_or_insert(began);
        let next = now + self.every.max((now - began) * AUDIT_DUTY_DIVISOR);
        if !done {
            return next;
        }
        self.pass_began = None;
        next.max(pass_began + self.period)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::clock::ManualClock;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A pacing on a clock the test moves, and the clock's start.
    fn pacing(timing: Timing) -> (Pacing<ManualClock>, ManualClock, Instant) {
        let clock = ManualClock::default();
        let t0 = clock.now();
        (Pacing::new(timing, clock.clone()), clock, t0)
    }

    fn timing(min_interval: u64, resync: u64, retry: u64) -> Timing {
        Timing {
            min_interval: ms(min_interval),
            resync: ms(resync),
            retry: ms(retry),
        }
    }

    #[test]
    fn a_burst_of_changes_waits_for_the_minimum_interval_after_the_last_apply() {
        let (mut p, clock, t0) = pacing(timing(10, 30_000, 1_000));
        assert_eq!(p.apply_not_before(), None, "the first apply goes at once");
        p.apply_begins();
        // Changes 3 ms and 9 ms later wait for the same moment: one apply for both.
        clock.advance(ms(3));
        assert_eq!(p.apply_not_before(), Some(t0 + ms(10)));
        clock.advance(ms(6));
        assert_eq!(p.apply_not_before(), Some(t0 + ms(10)));
        // A change long after the last apply does not wait.
        clock.advance(ms(100));
        assert!(p.apply_not_before().is_some_and(|t| t <= clock.now()));
        p.apply_begins();
        assert_eq!(p.apply_not_before(), Some(t0 + ms(119)));
        // A failure changes nothing of it: a retry waits for the interval too.
        p.apply_failed();
        assert_eq!(p.apply_not_before(), Some(t0 + ms(119)));
    }

    #[test]
    fn the_resync_is_due_a_period_after_the_start_and_after_each_resync() {
        let (mut p, clock, t0) = pacing(timing(10, 30_000, 1_000));
        clock.advance(ms(29_999));
        assert!(!p.resync_due());
        assert!(p.next_wake() <= t0 + ms(30_000));
        clock.advance(ms(1));
        assert!(p.resync_due());
        // Done half a second late: the next is a period after it was done.
        clock.advance(ms(500));
        p.resynced();
        assert!(!p.resync_due());
        clock.advance(ms(29_999));
        assert!(!p.resync_due());
        clock.advance(ms(1));
        assert!(p.resync_due());
    }

    #[test]
    fn a_failed_apply_is_retried_after_a_delay_that_doubles_up_to_the_resync_period() {
        let (mut p, clock, t0) = pacing(timing(10, 10_000, 1_000));
        assert_eq!(p.retry_at, None);
        let mut at = t0;
        for delay in [1_000, 2_000, 4_000, 8_000, 10_000, 10_000] {
            p.apply_failed();
            assert_eq!(p.retry_at, Some(at + ms(delay)));
            assert!(p.next_wake() <= at + ms(delay));
            clock.advance(ms(delay));
            at += ms(delay);
        }
        // A success: nothing to retry, and the next failure starts over.
        p.apply_succeeded();
        assert_eq!(p.retry_at, None);
        p.apply_failed();
        assert_eq!(p.retry_at, Some(at + ms(1_000)));
    }

    #[test]
    fn an_audit_step_is_due_each_interval_when_nothing_else_is() {
        // Resync 30 s: a step every 300 ms (a hundredth).
        let (mut p, clock, t0) = pacing(timing(10, 30_000, 1_000));
        assert_eq!(p.next_wake(), t0 + ms(300));
        clock.advance(ms(299));
        assert_eq!(p.start_audit_step(), None);
        clock.advance(ms(1));
        assert_eq!(p.start_audit_step(), Some(t0 + ms(300)));
        // The next one an interval later, whether or not this one ran.
        assert_eq!(p.next_wake(), t0 + ms(600));
        clock.advance(ms(100));
        assert_eq!(p.start_audit_step(), None);
        // A step that ran: spaced by what it took (see `AuditPace`).
        clock.advance(ms(200));
        let began = p.start_audit_step().expect("due at 600 ms");
        clock.advance(ms(2));
        p.audit_step_done(began, false);
        assert_eq!(p.next_wake(), t0 + ms(902));
        // A retry that is due goes first, then the audit goes on.
        p.apply_failed();
        clock.advance(ms(1_000));
        assert_eq!(p.start_audit_step(), None, "a retry is due");
        p.apply_succeeded();
        assert!(p.start_audit_step().is_some());
        // So does the resync.
        clock.advance(ms(30_000));
        assert_eq!(p.start_audit_step(), None, "the resync is due");
        p.resynced();
        assert!(p.start_audit_step().is_some());
    }

    #[test]
    fn audit_steps_come_no_closer_than_five_milliseconds() {
        // Resync 200 ms: a hundredth is 2 ms, too often.
        let (mut p, clock, t0) = pacing(timing(10, 200, 20));
        assert_eq!(p.next_wake(), t0 + ms(5));
        clock.advance(ms(5));
        assert!(p.start_audit_step().is_some());
        assert_eq!(p.next_wake(), t0 + ms(10));
    }

    fn pace() -> AuditPace {
        AuditPace {
            every: Duration::from_millis(300),
            period: Duration::from_secs(30),
            pass_began: None,
        }
    }

    #[test]
    fn a_short_pass_waits_for_its_period_and_a_long_one_does_not() {
        let t0 = Instant::now();
        let mut p = pace();
        // Three quick steps: the next pass begins a period after this one began.
        assert_eq!(p.after_step(t0, t0, false), t0 + ms(300));
        assert_eq!(
            p.after_step(t0 + ms(300), t0 + ms(300), false),
            t0 + ms(600)
        );
        assert_eq!(
            p.after_step(t0 + ms(600), t0 + ms(600), true),
            t0 + ms(30_000)
        );
        // The next pass, 40 s long: the one after it begins one step later.
        let t1 = t0 + ms(30_000);
        assert_eq!(p.after_step(t1, t1, false), t1 + ms(300));
        let end = t1 + ms(40_000);
        assert_eq!(p.after_step(end, end, true), end + ms(300));
        // A pass of one step.
        let t2 = end + ms(300);
        assert_eq!(p.after_step(t2, t2, true), t2 + ms(30_000));
    }

    #[test]
    fn a_slow_step_spaces_the_next_to_keep_the_audit_to_one_percent_of_a_core() {
        let t0 = Instant::now();
        let mut p = pace();
        // 9 ms of work: the next step 900 ms after it ended, not 300.
        assert_eq!(p.after_step(t0, t0 + ms(9), false), t0 + ms(909));
        // 2 ms: the step interval still rules.
        let t1 = t0 + ms(909);
        assert_eq!(p.after_step(t1, t1 + ms(2), false), t1 + ms(302));
    }
}
