//! Write-based zero copy: the reader advertises its landing buffer (SinkAvail), the
//! writer RDMA Writes queued bytes into it and says how many (RdmaWrCompl).
//!
//! The landing buffer belongs to the reader's driver, not to the reading program, so an
//! advert can stay outstanding for as long as the writer likes: it is used when enough
//! bytes are queued, and nothing is lost if it never is (the bytes go by buffered copy
//! meanwhile, and the stream's order holds because the written bytes take their place in
//! it when the RdmaWrCompl arrives, after every message sent before it).

use super::*;

/// An RDMA Write the driver posts before it sends anything else: `len` bytes (already
/// moved out of the send queue into its staging buffer) to the peer's landing buffer at
/// `addr` under `rkey`. The RdmaWrCompl that must follow it is the next message
/// [`Connection::poll_transmit`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaWrite {
    pub addr: u64,
    pub rkey: u32,
    pub len: usize,
}

impl Connection {
    /// Whether a reader asking for `want` bytes should advertise the landing buffer now:
    /// nothing to read, none advertised, the stream open both ways, zero copy on.
    pub fn sink_wanted(&self, want: usize) -> bool {
        self.cfg.zcopy_write
            && self.cfg.zcopy_threshold > 0
            && want >= self.cfg.zcopy_threshold
            && self.phase == Phase::Open
            && !self.peer_fin
            && self.rx.is_empty()
            && self.sink.is_none()
    }

    /// Advertise the landing buffer `advert` (SinkAvail goes out).
    pub fn advertise_sink(&mut self, advert: Advert) {
        debug_assert!(self.sink.is_none());
        self.sink = Some(advert);
        self.counters.sink_adverts_tx += 1;
        self.control.push_back(Control::SinkAvail(advert));
    }

    /// Whether the peer may still write into our landing buffer (its advert is out, or
    /// written bytes wait there for the reader): the buffer must not be reused.
    pub fn sink_busy(&self) -> bool {
        self.sink.is_some() || self.rx.iter().any(|i| matches!(i, RxItem::Landed { .. }))
    }

    pub(super) fn on_sink_avail(&mut self, advert: Advert) {
        if !self.cfg.zcopy_write || self.cfg.zcopy_threshold == 0 || advert.size == 0 {
            self.counters.sink_adverts_ignored += 1;
            return;
        }
        self.counters.sink_adverts_rx += 1;
        self.peer_sink = Some(advert);
    }

    pub(super) fn on_rdma_wr_compl(&mut self, size: u32) -> Result<(), ConnError> {
        let Some(advert) = self.sink else {
            return Err(self.violation(Violation::Unexpected(wire::Mid::RdmaWrCompl)));
        };
        if size > advert.size {
            return Err(self.violation(Violation::OverWrite {
                got: size,
                size: advert.size,
            }));
        }
        if self.peer_fin && size > 0 {
            return Err(self.violation(Violation::DataAfterDisConn));
        }
        self.sink = None;
        if size > 0 {
            let len = size as usize;
            self.rx.push_back(RxItem::Landed { offset: 0, len });
            self.rx_bytes += len;
            self.counters.zcopy_write_rx_bytes += u64::from(size);
        }
        Ok(())
    }

    /// Whether the peer's landing buffer is advertised to us (an RDMA Write may follow
    /// once enough bytes are queued).
    pub fn peer_sink_open(&self) -> bool {
        self.peer_sink.is_some()
    }

    /// If the peer's landing buffer is advertised and enough bytes are queued for it (its
    /// size, or at least the zero-copy threshold), move up to `out.len()` of them into
    /// `out` for an RDMA Write into it; RdmaWrCompl is then the next message.
    pub fn poll_rdma_write(&mut self, out: &mut [u8]) -> Option<RdmaWrite> {
        let sink = self.peer_sink?;
        let size = (sink.size as usize).min(out.len());
        let enough = size.min(self.cfg.zcopy_threshold).max(1);
        if self.phase != Phase::Open
            || self.abort_pending
            || self.source.is_some()
            || self.oob_out.is_some()
            || self.tx_credits < 2
            || self.tx.len() < enough
        {
            return None;
        }
        let n = self.tx.len().min(size);
        take_front(&mut self.tx, &mut out[..n]);
        self.peer_sink = None;
        self.counters.zcopy_write_tx_bytes += n as u64;
        // Nothing may go between the write and its completion message.
        self.control.push_front(Control::RdmaWrCompl(n as u32));
        Some(RdmaWrite {
            addr: sink.addr,
            rkey: sink.rkey,
            len: n,
        })
    }
}
