//! What the providers' wire modules share (`siw::wire`, `rxe::wire`): big-endian field
//! access, smoltcp-style `mod field` ranges, the boilerplate of a fixed-size header view
//! ([`fixed_header_view!`](crate::fixed_header_view)) and the property tests every such
//! header passes ([`header_proptests!`](crate::header_proptests)).
//!
//! A header module in this style has a `mod field` of byte ranges, a zero-copy
//! `Packet<T: AsRef<[u8]>>` whose `new_checked` refuses a buffer too short for it (so no
//! accessor can index out of bounds), accessors and setters that read and write through
//! the helpers here, and a `Repr` with `parse(&Packet)`, `emit(&mut Packet)` and
//! `buffer_len()`:
//!
//! ```
//! use rnicpi::wire::{rd16, rd32, wr32, Truncated};
//!
//! mod field {
//!     use rnicpi::wire::Field;
//!     pub const PORT: Field = 0..2;
//!     pub const KEY: Field = 2..6;
//! }
//! const HEADER_LEN: usize = field::KEY.end;
//!
//! #[derive(Debug, PartialEq)]
//! enum Error { Truncated { need: usize, have: usize } }
//! impl From<Truncated> for Error {
//!     fn from(t: Truncated) -> Error { Error::Truncated { need: t.need, have: t.have } }
//! }
//!
//! rnicpi::fixed_header_view!(Packet, HEADER_LEN, "an example header", Error);
//!
//! impl<T: AsRef<[u8]>> Packet<T> {
//!     fn port(&self) -> u16 { rd16(self.b(), field::PORT) }
//!     fn key(&self) -> u32 { rd32(self.b(), field::KEY) }
//! }
//! impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
//!     fn set_key(&mut self, v: u32) { wr32(self.bm(), field::KEY, v) }
//! }
//!
//! let mut b = [0, 7, 0, 0, 0, 0, 0xff];
//! Packet::new_checked(&mut b[..])?.set_key(0x0102_0304);
//! let p = Packet::new_checked(&b[..])?;
//! assert_eq!((p.port(), p.key(), p.header_bytes().len()), (7, 0x0102_0304, 6));
//! assert_eq!(Packet::new_checked(&b[..5]).err(), Some(Error::Truncated { need: 6, have: 5 }));
//! # Ok::<(), Error>(())
//! ```

/// Where a field lies in a header: `start..end` in bytes from the header's first byte (the
/// `mod field { pub const X: Field = a..b; }` of smoltcp's `wire`). Single-byte fields are
/// plain `usize` offsets.
pub type Field = core::ops::Range<usize>;

/// Where a field starts: a byte offset, or a [`Field`] (whose width is checked against the
/// accessor's in debug builds).
pub trait At {
    /// The offset of the first byte of a field `width` bytes wide.
    fn at(self, width: usize) -> usize;
}

impl At for usize {
    fn at(self, _width: usize) -> usize {
        self
    }
}

impl At for Field {
    fn at(self, width: usize) -> usize {
        debug_assert_eq!(self.len(), width, "field {self:?} read as {width} bytes");
        self.start
    }
}

/// A buffer shorter than the structure it should hold. Each wire module's error converts
/// from it (`From<Truncated>`), which is what [`fixed_header_view!`](crate::fixed_header_view)'s
/// `new_checked` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("buffer too short: need {need} bytes, have {have}")]
pub struct Truncated {
    /// Bytes the structure needs.
    pub need: usize,
    /// Bytes the buffer has.
    pub have: usize,
}

/// `Err(Truncated)` unless `have >= need`.
pub fn check_len(need: usize, have: usize) -> Result<(), Truncated> {
    if have < need {
        Err(Truncated { need, have })
    } else {
        Ok(())
    }
}

// Big-endian field access. Callers check lengths first (every view's `new_checked` does),
// so the slice bounds here always hold.

pub fn rd16(b: &[u8], at: impl At) -> u16 {
    let at = at.at(2);
    u16::from_be_bytes([b[at], b[at + 1]])
}

pub fn rd24(b: &[u8], at: impl At) -> u32 {
    let at = at.at(3);
    u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
}

pub fn rd32(b: &[u8], at: impl At) -> u32 {
    let at = at.at(4);
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub fn rd64(b: &[u8], at: impl At) -> u64 {
    let at = at.at(8);
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

pub fn wr16(b: &mut [u8], at: impl At, v: u16) {
    let at = at.at(2);
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// Writes the low 24 bits of `v`.
pub fn wr24(b: &mut [u8], at: impl At, v: u32) {
    let at = at.at(3);
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

pub fn wr32(b: &mut [u8], at: impl At, v: u32) {
    let at = at.at(4);
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

pub fn wr64(b: &mut [u8], at: impl At, v: u64) {
    let at = at.at(8);
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Bits `[shift, shift + width)` (counted from the least significant bit) of byte `at`.
pub fn rdbits(b: &[u8], at: usize, shift: u32, width: u32) -> u8 {
    (b[at] >> shift) & mask8(width)
}

/// Replace bits `[shift, shift + width)` of byte `at` with the low `width` bits of `v`.
pub fn wrbits(b: &mut [u8], at: usize, shift: u32, width: u32, v: u8) {
    let m = mask8(width) << shift;
    b[at] = (b[at] & !m) | ((v << shift) & m);
}

/// Set (`v`) or clear the bits `mask` of byte `at`.
pub fn wrflag(b: &mut [u8], at: usize, mask: u8, v: bool) {
    if v {
        b[at] |= mask;
    } else {
        b[at] &= !mask;
    }
}

fn mask8(width: u32) -> u8 {
    ((1u16 << width) - 1) as u8
}

/// Generates the boilerplate of a fixed-size header view: a `pub struct $name<T:
/// AsRef<[u8]>>` over a buffer at least `$len` bytes long, with `new_checked` (which
/// returns `Err(<$err>::from(Truncated))` for a shorter buffer), a crate-internal
/// `new_unchecked`, `into_inner`, `header_bytes`, and the private `b()` / `bm()` the
/// accessors read and write through.
///
/// `$err` is the wire module's error type; it must implement `From<`[`Truncated`]`>`.
#[macro_export]
macro_rules! fixed_header_view {
    ($name:ident, $len:expr, $what:literal, $err:ty) => {
        #[doc = concat!("A view of ", $what, " at the start of a byte buffer.")]
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            #[doc = concat!("Wrap `buffer`; `Err(Truncated)` if it is shorter than ", stringify!($len), " bytes.")]
            pub fn new_checked(buffer: T) -> ::core::result::Result<Self, $err> {
                $crate::wire::check_len($len, buffer.as_ref().len()).map_err(<$err>::from)?;
                Ok($name { buffer })
            }

            /// Crate-internal: the caller has checked the length.
            #[allow(dead_code)]
            pub(crate) fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }

            /// The wrapped buffer.
            #[allow(dead_code)]
            pub fn into_inner(self) -> T {
                self.buffer
            }

            /// The header's own bytes (the buffer may be longer).
            #[allow(dead_code)]
            pub fn header_bytes(&self) -> &[u8] {
                &self.buffer.as_ref()[..$len]
            }

            #[allow(dead_code)]
            fn b(&self) -> &[u8] {
                self.buffer.as_ref()
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            #[allow(dead_code)]
            fn bm(&mut self) -> &mut [u8] {
                self.buffer.as_mut()
            }
        }
    };
}

/// Property tests every fixed-size header passes: emit→parse round trip (writing only its
/// own bytes), truncation refused at every length, random bytes never panic and what they
/// parse to re-emits to the same. Expands to `#[test]` functions, so it goes inside a
/// test module, which needs `proptest` as a dev-dependency.
///
/// Arguments: the view type (built by [`fixed_header_view!`](crate::fixed_header_view)),
/// its `Repr` (with `parse(&View) -> Result<Repr, $err>`, infallible `emit(&mut View)` and
/// `buffer_len()`), the header length, a proptest strategy for the `Repr`, and the error
/// type (`From<`[`Truncated`]`>`).
#[macro_export]
macro_rules! header_proptests {
    ($packet:ident, $repr:ty, $len:expr, $strategy:expr, $err:ty) => {
        proptest::proptest! {
            #[test]
            fn round_trip(r in $strategy) {
                let mut b = vec![0x5au8; r.buffer_len() + 3];
                r.emit(&mut $packet::new_checked(&mut b[..]).unwrap());
                proptest::prop_assert_eq!(&b[$len..], &[0x5a, 0x5a, 0x5a][..], "writes only its own bytes");
                let p = $packet::new_checked(&b[..]).unwrap();
                proptest::prop_assert_eq!(<$repr>::parse(&p).unwrap(), r);
            }

            #[test]
            fn truncated_rejected_at_every_length(len in 0usize..$len) {
                let b = vec![0u8; len];
                proptest::prop_assert_eq!(
                    $packet::new_checked(&b[..]).err(),
                    Some(<$err>::from($crate::wire::Truncated { need: $len, have: len }))
                );
            }

            #[test]
            fn random_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..2 * $len)) {
                if let Ok(p) = $packet::new_checked(&b[..]) {
                    if let Ok(r) = <$repr>::parse(&p) {
                        let mut out = vec![0u8; $len];
                        r.emit(&mut $packet::new_checked(&mut out[..]).unwrap());
                        let again = <$repr>::parse(&$packet::new_checked(&out[..]).unwrap()).unwrap();
                        proptest::prop_assert_eq!(again, r);
                    }
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_endian_fields_at_offsets_and_ranges() {
        let mut b = [0u8; 17];
        wr16(&mut b, 0, 0x0102);
        wr24(&mut b, 2..5, 0xff03_0405);
        wr32(&mut b, 5, 0x0607_0809);
        wr64(&mut b, 9..17, 0x0a0b_0c0d_0e0f_1011);
        assert_eq!(b, core::array::from_fn(|i| i as u8 + 1));
        assert_eq!(rd16(&b, 0..2), 0x0102);
        assert_eq!(rd24(&b, 2), 0x03_0405);
        assert_eq!(rd32(&b, 5..9), 0x0607_0809);
        assert_eq!(rd64(&b, 9), 0x0a0b_0c0d_0e0f_1011);
    }

    #[test]
    fn bits_and_flags() {
        let mut b = [0b1010_0101u8];
        assert_eq!(rdbits(&b, 0, 4, 2), 0b10);
        wrbits(&mut b, 0, 4, 2, 0xff);
        assert_eq!(b[0], 0b1011_0101);
        wrbits(&mut b, 0, 0, 8, 0x3c);
        assert_eq!(b[0], 0x3c);
        wrflag(&mut b, 0, 0x80, true);
        wrflag(&mut b, 0, 0x04, false);
        assert_eq!(b[0], 0xb8);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "read as 4 bytes")]
    fn a_field_of_the_wrong_width_is_caught() {
        rd32(&[0u8; 8], 0..2);
    }

    #[test]
    fn check_len_says_what_is_missing() {
        assert_eq!(check_len(4, 4), Ok(()));
        assert_eq!(check_len(4, 3), Err(Truncated { need: 4, have: 3 }));
    }
}
