//! The maps the agent pins, each named once with its default capacity. [`maps!`] turns the
//! table into `map_names::X`, `map_names::ALL`, `capacity::X` and [`MAPS`].
//!
//! A row is `NAME(capacity)` or `NAME(as OTHER)`: a map sized as another one (the agent
//! resizes them together, `ebpf.mapSizes`). Its doc comment goes on both constants.

/// One map: its name (as the BPF object declares it and as it is pinned) and default
/// capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    pub name: &'static str,
    /// Default `max_entries`. The agent may override some at load time.
    pub capacity: u32,
    /// The map whose capacity this one takes (`NAME(as OTHER)` in the table).
    pub sized_as: Option<&'static str>,
}

macro_rules! maps {
    (@capacity as $other:ident) => { $other };
    (@capacity $capacity:expr) => { $capacity };
    (@sized_as as $other:ident) => { Some(map_names::$other) };
    (@sized_as $capacity:expr) => { None };
    ($( $(#[doc = $doc:literal])* $name:ident ( $($size:tt)+ ); )*) => {
        /// Names of the maps, as the BPF object declares them and as they are pinned.
        pub mod map_names {
            $(
                $(#[doc = $doc])*
                pub const $name: &str = stringify!($name);
            )*

            /// Every map the agent pins, in a stable order. (The SCTP ones are pinned so a
            /// tail call keeps working while the agent is down: a program array loses its
            /// entries when nothing in user space holds it.)
            pub const ALL: [&str; crate::maps::MAPS.len()] = [$($name),*];
        }

        /// Default capacities; the agent may override some at load time (`ebpf.mapSizes`,
        /// `conntrack.*`). The hash maps that the agent writes are not preallocated: an
        /// unused entry costs only its bucket.
        pub mod capacity {
            $(
                $(#[doc = $doc])*
                pub const $name: u32 = maps!(@capacity $($size)+);
            )*
        }

        /// The table itself, in the order of [`map_names::ALL`].
        pub const MAPS: [MapSpec; [$(stringify!($name)),*].len()] = [$(
            MapSpec {
                name: map_names::$name,
                capacity: capacity::$name,
                sized_as: maps!(@sized_as $($size)+),
            }
        ),*];
    };
}

maps! {
    /// Frontends × scopes: 100k Services with room to spare.
    SERVICES(262_144);
    /// Backend slots of every frontend: 100k Service ports × 10 endpoints on their
    /// ClusterIPs, with room for NodePorts and for the second generation of a backend
    /// set during a flip (`ebpf.mapSizes` raises it).
    BACKEND_SLOTS(2_097_152);
    /// Backends by id: 1M endpoints, 100k Services × 10.
    BACKENDS(1_048_576);
    AFFINITY(65_536);
    /// The frontend replies are shown as, one per frontend.
    REV_NAT(as SERVICES);
    /// Connect-time path: what the hooks did for each socket (by cookie). Live sockets
    /// that connected or sent to a frontend (entries go when the socket is released, so
    /// this bounds concurrent sockets, not connections over time).
    SOCK_LB(262_144);
    /// Connect-time path: connected sockets' bindings, in the slot each cookie names
    /// (`sock_slot`); a socket whose slot is taken goes to `SOCK_LB`.
    SOCK_CONNECTED(65_536);
    /// Connect-time path: per slot of socket cookies (`sock_count_slot`), the `SOCK_LB`
    /// entries counted under the filter's generation. A released socket whose slot
    /// counts none has no entry, and skips the lookup.
    SOCK_LB_COUNTS(65_536);
    /// Connect-time path: the `SockLbFilter` (generation; whether uncounted entries may
    /// be left).
    SOCK_LB_FILTER(1);
    /// Which backend ids belong to which service entry, and since when: one entry per
    /// live backend slot of the current generations.
    MEMBERS(as BACKEND_SLOTS);
    /// Answered flows (hash, expired by the agent's collector): kube-proxy's
    /// `conntrack.min` (the agent sizes it from `conntrack.maxPerCore` × CPUs, at least
    /// `conntrack.min`).
    CONNTRACK(131_072);
    /// Flows not answered yet (LRU: a flood of new flows only evicts its own kind); a
    /// quarter of the answered table by default.
    CONNTRACK_NEW(32_768);
    /// The source ports flows' reply tuples use (`port_slot`): a byte per port. A packet
    /// from a port never marked is no reply, and skips that probe.
    REPLY_PORTS(1_024);
    /// The ports frontends use (`port_slot`): a byte per port. A packet to a port never
    /// marked is for no frontend and no flow of ours, and passes after two array reads.
    FRONTEND_PORTS(1_024);
    /// Per-CPU counters, one per `counter` index.
    COUNTERS(crate::counter::COUNT);
    NODE_CONFIG(1);
    LOCAL_NETS(16_384);
    SOURCE_RANGES(16_384);
    /// The per-packet path's tail calls (`TAIL_SCTP_CRC`).
    TC_TAIL(1);
    /// The SCTP checksum work in flight, per CPU.
    SCTP_PENDING(1);
    /// The CRC32c shift table (`crc32c::zeros(len)` at index `len`).
    SCTP_ZEROS(crate::crc32c::TABLE_LEN);
    /// The ports of IPv4 datagrams whose later fragments are in flight.
    FRAGMENTS(8_192);
    /// Flows netfilter translated before the classifier was attached (kube-proxy's),
    /// by their client tuple: the classifier leaves their packets to netfilter. Those
    /// already translated when the agent started (a migration's live connections; LRU:
    /// beyond this, the oldest go back to being dropped as `ct_invalid`).
    NETFILTER_FLOWS(65_536);
    /// Maglev tables (`sched::SH`, `MH`) in chunks (`MaglevChunk`).
    MAGLEV(as BACKEND_SLOTS);
    /// Per service entry, per CPU: the round-robin cursor (`sched::RR`, `WRR`). LRU: an
    /// evicted cursor restarts at a random slot.
    RR_CURSORS(65_536);
    /// Per backend id: connections open now (the least-connection schedulers).
    ACTIVE_CONNS(as BACKENDS);
    /// Per (service entry, backend) with unequal weights: the weight.
    WEIGHTS(262_144);
    /// `LbStats` per (frontend `rev_nat_id`, backend id) pair (`StatsKey`): a pair is a
    /// backend slot's (plus one per frontend for its removed backends), so sized as the
    /// slots.
    LB_STATS(as BACKEND_SLOTS);
    /// Direct server return at a backend's node: the (frontend, backend) pairs of
    /// Services in `dsr` mode whose option it believes (`DsrPermitKey`).
    DSR_PERMITS(65_536);
    /// Per device (ifindex): the device it is a port of (a bridge, a bond), for the
    /// reverse-path checks.
    IF_MASTERS(4_096);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// `ABI.md`'s table of maps: per row, the cells under `map` and `default capacity`.
    fn abi_rows() -> Vec<(String, String)> {
        let abi = include_str!("../ABI.md");
        // A `\|` inside a cell is a pipe of the cell's text, not a column break.
        let cells = |line: &str| -> Vec<String> {
            let line = line.trim().trim_start_matches('|').trim_end_matches('|');
            line.replace("\\|", "\u{0}")
                .split('|')
                .map(|c| c.trim().replace('\u{0}', "|"))
                .collect()
        };
        let mut lines = abi.lines().skip_while(|l| !l.starts_with("| map |"));
        let header = cells(
            lines
                .next()
                .expect("ABI.md has a table whose first column is `map`"),
        );
        let column = |name: &str| {
            header
                .iter()
                .position(|h| h == name)
                .unwrap_or_else(|| panic!("ABI.md's table of maps has no `{name}` column"))
        };
        let (name_col, capacity_col) = (column("map"), column("default capacity"));
        lines
            .skip(1) // |---|---|
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let row = cells(l);
                assert_eq!(row.len(), header.len(), "ABI.md row {l:?}");
                let name = row[name_col].trim_matches('`').to_string();
                (name, row[capacity_col].clone())
            })
            .collect()
    }

    /// The leading number of a capacity cell: digits, grouped by spaces ("2 097 152").
    fn leading_number(cell: &str) -> Option<u32> {
        let digits: String = cell
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == ' ')
            .filter(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    }

    /// ABI.md lists every map of the table, and only those, with the capacity the code
    /// gives it; a map sized as another says so ("as `OTHER`").
    #[test]
    fn abi_md_lists_every_map_with_its_capacity() {
        let rows = abi_rows();
        let mut documented = BTreeMap::new();
        for (name, capacity) in &rows {
            assert!(
                documented
                    .insert(name.as_str(), capacity.as_str())
                    .is_none(),
                "ABI.md lists `{name}` twice"
            );
        }
        for spec in MAPS {
            let Some(cell) = documented.remove(spec.name) else {
                panic!("ABI.md's table of maps lacks `{}`", spec.name);
            };
            assert_eq!(
                leading_number(cell),
                Some(spec.capacity),
                "ABI.md gives `{}` the capacity {cell:?}",
                spec.name
            );
            match spec.sized_as {
                Some(other) => assert!(
                    cell.contains(&format!("as `{other}`")),
                    "ABI.md should say `{}` is sized as `{other}`: {cell:?}",
                    spec.name
                ),
                None => assert!(
                    !cell.contains("as `"),
                    "ABI.md says `{}` is sized as another map, the code does not: {cell:?}",
                    spec.name
                ),
            }
        }
        assert!(
            documented.is_empty(),
            "ABI.md lists maps the code lacks: {:?}",
            documented.keys().collect::<Vec<_>>()
        );
    }

    /// One table: the names, `ALL` and the capacities are its rows, and a map sized as
    /// another names one with a capacity of its own.
    #[test]
    fn the_table_is_consistent() {
        assert_eq!(map_names::ALL.len(), MAPS.len());
        for (name, spec) in map_names::ALL.iter().zip(MAPS) {
            assert_eq!(*name, spec.name);
            assert!(spec.capacity > 0, "{name}");
            if let Some(other) = spec.sized_as {
                let other = MAPS.iter().find(|m| m.name == other).unwrap();
                assert_eq!(
                    other.sized_as, None,
                    "{name} is sized as a map sized as another"
                );
                assert_eq!(spec.capacity, other.capacity, "{name}");
            }
        }
        let mut names = map_names::ALL.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), MAPS.len(), "a map is named twice");
        assert_eq!(capacity::MAGLEV, capacity::BACKEND_SLOTS);
        assert_eq!(capacity::COUNTERS, crate::counter::COUNT);
    }
}
