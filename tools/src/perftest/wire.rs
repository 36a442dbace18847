//! The messages perftest 4.5 (version string "6.06") exchanges before, between and after
//! its tests, byte for byte. Over rdma_cm (`-R`) every message is one RDMA Send and
//! multi-byte integers travel big-endian (`htobe32`/`htobe64` in perftest built with
//! `HAVE_ENDIAN`, as Debian's is). Over the TCP socket (perftest's default on IB/RoCE) the
//! same messages are written as they are, except `pingpong_dest`, which travels as text
//! ([`Dest::to_text`]).

use super::PerfError;

/// The version this implementation speaks on the wire (perftest 4.5-0.18, Debian 12).
pub const VERSION: &str = "6.06";
/// perftest refuses peers older than this (`check_version_compatibility`).
pub const MIN_PEER_VERSION: f64 = 5.70;
/// `char version[MAX_VERSION]`: the version message is always 16 bytes, NUL-padded.
pub const VERSION_LEN: usize = 16;
/// `sizeof(struct pingpong_dest)` on LP64: 5 ints, 4 bytes of padding, the 64-bit vaddr,
/// the 16-byte GID and 2 more ints.
pub const DEST_LEN: usize = 56;
/// The MTU message: `sprintf("%d", enum ibv_mtu)`, 2 bytes (`char[2]`) from version 5.31 on.
pub const MTU_LEN: usize = 2;
/// `KEY_MSG_SIZE_GID`: a `pingpong_dest` as text over the socket, with the GID (every
/// RoCE run: perftest always has a GID index on an Ethernet link), NUL included.
pub const DEST_TEXT_LEN: usize = 108;
/// Colon-separated fields of the text form: lid, out_reads, qpn, psn, rkey, vaddr, the 16
/// GID bytes, srqn (then an empty field before the NUL).
const DEST_TEXT_FIELDS: usize = 23;

/// `struct pingpong_dest`: what each side tells the other about one data QP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dest {
    pub lid: u32,
    pub out_reads: u32,
    pub qpn: u32,
    pub psn: u32,
    pub rkey: u32,
    pub vaddr: u64,
    pub gid: [u8; 16],
    pub srqn: u32,
    pub gid_index: i32,
}

impl Dest {
    pub fn encode(&self) -> [u8; DEST_LEN] {
        let mut b = [0u8; DEST_LEN];
        for (i, v) in [self.lid, self.out_reads, self.qpn, self.psn, self.rkey]
            .into_iter()
            .enumerate()
        {
            b[4 * i..4 * i + 4].copy_from_slice(&v.to_be_bytes());
        }
        // Bytes 20..24 are the struct's padding before `vaddr` (perftest sends stack garbage).
        b[24..32].copy_from_slice(&self.vaddr.to_be_bytes());
        b[32..48].copy_from_slice(&self.gid);
        b[48..52].copy_from_slice(&self.srqn.to_be_bytes());
        b[52..56].copy_from_slice(&self.gid_index.to_be_bytes());
        b
    }

    /// `KEY_PRINT_FMT_GID`: `"%04x:%04x:%06x:%06x:%08x:%016llx:"`, the GID bytes as
    /// `"%02x:"` each, `"%08x:"` for srqn, then the NUL (`ethernet_write_keys`). Fields are
    /// masked to their widths so the message is always 108 bytes.
    pub fn to_text(&self) -> [u8; DEST_TEXT_LEN] {
        let mut t = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid & 0xffff,
            self.out_reads & 0xffff,
            self.qpn & 0xff_ffff,
            self.psn & 0xff_ffff,
            self.rkey,
            self.vaddr
        );
        for g in self.gid {
            t.push_str(&format!("{g:02x}:"));
        }
        t.push_str(&format!("{:08x}:", self.srqn));
        let mut b = [0u8; DEST_TEXT_LEN];
        b[..t.len()].copy_from_slice(t.as_bytes());
        b
    }

    /// The text form as `ethernet_read_keys` reads it (hex fields between colons, up to
    /// the NUL). The GID index is not on the wire: the caller's own applies.
    pub fn from_text(b: &[u8]) -> Result<Dest, PerfError> {
        const BAD: PerfError = PerfError::Protocol("malformed pingpong_dest text");
        if b.len() != DEST_TEXT_LEN {
            return Err(PerfError::BadLength {
                what: "pingpong_dest text",
                want: DEST_TEXT_LEN,
                got: b.len(),
            });
        }
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        let text = std::str::from_utf8(&b[..end]).map_err(|_| BAD)?;
        let fields: Vec<&str> = text.split(':').collect();
        if fields.len() < DEST_TEXT_FIELDS {
            return Err(BAD);
        }
        let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| BAD);
        let u32f = |s: &str| hex(s).and_then(|v| u32::try_from(v).map_err(|_| BAD));
        let mut gid = [0u8; 16];
        for (g, f) in gid.iter_mut().zip(&fields[6..22]) {
            *g = u8::try_from(hex(f)?).map_err(|_| BAD)?;
        }
        Ok(Dest {
            lid: u32f(fields[0])?,
            out_reads: u32f(fields[1])?,
            qpn: u32f(fields[2])? & 0xff_ffff,
            psn: u32f(fields[3])? & 0xff_ffff,
            rkey: u32f(fields[4])?,
            vaddr: hex(fields[5])?,
            gid,
            srqn: u32f(fields[22])?,
            gid_index: 0,
        })
    }

    pub fn decode(b: &[u8]) -> Result<Dest, PerfError> {
        let b: &[u8; DEST_LEN] = b.try_into().map_err(|_| PerfError::BadLength {
            what: "pingpong_dest",
            want: DEST_LEN,
            got: b.len(),
        })?;
        let u32at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut vaddr = [0u8; 8];
        vaddr.copy_from_slice(&b[24..32]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[32..48]);
        Ok(Dest {
            lid: u32at(0),
            out_reads: u32at(4),
            qpn: u32at(8),
            psn: u32at(12),
            rkey: u32at(16),
            vaddr: u64::from_be_bytes(vaddr),
            gid,
            srqn: u32at(48),
            gid_index: u32at(52) as i32,
        })
    }
}

/// The 16-byte version message.
pub fn encode_version(v: &str) -> [u8; VERSION_LEN] {
    let mut b = [0u8; VERSION_LEN];
    let n = v.len().min(VERSION_LEN - 1);
    b[..n].copy_from_slice(&v.as_bytes()[..n]);
    b
}

/// The peer's version string (a C string) and its value as perftest reads it (`atof`).
pub fn decode_version(b: &[u8]) -> (String, f64) {
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let s = String::from_utf8_lossy(&b[..n]).into_owned();
    let v = atof(&s);
    (s, v)
}

/// C's `atof`: the longest leading decimal number, 0 when there is none.
fn atof(s: &str) -> f64 {
    let t = s.trim_start();
    let mut end = 0;
    let mut dot = false;
    for (i, c) in t.char_indices() {
        match c {
            '0'..='9' => end = i + 1,
            '.' if !dot => dot = true,
            '+' | '-' if i == 0 => {}
            _ => break,
        }
    }
    t[..end].parse().unwrap_or(0.0)
}

/// A C `int` as `hton_int` sends it.
pub fn encode_int(v: i32) -> [u8; 4] {
    v.to_be_bytes()
}

pub fn decode_int(b: &[u8], what: &'static str) -> Result<i32, PerfError> {
    let a: [u8; 4] = b.try_into().map_err(|_| PerfError::BadLength {
        what,
        want: 4,
        got: b.len(),
    })?;
    Ok(i32::from_be_bytes(a))
}

/// `enum ibv_mtu` of an MTU in bytes (the largest IB MTU that fits; 1500 → 1024 → 3).
pub fn mtu_enum(bytes: u32) -> u8 {
    match bytes {
        0..=511 => 1,
        512..=1023 => 2,
        1024..=2047 => 3,
        2048..=4095 => 4,
        _ => 5,
    }
}

/// Bytes of an `enum ibv_mtu` value.
pub fn mtu_bytes(e: u8) -> u32 {
    match e {
        1..=5 => 128u32 << e,
        _ => 0,
    }
}

/// The MTU message: the enum in decimal, truncated to 2 bytes as perftest does.
pub fn encode_mtu(e: u8) -> [u8; MTU_LEN] {
    let s = e.to_string();
    let mut b = [0u8; MTU_LEN];
    let n = s.len().min(MTU_LEN);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

/// The peer's MTU enum (`strtol` of the 2 bytes); `None` when it is not a valid MTU.
pub fn decode_mtu(b: &[u8]) -> Option<u8> {
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..n])
        .ok()?
        .parse::<u8>()
        .ok()
        .filter(|e| (1..=5).contains(e))
}

/// The five 8-byte values `xchg_bw_reports` sends one Send each (size, iterations, peak,
/// average, message rate), doubles byte-swapped like integers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BwReport {
    pub size: u64,
    pub iters: u64,
    pub bw_peak: f64,
    pub bw_avg: f64,
    pub msg_rate: f64,
}

impl BwReport {
    pub fn words(&self) -> [[u8; 8]; 5] {
        [
            self.size.to_be_bytes(),
            self.iters.to_be_bytes(),
            self.bw_peak.to_bits().to_be_bytes(),
            self.bw_avg.to_bits().to_be_bytes(),
            self.msg_rate.to_bits().to_be_bytes(),
        ]
    }

    pub fn from_words(w: &[[u8; 8]; 5]) -> BwReport {
        let f = |b: [u8; 8]| f64::from_bits(u64::from_be_bytes(b));
        BwReport {
            size: u64::from_be_bytes(w[0]),
            iters: u64::from_be_bytes(w[1]),
            bw_peak: f(w[2]),
            bw_avg: f(w[3]),
            msg_rate: f(w[4]),
        }
    }
}

/// An 8-byte report word as received.
pub fn word(b: &[u8]) -> Result<[u8; 8], PerfError> {
    b.try_into().map_err(|_| PerfError::BadLength {
        what: "bw report word",
        want: 8,
        got: b.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The client's record in `send_lat_siw.pcap` frame 2056 (kernel siw, perftest 4.5):
    /// the padding carries stack garbage (0x6655...), which decoding ignores.
    #[test]
    fn dest_from_capture() {
        let b = hex(concat!(
            "00000000000000010000000200",
            "90f8eaca472f006655000000005566f865c000",
            "52540077000c00000000000000000000",
            "0000000000000000"
        ));
        let d = Dest::decode(&b).unwrap();
        assert_eq!(d.lid, 0);
        assert_eq!(d.out_reads, 1);
        assert_eq!(d.qpn, 2);
        assert_eq!(d.psn, 0x90f8ea);
        assert_eq!(d.rkey, 0xca47_2f00);
        assert_eq!(d.vaddr, 0x5566_f865_c000);
        assert_eq!(&d.gid[..6], &[0x52, 0x54, 0x00, 0x77, 0x00, 0x0c]);
        let mut again = d.encode();
        again[20..24].copy_from_slice(&b[20..24]);
        assert_eq!(&again[..], &b[..]);
        assert!(Dest::decode(&b[..55]).is_err());
    }

    /// The server's record in `send_lat_rxe.pcap` frame 33 (kernel rxe, perftest 4.5,
    /// `-x 1`): 107 characters and the NUL.
    #[test]
    fn dest_text_from_capture() {
        let text = concat!(
            "0000:0001:000011:8e8030:00000000:0000562b7abbc000:",
            "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:0b:00000000:"
        );
        let mut b = text.as_bytes().to_vec();
        b.push(0);
        assert_eq!(b.len(), DEST_TEXT_LEN);
        let d = Dest::from_text(&b).unwrap();
        assert_eq!((d.lid, d.out_reads, d.qpn, d.psn), (0, 1, 0x11, 0x8e8030));
        assert_eq!((d.rkey, d.vaddr), (0, 0x562b_7abb_c000));
        assert_eq!(
            d.gid,
            std::net::Ipv4Addr::new(10, 77, 0, 11)
                .to_ipv6_mapped()
                .octets()
        );
        assert_eq!(&d.to_text()[..], &b[..]);
        let wide = Dest {
            qpn: 0x1ff_ffff,
            rkey: u32::MAX,
            vaddr: u64::MAX,
            gid: [0xff; 16],
            srqn: u32::MAX,
            ..d
        };
        assert_eq!(wide.to_text()[DEST_TEXT_LEN - 1], 0, "always 108 bytes");
        assert_eq!(Dest::from_text(&wide.to_text()).unwrap().qpn, 0xff_ffff);
        assert!(Dest::from_text(&b[..100]).is_err());
        let mut bad = b.clone();
        bad[60] = b'z';
        assert!(Dest::from_text(&bad).is_err());
        let mut short = b.clone();
        short[70] = 0;
        assert!(Dest::from_text(&short).is_err(), "too few fields");
        assert!(Dest::from_text(&[0xff; DEST_TEXT_LEN]).is_err());
    }

    #[test]
    fn prologue_messages_match_capture() {
        // Frames 26/28/30/32 of send_lat_siw.pcap: version, page size, cache line, MTU.
        assert_eq!(
            &encode_version("6.06")[..],
            &hex("362e3036000000000000000000000000")[..]
        );
        assert_eq!(
            decode_version(&hex("362e3036000000000000000000000000")).1,
            6.06
        );
        assert_eq!(encode_int(4096), [0, 0, 0x10, 0]);
        assert_eq!(decode_int(&hex("00000040"), "x").unwrap(), 64);
        assert_eq!(encode_mtu(mtu_enum(1500)), [b'3', 0]);
        assert_eq!(decode_mtu(&hex("3300")), Some(3));
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(decode_mtu(b"9\0"), None);
    }

    #[test]
    fn atof_like_c() {
        assert_eq!(atof("6.29"), 6.29);
        assert_eq!(atof("5.70-beta"), 5.70);
        assert_eq!(atof("x"), 0.0);
    }

    #[test]
    fn bw_report_round_trip() {
        let r = BwReport {
            size: 65536,
            iters: 5000,
            bw_peak: 1234.5,
            bw_avg: 1000.25,
            msg_rate: 0.016,
        };
        let w = r.words();
        assert_eq!(w[0], [0, 0, 0, 0, 0, 1, 0, 0]);
        assert_eq!(BwReport::from_words(&w), r);
    }
}
