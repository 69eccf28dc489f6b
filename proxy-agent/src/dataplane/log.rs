//! A dataplane that only logs the diffs it is asked to apply: for debugging and for
//! testing everything above the kernel.

use super::{ApplyReport, Dataplane};
use crate::model::NodeView;

/// Remembers the last view and logs `+`/`-` lines for each change.
#[derive(Default)]
pub struct LogDataplane {
    current: NodeView,
    /// Every line logged, in order (tests read it).
    pub lines: Vec<String>,
}

impl Dataplane for LogDataplane {
    fn apply(&mut self, view: &NodeView) -> anyhow::Result<ApplyReport> {
        let mut report = ApplyReport::default();
        for (fe, old) in &self.current {
            if view.get(fe) != Some(old) {
                self.lines
                    .push(format!("- {fe} {} {:?}", old.service, old.backends));
                report.frontends_removed += 1;
            }
        }
        for (fe, new) in view {
            if self.current.get(fe) != Some(new) {
                self.lines
                    .push(format!("+ {fe} {} {:?}", new.service, new.backends));
                report.frontends_written += 1;
            }
        }
        for line in
            &self.lines[self.lines.len() - report.frontends_removed - report.frontends_written..]
        {
            tracing::info!("{line}");
        }
        self.current = view.clone();
        Ok(report)
    }
}
