//! Zeroing without the compiler's `memset`. For a struct of more than a few bytes LLVM's
//! BPF backend calls `memset`, which `compiler_builtins` implements as a loop of one-byte
//! stores: zeroing a 64-byte FIB parameter block that way walks ~320 instructions on
//! every packet. Volatile four-byte stores are never turned back into that call.
//!
//! Layer 0. Owns: `zeroed_in`, `zero`. May import: nothing of the crate.

use core::mem::{MaybeUninit, align_of, size_of};

/// `slot`, every byte zero, as a `T`. `T` must be plain data for which all-zero is a
/// valid value, whose size is a multiple of 4 and whose alignment is at least 4 (checked
/// when it is compiled). In place: a zeroed value returned by value would be copied,
/// and the compiler turns a copy of known zeros back into `memset`.
#[inline(always)]
pub fn zeroed_in<T: Copy>(slot: &mut MaybeUninit<T>) -> &mut T {
    // SAFETY: every byte of `slot` is written; all-zero is valid for `T` (the caller's
    // contract, as for `core::mem::zeroed`).
    unsafe {
        zero_raw(slot.as_mut_ptr());
        slot.assume_init_mut()
    }
}

/// Sets every byte of `*v` to zero (see `zeroed` for what `T` must be).
#[inline(always)]
pub fn zero<T: Copy>(v: &mut T) {
    // SAFETY: `v` is a valid, exclusive reference; all-zero is valid for `T`.
    unsafe { zero_raw(v as *mut T) }
}

#[inline(always)]
unsafe fn zero_raw<T>(p: *mut T) {
    const { assert!(size_of::<T>() % 4 == 0 && align_of::<T>() >= 4) };
    let words = p as *mut u32;
    let mut i = 0;
    while i < size_of::<T>() / 4 {
        // SAFETY: in bounds of `*p` and aligned (checked above).
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
}
