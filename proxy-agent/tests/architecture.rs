//! The layers of docs/architecture.md, checked from the source: every module of the agent
//! and of the BPF programs imports only modules of a lower layer (read from its `use`
//! lines and `crate::`/`super::` paths, test modules left out), the model imports no
//! kernel-side crate, and only the command line reads the config; and the test crates
//! under tests/ (the e2e suite, the benchmarks, the cluster in a box) name none of each
//! other.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

/// The agent's top-level modules by layer (`cli` is the binary's: main.rs and cli/;
/// `model`, `dataplane` and `netns` are the crates below, re-exported). The feed's folder
/// holds three layers (`FOLDERS_OF_LAYERS`): its wire format and TLS below the sources
/// (the feed's client is a source), its server above them.
const AGENT_LAYERS: &[(&str, u32)] = &[
    ("model", 0),
    ("netns", 0),
    ("feed", 0),
    ("dataplane", 1),
    ("health_check", 1),
    ("feed::wire", 1),
    ("feed::tls", 1),
    ("source", 2),
    ("runner", 3),
    ("feed::server", 3),
    ("trace", 3),
    ("kube_proxy_cleanup", 3),
    ("metrics", 4),
    ("config", 4),
    ("http_server", 5),
    ("cli", 6),
];

/// Top-level folders whose children have layers of their own (`feed::wire`).
const FOLDERS_OF_LAYERS: &[&str] = &["feed"];

/// The BPF programs' modules by layer, as proxy-ebpf/src/main.rs lists them.
const EBPF_LAYERS: &[(&str, u32)] = &[
    ("verdict", 0),
    ("maps", 0),
    ("frame", 0),
    ("mem", 0),
    ("packet", 1),
    ("stats", 1),
    ("drop", 1),
    ("node", 2),
    ("conntrack", 3),
    ("lb", 3),
    ("reject", 3),
    ("route", 3),
    ("nat", 4),
    ("icmp", 4),
    ("dsr", 4),
    ("pipeline", 5),
    ("sock", 5),
    ("main", 6),
];

/// Crates of the kernel side or the runtime: the model knows none of them.
const NOT_IN_THE_MODEL: &[&str] = &[
    "proxy_common",
    "aya",
    "aya_log",
    "kube",
    "tokio",
    "axum",
    "libc",
    "nix",
    "netlink_sys",
    "netlink_packet_core",
    "netlink_packet_route",
    "netlink_packet_netfilter",
    "netlink_packet_sock_diag",
    "prometheus_client",
];

/// What the command line alone may import.
const CLI_ONLY: &[&str] = &["config"];

#[test]
fn agent_modules_import_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let problems = check_crate(&src, AGENT_LAYERS, agent_module_of);
    assert!(
        problems.is_empty(),
        "upward imports:\n{}",
        problems.join("\n")
    );
}

#[test]
fn bpf_modules_import_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy-ebpf/src");
    let problems = check_crate(&src, EBPF_LAYERS, |rel| {
        Some(
            rel.iter()
                .next()?
                .to_str()?
                .trim_end_matches(".rs")
                .to_string(),
        )
    });
    assert!(
        problems.is_empty(),
        "upward imports:\n{}",
        problems.join("\n")
    );
}

/// The model is a crate of its own (`proxy-model`): Cargo refuses what its manifest does
/// not list, so the wall is its manifest — and its code names none of them either.
#[test]
fn the_model_uses_no_kernel_side_crate() {
    let problems = crate_uses("proxy-model", NOT_IN_THE_MODEL);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Crates of the Kubernetes side, the HTTP servers and the agent: the dataplane knows
/// none of them (it takes a node view and settings, and gives reports).
const NOT_IN_THE_DATAPLANE: &[&str] = &[
    "proxy_agent",
    "kube",
    "k8s_openapi",
    "axum",
    "hyper",
    "tonic",
    "prometheus_client",
    "clap",
];

/// The dataplane is a crate of its own (`proxy-dataplane`), below the sources, the runner
/// and the agent's config: its manifest and its code name none of their crates.
#[test]
fn the_dataplane_uses_no_agent_side_crate() {
    let problems = crate_uses("proxy-dataplane", NOT_IN_THE_DATAPLANE);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Where the crate at `dir` (its manifest's `[dependencies]`, its code) names one of
/// `forbidden`.
fn crate_uses(dir: &str, forbidden: &[&'static str]) -> Vec<String> {
    names_in(dir, &["dependencies"], &["src"], forbidden)
}

/// Where the crate at `dir` names one of `forbidden`: in its manifest's `tables`
/// (`dependencies`, `dev-dependencies`, ...) or in the code of its `folders`.
fn names_in(
    dir: &str,
    tables: &[&str],
    folders: &[&str],
    forbidden: &[&'static str],
) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
    let manifest = read(&root.join("Cargo.toml"));
    let mut problems: Vec<String> = manifest_names(&manifest, tables, forbidden)
        .map(|c| format!("{dir}/Cargo.toml depends on {c}"))
        .collect();
    for file in folders.iter().flat_map(|f| rust_files(&root.join(f))) {
        let code = code_of(&read(&file));
        problems
            .extend(foreign_crates(&code, forbidden).map(|c| format!("{}: {c}", file.display())));
    }
    problems
}

/// The crates of `forbidden` that `manifest` lists in one of its `tables` (also a
/// target's: `[target.'cfg(unix)'.dependencies]`).
fn manifest_names<'a>(
    manifest: &'a str,
    tables: &'a [&str],
    forbidden: &'a [&'static str],
) -> impl Iterator<Item = &'static str> + 'a {
    let mut inside = false;
    let deps: Vec<&str> = manifest
        .lines()
        .filter(|l| {
            let Some(header) = l.trim().strip_prefix('[').and_then(|h| h.strip_suffix(']')) else {
                return inside;
            };
            inside = tables
                .iter()
                .any(|t| header == *t || header.ends_with(&format!(".{t}")));
            false
        })
        .collect();
    forbidden.iter().copied().filter(move |c| {
        let name = c.replace('_', "-");
        deps.iter().any(|l| {
            l.trim_start().starts_with(&format!("{name} "))
                || l.trim_start().starts_with(&format!("{name}="))
        })
    })
}

/// Every table of a manifest that lists crates a target uses.
const DEPENDENCY_TABLES: &[&str] = &["dependencies", "dev-dependencies", "build-dependencies"];

/// The test crates under tests/ beside the testbed, by folder and crate name: the e2e
/// suite, the benchmarks and the cluster in a box.
const TEST_CRATES: &[(&str, &str)] = &[
    ("tests/e2e", "proxy_e2e"),
    ("tests/bench", "proxy_bench"),
    ("tests/cluster", "proxy_cluster"),
];

/// The test crates share what they share through the testbed (`proxy-testbed`) and the
/// product's crates, never through each other: no manifest of theirs (any dependency
/// table) and none of their code names another of them; the testbed, below them all,
/// names none of them.
#[test]
fn the_test_crates_name_none_of_each_other() {
    let all: Vec<&'static str> = TEST_CRATES.iter().map(|(_, c)| *c).collect();
    let mut problems = names_in("tests/testbed", DEPENDENCY_TABLES, &["src"], &all);
    for (dir, own) in TEST_CRATES {
        let manifest = read(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(dir)
                .join("Cargo.toml"),
        );
        assert!(
            manifest.contains(&format!("name = \"{}\"", own.replace('_', "-"))),
            "{dir}/Cargo.toml is not {own}'s"
        );
        let others: Vec<&'static str> = all.iter().copied().filter(|c| c != own).collect();
        problems.extend(names_in(dir, DEPENDENCY_TABLES, &["src", "tests"], &others));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_manifest_check_reads_every_dependency_table() {
    let manifest = r#"[package]
name = "proxy-e2e"

[dependencies]
anyhow = "1"

[dev-dependencies]
proxy-bench = { path = "../bench" }

[target.'cfg(unix)'.build-dependencies]
proxy-cluster={ path = "../cluster" }

[features]
proxy-testbed = []
"#;
    let forbidden = ["proxy_bench", "proxy_cluster", "proxy_testbed", "anyhow"];
    let named = |tables: &[&str]| manifest_names(manifest, tables, &forbidden).collect::<Vec<_>>();
    assert_eq!(
        named(DEPENDENCY_TABLES),
        ["proxy_bench", "proxy_cluster", "anyhow"]
    );
    assert_eq!(named(&["dependencies"]), ["anyhow"]);
}

/// Inside the model crate: no two modules import each other, however far round, and a
/// module imports the leaf that defines what it uses, never the crate root (which only
/// declares the modules and re-exports them for the crates above).
#[test]
fn the_models_modules_import_leaves_without_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy-model/src");
    let modules: BTreeMap<String, PathBuf> = rust_files(&src)
        .into_iter()
        // The root, and test-only files (`view_tests`, `objects/tests`: test modules).
        .filter(|f| f.file_name().is_some_and(|n| n != "lib.rs") && !is_test_file(f))
        .map(|f| {
            let stem = f.file_stem().expect("stem").to_string_lossy().to_string();
            (stem, f)
        })
        .collect();
    let mut problems = Vec::new();
    let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (module, file) in &modules {
        let code = code_of(&read(file));
        for target in imported_modules(std::slice::from_ref(module), &code) {
            if target == *module {
                continue;
            }
            if modules.contains_key(&target) {
                edges.entry(module.clone()).or_default().push(target);
            } else {
                problems.push(format!(
                    "{module} imports {target} from the crate root: import it from its module"
                ));
            }
        }
    }
    problems.extend(circles(&edges));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Small modules: no source file of the product's crates over 700 lines (test files
/// aside: a test module of its own, `tests.rs` or `*_tests.rs`).
#[test]
fn no_source_file_is_over_700_lines() {
    let mut long = Vec::new();
    for file in product_sources() {
        let lines = read(&file).lines().count();
        if lines > 700 {
            long.push(format!("{}: {lines} lines", file.display()));
        }
    }
    assert!(long.is_empty(), "split these:\n{}", long.join("\n"));
}

/// Inside every crate of the product, no two modules import each other however far round
/// (a parent that uses its child, and a child that imports the parent's own items, make
/// a circle too): each module imports the leaf that defines what it uses. Read from
/// `crate::`, `super::`, `self::` and child-module paths, each to the deepest module it
/// names.
#[test]
fn no_crate_has_a_circle_between_its_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    for krate in PRODUCT_CRATES {
        let src = root.join(krate).join("src");
        let graph = module_graph(&src);
        assert!(graph.len() > 1, "no modules under {}", src.display());
        problems.extend(circles(&graph).into_iter().map(|c| format!("{krate}: {c}")));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A test module in a file of its own (`tests.rs`, `*_tests.rs`): the size and module
/// checks leave it out.
fn is_test_file(file: &Path) -> bool {
    file.file_stem()
        .is_some_and(|n| n.to_string_lossy().ends_with("tests"))
}

/// Every source file of the product's crates, test files aside.
fn product_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    PRODUCT_CRATES
        .iter()
        .flat_map(|krate| rust_files(&root.join(krate).join("src")))
        .filter(|f| !is_test_file(f))
        .collect()
}

/// The product's crates: the module, size and length checks read them.
const PRODUCT_CRATES: &[&str] = &[
    "proxy-common",
    "proxy-model",
    "proxy-dataplane",
    "proxy-agent",
    "proxy-ebpf",
    "xtask",
];

/// Each module of the crate at `src` (named by its path, `bpf::writer`; the root is
/// `crate`) with the modules its code names. Test files (`tests.rs`, `*_tests.rs`) and
/// `#[cfg(test)]` items are left out; `src/bin/` holds crates of their own.
fn module_graph(src: &Path) -> BTreeMap<String, Vec<String>> {
    let files: Vec<(Vec<String>, PathBuf)> = rust_files(src)
        .into_iter()
        .filter(|f| !is_test_file(f))
        .filter_map(|f| {
            let rel = f.strip_prefix(src).ok()?.to_path_buf();
            if rel.starts_with("bin") {
                return None;
            }
            let mut path = module_path(&rel);
            if path == ["lib"] {
                path.clear();
            }
            Some((path, f))
        })
        .collect();
    let modules: std::collections::BTreeSet<Vec<String>> =
        files.iter().map(|(p, _)| p.clone()).collect();
    let name = |p: &[String]| {
        if p.is_empty() {
            "crate".to_string()
        } else {
            p.join("::")
        }
    };
    let mut graph: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (own, file) in &files {
        let code = code_of(&read(file));
        let children: Vec<String> = modules
            .iter()
            .filter(|m| m.len() == own.len() + 1 && m.starts_with(own))
            .map(|m| m[own.len()].clone())
            .collect();
        let edges = graph.entry(name(own)).or_default();
        for named in named_paths(own, &children, &code) {
            let deepest = (0..=named.len())
                .rev()
                .map(|n| &named[..n])
                .find(|p| modules.contains(*p))
                .unwrap_or(&[]);
            let target = name(deepest);
            if deepest != own.as_slice() && !edges.contains(&target) {
                edges.push(target);
            }
        }
    }
    graph
}

/// The paths from the crate root that `code`, module `own`'s, names through `crate::`,
/// `super::`, `self::` or one of its `children`; a `use` group gives each of its paths.
fn named_paths(own: &[String], children: &[String], code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        let start: Option<(Vec<String>, &str)> = if !boundary {
            None
        } else if let Some(r) = rest.strip_prefix("crate::") {
            Some((Vec::new(), r))
        } else if rest.starts_with("super::") {
            let mut r = rest;
            let mut base = own.to_vec();
            while let Some(after) = r.strip_prefix("super::") {
                base.pop();
                r = after;
            }
            Some((base, r))
        } else if let Some(r) = rest.strip_prefix("self::") {
            Some((own.to_vec(), r))
        } else {
            children.iter().find_map(|c| {
                let r = rest.strip_prefix(c.as_str())?.strip_prefix("::")?;
                let mut base = own.to_vec();
                base.push(c.clone());
                Some((base, r))
            })
        };
        let Some((base, after)) = start else {
            // Another crate's path (`aya::maps::{..}`): its group's names are not ours.
            let foreign = boundary
                .then(|| ident(rest))
                .flatten()
                .filter(|id| rest[id.len()..].starts_with("::"));
            i += match foreign {
                Some(id) => {
                    let after = &rest[id.len() + 2..];
                    let mut at = 0;
                    use_tree_at(after, &mut at);
                    id.len() + 2 + at.max(1)
                }
                None => rest.chars().next().map_or(1, char::len_utf8),
            };
            continue;
        };
        for tail in use_tree(after) {
            let mut full = base.clone();
            full.extend(tail);
            out.push(full);
        }
        i += rest.len() - after.len();
    }
    out
}

/// The paths of a use tree (or an expression's path) at the start of `text`:
/// `a::{b, c::{d, e}}` gives `a::b`, `a::c::d`, `a::c::e`.
fn use_tree(text: &str) -> Vec<Vec<String>> {
    use_tree_at(text, &mut 0)
}

/// [`use_tree`] from `at`, which it leaves after the tree.
fn use_tree_at(text: &str, at: &mut usize) -> Vec<Vec<String>> {
    return tree(text, at);

    fn tree(text: &str, at: &mut usize) -> Vec<Vec<String>> {
        let mut segs = Vec::new();
        loop {
            let rest = text[*at..].trim_start();
            *at = text.len() - rest.len();
            if let Some(group) = rest.strip_prefix('{') {
                *at = text.len() - group.len();
                let mut out = Vec::new();
                loop {
                    for tail in tree(text, at) {
                        let mut full: Vec<String> = segs.clone();
                        full.extend(tail);
                        out.push(full);
                    }
                    let rest = text[*at..].trim_start();
                    *at = text.len() - rest.len();
                    match rest.chars().next() {
                        Some(',') => {
                            *at += 1;
                            if text[*at..].trim_start().starts_with('}') {
                                let r = text[*at..].trim_start();
                                *at = text.len() - r.len() + 1;
                                return out;
                            }
                        }
                        Some('}') => {
                            *at += 1;
                            return out;
                        }
                        _ => return out,
                    }
                }
            }
            let Some(id) = ident(rest) else {
                return vec![segs];
            };
            *at += id.len();
            segs.push(id);
            match text[*at..].strip_prefix("::") {
                Some(_) => *at += 2,
                None => return vec![segs],
            }
        }
    }
}

#[test]
fn the_module_graph_reads_paths() {
    let own = ["bpf".to_string(), "writer".to_string()];
    let children = ["node".to_string()];
    let paths = named_paths(
        &own,
        &children,
        "use crate::{a::b, c::{d, e}}; use super::maps::M; fn f() { self::node::g(); node::h(); x::node::y(); } use aya::{node::Z, maps};",
    );
    let paths: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "a::b",
            "c::d",
            "c::e",
            "bpf::maps::M",
            "bpf::writer::node::g",
            "bpf::writer::node::h"
        ]
    );
}

/// Small functions: none of the product's crates over 100 lines (a function's first line
/// to its closing brace at the same indentation; test files aside).
#[test]
fn no_function_is_over_100_lines() {
    let mut long = Vec::new();
    for file in product_sources() {
        for (name, line, lines) in long_functions(&read(&file), 100) {
            long.push(format!("{}:{line}: {name}, {lines} lines", file.display()));
        }
    }
    assert!(long.is_empty(), "split these:\n{}", long.join("\n"));
}

/// The functions of `text` over `max` lines: name, first line (1-based), length.
fn long_functions(text: &str, max: usize) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let after_vis = trimmed
            .strip_prefix("pub ")
            .or_else(|| {
                trimmed
                    .strip_prefix("pub(")
                    .and_then(|r| r.split_once(") ").map(|(_, r)| r))
            })
            .unwrap_or(trimmed);
        let after_kw = ["const ", "async ", "unsafe "]
            .iter()
            .fold(after_vis, |r, kw| r.strip_prefix(kw).unwrap_or(r));
        let Some(name) = after_kw.strip_prefix("fn ").and_then(ident) else {
            continue;
        };
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            let n = end + 2;
            if n > max {
                out.push((name, i + 1, n));
            }
        }
    }
    out
}

#[test]
fn the_length_check_measures_functions() {
    let body = "    x();\n".repeat(101);
    let text = format!("pub(crate) async fn long() {{\n{body}}}\n\nfn short() {{\n}}\n");
    assert_eq!(long_functions(&text, 100), [("long".to_string(), 1, 103)]);
    assert!(long_functions(&text, 103).is_empty());
}

/// Each circle of `edges` once, as `a -> b -> a`.
fn circles(edges: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    fn walk(
        at: &str,
        edges: &BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut circle = path[i..].to_vec();
            circle.push(at.to_string());
            out.push(format!("circle: {}", circle.join(" -> ")));
            return;
        }
        if !done.insert(at.to_string()) {
            return;
        }
        path.push(at.to_string());
        for next in edges.get(at).into_iter().flatten() {
            walk(next, edges, path, done, out);
        }
        path.pop();
    }
    let mut out = Vec::new();
    let mut done = std::collections::BTreeSet::new();
    for start in edges.keys() {
        walk(start, edges, &mut Vec::new(), &mut done, &mut out);
    }
    out
}

#[test]
fn the_circle_finder_finds_circles() {
    let edges = |pairs: &[(&str, &str)]| {
        let mut e: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (a, b) in pairs {
            e.entry(a.to_string()).or_default().push(b.to_string());
        }
        e
    };
    assert_eq!(
        circles(&edges(&[("a", "b"), ("b", "c"), ("c", "a")])),
        ["circle: a -> b -> c -> a"]
    );
    assert!(circles(&edges(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
}

/// The checker itself: each kind of upward import is caught, and what only looks like
/// one (comments, strings, test modules, a module's own paths) is not.
#[test]
fn the_checker_catches_upward_imports() {
    let layers = AGENT_LAYERS;
    let check = |path: &str, text: &str| {
        let rel = PathBuf::from(path);
        let module = agent_module_of(&rel).expect("module");
        violations(&module, &module_path(&rel), &code_of(text), layers)
    };
    assert_eq!(
        check("model/view.rs", "use crate::config::Config;").len(),
        1
    );
    assert_eq!(
        check(
            "model/view.rs",
            "use crate::{\n    model::X,\n    dataplane::bpf::Y,\n};"
        )
        .len(),
        1,
        "a group names the upward module"
    );
    assert_eq!(
        check("model/mod.rs", "fn f() { crate::runner::run(); }").len(),
        1
    );
    assert_eq!(
        check("model/a/b.rs", "use super::super::super::source::S;").len(),
        1
    );
    assert_eq!(
        check("health_check.rs", "use super::runner::Status;").len(),
        1
    );
    assert_eq!(
        check("http_server.rs", "use crate::config::Config;").len(),
        1,
        "config is the CLI's"
    );
    assert_eq!(
        check(
            "main.rs",
            "use proxy_agent::config::Config; use crate::cli::run;"
        )
        .len(),
        0
    );
    for harmless in [
        "// use crate::config::Config;",
        "/* crate::runner */ fn f() {}",
        "const S: &str = \"crate::runner::x\";",
        "use super::schedule::Scheduler;",
        "use crate::model::NodeView;",
        "#[cfg(test)]\nmod tests {\n    use crate::runner::Status;\n}\n",
    ] {
        assert_eq!(
            check("model/view.rs", harmless),
            Vec::<String>::new(),
            "{harmless}"
        );
    }
    let bpf =
        |path: &str, text: &str| violations(path, &[path.to_string()], &code_of(text), EBPF_LAYERS);
    assert_eq!(
        bpf(
            "conntrack",
            "use crate::{verdict::DROP, pipeline::is_local};"
        )
        .len(),
        1
    );
    assert_eq!(
        bpf("nat", "use crate::icmp::Scratch;").len(),
        1,
        "same layer"
    );
    assert!(bpf("pipeline", "use crate::{conntrack, nat, verdict::PASS_ON};").is_empty());
    let foreign: Vec<&str> = foreign_crates(
        &code_of("use aya::maps::HashMap; fn f() { proxy_common::addr::to_words(x); }"),
        NOT_IN_THE_MODEL,
    )
    .collect();
    assert_eq!(foreign, ["proxy_common", "aya"]);
}

/// Every upward import of the crate rooted at `src`.
fn check_crate(
    src: &Path,
    layers: &[(&str, u32)],
    module_of: impl Fn(&Path) -> Option<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let files = rust_files(src);
    assert!(!files.is_empty(), "no sources under {}", src.display());
    for file in files {
        let rel = file.strip_prefix(src).expect("under src").to_path_buf();
        if rel == Path::new("lib.rs") {
            continue;
        }
        let Some(module) = module_of(&rel) else {
            continue;
        };
        let code = code_of(&read(&file));
        for v in violations(&module, &module_path(&rel), &code, layers) {
            problems.push(format!("{}: {v}", rel.display()));
        }
    }
    problems
}

/// The agent's top-level module a file belongs to (`feed::wire` in a folder of layers).
fn agent_module_of(rel: &Path) -> Option<String> {
    let mut parts = rel.iter();
    let first = parts.next()?.to_str()?;
    let second = parts.next().and_then(|p| p.to_str());
    Some(match (first, second) {
        ("main.rs", _) => "cli".to_string(),
        (f, Some(child)) if FOLDERS_OF_LAYERS.contains(&f) && child != "mod.rs" => {
            format!("{f}::{}", child.trim_end_matches(".rs"))
        }
        (f, _) => f.trim_end_matches(".rs").to_string(),
    })
}

/// The module path of a file (`dataplane/bpf/mod.rs` → dataplane, bpf).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "main") {
        parts.pop();
    }
    parts
}

/// The imports of `module` (a file at `path`) that reach a module of its own layer or
/// above, or a module only the command line may read.
fn violations(module: &str, path: &[String], code: &str, layers: &[(&str, u32)]) -> Vec<String> {
    let layer_of: BTreeMap<&str, u32> = layers.iter().copied().collect();
    let Some(&own) = layer_of.get(module) else {
        return vec![format!("module {module} has no layer: add it to the table")];
    };
    let mut out = Vec::new();
    for target in imported_modules(path, code) {
        if target == module {
            continue;
        }
        if CLI_ONLY.contains(&target.as_str()) && module != "cli" && layers == AGENT_LAYERS {
            out.push(format!(
                "{module} imports {target}, which only the command line reads"
            ));
            continue;
        }
        match layer_of.get(target.as_str()) {
            Some(&l) if l < own => {}
            Some(&l) => out.push(format!(
                "{module} (layer {own}) imports {target} (layer {l}): not a lower layer"
            )),
            // Not a module of ours (a macro's `crate::` or an item of the crate root).
            None => {}
        }
    }
    out
}

/// The top-level modules a file's code names through `crate::` or `super::` paths.
fn imported_modules(path: &[String], code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        if boundary && rest.starts_with("crate::") {
            out.extend(first_segments(&rest["crate::".len()..]));
            i += "crate::".len();
            continue;
        }
        if boundary && rest.starts_with("super::") {
            let mut ups = 0;
            let mut r = rest;
            while let Some(after) = r.strip_prefix("super::") {
                ups += 1;
                r = after;
            }
            // A file's own module is the last part of its path; `super` leaves it.
            if ups >= path.len() {
                out.extend(first_segments(r));
            } else if ups == path.len() - 1 {
                out.push(path[0].clone());
            }
            i += rest.len() - r.len();
            continue;
        }
        i += rest.chars().next().map_or(1, char::len_utf8);
    }
    out
}

/// The first path segment after `crate::` (or each one of a `{...}` group).
fn first_segments(after: &str) -> Vec<String> {
    if let Some(group) = after.strip_prefix('{') {
        let mut depth = 1;
        let mut items = Vec::new();
        let mut current = String::new();
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                ',' if depth == 1 => {
                    items.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            if depth == 1 && c != '}' {
                current.push(c);
            }
        }
        items.push(current);
        return items
            .iter()
            .filter_map(|it| layer_unit(it.trim()))
            .collect();
    }
    layer_unit(after).into_iter().collect()
}

/// The module a path starting at `s` names, as the layer tables name them: its first
/// segment, or two in a folder of layers (`feed::wire`).
fn layer_unit(s: &str) -> Option<String> {
    let id = ident(s)?;
    if FOLDERS_OF_LAYERS.contains(&id.as_str())
        && let Some(child) = s[id.len()..].strip_prefix("::").and_then(ident)
    {
        return Some(format!("{id}::{child}"));
    }
    Some(id)
}

fn ident(s: &str) -> Option<String> {
    let id: String = s
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!id.is_empty() && id != "self").then_some(id)
}

/// The crates of `forbidden` that `code` names.
fn foreign_crates<'a>(
    code: &'a str,
    forbidden: &'a [&'static str],
) -> impl Iterator<Item = &'static str> + 'a {
    forbidden.iter().copied().filter(move |c| {
        let needle = format!("{c}::");
        code.match_indices(&needle).any(|(at, _)| {
            at == 0 || {
                let b = code.as_bytes()[at - 1];
                !(b.is_ascii_alphanumeric() || b == b'_' || b == b':')
            }
        })
    })
}

/// The code of a file without comments, string contents and `#[cfg(test)]` items.
fn code_of(text: &str) -> String {
    let stripped = strip_comments_and_strings(text);
    strip_test_items(&stripped)
}

fn strip_comments_and_strings(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
            }
            '"' => {
                out.push('"');
                let mut escaped = false;
                for c in chars.by_ref() {
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        break;
                    }
                }
                out.push('"');
            }
            c => out.push(c),
        }
    }
    out
}

/// Drops each `#[cfg(test)]` item (a `mod tests { .. }`, or one item up to its `;` or
/// its balanced braces): tests may reach across layers to set up what they check.
fn strip_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let end = match (after.find('{'), after.find(';')) {
            (Some(b), Some(s)) if s < b => s + 1,
            (Some(b), _) => {
                let mut depth = 0;
                let mut end = after.len();
                for (k, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, Some(s)) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}
