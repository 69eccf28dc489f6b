//! A batch sent in parts (`Batch.continued`), joined again on the node before anything of
//! it is applied: a large snapshot streams in messages of bounded size, yet a node never
//! programs half of one.

use super::v1;

/// The parts of the batch being received.
#[derive(Debug, Default)]
pub struct Parts {
    held: Option<v1::Batch>,
}

impl Parts {
    /// Takes one message: the whole batch once its last part is in, else `None`.
    /// A part whose snapshot, epoch or revision differ from the first's starts over
    /// (the server never mixes batches; a stream that did is taken at its word).
    pub fn push(&mut self, mut part: v1::Batch) -> Option<v1::Batch> {
        let more = part.continued;
        part.continued = false;
        let whole = match self.held.take() {
            Some(mut held)
                if held.snapshot == part.snapshot
                    && held.epoch == part.epoch
                    && held.revision == part.revision =>
            {
                held.ops.append(&mut part.ops);
                held.api_validated = part.api_validated;
                held
            }
            _ => part,
        };
        if more {
            self.held = Some(whole);
            None
        } else {
            Some(whole)
        }
    }

    /// Whether a batch is half received.
    pub fn pending(&self) -> bool {
        self.held.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(revision: u64, ops: usize, continued: bool) -> v1::Batch {
        v1::Batch {
            snapshot: true,
            epoch: "e".into(),
            revision,
            ops: vec![v1::Op::default(); ops],
            api_validated: true,
            continued,
        }
    }

    #[test]
    fn parts_join_into_one_batch_and_only_at_the_last() {
        let mut p = Parts::default();
        assert_eq!(p.push(part(7, 2, true)), None);
        assert!(p.pending());
        assert_eq!(p.push(part(7, 3, true)), None);
        let whole = p.push(part(7, 1, false)).expect("the last part");
        assert_eq!(whole.ops.len(), 6);
        assert!(!whole.continued && whole.snapshot && whole.revision == 7);
        assert!(!p.pending());
        // A batch in one message passes as it is.
        assert_eq!(p.push(part(8, 4, false)).map(|b| b.ops.len()), Some(4));
    }

    #[test]
    fn a_part_of_another_batch_starts_over() {
        let mut p = Parts::default();
        assert_eq!(p.push(part(7, 2, true)), None);
        let whole = p.push(part(9, 1, false)).expect("a batch of its own");
        assert_eq!((whole.revision, whole.ops.len()), (9, 1));
    }
}
