//! A dataplane that only logs the diffs it is asked to apply: for debugging and for
//! testing everything above the kernel.

use super::{ApplyReport, Dataplane};
use proxy_model::{NodeView, diff_lines};

/// Remembers the last view and logs `+`/`-` lines for each change.
#[derive(Default)]
pub struct LogDataplane {
    pub current: NodeView,
    /// Every line logged, in order (tests read it).
    pub lines: Vec<String>,
}

impl Dataplane for LogDataplane {
    fn apply(&mut self, view: &NodeView) -> crate::error::Result<ApplyReport> {
        let lines = diff_lines(&self.current, view);
        let report = ApplyReport {
            frontends_written: lines.iter().filter(|l| l.starts_with('+')).count(),
            frontends_removed: lines.iter().filter(|l| l.starts_with('-')).count(),
            ..Default::default()
        };
        for line in &lines {
            tracing::info!("{line}");
        }
        self.lines.extend(lines);
        self.current = view.clone();
        Ok(report)
    }
}
