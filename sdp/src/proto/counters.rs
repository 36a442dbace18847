//! Per-connection counters: messages by kind each way, bytes by mode, and every refusal.

use crate::wire::Mid;

/// What one connection did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub msgs_tx: u64,
    pub msgs_rx: u64,
    pub data_msgs_tx: u64,
    pub data_msgs_rx: u64,
    pub control_msgs_tx: u64,
    pub control_msgs_rx: u64,
    pub bcopy_tx_bytes: u64,
    pub bcopy_rx_bytes: u64,
    pub zcopy_tx_bytes: u64,
    pub zcopy_rx_bytes: u64,
    pub zcopy_adverts_tx: u64,
    pub zcopy_adverts_rx: u64,
    pub zcopy_revoked: u64,
    pub credit_updates: u64,
    pub keepalives: u64,
    pub oob_tx: u64,
    pub oob_rx: u64,
    /// A SendSm for an advert already fully read (harmless, counted).
    pub late_sendsm: u64,
    /// SinkAvail adverts left unused (zero copy off, or an empty advert).
    pub sink_adverts_ignored: u64,
    /// Landing buffers advertised (SinkAvail sent) and received.
    pub sink_adverts_tx: u64,
    pub sink_adverts_rx: u64,
    /// Bytes RDMA Written into the peer's landing buffer, and landed in ours.
    pub zcopy_write_tx_bytes: u64,
    pub zcopy_write_rx_bytes: u64,
    /// Protocol violations by the peer (each aborted the connection).
    pub violations: u64,
}

impl Counters {
    pub(crate) fn count_tx(&mut self, mid: Mid) {
        self.msgs_tx += 1;
        if mid == Mid::Data {
            self.data_msgs_tx += 1;
        } else {
            self.control_msgs_tx += 1;
        }
    }

    pub(crate) fn count_rx(&mut self, mid: Mid) {
        self.msgs_rx += 1;
        if mid == Mid::Data {
            self.data_msgs_rx += 1;
        } else {
            self.control_msgs_rx += 1;
        }
    }

    /// Name and value of every counter, for tools.
    pub fn rows(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("msgs_tx", self.msgs_tx),
            ("msgs_rx", self.msgs_rx),
            ("data_msgs_tx", self.data_msgs_tx),
            ("data_msgs_rx", self.data_msgs_rx),
            ("control_msgs_tx", self.control_msgs_tx),
            ("control_msgs_rx", self.control_msgs_rx),
            ("bcopy_tx_bytes", self.bcopy_tx_bytes),
            ("bcopy_rx_bytes", self.bcopy_rx_bytes),
            ("zcopy_tx_bytes", self.zcopy_tx_bytes),
            ("zcopy_rx_bytes", self.zcopy_rx_bytes),
            ("zcopy_adverts_tx", self.zcopy_adverts_tx),
            ("zcopy_adverts_rx", self.zcopy_adverts_rx),
            ("zcopy_revoked", self.zcopy_revoked),
            ("credit_updates", self.credit_updates),
            ("keepalives", self.keepalives),
            ("oob_tx", self.oob_tx),
            ("oob_rx", self.oob_rx),
            ("late_sendsm", self.late_sendsm),
            ("sink_adverts_ignored", self.sink_adverts_ignored),
            ("sink_adverts_tx", self.sink_adverts_tx),
            ("sink_adverts_rx", self.sink_adverts_rx),
            ("zcopy_write_tx_bytes", self.zcopy_write_tx_bytes),
            ("zcopy_write_rx_bytes", self.zcopy_write_rx_bytes),
            ("violations", self.violations),
        ]
    }
}
