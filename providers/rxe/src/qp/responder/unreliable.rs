//! The responder of a UC QP. Packets are placed as an RC responder places them (the same
//! checks, in the same order), but nothing is ever answered: a packet that is not the one
//! expected, or that a reliable responder would NAK (no receive posted, an access it may
//! not have, a malformed sequence), is dropped with the rest of its message, and the
//! next First or Only packet, whatever its PSN, starts over (IBTA 9.7.5.1.2, as Linux's
//! `rxe_resp.c` does it). Only our own consumer's fault — a receive it posted that cannot
//! be written, a corrupt ring — takes the QP to Error.
//!
//! A First or Only packet that arrives while a message is in progress means that
//! message lost its end: it is abandoned and the new one is placed (Linux rxe drops the
//! new one too). A receive taken for a message that is then dropped is not consumed: the
//! next message that needs one takes it ([`Responder::spare`](super::Responder)).
//! A Send too long for its receive completes that receive with `LocLenErr`, as a UD
//! datagram does, and the QP stays up.

use super::{InMsg, Verdict};
use crate::qp::{Engine, State};
use crate::wire::{psn_add, NakCode, RoceRepr};

impl Engine<'_> {
    /// One UC request packet, whose opcode is UC's and whose QP is ready to receive.
    pub(in crate::qp) fn on_uc_request(&self, st: &mut State, p: &RoceRepr<'_>) {
        let start = p.bth.opcode.position().is_start();
        let in_order = p.bth.psn == st.resp.psn;
        if !start {
            if st.resp.drop_msg || !in_order {
                return self.drop_uc(st, p, "out of sequence");
            }
        } else {
            if !st.resp.drop_msg && (!in_order || st.resp.cur.is_some()) {
                // Whole messages went missing before this one, or the one in progress
                // lost its end.
                self.count(&self.counters.uc_dropped);
            }
            self.abandon_uc(st);
            st.resp.drop_msg = false;
        }
        match self.execute(st, p) {
            Verdict::Done { npkts } => st.resp.psn = psn_add(p.bth.psn, npkts),
            Verdict::Rnr => self.drop_uc(st, p, "no receive posted"),
            Verdict::Fatal(NakCode::RemoteOperationalError, kind) => {
                self.fatal(st, kind, "UC responder cannot use its receive")
            }
            Verdict::Fatal(..) => self.drop_uc(st, p, "refused"),
        }
    }

    /// Drop `p` and the rest of its message (counted once per message).
    fn drop_uc(&self, st: &mut State, p: &RoceRepr<'_>, why: &'static str) {
        if std::mem::replace(&mut st.resp.drop_msg, true) {
            return;
        }
        tracing::debug!(
            qpn = self.base.qpn,
            psn = p.bth.psn,
            expected = st.resp.psn,
            why,
            "rxe UC: packet dropped with its message"
        );
        self.count(&self.counters.uc_dropped);
        self.abandon_uc(st);
    }

    /// Give up the message in progress; its receive, if it took one, is kept for the next.
    fn abandon_uc(&self, st: &mut State) {
        if let Some(InMsg::Send { wqe, .. }) = st.resp.cur.take() {
            debug_assert!(
                st.resp.spare.is_none(),
                "a Send takes the spare receive first"
            );
            st.resp.spare = Some(wqe);
        }
    }
}
