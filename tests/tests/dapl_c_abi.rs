//! krdma's DAT provider at its C boundary, through Debian's `libdat2`:
//!
//! * every structure the provider reads or writes has the size and member offsets
//!   `<dat2/udat.h>` gives it (the `DAT_PROVIDER` table included);
//! * `tests/c/dapl_api.c` over each device and front door: handles of the wrong kind,
//!   of another IA, stale and double-freed; NULL pointers; wrong sizes; private data
//!   over the limit; busy objects; graceful and abrupt IA close — each the DAT error
//!   code, nothing crashes;
//! * a consumer killed mid-transfer (the same program streaming RDMA Writes) leaves
//!   its peer — this test, on the Rust API — with the connection's end and its
//!   receive flushed, never a hang.

use krdma_dapl::*;
use krdma_tests::{daemon_possible, private_loopback, Daemon};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::Target;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let profile = deps.parent().unwrap().to_path_buf();
    [deps, profile]
        .into_iter()
        .find(|d| d.join("libdaplkrdma.so").exists())
        .unwrap_or_else(|| panic!("libdaplkrdma.so not found next to {}", exe.display()))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("krdma-dapl-c-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compile `src` against the system's DAT headers and libdat2.
fn cc(src: &Path, out: &Path) {
    assert!(
        Path::new("/usr/include/dat2/udat.h").exists(),
        "libdapl-dev is missing (scripts/test.sh installs it)"
    );
    let o = Command::new("cc")
        .args(["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg("-ldat2")
        .output()
        .expect("run cc");
    assert!(
        o.status.success(),
        "cc {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn dat_conf(dir: &Path) -> PathBuf {
    let conf = dir.join("dat.conf");
    let lines = tools::datconf::lines(
        &["siw0".into(), "rxe0".into()],
        &lib_dir().join("libdaplkrdma.so"),
    );
    std::fs::write(&conf, lines).unwrap();
    conf
}

#[test]
fn dapl_c_layouts_match_the_header() {
    let rows = daplkrdma::sys::layout();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <dat2/udat.h>\n#include <dat2/dat_registry.h>\nint main(void) {\n",
    );
    for (name, _) in &rows {
        match name.split_once('.') {
            Some((ty, member)) => {
                c += &format!("  printf(\"%zu\\n\", offsetof({ty}, {member}));\n")
            }
            None => c += &format!("  printf(\"%zu\\n\", sizeof({name}));\n"),
        }
    }
    c += "  return 0;\n}\n";
    let dir = scratch("layout");
    let (src, bin) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).unwrap();
    cc(&src, &bin);
    let out = Command::new(&bin).output().unwrap();
    let got: Vec<usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(got.len(), rows.len());
    let wrong: Vec<String> = rows
        .iter()
        .zip(&got)
        .filter(|((_, rust), c)| rust != *c)
        .map(|((name, rust), c)| format!("{name}: Rust {rust}, C {c}"))
        .collect();
    assert!(wrong.is_empty(), "layouts differ:\n{}", wrong.join("\n"));
    assert_eq!(
        daplkrdma::sys::VTABLE_MEMBERS.len(),
        79,
        "the DAT_PROVIDER table has 79 functions"
    );
    eprintln!("{} sizes and offsets agree with <dat2/udat.h>", rows.len());
    let _ = std::fs::remove_dir_all(dir);
}

/// Each front door, with the device file a child process opens (`embedded` or a path).
fn each_door(f: impl Fn(&Target, &str, Option<&Daemon>)) {
    krdma_tests::setup_embedded();
    f(&Target::Embedded, "embedded", None);
    if daemon_possible() {
        let d = Daemon::start();
        f(&d.target(), &d.path.display().to_string(), Some(&d));
    }
}

fn program(dir: &Path) -> PathBuf {
    let bin = dir.join("dapl_api");
    cc(&repo().join("tests/c/dapl_api.c"), &bin);
    bin
}

#[test]
fn dapl_c_hostile_input() {
    let dir = scratch("api");
    let (bin, conf) = (program(&dir), dat_conf(&dir));
    each_door(|_, device, _| {
        for dev in ["siw0", "rxe0"] {
            let out = Command::new(&bin)
                .arg("api")
                .env("DAT_OVERRIDE", &conf)
                .env("DAPL_IA", format!("krdma-{dev}"))
                .env("KRDMA_DEVICE", device)
                .env("KRDMA_RXE_ADDR", private_loopback(210).to_string())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() && text.contains("API OK"),
                "{dev} through {device}:\n{text}"
            );
            eprintln!("hostile input over {dev} through {device}: every answer a DAT code");
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn dapl_peer_killed_mid_transfer() {
    let dir = scratch("death");
    let (bin, conf) = (program(&dir), dat_conf(&dir));
    let t = Some(Duration::from_secs(20));
    each_door(|target, device, _| {
        for dev in ["siw0", "rxe0"] {
            let ia = Ia::open_on(target, dev).unwrap();
            let pz = Pz::create(&ia).unwrap();
            let evd = |flags, n| Evd::create(&ia, n, None, flags).unwrap();
            let (cr_evd, conn, dto) = (
                evd(EvdFlags::CR, 4),
                evd(EvdFlags::CONNECTION, 4),
                evd(EvdFlags::DTO, 64),
            );
            let ep = Ep::create(&pz, &dto, &dto, &conn, EpAttr::default(), None).unwrap();
            let target_buf =
                Lmr::create(&pz, ual::RegBuf::new(1 << 20).unwrap(), MemPriv::ALL).unwrap();
            let psp = Psp::create_any(&ia, &cr_evd).unwrap();
            let addr = ia.query().address.unwrap();
            let mut child = Command::new(&bin)
                .args(["stream", &addr.to_string(), &psp.conn_qual().to_string()])
                .env("DAT_OVERRIDE", &conf)
                .env("DAPL_IA", format!("krdma-{dev}"))
                .env("KRDMA_DEVICE", device)
                .env("KRDMA_RXE_ADDR", private_loopback(211).to_string())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let Event::ConnRequest(cr) = cr_evd.wait(t, 1).unwrap().0 else {
                panic!("no request")
            };
            // The advert: a DAT_RMR_TRIPLET (address, length, context) in host order.
            let rmr = target_buf.rmr_triplet(0, 1 << 20).unwrap();
            let mut advert = rmr.address.to_ne_bytes().to_vec();
            advert.extend(rmr.length.to_ne_bytes());
            advert.extend(rmr.rmr_context.to_ne_bytes());
            ep.post_recv(
                &[target_buf.triplet(0, 64).unwrap()],
                77,
                Completion::DEFAULT,
            )
            .unwrap();
            cr.accept(Some(&ep), &advert).unwrap();
            let Event::Connection(c) = conn.wait(t, 1).unwrap().0 else {
                panic!()
            };
            assert_eq!(c.kind, ConnEvent::Established);
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert_eq!(line.trim(), "STREAMING");
            std::thread::sleep(Duration::from_millis(300));
            child.kill().unwrap();
            let killed = Instant::now();
            child.wait().unwrap();
            // Through krdmad the daemon closes a dead process's connections (siw: FIN;
            // rxe: DREQ). An embedded peer's whole stack dies with it: over InfiniBand
            // nothing tells this side until it sends — then the retries run out.
            let end = match conn.wait(Some(Duration::from_secs(3)), 1) {
                Ok((ev, _)) => ev,
                Err(e) => {
                    assert_eq!(e.major, Major::TimeoutExpired, "{e:?}");
                    assert!(
                        device == "embedded" && dev == "rxe0",
                        "no end over {dev} through {device}"
                    );
                    let probe = target_buf.triplet(64, 8).unwrap();
                    let remote = RmrTriplet {
                        rmr_context: 1,
                        address: 0,
                        length: 8,
                    };
                    ep.post_rdma_write(&[probe], 78, &remote, Completion::DEFAULT)
                        .unwrap();
                    conn.wait(Some(Duration::from_secs(120)), 1)
                        .expect("the connection's end")
                        .0
                }
            };
            let Event::Connection(end) = end else {
                panic!()
            };
            assert!(
                matches!(end.kind, ConnEvent::Broken | ConnEvent::Disconnected),
                "{:?}",
                end.kind
            );
            // The receive completes flushed (and a probe, if one went out, failed).
            let mut flushed = false;
            while let Ok((Event::Dto(d), _)) = dto.wait(t, 1) {
                if d.op == DtoOp::Receive {
                    assert_eq!((d.cookie, d.status), (77, DtoStatus::Flushed));
                    flushed = true;
                    break;
                }
                assert_ne!(
                    d.status,
                    DtoStatus::Success,
                    "the probe reached a dead peer"
                );
            }
            assert!(flushed, "the posted receive was not flushed");
            eprintln!(
                "{dev} through {device}: peer killed mid-transfer -> {:?} and a flushed receive after {:?}",
                end.kind,
                killed.elapsed()
            );
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}
