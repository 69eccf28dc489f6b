//! The verifier's work per program, as this kernel counts it (`verified_insns` of
//! BPF_OBJ_GET_INFO, Linux 5.16+): each program stays within half of the 1M-instruction
//! limit, so that older verifiers, which prune less (5.10 walked 300,631 instructions of
//! `tc_ingress` where this kernel walks fewer), keep room too. `cargo xtask kernels` runs
//! the programs on those kernels themselves.

use aya::programs::{CgroupSock, CgroupSockAddr, Program, SchedClassifier, Xdp};
use proxy_dataplane::bpf::{CGROUP_PROGRAMS, SOCK_RELEASE_PROGRAM, load_private};

/// The kernel's limit on instructions the verifier walks for one program.
const LIMIT: u32 = 1_000_000;

#[test_support::needs_root]
#[test]
fn every_program_leaves_half_the_verifiers_budget() {
    let (mut ebpf, _maps) = load_private(&[]).expect("the object loads");
    let mut names: Vec<&str> = vec!["tc_ingress", "tc_egress", "xdp_ingress"];
    names.extend(CGROUP_PROGRAMS);
    names.push(SOCK_RELEASE_PROGRAM);
    let mut report = Vec::new();
    let mut over = Vec::new();
    for name in names {
        let prog = ebpf
            .program_mut(name)
            .unwrap_or_else(|| panic!("no {name}"));
        load(name, prog);
        let info = prog.info().expect("program info");
        let Some(walked) = info.verified_instruction_count() else {
            test_support::cannot_run(
                "every_program_leaves_half_the_verifiers_budget",
                "this kernel does not report verified_insns (Linux 5.16+)",
            );
            return;
        };
        let line = format!("{walked:>9} {name}");
        if walked > LIMIT / 2 {
            over.push(line.clone());
        }
        report.push(line);
    }
    println!("instructions the verifier walked:\n{}", report.join("\n"));
    assert!(
        over.is_empty(),
        "past half of the verifier's {LIMIT}-instruction limit:\n{}",
        over.join("\n")
    );
}

/// Loads `prog` by its type (the object's programs are of four).
fn load(name: &str, prog: &mut Program) {
    let loaded = match prog {
        Program::SchedClassifier(p) => SchedClassifier::load(p),
        Program::Xdp(p) => Xdp::load(p),
        Program::CgroupSockAddr(p) => CgroupSockAddr::load(p),
        Program::CgroupSock(p) => CgroupSock::load(p),
        other => panic!("{name}: a program type this test does not load: {other:?}"),
    };
    loaded.unwrap_or_else(|e| panic!("the verifier accepts {name}: {e}"));
}
