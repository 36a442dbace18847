//! How the daemon reaches registered memory, measured: 1 MiB RDMA Writes through
//! `krdmad` into memory of the two kinds a consumer registers — `malloc`'ed (heap)
//! memory, which the daemon reaches through the consumer's memory file, and a sealed
//! shared `RegBuf`, which it maps — against raw TCP on loopback in the same run.
//! `KRDMA_TEST_KRDMAD=<path>` runs another build of the daemon (to compare with an
//! earlier one). Needs root and /dev/fuse.
//!
//! `cargo bench -p krdma-tests --bench memory_path`

use krdma_tests::{connected_pair, daemon_possible, Daemon, FrontDoor};
use tools::perf::{bandwidth, tcp_bandwidth, Endpoint, Op};
use ual::Access;

const MSG: u32 = 1 << 20;
const TOTAL: u64 = 512 << 20;
const WINDOW: u32 = 16;
const RUNS: usize = 5;

/// The median of `RUNS` runs of `f`, in GB/s.
fn median(mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..RUNS).map(|_| f() / 1e9).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[RUNS / 2]
}

fn main() {
    if !daemon_possible() {
        println!("memory_path: needs root and /dev/fuse");
        return;
    }
    let door = FrontDoor::Daemon(Daemon::start());
    println!("| device | heap (memory file) GB/s | RegBuf (mapped) GB/s | raw TCP GB/s | heap / TCP | RegBuf / TCP |");
    println!("|---|---|---|---|---|---|");
    for device in ["siw0", "rxe0"] {
        let (a, b, s, c) = connected_pair(&door, device, MSG as usize);
        let regbuf = median(|| bandwidth(&s, &c, Op::Write, MSG, TOTAL, WINDOW).unwrap());
        // The same connection, from and into heap memory.
        let src = vec![7u8; MSG as usize];
        let dst = vec![0u8; MSG as usize];
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        // SAFETY: both vectors outlive the registrations (dropped at the end of this
        // iteration, the MRs first) and are not touched meanwhile.
        let (src_mr, dst_mr) = unsafe {
            (
                b.reg_mr(&c.pd, src.as_ptr(), src.len(), all).unwrap(),
                a.reg_mr(&s.pd, dst.as_ptr(), dst.len(), all).unwrap(),
            )
        };
        let heap_client = Endpoint {
            qp: c.qp.clone(),
            cq: c.cq.clone(),
            mr: src_mr.clone(),
            buf: c.buf.clone(),
            pd: c.pd.clone(),
            remote: (dst_mr.addr, dst_mr.rkey, dst_mr.len),
            depth: c.depth,
        };
        let heap = median(|| bandwidth(&s, &heap_client, Op::Write, MSG, TOTAL, WINDOW).unwrap());
        let tcp = median(|| tcp_bandwidth(MSG as usize, TOTAL).unwrap());
        println!(
            "| {device} | {heap:.2} | {regbuf:.2} | {tcp:.2} | {:.2}x | {:.2}x |",
            heap / tcp,
            regbuf / tcp
        );
        drop((heap_client, src_mr, dst_mr, s, c, a, b));
        drop((src, dst));
    }
}
