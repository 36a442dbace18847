//! The software RoCEv2 provider.
//!
//! What exists so far is [`wire`]: parsers and emitters for everything Linux `rdma_rxe`
//! puts on the wire (InfiniBand transport headers over UDP/4791, the RoCEv2 ICRC, and the
//! IB CM MADs that rdma_cm exchanges on QP1), checked against captures of the kernel
//! driver. The queue-pair engine that will use them (and the device the rest of krdma
//! talks to) is still to come; the work is tracked in issue 4.
#![forbid(unsafe_code)]

pub mod wire;
