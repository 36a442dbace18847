//! Address handles: where a UD Send goes. A consumer makes one per destination
//! ([`rnicpi::Provider::create_ah`]) and names it by number in each UD Send; the number is
//! looked up here at send time, under the sending QP's protection domain, so a number of
//! another PD (another tenant's) is no address at all.

use parking_lot::RwLock;
use rnicpi::{AhAttr, Result, VerbsError};
use std::collections::HashMap;
use std::net::IpAddr;

/// Address handles one device holds.
pub(crate) const MAX_AH: u32 = 64 * 1024;

/// A resolved address handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ah {
    pub pd: u32,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// 20 bits: with the QP numbers, the UDP source port's entropy.
    pub flow_label: u32,
}

#[derive(Default)]
pub(crate) struct AhTable {
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u32,
    map: HashMap<u32, Ah>,
}

impl AhTable {
    /// Record `ah`; its number (never 0, never one in use).
    pub fn insert(&self, ah: Ah) -> Result<u32> {
        let mut g = self.inner.write();
        let i = &mut *g;
        if i.map.len() >= MAX_AH as usize {
            return Err(VerbsError::Exhausted);
        }
        let map = &i.map;
        let n = rnicpi::ids::next_free(&mut i.next, map.len(), |n| map.contains_key(&n))
            .ok_or(VerbsError::Exhausted)?;
        i.map.insert(n, ah);
        Ok(n)
    }

    pub fn remove(&self, n: u32) -> Result<()> {
        self.inner
            .write()
            .map
            .remove(&n)
            .map(|_| ())
            .ok_or(VerbsError::NoSuchResource)
    }

    /// Address handle `n` if it belongs to protection domain `pd`.
    pub fn get(&self, n: u32, pd: u32) -> Option<Ah> {
        self.inner
            .read()
            .map
            .get(&n)
            .copied()
            .filter(|a| a.pd == pd)
    }

    pub fn live(&self) -> usize {
        self.inner.read().map.len()
    }
}

/// Check an address handle's attributes as a device with one port does.
pub(crate) fn check(attr: &AhAttr) -> Result<()> {
    if attr.port != 1 || attr.flow_label > 0xf_ffff {
        return Err(VerbsError::Invalid);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ah(pd: u32) -> Ah {
        Ah {
            pd,
            src: "127.0.0.1".parse().unwrap(),
            dst: "127.0.0.2".parse().unwrap(),
            flow_label: 0,
        }
    }

    #[test]
    fn numbers_are_scoped_to_their_pd() {
        let t = AhTable::default();
        let a = t.insert(ah(1)).unwrap();
        let b = t.insert(ah(2)).unwrap();
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(t.get(a, 1), Some(ah(1)));
        assert_eq!(t.get(a, 2), None, "another PD's handle is no address");
        assert_eq!(t.remove(a), Ok(()));
        assert_eq!(t.get(a, 1), None);
        assert_eq!(t.remove(a), Err(VerbsError::NoSuchResource));
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn attributes_are_checked() {
        assert!(check(&AhAttr::default()).is_ok());
        assert!(check(&AhAttr {
            port: 2,
            ..AhAttr::default()
        })
        .is_err());
        assert!(check(&AhAttr {
            flow_label: 1 << 20,
            ..AhAttr::default()
        })
        .is_err());
    }
}
