//! C1: a context acts only for the process that opened it, with the credentials it had.
//!
//! * A descriptor of `/dev/krdma` passed to another process over a Unix socket
//!   (`SCM_RIGHTS`), even one of the same user, is refused on every command (`EACCES`),
//!   on `read` and on `poll`; the opener's objects and its pending connection request are
//!   untouched; once the opener exits the context ends at once, though the other process
//!   still holds the file.
//! * A fork child is refused, through both front doors (the daemon checks the requesting
//!   process; an embedded kAL and the uAL refuse a fork child of their process), and its
//!   copies of the parent's objects drop without touching the parent's; the context ends
//!   with its opener.
//! * An opener that execs a setuid program is refused and its context ends.

use krdma_tests::probe::{every_command, Known, Own, Victim};
use krdma_tests::{
    as_user, await_context_gone, child_test, daemon_possible, hear, private_dir, say, Bystander,
    Daemon, FrontDoor, Role,
};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use std::time::Duration;
use ual::{abi, Context, DeviceFile, Target};

const NOBODY: u32 = 65534;
const OTHER: u32 = 65533;
const EACCES: i32 = libc::EACCES;

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).map(PathBuf::from)
}

fn errno_of(r: ual::Result<()>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

fn target() -> Target {
    match std::env::var("KRDMA_TEST_DOOR").as_deref() {
        Ok("embedded") | Err(_) => {
            krdma_tests::setup_embedded();
            Target::Embedded
        }
        Ok(p) => Target::Device(p.into()),
    }
}

/// A daemon with a bystander on rxe0 (created before any attack) and a root context
/// that watches the others.
fn watched_daemon() -> (FrontDoor, Bystander, std::sync::Arc<Context>) {
    let door = FrontDoor::Daemon(Daemon::start());
    let bystander = Bystander::start(&door, "rxe0");
    let observer = Context::open_target(&door.target()).unwrap();
    (door, bystander, observer)
}

// ---- SCM_RIGHTS -------------------------------------------------------------------

/// Role: opens the device, builds a victim context and passes its descriptor to whoever
/// connects to the socket; checks its objects once that process has tried its commands.
#[test]
#[ignore = "a role of a_passed_descriptor_acts_for_no_one"]
fn role_passer() {
    let (Some(dev), Some(sock)) = (env_path("KRDMA_TEST_DEVICE"), env_path("KRDMA_TEST_SOCK"))
    else {
        return;
    };
    let v = Victim::new(&Target::Device(dev), "siw0");
    say("CTX", v.known.ctx);
    let l = UnixListener::bind(&sock).unwrap();
    say("READY", "");
    let (mut s, _) = l.accept().unwrap();
    let file = v.ctx.channel().device_file().unwrap();
    let fds = [file.fd().as_raw_fd()];
    let line = format!("{}\n", v.known.to_line());
    let iov = [std::io::IoSlice::new(line.as_bytes())];
    let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
    nix::sys::socket::sendmsg::<()>(
        s.as_raw_fd(),
        &iov,
        &cmsg,
        nix::sys::socket::MsgFlags::empty(),
        None,
    )
    .unwrap();
    let mut done = [0u8; 4];
    s.read_exact(&mut done).unwrap();
    v.check();
    say("EXITING", "");
}

/// Role: receives a descriptor and the numbers of its context, and tries everything.
#[test]
#[ignore = "a role of a_passed_descriptor_acts_for_no_one"]
fn role_receiver() {
    let Some(sock) = env_path("KRDMA_TEST_SOCK") else {
        return;
    };
    let mut s = UnixStream::connect(&sock).unwrap();
    let mut buf = vec![0u8; 512];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let (n, fd) = {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            nix::sys::socket::MsgFlags::empty(),
        )
        .unwrap();
        let fd = msg
            .cmsgs()
            .unwrap()
            .find_map(|c| match c {
                nix::sys::socket::ControlMessageOwned::ScmRights(v) => v.first().copied(),
                _ => None,
            })
            .expect("a descriptor");
        (msg.bytes, fd)
    };
    let known = Known::parse(std::str::from_utf8(&buf[..n]).unwrap().trim());
    // SAFETY: the descriptor just received is ours alone.
    let file = DeviceFile::from_fd(unsafe { OwnedFd::from_raw_fd(fd) }).unwrap();
    let own = Own::new();
    for mut a in every_command(&known, &own) {
        say(
            "TRIED",
            format!("{} {}", a.name, errno_of(file.ioctl(a.cmd, &mut a.arg))),
        );
    }
    let mut events = vec![0u8; abi::EVENT_SIZE];
    say(
        "TRIED",
        format!("read {}", errno_of(file.read_events(&mut events).map(drop))),
    );
    say(
        "TRIED",
        format!(
            "poll {}",
            errno_of(file.wait_readable(Some(Duration::ZERO)).map(drop))
        ),
    );
    say("FIRST", "done");
    s.write_all(b"done").unwrap();
    // Once the opener is gone (the test says so), try again.
    assert_eq!(hear(), "again");
    let mut q = bytemuck::bytes_of(&<abi::QueryAbi as bytemuck::Zeroable>::zeroed()).to_vec();
    say("AFTER", errno_of(file.ioctl(abi::cmd::QUERY_ABI, &mut q)));
}

#[test]
fn a_passed_descriptor_acts_for_no_one() {
    if !daemon_possible() {
        return;
    }
    let (door, bystander, observer) = watched_daemon();
    let d = door.daemon().unwrap();
    let dir = private_dir("krdma-scm");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let sock = dir.join("sock");
    let role = |name: &str| {
        let mut c = child_test(name);
        c.env("KRDMA_TEST_DEVICE", &d.path)
            .env("KRDMA_TEST_SOCK", &sock);
        Role::spawn(as_user(&c, NOBODY))
    };
    let mut opener = role("role_passer");
    let ctx: u32 = opener.expect("CTX").parse().unwrap();
    opener.expect("READY");
    // The same user, another process: the case only a check of the process catches.
    let mut receiver = role("role_receiver");
    receiver.expect("FIRST");
    let tried = receiver.said(false);
    let tried: Vec<&String> = tried.iter().filter(|l| l.starts_with("TRIED ")).collect();
    assert_eq!(tried.len(), abi::cmd::ALL.len() + 2, "{tried:?}");
    for t in &tried {
        let errno: i32 = t.rsplit(' ').next().unwrap().parse().unwrap();
        // poll(2) has no errno to give: the refused FUSE poll is POLLERR (ENOTCONN here).
        let want = match t.starts_with("TRIED poll ") {
            true => libc::ENOTCONN,
            false => EACCES,
        };
        assert_eq!(errno, want, "another process got through: {t}");
    }
    // Nothing of the opener's was touched: its connection works and its pending
    // request is still there for it to accept.
    opener.expect("INTACT");
    opener.expect("ACCEPTED");
    opener.expect("EXITING");
    assert!(opener.wait().success());
    // The receiver still holds the file, so no RELEASE comes: the opener's exit alone
    // ends the context.
    let took = await_context_gone(&observer, ctx, Duration::from_secs(1));
    eprintln!("context ended {took:?} after its opener exited");
    receiver.tell("again");
    assert_eq!(receiver.expect("AFTER"), EACCES.to_string());
    assert!(receiver.wait().success());
    let counters: std::collections::HashMap<String, u64> =
        observer.stat_kal().unwrap().into_iter().collect();
    assert!(counters["request_refused_foreign_process"] >= tried.len() as u64);
    assert!(counters["context_ended_opener_exited"] >= 1);
    bystander.finish().assert_served(Duration::from_secs(2));
}

// ---- fork ---------------------------------------------------------------------------

/// Raw `write(1)`: a fork child of a multithreaded process must not take std's locks.
/// On a line of its own: the parent's test harness may have left one unfinished.
fn raw_say(line: &str) {
    let l = format!("\n{line}\n");
    // SAFETY: writes our own buffer to descriptor 1.
    unsafe { libc::write(1, l.as_ptr().cast(), l.len()) };
}

/// Role: a victim context through `KRDMA_TEST_DOOR` whose process forks; the child
/// tries the context through the uAL and beneath it, then outlives its parent.
#[test]
#[ignore = "a role of a_fork_child_is_refused_through_both_doors"]
fn role_forker() {
    if std::env::var_os("KRDMA_TEST_DOOR").is_none() {
        return;
    }
    let target = target();
    let v = Victim::new(&target, "siw0");
    say("CTX", v.known.ctx);
    let (r, w) = nix::unistd::pipe().unwrap();
    let file_fd = v.ctx.channel().device_file().map(|f| f.fd().as_raw_fd());
    let embedded = v.ctx.channel().embedded().map(|(k, c)| (k.clone(), c));
    // SAFETY: the child only makes system calls, uAL/kAL calls that refuse at once, and
    // raw writes, then _exit; it never returns into the test harness.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            drop(w);
            // Our own duplicate of the inherited device file, to try beneath the uAL
            // (the uAL objects' copies close theirs when dropped).
            let raw = file_fd.map(|fd| {
                // SAFETY: a fresh duplicate of the inherited descriptor, ours alone.
                DeviceFile::from_fd(unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) }).unwrap()
            });
            let mut out = Vec::new();
            out.push(format!(
                "ualpd={}",
                errno_of(v.ctx.alloc_pd(v.known.dev).map(drop))
            ));
            out.push(format!(
                "ualstat={}",
                errno_of(v.ctx.stat_contexts().map(drop))
            ));
            let s = &v.ends.0;
            out.push(format!("post={}", errno_of(s.post_recv(9, 0, 8))));
            let mut q = [0u8; 16];
            if let Some(f) = &raw {
                // Beneath the uAL: the daemon itself must refuse the child.
                out.push(format!(
                    "raw={}",
                    errno_of(f.ioctl(abi::cmd::QUERY_ABI, &mut q))
                ));
            }
            if let Some((kal, ctx)) = &embedded {
                out.push(format!(
                    "kal={}",
                    errno_of(kal.ioctl(*ctx, abi::cmd::QUERY_ABI, &mut q))
                ));
            }
            raw_say(&format!("CHILD1 {}", out.join(" ")));
            // The child's copies of the parent's objects go without touching the parent.
            drop(v);
            drop(embedded);
            raw_say("CHILD-DROPPED ok");
            let mut b = [0u8; 1];
            let _ = nix::unistd::read(&r, &mut b); // EOF: the parent is gone
            if let Some(f) = &raw {
                raw_say(&format!(
                    "CHILD2 {}",
                    errno_of(f.ioctl(abi::cmd::QUERY_ABI, &mut q))
                ));
            }
            // SAFETY: leaves without running the parent's destructors or the harness.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { .. } => {
            drop(r);
            assert_eq!(hear(), "check");
            v.check();
            assert_eq!(hear(), "exit");
            // EXITING before the child can hear the pipe close: the test reads the
            // child's CHILD2 after our EXITING, never before it.
            say("EXITING", "");
            drop(w);
        }
    }
}

fn fork_child_through(door: &FrontDoor) {
    // The child shares a kAL with the bystander through the daemon only (an embedded
    // child has a kAL of its own).
    let bystander = door.daemon().map(|_| Bystander::start(door, "rxe0"));
    let mut c = child_test("role_forker");
    c.env("KRDMA_TEST_DOOR", door.env_value());
    let mut forker = Role::spawn(as_user(&c, NOBODY));
    let ctx: u32 = forker.expect("CTX").parse().unwrap();
    let child = forker.expect("CHILD1");
    for result in child.split_whitespace() {
        let (what, errno) = result.split_once('=').unwrap();
        assert_eq!(
            errno,
            EACCES.to_string(),
            "a fork child got through ({what}): {child}"
        );
    }
    forker.expect("CHILD-DROPPED");
    forker.tell("check");
    forker.expect("INTACT");
    forker.expect("ACCEPTED");
    let observer = door
        .daemon()
        .map(|d| Context::open_target(&d.target()).unwrap());
    forker.tell("exit");
    forker.expect("EXITING");
    if let Some(o) = &observer {
        // The child still holds the device file: the opener's exit alone ends it.
        let took = await_context_gone(o, ctx, Duration::from_secs(1));
        eprintln!("context ended {took:?} after its opener exited");
        assert_eq!(forker.expect("CHILD2"), EACCES.to_string());
    }
    forker.wait();
    if let Some(b) = bystander {
        b.finish().assert_served(Duration::from_secs(2));
    }
}

#[test]
fn a_fork_child_is_refused_through_both_doors() {
    fork_child_through(&FrontDoor::Embedded);
    if daemon_possible() {
        fork_child_through(&FrontDoor::Daemon(Daemon::start()));
    }
}

// ---- setuid exec --------------------------------------------------------------------

/// Role: opens the device with a descriptor that survives exec, then execs a setuid
/// copy of this test program that tries to use it.
#[test]
#[ignore = "a role of a_setuid_exec_ends_the_context"]
fn role_setuid_opener() {
    let (Some(dev), Some(helper)) = (env_path("KRDMA_TEST_DEVICE"), env_path("KRDMA_TEST_HELPER"))
    else {
        return;
    };
    // No O_CLOEXEC: this descriptor is meant to reach the exec'd program.
    let fd = nix::fcntl::open(
        &dev,
        nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    let probe = DeviceFile::from_fd(fd.try_clone().unwrap()).unwrap();
    let mut q = abi::QueryAbi {
        version: 0,
        event_size: 0,
        context: 0,
        _pad: 0,
    };
    probe
        .ioctl(abi::cmd::QUERY_ABI, bytemuck::bytes_of_mut(&mut q))
        .unwrap();
    say("CTX", q.context);
    drop(probe);
    let raw = fd.as_raw_fd();
    std::mem::forget(fd);
    let err = std::os::unix::process::CommandExt::exec(
        std::process::Command::new(helper)
            .args(["role_setuid_helper", "--exact", "--ignored", "--nocapture"])
            .env("KRDMA_TEST_FD", raw.to_string()),
    );
    panic!("exec failed: {err}");
}

/// Role: the setuid program, holding its pre-exec self's descriptor.
#[test]
#[ignore = "a role of a_setuid_exec_ends_the_context"]
fn role_setuid_helper() {
    let Some(fd) = std::env::var("KRDMA_TEST_FD")
        .ok()
        .and_then(|v| v.parse().ok())
    else {
        return;
    };
    say("EUID", nix::unistd::geteuid());
    // SAFETY: inherited across exec for us alone.
    let file = DeviceFile::from_fd(unsafe { OwnedFd::from_raw_fd(fd) }).unwrap();
    let mut q = [0u8; 16];
    say("SETUID", errno_of(file.ioctl(abi::cmd::QUERY_ABI, &mut q)));
    let _ = hear();
}

/// A copy of this test program owned by `uid` with the setuid bit, in `dir`.
fn setuid_copy(dir: &Path, uid: u32) -> PathBuf {
    let copy = dir.join("setuid-helper");
    std::fs::copy(std::env::current_exe().unwrap(), &copy).unwrap();
    nix::unistd::chown(&copy, Some(uid.into()), Some(uid.into())).unwrap();
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    copy
}

#[test]
fn a_setuid_exec_ends_the_context() {
    if !daemon_possible() {
        return;
    }
    let (door, bystander, observer) = watched_daemon();
    let d = door.daemon().unwrap();
    let dir = private_dir("krdma-setuid");
    let helper = setuid_copy(&dir, OTHER);
    let mut c = child_test("role_setuid_opener");
    c.env("KRDMA_TEST_DEVICE", &d.path)
        .env("KRDMA_TEST_HELPER", &helper);
    let mut opener = Role::spawn(as_user(&c, NOBODY));
    let ctx: u32 = opener.expect("CTX").parse().unwrap();
    assert_eq!(
        opener.expect("EUID"),
        OTHER.to_string(),
        "the setuid bit did not take effect ({} mounted nosuid?)",
        dir.display()
    );
    assert_eq!(
        opener.expect("SETUID"),
        EACCES.to_string(),
        "the setuid program got through"
    );
    let took = await_context_gone(&observer, ctx, Duration::from_secs(1));
    eprintln!("context ended {took:?} after the refused request");
    let counters: std::collections::HashMap<String, u64> =
        observer.stat_kal().unwrap().into_iter().collect();
    assert!(counters["context_ended_creds_changed"] >= 1);
    opener.wait();
    let _ = std::fs::remove_dir_all(&dir);
    bystander.finish().assert_served(Duration::from_secs(2));
}
