//! `ProviderQp::disconnect(false)` is the orderly close: siw sends its FIN only once the
//! send queue has drained, and rxe sends its DREQ only then too, so a Send posted just
//! before an orderly disconnect completes and arrives. (Found by the IT-API port to rxe0.)

use krdma_tests::FrontDoor;
use std::time::Duration;
use tools::perf::connect_pair;
use ual::{send_flags, WcStatus};

#[test]
fn rxe_orderly_disconnect_lets_a_posted_send_arrive() {
    krdma_tests::init_logging();
    krdma_tests::setup_embedded();
    let door = FrontDoor::Embedded;
    let (a, b) = (door.open(), door.open());
    let (s, c) = connect_pair(&a, &b, "rxe0", 4096, 16).expect("connect over rxe0");
    s.post_recv(1, 0, 64).unwrap();
    c.buf.write(0, b"last words");
    c.send(2, 0, 10, send_flags::SIGNALED).unwrap();
    c.qp.disconnect(false).unwrap();
    let sent = c.cq.wait(1, Duration::from_secs(10)).unwrap();
    let got = s.cq.wait(1, Duration::from_secs(10)).unwrap();
    assert_eq!(
        (sent[0].status(), got[0].status(), got[0].byte_len),
        (WcStatus::Success, WcStatus::Success, 10),
        "the Send posted before the orderly disconnect must complete and arrive"
    );
    drop((a, b));
}
