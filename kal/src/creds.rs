//! Credentials: what the kernel says of a process or thread (`/proc/<pid>/status`), the
//! capability sets of our own threads, and running a piece of work as another user.
//!
//! Capabilities and the file-system uid are per thread in Linux (the C library makes
//! `setuid` and friends process-wide, but the system calls are not), which is what lets
//! the daemon act as a tenant in one short-lived thread while the rest keep their rights.

use std::io;

/// Capability numbers (`linux/capability.h`) the kAL asks about or keeps.
pub mod cap {
    pub const CHOWN: u32 = 0;
    pub const DAC_OVERRIDE: u32 = 1;
    pub const DAC_READ_SEARCH: u32 = 2;
    pub const SETGID: u32 = 6;
    pub const SETUID: u32 = 7;
    pub const NET_BIND_SERVICE: u32 = 10;
    pub const NET_RAW: u32 = 13;
    pub const SYS_PTRACE: u32 = 19;
    pub const SYS_ADMIN: u32 = 21;
    pub const CHECKPOINT_RESTORE: u32 = 40;
}

/// A process's or thread's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Creds {
    /// Real, effective, saved and file-system uid.
    pub uids: [u32; 4],
    /// Real, effective, saved and file-system gid.
    pub gids: [u32; 4],
    /// Effective capabilities (bit `n` is capability `n`).
    pub cap_eff: u64,
}

impl Creds {
    pub fn euid(&self) -> u32 {
        self.uids[1]
    }

    pub fn fsuid(&self) -> u32 {
        self.uids[3]
    }

    pub fn fsgid(&self) -> u32 {
        self.gids[3]
    }

    /// Same uids and gids (capabilities may differ between threads and over time).
    pub fn same_identity(&self, other: &Creds) -> bool {
        self.uids == other.uids && self.gids == other.gids
    }

    pub fn has(&self, cap: u32) -> bool {
        self.cap_eff & (1u64 << cap) != 0
    }
}

/// The lines of `/proc/<pid>/status` (or `/proc/<pid>/task/<tid>/status`) the kAL uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// The thread group (process) the task belongs to.
    pub tgid: u32,
    pub creds: Creds,
}

impl Status {
    /// The fields of a status text, in one pass (it is read on every request).
    pub fn parse(text: &str) -> Option<Status> {
        let four = |v: &str| -> Option<[u32; 4]> {
            let mut it = v.split_whitespace().map(|x| x.parse().ok());
            Some([it.next()??, it.next()??, it.next()??, it.next()??])
        };
        let (mut tgid, mut uids, mut gids, mut cap_eff) = (None, None, None, None);
        for line in text.lines() {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            match name {
                "Tgid" => tgid = value.trim().parse().ok(),
                "Uid" => uids = four(value),
                "Gid" => gids = four(value),
                "CapEff" => {
                    cap_eff = u64::from_str_radix(value.trim(), 16).ok();
                    break; // the last of the four
                }
                _ => {}
            }
        }
        Some(Status {
            tgid: tgid?,
            creds: Creds {
                uids: uids?,
                gids: gids?,
                cap_eff: cap_eff?,
            },
        })
    }

    /// The status of task `pid` (a process or any thread: `/proc/<tid>` works for both).
    pub fn of(pid: u32) -> io::Result<Status> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        Status::parse(&text).ok_or_else(|| io::Error::other("unreadable /proc status"))
    }
}

/// Who is asking for a command: the kAL checks rights (privileged ports, other users'
/// statistics) against the requesting thread, not only against the opener.
#[derive(Debug, Clone, Copy)]
pub enum Requester {
    /// Embedded mode: the calling thread of this very process.
    ThisThread,
    /// Daemon mode: the requesting thread, as checked against the context's opener.
    Verified(Creds),
}

impl Requester {
    pub fn euid(&self) -> u32 {
        match self {
            Requester::ThisThread => nix::unistd::geteuid().as_raw(),
            Requester::Verified(c) => c.euid(),
        }
    }

    /// Whether the requester holds `cap` in its effective set.
    pub fn has(&self, cap: u32) -> bool {
        match self {
            Requester::ThisThread => {
                CapSets::current().is_ok_and(|s| s.effective & (1u64 << cap) != 0)
            }
            Requester::Verified(c) => c.has(cap),
        }
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// The capability sets of the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapSets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

impl CapSets {
    pub fn current() -> io::Result<CapSets> {
        let mut h = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let mut d = [CapData::default(); 2];
        // SAFETY: capget with a version-3 header fills two CapData structs, which `d` is.
        if unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let join = |f: fn(&CapData) -> u32| f(&d[0]) as u64 | (f(&d[1]) as u64) << 32;
        Ok(CapSets {
            effective: join(|c| c.effective),
            permitted: join(|c| c.permitted),
            inheritable: join(|c| c.inheritable),
        })
    }

    /// Make these the calling thread's sets (only ever a subset of what it has).
    pub fn apply(&self) -> io::Result<()> {
        let mut h = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let split = |v: u64| [v as u32, (v >> 32) as u32];
        let (e, p, i) = (
            split(self.effective),
            split(self.permitted),
            split(self.inheritable),
        );
        let d = [0, 1].map(|n| CapData {
            effective: e[n],
            permitted: p[n],
            inheritable: i[n],
        });
        // SAFETY: capset with a version-3 header reads two CapData structs, which `d` is.
        if unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Field `n` (numbered from 1, as in proc(5)) of a `/proc/<pid>/stat` line. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted after its last
/// `)`; `n` is at least 3.
pub(crate) fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n.checked_sub(3)?)
}

/// The highest capability number this kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Keep only the capabilities in `keep` (bits), for the calling thread and every thread
/// it creates from now on: they leave the bounding set (so no exec can give them back),
/// the permitted and effective sets; the inheritable and ambient sets are emptied and
/// `no_new_privs` is set. Threads created earlier keep their own sets, so call it
/// before starting any.
pub fn keep_only(keep: u64) -> io::Result<()> {
    for c in 0..=last_cap() {
        if keep & (1u64 << c) == 0 {
            // SAFETY: prctl with integer arguments only.
            if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, c as libc::c_ulong, 0, 0, 0) } != 0 {
                // EINVAL: a capability this kernel does not have; EPERM: no CAP_SETPCAP
                // (a container may withhold it), then only the sets below shrink.
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINVAL) => {}
                    Some(libc::EPERM) => {
                        tracing::warn!("cannot shrink the capability bounding set: {e}");
                        break;
                    }
                    _ => return Err(e),
                }
            }
        }
    }
    let now = CapSets::current()?;
    CapSets {
        effective: now.effective & keep,
        permitted: now.permitted & keep,
        inheritable: 0,
    }
    .apply()?;
    // SAFETY: prctl with integer arguments only.
    unsafe {
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) != 0
            || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Run `work` on a thread of its own that acts as the process with `creds`: it has taken
/// its file-system uid and gid, and its effective capabilities are the process's own
/// (as far as we have them) plus `keep`, so whatever it opens the kernel checks as if
/// that process opened it: DAC permissions, and the ptrace access check of
/// `/proc/<pid>/mem` and `/proc/<pid>/map_files` (a process of another user, one that is
/// not dumpable, or one with capabilities the caller lacks, is refused). `keep` is for
/// rights the daemon itself needs on the way (`CAP_SYS_ADMIN` to reach `map_files`),
/// never `CAP_SYS_PTRACE`.
pub fn as_opener<T: Send>(
    creds: &Creds,
    keep: u64,
    work: impl FnOnce() -> T + Send,
) -> io::Result<T> {
    let (uid, gid) = (creds.fsuid(), creds.fsgid());
    let wanted = creds.cap_eff | (keep & !(1u64 << cap::SYS_PTRACE));
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("krdma-as-user".into())
            .spawn_scoped(s, move || {
                // setfsuid/setfsgid report the previous id and never fail outright; the
                // call with -1 reads the id back, so a refusal is seen.
                // SAFETY: the calls change only this thread's file-system ids.
                let ok = unsafe {
                    libc::setfsgid(gid);
                    libc::setfsuid(uid);
                    libc::setfsgid(u32::MAX) as u32 == gid && libc::setfsuid(u32::MAX) as u32 == uid
                };
                if !ok {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "cannot take the caller's file-system ids",
                    ));
                }
                let mut caps = CapSets::current()?;
                caps.effective = wanted & caps.permitted;
                caps.apply()?;
                Ok(work())
            })?
            .join()
            .map_err(|_| io::Error::other("as-user thread panicked"))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status() {
        let text = "Name:\tx\nTgid:\t42\nPid:\t43\nUid:\t1000\t1001\t1002\t1003\n\
                    Gid:\t5\t6\t7\t8\nCapEff:\t0000000000000400\n";
        let s = Status::parse(text).unwrap();
        assert_eq!(s.tgid, 42);
        assert_eq!(s.creds.uids, [1000, 1001, 1002, 1003]);
        assert_eq!(s.creds.gids, [5, 6, 7, 8]);
        assert!(s.creds.has(cap::NET_BIND_SERVICE));
        assert!(!s.creds.has(cap::NET_RAW));
        assert_eq!(s.creds.euid(), 1001);
        assert!(Status::parse("Tgid:\t1\nUid:\t1 2 3\n").is_none());
    }

    #[test]
    fn own_status_and_caps_agree() {
        let s = Status::of(std::process::id()).unwrap();
        assert_eq!(s.tgid, std::process::id());
        assert_eq!(s.creds.euid(), nix::unistd::geteuid().as_raw());
        let caps = CapSets::current().unwrap();
        assert_eq!(caps.effective, s.creds.cap_eff);
    }

    #[test]
    fn stat_fields_are_counted_past_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 30 10 3 0 77";
        assert_eq!(stat_field(stat, 3), Some("S"));
        assert_eq!(stat_field(stat, 19), Some("10"));
        assert_eq!(stat_field(stat, 22), Some("77"));
        assert_eq!(stat_field("1 (x) S 0", 19), None);
        assert_eq!(stat_field(stat, 2), None);
    }

    #[test]
    fn keep_only_leaves_what_it_keeps_in_every_set() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let keep = 1u64 << cap::NET_RAW | 1 << cap::SETUID;
        // Capability sets are per thread: the test thread's own stay as they are.
        let (sets, status) = std::thread::spawn(move || {
            keep_only(keep).unwrap();
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            (CapSets::current().unwrap(), status)
        })
        .join()
        .unwrap();
        assert_eq!(sets.effective, keep);
        assert_eq!(sets.permitted, keep);
        assert_eq!(sets.inheritable, 0);
        let field = |n: &str| {
            let v = status.lines().find_map(|l| l.strip_prefix(n)).unwrap();
            u64::from_str_radix(v.trim(), 16).unwrap()
        };
        assert_eq!(field("CapBnd:"), keep);
        assert_eq!(field("CapAmb:"), 0);
        assert!(status
            .lines()
            .any(|l| l.starts_with("NoNewPrivs:") && l.ends_with('1')));
        assert_ne!(CapSets::current().unwrap().effective, keep);
    }

    #[test]
    fn as_user_changes_only_its_own_thread() {
        if !nix::unistd::geteuid().is_root() {
            return; // taking another fsuid needs CAP_SETUID
        }
        let before = CapSets::current().unwrap();
        let nobody = Creds {
            uids: [65534; 4],
            gids: [65534; 4],
            cap_eff: 0,
        };
        let (fsuid, caps) = as_opener(&nobody, 1 << cap::SYS_ADMIN, || {
            // SAFETY: reads this thread's fsuid back (-1 changes nothing).
            let fsuid = unsafe { libc::setfsuid(u32::MAX) } as u32;
            (fsuid, CapSets::current().unwrap())
        })
        .unwrap();
        assert_eq!(fsuid, 65534);
        assert_eq!(
            caps.effective,
            1 << cap::SYS_ADMIN,
            "nobody's rights and what was kept"
        );
        assert_eq!(
            CapSets::current().unwrap(),
            before,
            "the caller's thread is unchanged"
        );
        // SAFETY: as above.
        assert_eq!(unsafe { libc::setfsuid(u32::MAX) }, 0);
        // A file only its owner may read is refused to the other user.
        let dir = std::env::temp_dir().join(format!("krdma-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, b"x").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let as_nobody = as_opener(&nobody, 0, || std::fs::read(&secret)).unwrap();
        assert_eq!(
            as_nobody.unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert!(std::fs::read(&secret).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
