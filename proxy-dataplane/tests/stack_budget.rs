//! The programs' combined stack, as the verifiers of the kernels people run count it,
//! read from the object itself so a change that breaks an older kernel fails here, on
//! any kernel, before the kernel matrix (`cargo xtask kernels`) boots one.
//!
//! Each program's deepest chain of BPF-to-BPF calls, every frame rounded up to 32 bytes
//! (kernels before 6.9 round so; later ones, with the JIT, to 16), must stay within the
//! kernel's 512 bytes with `HEADROOM` to spare. 6.1 and 5.10 once refused `tc_ingress`
//! at 544 bytes while 6.18 accepted it. A frame's depth is the deepest stack slot its
//! instructions reach (`r10 - N`, directly or through a register copied from r10), as
//! the verifier's own count is; the chain is every call the code holds, reachable or not
//! (the verifier skips dead branches), so this count is the safe side of the kernel's.

use std::collections::{BTreeMap, HashMap};

use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget, SectionIndex};

/// The kernel's limit on a program's combined stack.
const LIMIT: u32 = 512;
/// What a change may add before the kernel refuses: a frame's rounding step.
const HEADROOM: u32 = 32;
/// Frames round up to this on the kernels before 6.9.
const FRAME_ROUNDING: u32 = 32;

/// One function: where its code is, how deep its frame, whom it calls.
struct Function {
    name: String,
    depth: u32,
    calls: Vec<usize>,
}

#[test]
fn every_programs_combined_stack_leaves_headroom_on_older_kernels() {
    let file = object::File::parse(proxy_dataplane::bpf::BPF_OBJECT).expect("the BPF object");
    let functions = functions(&file);
    let mut report = Vec::new();
    let mut over = Vec::new();
    for (i, f) in functions.iter().enumerate() {
        if !is_program(&file, &f.name) {
            continue;
        }
        let (depth, chain) = deepest(&functions, i, &mut Vec::new());
        let line = format!(
            "{:>4} {}: {}",
            depth,
            f.name,
            chain
                .iter()
                .map(|&c| format!("{}({})", short(&functions[c].name), functions[c].depth))
                .collect::<Vec<_>>()
                .join(" > ")
        );
        if depth + HEADROOM > LIMIT {
            over.push(line.clone());
        }
        report.push(line);
    }
    assert!(
        report.len() >= 10,
        "found only {} programs in the object: {report:#?}",
        report.len()
    );
    println!("{}", report.join("\n"));
    assert!(
        over.is_empty(),
        "combined stack past {} bytes ({LIMIT} less {HEADROOM} of headroom), frames \
         rounded to {FRAME_ROUNDING}:\n{}",
        LIMIT - HEADROOM,
        over.join("\n")
    );
}

/// A program is a function symbol outside `.text` (its own ELF section).
fn is_program(file: &object::File<'_>, name: &str) -> bool {
    file.symbols().any(|s| {
        s.name() == Ok(name)
            && s.kind() == object::SymbolKind::Text
            && s.section_index()
                .and_then(|i| file.section_by_index(i).ok())
                .and_then(|sec| sec.name().ok().map(|n| n != ".text"))
                .unwrap_or(false)
    })
}

/// The deepest chain from function `i`: its combined stack and the functions on it.
fn deepest(functions: &[Function], i: usize, path: &mut Vec<usize>) -> (u32, Vec<usize>) {
    path.push(i);
    let mut best = (0, Vec::new());
    for &c in &functions[i].calls {
        if path.contains(&c) {
            continue; // BPF has no recursion; a cycle would be a misread call
        }
        let found = deepest(functions, c, path);
        if found.0 > best.0 {
            best = found;
        }
    }
    path.pop();
    let frame = functions[i].depth.max(1).div_ceil(FRAME_ROUNDING) * FRAME_ROUNDING;
    let mut chain = vec![i];
    chain.extend(best.1);
    (frame + best.0, chain)
}

/// Every function symbol of every code section, with its frame and calls.
fn functions(file: &object::File<'_>) -> Vec<Function> {
    // (section, start offset) → index, to resolve calls.
    let mut at: BTreeMap<(usize, u64), usize> = BTreeMap::new();
    let mut spans = Vec::new();
    for s in file.symbols() {
        if s.kind() != object::SymbolKind::Text || s.size() == 0 {
            continue;
        }
        let (Some(section), Ok(name)) = (s.section_index(), s.name()) else {
            continue;
        };
        at.insert((section.0, s.address()), spans.len());
        spans.push((name.to_string(), section, s.address(), s.size()));
    }
    let mut functions: Vec<Function> = spans
        .iter()
        .map(|(name, ..)| Function {
            name: name.clone(),
            depth: 0,
            calls: Vec::new(),
        })
        .collect();
    let function_at = |section: SectionIndex, offset: u64| -> Option<usize> {
        at.range((section.0, 0)..=(section.0, offset))
            .next_back()
            .filter(|&(&(s, start), &i)| s == section.0 && offset < start + spans[i].3)
            .map(|(_, &i)| i)
    };
    for (i, (_, section, start, size)) in spans.iter().enumerate() {
        let sec = file
            .section_by_index(*section)
            .expect("the symbol's section");
        let data = sec.data().expect("section data");
        // Calls the linker left to relocate: the call's offset → the symbol's section,
        // address, and whether it is the section itself (the immediate then counts from
        // the section's start) or a function (the immediate is -1).
        let relocated: HashMap<u64, (SectionIndex, u64, bool)> = sec
            .relocations()
            .filter_map(|(offset, r)| {
                let RelocationTarget::Symbol(sym) = r.target() else {
                    return None;
                };
                let sym = file.symbol_by_index(sym).ok()?;
                let is_section = sym.kind() == object::SymbolKind::Section;
                Some((offset, (sym.section_index()?, sym.address(), is_section)))
            })
            .collect();
        let code = &data[*start as usize..(*start + *size) as usize];
        // Registers holding a copy of r10 (the frame pointer).
        let mut fp_copy = [false; 11];
        let mut pc = 0;
        while pc + 8 <= code.len() {
            let insn = &code[pc..pc + 8];
            let (op, dst, src) = (
                insn[0],
                usize::from(insn[1] & 0xf),
                usize::from(insn[1] >> 4),
            );
            let off = i64::from(i16::from_le_bytes([insn[2], insn[3]]));
            let imm = i64::from(i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]));
            let reach = |n: i64| u32::try_from(-n).unwrap_or(0);
            let depth = &mut functions[i].depth;
            match op & 7 {
                // LDX through r10; the loaded register is no copy of it.
                1 => {
                    if src == 10 {
                        *depth = (*depth).max(reach(off));
                    }
                    if dst < 11 {
                        fp_copy[dst] = false;
                    }
                }
                // ST, STX through r10.
                2 | 3 if dst == 10 => *depth = (*depth).max(reach(off)),
                // ALU: `rX = r10` makes a copy, `rX += -N` points it at a slot, anything
                // else writing rX ends the copy.
                4 | 7 if dst < 10 => match op {
                    0xbf => fp_copy[dst] = src == 10 || (src < 11 && fp_copy[src]),
                    0x07 if fp_copy[dst] => *depth = (*depth).max(reach(imm)),
                    _ => fp_copy[dst] = false,
                },
                _ => {}
            }
            if op == 0x85 {
                // A call clobbers r0-r5.
                fp_copy[..6].fill(false);
            }
            if op == 0x85 && src == 1 {
                let here = start + pc as u64;
                let target = match relocated.get(&here) {
                    Some(&(s, base, true)) => (s, (base as i64 + (imm + 1) * 8) as u64),
                    Some(&(s, base, false)) => (s, base),
                    None => (*section, (here as i64 + (imm + 1) * 8) as u64),
                };
                if let Some(callee) = function_at(target.0, target.1) {
                    functions[i].calls.push(callee);
                }
            }
            // ld_imm64 takes two slots.
            pc += if op == 0x18 { 16 } else { 8 };
        }
        functions[i].calls.sort_unstable();
        functions[i].calls.dedup();
    }
    functions
}

/// A Rust symbol's last path segment, for the report.
fn short(name: &str) -> String {
    // v0 mangling: ..._10proxy_ebpf9conntrack5stale → "conntrack::stale"-ish tail.
    let tail = name.rsplit("proxy_ebpf").next().unwrap_or(name);
    tail.chars().take(48).collect()
}
