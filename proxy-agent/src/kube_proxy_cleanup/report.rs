//! What the cleanup did, line by line: removed, left or failed, where, and what.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Removed,
    Left,
    Failed,
}

/// Every line of the cleanup: what, where, and the outcome.
#[derive(Debug, Default)]
pub struct Report {
    pub lines: Vec<(Outcome, String, String)>,
}

impl Report {
    pub(super) fn add(&mut self, outcome: Outcome, place: &str, what: String) {
        self.lines.push((outcome, place.to_string(), what));
    }

    pub fn count(&self, outcome: Outcome) -> usize {
        self.lines.iter().filter(|(o, ..)| *o == outcome).count()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (outcome, place, what) in &self.lines {
            let o = match outcome {
                Outcome::Removed => "removed",
                Outcome::Left => "left",
                Outcome::Failed => "FAILED",
            };
            writeln!(f, "{o:<8} {place:<16} {what}")?;
        }
        write!(
            f,
            "{} removed, {} left, {} failed",
            self.count(Outcome::Removed),
            self.count(Outcome::Left),
            self.count(Outcome::Failed)
        )
    }
}
