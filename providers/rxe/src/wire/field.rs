//! Big-endian field access. Callers check lengths first (every view's `new_checked` does),
//! so the slice bounds here always hold.

pub(crate) fn rd16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

pub(crate) fn rd24(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
}

pub(crate) fn rd32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn rd64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

pub(crate) fn wr16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// Writes the low 24 bits of `v`.
pub(crate) fn wr24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

pub(crate) fn wr32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn wr64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Bits `[shift, shift + width)` (counted from the least significant bit) of byte `at`.
pub(crate) fn rdbits(b: &[u8], at: usize, shift: u32, width: u32) -> u8 {
    (b[at] >> shift) & mask8(width)
}

/// Replace bits `[shift, shift + width)` of byte `at` with the low `width` bits of `v`.
pub(crate) fn wrbits(b: &mut [u8], at: usize, shift: u32, width: u32, v: u8) {
    let m = mask8(width) << shift;
    b[at] = (b[at] & !m) | ((v << shift) & m);
}

fn mask8(width: u32) -> u8 {
    ((1u16 << width) - 1) as u8
}
