//! The text of `proxy-agent dump --stats`: `ipvsadm -Ln --stats`'s layout and number
//! format, with the scheduler and `ipvsadm -Ln`'s Weight and ActiveConn beside it.

use std::fmt::Write as _;

use super::rows::{FrontendStats, Totals};

/// ipvsadm's first column: 33 characters, wider for long (IPv6) addresses.
const MIN_NAME_WIDTH: usize = 33;

/// The table, one line per frontend and one per backend under it. `exact`: every number
/// in full (ipvsadm's `--exact`), else as ipvsadm abbreviates them.
pub fn render_table(rows: &[FrontendStats], exact: bool) -> String {
    let frontend_name = |r: &FrontendStats| {
        // `Protocol`'s Display ignores widths: padded as a string.
        let proto = r.protocol.to_string();
        format!("{proto:<4} {} {}", r.address, r.scheduler)
    };
    let backend_name = |a: &std::net::SocketAddr| format!("  -> {a}");
    let longest = rows
        .iter()
        .map(|r| frontend_name(r).len())
        .chain(
            rows.iter()
                .flat_map(|r| &r.backends)
                .map(|b| backend_name(&b.address).len()),
        )
        .max()
        .unwrap_or(0);
    let width = MIN_NAME_WIDTH.max(longest + 1);
    let number = |n: u64| {
        if exact {
            n.to_string()
        } else {
            large_number(n)
        }
    };
    let line = |name: &str, weight: &str, active: &str, counts: [String; 5]| {
        let mut l = format!("{name:<width$}{weight:>7}{active:>11}");
        for c in counts {
            // Nine wide, as ipvsadm; a longer (exact) number still gets a space before it.
            let w = (c.len() + 1).max(9);
            // Writing to a String cannot fail.
            let _ = write!(l, "{c:>w$}");
        }
        l.push('\n');
        l
    };
    let counts = |t: &Totals| {
        [
            t.conns,
            t.packets_in,
            t.packets_out,
            t.bytes_in,
            t.bytes_out,
        ]
        .map(number)
    };
    let mut out = line(
        "Prot LocalAddress:Port Scheduler",
        "Weight",
        "ActiveConn",
        ["Conns", "InPkts", "OutPkts", "InBytes", "OutBytes"].map(String::from),
    );
    out.push_str("  -> RemoteAddress:Port\n");
    for r in rows {
        out += &line(&frontend_name(r), "", "", counts(&r.stats));
        for b in &r.backends {
            out += &line(
                &backend_name(&b.address),
                &b.weight.to_string(),
                &b.active_conns.to_string(),
                counts(&b.stats),
            );
        }
    }
    out
}

/// A count as ipvsadm prints it (`print_largenum`): in full below 100 million, then in
/// thousands (K), millions (M), billions (G) or trillions (T), truncated.
pub fn large_number(n: u64) -> String {
    const UNITS: [(u64, u64, char); 4] = [
        (1_000_000_000, 1_000, 'K'),
        (100_000_000_000, 1_000_000, 'M'),
        (100_000_000_000_000, 1_000_000_000, 'G'),
        (u64::MAX, 1_000_000_000_000, 'T'),
    ];
    if n < 100_000_000 {
        return n.to_string();
    }
    let (_, div, unit) = UNITS
        .into_iter()
        .find(|&(below, _, _)| n < below)
        .unwrap_or(UNITS[3]);
    format!("{}{unit}", n / div)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::stats::rows::BackendStats;
    use proxy_model::Protocol;

    #[test]
    fn numbers_abbreviate_as_ipvsadm_does() {
        assert_eq!(large_number(0), "0");
        assert_eq!(large_number(99_999_999), "99999999");
        assert_eq!(large_number(100_000_000), "100000K");
        assert_eq!(large_number(999_999_999), "999999K");
        assert_eq!(large_number(1_000_000_000), "1000M");
        assert_eq!(large_number(99_999_999_999), "99999M");
        assert_eq!(large_number(100_000_000_000), "100G");
        assert_eq!(large_number(100_000_000_000_000), "100T");
        assert_eq!(large_number(u64::MAX), "18446744T");
    }

    fn totals(conns: u64, pin: u64, pout: u64, bin: u64, bout: u64) -> Totals {
        Totals {
            conns,
            packets_in: pin,
            packets_out: pout,
            bytes_in: bin,
            bytes_out: bout,
        }
    }

    #[test]
    fn a_frontend_and_its_backends_in_ipvsadm_columns() {
        let rows = [FrontendStats {
            address: "10.96.0.10:80".parse().expect("addr"),
            protocol: Protocol::Tcp,
            scheduler: "wrr",
            service_ids: vec![3],
            stats: totals(2, 5, 3, 300, 2_500_000_000),
            backends: vec![
                BackendStats {
                    address: "10.244.1.5:8080".parse().expect("addr"),
                    id: 7,
                    weight: 3,
                    active_conns: 1,
                    stats: totals(2, 5, 3, 300, 2_500_000_000),
                },
                BackendStats {
                    address: "10.244.2.6:8080".parse().expect("addr"),
                    id: 8,
                    weight: 1,
                    active_conns: 0,
                    stats: Totals::default(),
                },
            ],
        }];
        let expected = "\
Prot LocalAddress:Port Scheduler  Weight ActiveConn    Conns   InPkts  OutPkts  InBytes OutBytes
  -> RemoteAddress:Port
TCP  10.96.0.10:80 wrr                                     2        5        3      300    2500M
  -> 10.244.1.5:8080                   3          1        2        5        3      300    2500M
  -> 10.244.2.6:8080                   1          0        0        0        0        0        0
";
        assert_eq!(render_table(&rows, false), expected);
        let exact = render_table(&rows, true);
        assert!(
            exact.contains("      300 2500000000\n"),
            "--exact prints every digit:\n{exact}"
        );
    }

    #[test]
    fn long_ipv6_names_widen_the_first_column() {
        let rows = [FrontendStats {
            address: "[2001:db8:aaaa:bbbb:cccc:dddd:eeee:ffff]:65535"
                .parse()
                .expect("addr"),
            protocol: Protocol::Sctp,
            scheduler: "mh",
            service_ids: vec![1, 2],
            stats: Totals::default(),
            backends: Vec::new(),
        }];
        let text = render_table(&rows, false);
        let mut lines = text.lines();
        let header = lines.next().expect("header");
        let _ = lines.next();
        let row = lines.next().expect("row");
        assert!(row.starts_with("SCTP [2001:db8:aaaa:bbbb:cccc:dddd:eeee:ffff]:65535 mh "));
        assert_eq!(header.len(), row.len(), "columns stay aligned:\n{text}");
    }
}
