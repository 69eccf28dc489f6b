//! kube-proxy's iptables chains, per backend (legacy, nft) and family: which chains are
//! its own (its iptables and IPVS modes' fixed chains, the per-Service and per-endpoint
//! chains, the canaries), which KUBE-* chains are kubelet's, and one `iptables-restore
//! --noflush` transaction per table that deletes the jumps from built-in chains, then
//! flushes and deletes kube-proxy's chains, as `kube-proxy --cleanup` does.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use super::report::{Outcome, Report};

/// Fixed chains of kube-proxy's iptables and IPVS modes, by table
/// (pkg/proxy/iptables/cleanup.go, pkg/proxy/ipvs/proxier.go `iptablesCleanupChains`).
const FIXED: [(&str, &[&str]); 3] = [
    (
        "nat",
        &[
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
        ],
    ),
    (
        "filter",
        &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ],
    ),
    ("mangle", &["KUBE-PROXY-CANARY"]),
];

/// Per-Service and per-endpoint chains (nat): kube-proxy hunts these by prefix.
const SERVICE_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// kubelet's chains: kube-proxy's cleanup leaves them, and so do we.
const KUBELET: [&str; 4] = [
    "KUBE-IPTABLES-HINT",
    "KUBE-KUBELET-CANARY",
    "KUBE-FIREWALL",
    "KUBE-MARK-DROP",
];

/// One table of an `iptables-save` dump.
#[derive(Debug, Default, PartialEq)]
pub struct Table {
    pub name: String,
    /// Chain name → built in (has a policy).
    pub chains: BTreeMap<String, bool>,
    /// `(chain, rule spec after "-A CHAIN ")`, in order.
    pub rules: Vec<(String, String)>,
}

/// Splits an `iptables-save` dump into its tables.
pub fn parse_save(text: &str) -> Vec<Table> {
    let mut tables = Vec::new();
    let mut cur: Option<Table> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            cur = Some(Table {
                name: name.trim().to_string(),
                ..Default::default()
            });
        } else if line.trim() == "COMMIT" {
            tables.extend(cur.take());
        } else if let (Some(t), Some(decl)) = (cur.as_mut(), line.strip_prefix(':')) {
            let mut parts = decl.split_whitespace();
            if let Some(name) = parts.next() {
                let builtin = parts.next().is_some_and(|policy| policy != "-");
                t.chains.insert(name.to_string(), builtin);
            }
        } else if let (Some(t), Some(rule)) = (cur.as_mut(), line.strip_prefix("-A "))
            && let Some((chain, spec)) = rule.split_once(' ')
        {
            t.rules.push((chain.to_string(), spec.to_string()));
        }
    }
    tables
}

/// The chain a rule jumps or goes to (`-j` / `-g`), if any.
fn target(spec: &str) -> Option<&str> {
    let mut words = spec.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" || w == "--jump" || w == "--goto" {
            return words.next();
        }
    }
    None
}

/// Why a chain is kube-proxy's, or why a KUBE-* chain is not.
fn is_kube_proxys(table: &str, chain: &str) -> bool {
    FIXED
        .iter()
        .any(|(t, chains)| *t == table && chains.contains(&chain))
        || (table == "nat" && SERVICE_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// What one table's cleanup does.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// Rule specs (`CHAIN rest`) in built-in chains that jump to a chain going away.
    pub delete_rules: Vec<(String, String)>,
    /// kube-proxy's chains, flushed then deleted.
    pub remove_chains: Vec<String>,
    /// KUBE-* chains that stay, with the reason.
    pub left: Vec<(String, String)>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.delete_rules.is_empty() && self.remove_chains.is_empty()
    }

    /// The `iptables-restore --noflush` input: jumps deleted, chains flushed (a `:CHAIN`
    /// line flushes an existing chain) and deleted, in one transaction.
    pub fn restore_input(&self, table: &str) -> String {
        let mut s = format!("*{table}\n");
        for c in &self.remove_chains {
            s.push_str(&format!(":{c} - [0:0]\n"));
        }
        for (chain, spec) in &self.delete_rules {
            s.push_str(&format!("-D {chain} {spec}\n"));
        }
        for c in &self.remove_chains {
            s.push_str(&format!("-X {c}\n"));
        }
        s.push_str("COMMIT\n");
        s
    }
}

/// Decides a table's cleanup: kube-proxy's chains go, with the jumps to them from
/// built-in chains. A chain someone else's chain still jumps to stays (with what that
/// chain reaches of kube-proxy's), since deleting it would mean editing their chain.
pub fn plan(table: &Table) -> Plan {
    let mut going: BTreeSet<&str> = table
        .chains
        .iter()
        .filter(|(name, builtin)| !**builtin && is_kube_proxys(&table.name, name))
        .map(|(name, _)| name.as_str())
        .collect();
    let mut left = Vec::new();
    loop {
        let pinned = table.rules.iter().find_map(|(chain, spec)| {
            let t = target(spec)?;
            let keeps = !table.chains.get(chain).copied().unwrap_or(false)
                && !going.contains(chain.as_str())
                && going.contains(t);
            keeps.then_some((t, chain))
        });
        let Some((t, from)) = pinned else { break };
        going.remove(t);
        left.push((t.to_string(), format!("still jumped to from chain {from}")));
    }
    for name in table.chains.keys() {
        if !name.starts_with("KUBE-") || going.contains(name.as_str()) {
            continue;
        }
        if left.iter().any(|(c, _)| c == name) {
            continue;
        }
        let why = if KUBELET.contains(&name.as_str()) {
            "kubelet's (kube-proxy --cleanup leaves it too)"
        } else {
            "not one of kube-proxy's chains (kube-proxy --cleanup leaves it too)"
        };
        left.push((name.clone(), why.to_string()));
    }
    let delete_rules = table
        .rules
        .iter()
        .filter(|(chain, spec)| {
            table.chains.get(chain).copied().unwrap_or(false)
                && target(spec).is_some_and(|t| going.contains(t))
        })
        .cloned()
        .collect();
    Plan {
        delete_rules,
        remove_chains: going.into_iter().map(str::to_string).collect(),
        left,
    }
}

/// One iptables backend of one family: its save and restore commands.
pub struct Backend {
    /// `iptables-legacy`, `ip6tables-nft`, ... (the save command without `-save`).
    pub name: String,
    save: PathBuf,
    restore: PathBuf,
}

/// The backends whose commands this host has: for each family the `-legacy` and `-nft`
/// variants, or the plain command when neither variant is installed. Either backend may
/// hold kube-proxy's rules (its image picks one by what it finds on the node).
pub fn backends() -> Vec<Backend> {
    let mut out = Vec::new();
    for family in ["iptables", "ip6tables"] {
        let variants: Vec<Backend> = ["-legacy", "-nft"]
            .iter()
            .filter_map(|v| backend(&format!("{family}{v}")))
            .collect();
        if variants.is_empty() {
            out.extend(backend(family));
        } else {
            out.extend(variants);
        }
    }
    out
}

fn backend(name: &str) -> Option<Backend> {
    Some(Backend {
        name: name.to_string(),
        save: find(&format!("{name}-save"))?,
        restore: find(&format!("{name}-restore"))?,
    })
}

/// A command in `PATH` or the usual sbin folders.
pub fn find(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())
}

/// Cleans one backend: every table its save command shows (`-save` without `-t` lists
/// only tables that exist, so nothing is created or loaded to look).
pub fn clean(backend: &Backend, report: &mut Report) {
    let what = &backend.name;
    let saved = match run(&backend.save, &[], None) {
        Ok(out) => out,
        Err(e) => {
            report.add(
                Outcome::Failed,
                what,
                format!("{} failed: {e}", backend.save.display()),
            );
            return;
        }
    };
    for table in parse_save(&saved) {
        let plan = plan(&table);
        for (chain, why) in &plan.left {
            report.add(
                Outcome::Left,
                what,
                format!("{} chain {chain}: {why}", table.name),
            );
        }
        if plan.is_empty() {
            continue;
        }
        let input = plan.restore_input(&table.name);
        if let Err(e) = run(&backend.restore, &["--noflush"], Some(&input)) {
            report.add(
                Outcome::Failed,
                what,
                format!(
                    "{} table: {} --noflush failed: {e}",
                    table.name,
                    backend.restore.display()
                ),
            );
            continue;
        }
        for (chain, spec) in &plan.delete_rules {
            report.add(
                Outcome::Removed,
                what,
                format!("{} rule -A {chain} {spec}", table.name),
            );
        }
        summarize_chains(&table.name, &plan.remove_chains, what, report);
    }
}

/// Fixed chains by name; per-Service and per-endpoint chains counted by prefix (a large
/// cluster has tens of thousands).
fn summarize_chains(table: &str, chains: &[String], what: &str, report: &mut Report) {
    let mut by_prefix: BTreeMap<&str, usize> = BTreeMap::new();
    for c in chains {
        match SERVICE_PREFIXES.iter().find(|p| c.starts_with(**p)) {
            Some(p) => *by_prefix.entry(p).or_default() += 1,
            None => report.add(Outcome::Removed, what, format!("{table} chain {c}")),
        }
    }
    for (p, n) in by_prefix {
        report.add(Outcome::Removed, what, format!("{table} chains {p}*: {n}"));
    }
}

fn run(cmd: &Path, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .map_err(|e| e.to_string())?;
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVED: &str = "\
# Generated by iptables-nft-save
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
:MINE - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A FORWARD -j MINE
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A MINE -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-AAAA - [0:0]
:KUBE-SEP-BBBB - [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -j KUBE-SVC-AAAA
-A KUBE-SVC-AAAA -j KUBE-SEP-BBBB
-A KUBE-SEP-BBBB -s 10.20.0.2/32 -j KUBE-MARK-MASQ
-A CNI-HOSTPORT-MASQ -j KUBE-MARK-MASQ
COMMIT
";

    fn table<'a>(tables: &'a [Table], name: &str) -> &'a Table {
        tables.iter().find(|t| t.name == name).expect("table")
    }

    #[test]
    fn a_save_dump_splits_into_tables_chains_and_rules() {
        let tables = parse_save(SAVED);
        assert_eq!(tables.len(), 3);
        let filter = table(&tables, "filter");
        assert_eq!(filter.chains.get("INPUT"), Some(&true));
        assert_eq!(filter.chains.get("KUBE-FORWARD"), Some(&false));
        assert_eq!(filter.rules[0], ("INPUT".into(), "-j KUBE-FIREWALL".into()));
        assert_eq!(target(&filter.rules[1].1), Some("KUBE-FORWARD"));
    }

    #[test]
    fn kube_proxys_chains_go_with_their_jumps_kubelets_and_others_stay() {
        let tables = parse_save(SAVED);
        let filter = plan(table(&tables, "filter"));
        assert_eq!(filter.remove_chains, ["KUBE-FORWARD", "KUBE-SERVICES"]);
        assert_eq!(
            filter
                .delete_rules
                .iter()
                .map(|(c, _)| c.as_str())
                .collect::<Vec<_>>(),
            ["FORWARD", "FORWARD"],
            "only the jumps to kube-proxy's chains: {:?}",
            filter.delete_rules
        );
        assert_eq!(filter.left.len(), 1);
        assert_eq!(filter.left[0].0, "KUBE-FIREWALL");
        assert!(filter.left[0].1.contains("kubelet"));

        let mangle = plan(table(&tables, "mangle"));
        assert_eq!(mangle.remove_chains, ["KUBE-PROXY-CANARY"]);
        let left: Vec<&str> = mangle.left.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(left, ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"]);
    }

    #[test]
    fn a_chain_someone_elses_chain_jumps_to_stays() {
        let tables = parse_save(SAVED);
        let nat = plan(table(&tables, "nat"));
        // CNI-HOSTPORT-MASQ jumps to KUBE-MARK-MASQ: that one stays, and KUBE-SEP-BBBB,
        // which jumps to it, can still go (it is flushed first).
        assert_eq!(
            nat.remove_chains,
            ["KUBE-SEP-BBBB", "KUBE-SERVICES", "KUBE-SVC-AAAA"]
        );
        assert_eq!(nat.left.len(), 1);
        assert_eq!(nat.left[0].0, "KUBE-MARK-MASQ");
        assert!(nat.left[0].1.contains("CNI-HOSTPORT-MASQ"));
        assert_eq!(nat.delete_rules.len(), 1);
        let input = nat.restore_input("nat");
        assert!(input.starts_with("*nat\n:KUBE-SEP-BBBB - [0:0]\n"));
        assert!(input.contains(
            "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ));
        assert!(input.ends_with("-X KUBE-SVC-AAAA\nCOMMIT\n"));
    }

    #[test]
    fn nothing_of_kube_proxys_means_nothing_to_do() {
        let tables =
            parse_save("*filter\n:INPUT ACCEPT [0:0]\n:MINE - [0:0]\n-A INPUT -j MINE\nCOMMIT\n");
        let p = plan(&tables[0]);
        assert!(p.is_empty() && p.left.is_empty());
    }
}
