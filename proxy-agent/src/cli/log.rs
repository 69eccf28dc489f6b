//! The agent's log output: every record cut to at most `MAX_RECORD` bytes, so no record
//! floods the log — kube-client's own WARN quotes a whole response body it cannot decode
//! (30 MB in 30 s with 3,000 Services, once per retry).

use std::io::{self, Write};

use tracing_subscriber::fmt::MakeWriter;

/// The longest record written whole.
pub const MAX_RECORD: usize = 8 * 1024;

/// Makes writers that cut each record (one `write_all` per record, as tracing-subscriber's
/// fmt layer writes them) to `MAX_RECORD` bytes.
pub struct Capped<M>(pub M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for Capped<M> {
    type Writer = CappedWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        CappedWriter(self.0.make_writer())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        CappedWriter(self.0.make_writer_for(meta))
    }
}

pub struct CappedWriter<W>(W);

impl<W: Write> Write for CappedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() <= MAX_RECORD {
            return self.0.write(buf);
        }
        // At a UTF-8 character boundary.
        let mut end = MAX_RECORD;
        while end > 0 && buf[end] & 0xc0 == 0x80 {
            end -= 1;
        }
        self.0.write_all(&buf[..end])?;
        writeln!(self.0, "… ({} bytes cut)", buf.len() - end)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_record_is_cut_and_a_short_one_kept() {
        let mut out = Vec::new();
        let mut w = CappedWriter(&mut out);
        w.write_all(b"short\n").expect("write");
        let body = "é".repeat(20_000);
        w.write_all(format!("WARN {body}\n").as_bytes())
            .expect("write");
        let text = String::from_utf8(out).expect("still UTF-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{}", text.len());
        assert_eq!(lines[0], "short");
        assert!(lines[1].len() <= MAX_RECORD + 40, "{}", lines[1].len());
        assert!(
            lines[1].ends_with(" bytes cut)"),
            "{}",
            &lines[1][MAX_RECORD - 20..]
        );
    }
}
