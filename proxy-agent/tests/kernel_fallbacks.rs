//! The start-time probes on this kernel, and the `bpf_set_retval` fallback as the
//! verifier sees it: loaded with `SET_RETVAL` = 0 (what a kernel before 5.18 gets), the
//! connect-time programs lose the helper call — the verifier removed it as dead code, so
//! an older verifier never checks it. Root only (probes load programs).

mod support;

use aya::{
    EbpfLoader,
    programs::{CgroupSockAddr, ProgramError},
};
use proxy_agent::dataplane::bpf::{
    BPF_OBJECT, TcAttachMode, TcHook,
    kernel::{self, choose_tc_hook},
};
use test_support::needs_root;

/// The translated size of `program` loaded with `SET_RETVAL` = `set_retval`.
fn translated_size(program: &str, set_retval: u8) -> Result<u32, ProgramError> {
    let mut ebpf = EbpfLoader::new()
        .override_global("SET_RETVAL", &set_retval, true)
        .load(BPF_OBJECT)
        .expect("loading the object");
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(program)
        .expect("program")
        .try_into()
        .expect("a sock_addr program");
    prog.load()?;
    Ok(prog.info()?.size_translated().expect("translated size"))
}

#[needs_root]
#[test]
fn set_retval_off_leaves_no_call_for_the_verifier() {
    for program in ["connect4", "connect6", "sendmsg4", "sendmsg6"] {
        let with = translated_size(program, 1).expect("loads with bpf_set_retval");
        let without = translated_size(program, 0).expect("loads without bpf_set_retval");
        assert!(
            without < with,
            "{program}: {without} bytes without the call, {with} with it: not pruned"
        );
    }
}

/// This kernel (6.6 or later) has tcx: `auto` picks it, `tcx` is accepted, and every
/// feature the programs need is found.
#[needs_root]
#[test]
fn auto_chooses_tcx_on_this_kernel() {
    let release = kernel::release().expect("kernel release");
    assert_eq!(
        kernel::tcx_supported().expect("probe"),
        release >= (6, 6),
        "tcx probe on {release:?}"
    );
    if release < (6, 6) {
        return;
    }
    assert_eq!(
        choose_tc_hook(TcAttachMode::Auto).expect("auto"),
        TcHook::Tcx
    );
    assert_eq!(choose_tc_hook(TcAttachMode::Tcx).expect("tcx"), TcHook::Tcx);
    assert_eq!(
        choose_tc_hook(TcAttachMode::Clsact).expect("clsact"),
        TcHook::Clsact
    );
    let found = kernel::check(true, Some(TcAttachMode::Auto)).expect("every feature found");
    assert_eq!(found.tc_hook, Some(TcHook::Tcx));
    assert!(found.set_retval, "bpf_set_retval is in 5.18 and later");
}
