//! uDAPL RDMA Write with verification: the server listens on a PSP and accepts with its
//! buffer's RMR triplet as private data; the client RDMA-Writes a pattern into it and
//! then Sends "written"; the server checks every byte and answers with a Send of its
//! verdict. Round after round, with the bandwidth reported.
//!
//! ```sh
//! cargo run --release -p krdma-dapl --example rdma_write                        # both ends
//! cargo run --release -p krdma-dapl --example rdma_write -- --server 45300       # one end...
//! cargo run --release -p krdma-dapl --example rdma_write -- --client 10.0.0.2:45300
//! cargo run --release -p krdma-dapl --example rdma_write -- --device krdma-rxe0  # RoCEv2
//! ```

use clap::Parser;
use krdma_dapl::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The IA (krdma-siw0 / krdma-rxe0, or the device name).
    #[arg(long, default_value = "krdma-siw0")]
    device: String,
    /// Be the server only, on this connection qualifier.
    #[arg(long)]
    server: Option<u16>,
    /// Be the client only, of the server at this address and qualifier.
    #[arg(long)]
    client: Option<SocketAddr>,
    /// Bytes per RDMA Write.
    #[arg(long, default_value_t = 1 << 20)]
    size: u32,
    #[arg(long, default_value_t = 32)]
    rounds: u32,
}

const T: Option<Duration> = Some(Duration::from_secs(30));
/// Messages live in the buffer's first 64 bytes; the data after them.
const MSG: u32 = 64;

/// One side: IA, PZ, EVDs, an endpoint, and one registered buffer.
struct Side {
    ia: Ia,
    dto: Evd,
    conn: Evd,
    ep: Ep,
    lmr: Lmr,
}

impl Side {
    fn new(device: &str, size: u32) -> Result<Side> {
        let ia = Ia::open(device)?;
        let pz = Pz::create(&ia)?;
        let dto = Evd::create(&ia, 64, None, EvdFlags::DTO)?;
        let conn = Evd::create(&ia, 4, None, EvdFlags::CONNECTION)?;
        let ep = Ep::create(&pz, &dto, &dto, &conn, EpAttr::default(), None)?;
        let buf = ual::RegBuf::new((MSG + size) as usize).expect("buffer");
        let lmr = Lmr::create(&pz, buf, MemPriv::ALL)?;
        Ok(Side {
            ia,
            dto,
            conn,
            ep,
            lmr,
        })
    }

    fn buf(&self) -> &ual::RegBuf {
        self.lmr.buffer().expect("registered buffer")
    }

    fn post_recv(&self) -> Result<()> {
        self.ep
            .post_recv(&[self.lmr.triplet(0, MSG)?], 1, Completion::DEFAULT)
    }

    fn send(&self, text: &[u8]) -> Result<()> {
        let at = MSG as u64 / 2;
        self.buf().write(at as usize, text);
        let t = self.lmr.triplet(at, text.len() as u32)?;
        self.ep.post_send(&[t], 2, Completion::SUPPRESS)
    }

    /// The next received message.
    fn recv(&self) -> Result<Vec<u8>> {
        loop {
            let (ev, _) = self.dto.wait(T, 1)?;
            if let Event::Dto(d) = ev {
                assert_eq!(d.status, DtoStatus::Success, "{:?}", d.op);
                if d.op == DtoOp::Receive {
                    let mut m = vec![0; d.transferred_length as usize];
                    self.buf().read(0, &mut m);
                    self.post_recv()?;
                    return Ok(m);
                }
            }
        }
    }

    fn established(&self) -> Result<Vec<u8>> {
        match self.conn.wait(T, 1)?.0 {
            Event::Connection(c) if c.kind == ConnEvent::Established => Ok(c.private_data),
            other => panic!("not connected: {other:?}"),
        }
    }
}

fn pattern(round: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(round) as u8)
        .collect()
}

fn server(
    device: &str,
    qual: u16,
    size: u32,
    rounds: u32,
    ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    let s = Side::new(device, size)?;
    let cr_evd = Evd::create(&s.ia, 4, None, EvdFlags::CR)?;
    let psp = if qual == 0 {
        Psp::create_any(&s.ia, &cr_evd)?
    } else {
        Psp::create(&s.ia, qual as u64, &cr_evd)?
    };
    ready(SocketAddr::new(
        s.ia.query().address.expect("an address"),
        psp.conn_qual() as u16,
    ));
    let Event::ConnRequest(cr) = cr_evd.wait(None, 1)?.0 else {
        unreachable!()
    };
    // The advert: where to write (address, key), 12 bytes big-endian.
    let target = s.lmr.rmr_triplet(MSG as u64, size)?;
    let mut advert = target.address.to_be_bytes().to_vec();
    advert.extend(target.rmr_context.to_be_bytes());
    s.post_recv()?;
    cr.accept(Some(&s.ep), &advert)?;
    s.established()?;
    for round in 0..rounds {
        assert_eq!(s.recv()?, b"written");
        let mut got = vec![0; size as usize];
        s.buf().read(MSG as usize, &mut got);
        let ok = got == pattern(round, size as usize);
        s.send(if ok { b"verified" } else { b"corrupt!" })?;
        assert!(ok, "round {round}: the data differs");
    }
    match s.conn.wait(T, 1)?.0 {
        Event::Connection(c) => println!("server: {:?}", c.kind),
        other => println!("server: {other:?}"),
    }
    Ok(())
}

fn client(device: &str, at: SocketAddr, size: u32, rounds: u32) -> Result<()> {
    let c = Side::new(device, size)?;
    c.post_recv()?;
    c.ep.connect(at, b"")?;
    let advert = c.established()?;
    let target = RmrTriplet {
        address: u64::from_be_bytes(advert[..8].try_into().unwrap()),
        rmr_context: u32::from_be_bytes(advert[8..12].try_into().unwrap()),
        length: size,
    };
    let start = Instant::now();
    for round in 0..rounds {
        c.buf().write(MSG as usize, &pattern(round, size as usize));
        c.ep.post_rdma_write(
            &[c.lmr.triplet(MSG as u64, size)?],
            round as u64,
            &target,
            Completion::SUPPRESS,
        )?;
        // A Send after the Write arrives after it (both transports keep the order).
        c.send(b"written")?;
        assert_eq!(c.recv()?, b"verified", "round {round}");
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "client: {rounds} x {size} B RDMA Write verified over {device}: {:.1} MB/s",
        (rounds as f64 * size as f64) / secs / 1e6
    );
    c.ep.disconnect(false)?;
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    match (a.server, a.client) {
        (Some(q), _) => server(&a.device, q, a.size, a.rounds, |at| {
            println!("server at {at}")
        }),
        (None, Some(at)) => client(&a.device, at, a.size, a.rounds),
        (None, None) => {
            let (tx, rx) = std::sync::mpsc::channel();
            let (dev, size, rounds) = (a.device.clone(), a.size, a.rounds);
            let s = std::thread::spawn(move || {
                server(&dev, 0, size, rounds, |at| tx.send(at).unwrap())
            });
            let at = rx.recv().expect("server up");
            client(&a.device, at, a.size, a.rounds)?;
            s.join().expect("server thread")
        }
    }
}
