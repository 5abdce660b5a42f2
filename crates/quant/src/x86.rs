//! x86-64 helpers for the integer kernels.

use core::arch::x86_64::*;

/// `acc + Σ pairs a·b` per 32-bit lane, as one `vpdpwssd`. Written as inline assembly because
/// LLVM otherwise rewrites the intrinsic's chains as `vpmaddwd` + `vpaddd`, two operations on
/// the same vector ports instead of one.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
pub unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    core::arch::asm!(
        "vpdpwssd {acc}, {a}, {b}",
        acc = inout(zmm_reg) acc,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    acc
}
