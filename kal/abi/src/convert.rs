//! Between the ABI's plain structs and the verbs types of the RNIC-PI, in one place for
//! both sides: the kAL encodes what a provider answers and decodes what a consumer asks;
//! the uAL does the reverse. Decoding checks every value a hostile caller could set.

use crate::{
    name_to_str, str_to_name, QpAttrs, QueryDevice, QueryPort, FAST_PATH_CONSUMER,
    FAST_PATH_EITHER, FAST_PATH_KAL, MAX_GIDS,
};
use rnicpi::{
    Access, DeviceAttr, FastPath, PortAttr, PortState, PrivateDataLimits, QpAttr, QpAttrMask,
    QpState, Transport,
};

impl QueryDevice {
    /// Device `dev`'s attributes, as `QUERY_DEVICE` returns them.
    pub fn encode(dev: u32, d: &DeviceAttr) -> QueryDevice {
        QueryDevice {
            dev,
            transport: d.transport as u8,
            atomics: d.atomics as u8,
            memory_windows: d.memory_windows as u8,
            phys_port_cnt: d.phys_port_cnt,
            node_guid: d.node_guid,
            vendor_id: d.vendor_id,
            max_qp: d.max_qp,
            max_qp_wr: d.max_qp_wr,
            max_sge: d.max_sge,
            max_inline: d.max_inline,
            max_cq: d.max_cq,
            max_cqe: d.max_cqe,
            max_mr: d.max_mr,
            max_pd: d.max_pd,
            max_srq: d.max_srq,
            max_srq_wr: d.max_srq_wr,
            max_ird: d.max_ird,
            max_ord: d.max_ord,
            pdata_connect: d.private_data.connect,
            pdata_accept: d.private_data.accept,
            pdata_reject: d.private_data.reject,
            fast_path: match d.fast_path {
                FastPath::Kal => FAST_PATH_KAL,
                FastPath::Consumer { .. } => FAST_PATH_CONSUMER,
                FastPath::Either { .. } => FAST_PATH_EITHER,
            },
            _pad: 0,
            max_ah: d.max_ah,
            max_mr_size: d.max_mr_size,
            name: str_to_name(&d.name),
            uvp_driver: d
                .fast_path
                .user_provider()
                .map_or([0; 32], |(driver, _)| str_to_name(driver)),
            uvp_device: d
                .fast_path
                .user_provider()
                .map_or([0; 32], |(_, device)| str_to_name(device)),
        }
    }

    /// The attributes back; `None` for a transport this side does not know.
    pub fn decode(&self) -> Option<DeviceAttr> {
        Some(DeviceAttr {
            name: name_to_str(&self.name).to_string(),
            transport: Transport::from_u8(self.transport)?,
            node_guid: self.node_guid,
            vendor_id: self.vendor_id,
            max_qp: self.max_qp,
            max_qp_wr: self.max_qp_wr,
            max_sge: self.max_sge,
            max_inline: self.max_inline,
            max_cq: self.max_cq,
            max_cqe: self.max_cqe,
            max_mr: self.max_mr,
            max_mr_size: self.max_mr_size,
            max_pd: self.max_pd,
            max_srq: self.max_srq,
            max_srq_wr: self.max_srq_wr,
            max_ird: self.max_ird,
            max_ord: self.max_ord,
            atomics: self.atomics != 0,
            memory_windows: self.memory_windows != 0,
            max_ah: self.max_ah,
            phys_port_cnt: self.phys_port_cnt,
            private_data: PrivateDataLimits {
                connect: self.pdata_connect,
                accept: self.pdata_accept,
                reject: self.pdata_reject,
            },
            fast_path: match self.fast_path {
                FAST_PATH_KAL => FastPath::Kal,
                FAST_PATH_CONSUMER => FastPath::Consumer {
                    driver: name_to_str(&self.uvp_driver).to_string(),
                    device: name_to_str(&self.uvp_device).to_string(),
                },
                FAST_PATH_EITHER => FastPath::Either {
                    driver: name_to_str(&self.uvp_driver).to_string(),
                    device: name_to_str(&self.uvp_device).to_string(),
                },
                _ => return None,
            },
        })
    }
}

impl QueryPort {
    /// Fill in the answer for the port this query names.
    pub fn set(&mut self, p: &PortAttr) {
        self.state = p.state as u8;
        self.active_mtu = p.active_mtu;
        self.gid_count = p.gids.len().min(MAX_GIDS) as u32;
        self.gids = [[0; 16]; MAX_GIDS];
        for (slot, g) in self.gids.iter_mut().zip(&p.gids) {
            *slot = *g;
        }
        self.netdev = str_to_name(&p.netdev);
    }

    /// The port's attributes back; `None` for a state this side does not know.
    pub fn decode(&self) -> Option<PortAttr> {
        Some(PortAttr {
            state: PortState::from_u8(self.state)?,
            active_mtu: self.active_mtu,
            gids: self.gids[..(self.gid_count as usize).min(MAX_GIDS)].to_vec(),
            netdev: name_to_str(&self.netdev).to_string(),
        })
    }
}

/// Path MTUs a QP may be given (IB's enumeration, in bytes).
const PATH_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

impl QpAttrs {
    /// The attributes of QP `handle`, with `mask` naming those a Modify QP sets.
    pub fn encode(handle: u32, q: &QpAttr, mask: QpAttrMask) -> QpAttrs {
        QpAttrs {
            handle,
            mask: mask.bits(),
            state: q.state as u8,
            max_rd_atomic: q.max_rd_atomic,
            max_dest_rd_atomic: q.max_dest_rd_atomic,
            timeout: q.timeout,
            retry_cnt: q.retry_cnt,
            rnr_retry: q.rnr_retry,
            min_rnr_timer: q.min_rnr_timer,
            sgid_index: q.sgid_index,
            access: q.access.bits(),
            path_mtu: q.path_mtu,
            dest_qpn: q.dest_qpn,
            rq_psn: q.rq_psn,
            sq_psn: q.sq_psn,
            qkey: q.qkey,
            pkey_index: q.pkey_index,
            hop_limit: q.hop_limit,
            _pad: 0,
            dgid: q.dgid,
        }
    }

    /// A Modify QP's attributes and mask. Unknown mask or access bits, an unknown state
    /// and a path MTU IB does not have are refused; QPNs and PSNs keep their 24 bits.
    pub fn decode(&self) -> Option<(QpAttr, QpAttrMask)> {
        let mask = QpAttrMask::from_bits(self.mask)?;
        let state = if mask.contains(QpAttrMask::STATE) {
            QpState::from_u8(self.state)?
        } else {
            QpState::Reset
        };
        if mask.contains(QpAttrMask::PATH_MTU) && !PATH_MTUS.contains(&self.path_mtu) {
            return None;
        }
        let attr = QpAttr {
            state,
            access: Access::from_bits(self.access)?,
            path_mtu: self.path_mtu,
            dest_qpn: self.dest_qpn & 0xff_ffff,
            rq_psn: self.rq_psn & 0xff_ffff,
            sq_psn: self.sq_psn & 0xff_ffff,
            max_rd_atomic: self.max_rd_atomic,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            rnr_retry: self.rnr_retry,
            min_rnr_timer: self.min_rnr_timer,
            pkey_index: self.pkey_index,
            qkey: self.qkey,
            dgid: self.dgid,
            sgid_index: self.sgid_index,
            hop_limit: self.hop_limit,
        };
        Some((attr, mask))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> DeviceAttr {
        DeviceAttr {
            name: "rxe0".into(),
            transport: Transport::Ib,
            node_guid: 0x0102_0304_0506_0708,
            vendor_id: 0xffffff,
            max_qp: 1,
            max_qp_wr: 2,
            max_sge: 3,
            max_inline: 4,
            max_cq: 5,
            max_cqe: 6,
            max_mr: 7,
            max_mr_size: 1 << 40,
            max_pd: 8,
            max_srq: 9,
            max_srq_wr: 10,
            max_ird: 11,
            max_ord: 12,
            atomics: true,
            memory_windows: false,
            max_ah: 13,
            phys_port_cnt: 1,
            private_data: PrivateDataLimits {
                connect: 56,
                accept: 196,
                reject: 148,
            },
            fast_path: FastPath::Kal,
        }
    }

    #[test]
    fn device_attributes_round_trip() {
        let d = device();
        assert_eq!(QueryDevice::encode(3, &d).decode(), Some(d));
        let d = DeviceAttr {
            fast_path: FastPath::Consumer {
                driver: "ibverbs".into(),
                device: "mlx5_0".into(),
            },
            ..device()
        };
        assert_eq!(QueryDevice::encode(3, &d).decode(), Some(d.clone()));
        let mut q = QueryDevice::encode(3, &d);
        q.fast_path = 7;
        assert_eq!(q.decode(), None);
    }

    #[test]
    fn qp_attributes_round_trip_and_hostile_values_are_refused() {
        let q = QpAttr {
            state: QpState::Rts,
            access: Access::REMOTE_WRITE,
            path_mtu: 1024,
            dest_qpn: 0x12,
            ..QpAttr::default()
        };
        let mask = QpAttrMask::STATE | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN;
        let a = QpAttrs::encode(7, &q, mask);
        assert_eq!(a.decode(), Some((q, mask)));
        assert_eq!(
            QpAttrs {
                path_mtu: 1000,
                ..a
            }
            .decode(),
            None
        );
        assert_eq!(
            QpAttrs {
                mask: u32::MAX,
                ..a
            }
            .decode(),
            None
        );
        assert_eq!(QpAttrs { state: 200, ..a }.decode(), None);
        assert_eq!(
            QpAttrs {
                access: u32::MAX,
                ..a
            }
            .decode(),
            None
        );
    }
}
