//! The layers of docs/architecture.md, checked from the source: every module of the agent
//! and of the BPF programs imports only modules of a lower layer (read from its `use`
//! lines and `crate::`/`super::` paths, test modules left out), the model imports no
//! kernel-side crate, and only the command line reads the config.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

/// The agent's top-level modules by layer (`cli` is the binary's: main.rs and cli/).
const AGENT_LAYERS: &[(&str, u32)] = &[
    ("model", 0),
    ("netns", 0),
    ("source", 1),
    ("dataplane", 1),
    ("health_check", 1),
    ("wire", 1),
    ("runner", 2),
    ("fanout", 2),
    ("feed", 2),
    ("trace", 2),
    ("kube_proxy_cleanup", 2),
    ("metrics", 3),
    ("config", 3),
    ("http_server", 4),
    ("cli", 5),
];

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
    // The throughput benchmark's generator: an object of its own (imports no module).
    ("bench_gen", 0),
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy-model");
    let manifest = read(&root.join("Cargo.toml"));
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("[dependencies]")
        .split("\n[")
        .next()
        .unwrap_or_default();
    let mut problems: Vec<String> = NOT_IN_THE_MODEL
        .iter()
        .filter(|c| {
            let name = c.replace('_', "-");
            deps.lines().any(|l| {
                l.trim_start().starts_with(&format!("{name} "))
                    || l.trim_start().starts_with(&format!("{name}="))
            })
        })
        .map(|c| format!("proxy-model/Cargo.toml depends on {c}"))
        .collect();
    for file in rust_files(&root.join("src")) {
        let code = code_of(&read(&file));
        problems.extend(foreign_crates(&code).map(|c| format!("{}: {c}", file.display())));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
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
        .filter(|f| {
            f.file_name().is_some_and(|n| n != "lib.rs")
                && !f
                    .file_stem()
                    .is_some_and(|n| n.to_string_lossy().ends_with("tests"))
        })
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    for krate in [
        "proxy-agent",
        "proxy-model",
        "proxy-common",
        "proxy-ebpf",
        "xtask",
    ] {
        for file in rust_files(&root.join(krate).join("src")) {
            if file
                .file_stem()
                .is_some_and(|n| n.to_string_lossy().ends_with("tests"))
            {
                continue;
            }
            let lines = read(&file).lines().count();
            if lines > 700 {
                long.push(format!("{}: {lines} lines", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "split these:\n{}", long.join("\n"));
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
    let foreign: Vec<&str> = foreign_crates(&code_of(
        "use aya::maps::HashMap; fn f() { proxy_common::addr::to_words(x); }",
    ))
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

/// The agent's top-level module a file belongs to.
fn agent_module_of(rel: &Path) -> Option<String> {
    let first = rel.iter().next()?.to_str()?;
    Some(match first {
        "main.rs" => "cli".to_string(),
        f => f.trim_end_matches(".rs").to_string(),
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
        return items.iter().filter_map(|it| ident(it.trim())).collect();
    }
    ident(after).into_iter().collect()
}

fn ident(s: &str) -> Option<String> {
    let id: String = s
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!id.is_empty() && id != "self").then_some(id)
}

/// Crates the model must not name.
fn foreign_crates(code: &str) -> impl Iterator<Item = &'static str> + '_ {
    NOT_IN_THE_MODEL.iter().copied().filter(move |c| {
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
