//! The runner's clock: what its pacing reads the time from, injected so that the
//! timing rules can be driven by a test instead of waited for (kube-proxy's
//! BoundedFrequencyRunner takes a `clock.Clock` for the same reason).

use std::time::Instant;

#[cfg(test)]
pub use self::manual::ManualClock;

/// Where the time comes from.
pub trait Clock {
    fn now(&self) -> Instant;
}

/// tokio's clock: the real time, or a test's paused and advanced time
/// (`tokio::time::pause`), so that it agrees with the loop's `sleep_until`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

#[cfg(test)]
mod manual {
    use std::{cell::Cell, rc::Rc, time::Duration};

    use super::{Clock, Instant};

    /// A clock that moves only when told; clones share it.
    #[derive(Clone, Debug)]
    pub struct ManualClock(Rc<Cell<Instant>>);

    impl Default for ManualClock {
        fn default() -> Self {
            Self(Rc::new(Cell::new(Instant::now())))
        }
    }

    impl ManualClock {
        /// Moves the time on by `by`.
        pub fn advance(&self, by: Duration) {
            self.0.set(self.0.get() + by);
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Instant {
            self.0.get()
        }
    }
}
