//! The scheduling priority of krdmad's threads.
//!
//! Through krdmad the engines do what a kernel does in its network processing: they build,
//! send, take and place the datagrams of every consumer, and answer their doorbells. A
//! kernel does that ahead of any process; a daemon at the consumers' own priority instead
//! gets a fair share beside them, and a consumer that polls its completion queue (perftest,
//! any latency-minded program) is always runnable, so on a two-core host the engine waited
//! for a CPU behind the very consumer waiting for it. krdmad therefore runs its threads at a
//! lower nice value than a consumer's default: weight 9548 against 1024 at -10, about nine
//! tenths of a contended CPU, without the starvation a real-time class could cause.
//!
//! Nice is per thread in Linux and a new thread inherits its creator's, so setting the
//! calling thread's before it starts any covers every thread of the daemon. Where the
//! kernel groups tasks by session (`CONFIG_SCHED_AUTOGROUP`), a group's share beside
//! other groups follows the group's own nice (`/proc/self/autogroup`): a consumer started
//! from another session sits in another group, and thread nice values do not reach
//! across groups. That is set too, but only when the session is krdmad's own (started
//! by a service manager or `setsid`): started from a shell, krdmad shares the shell's
//! group, whose nice would outlive krdmad and raise every program of that session.

use std::io;

/// krdmad's nice value unless told otherwise (`krdmad --nice`).
pub const DEFAULT_NICE: i32 = -10;

/// What [`run_ahead`] managed to set.
#[derive(Debug)]
pub struct Applied {
    /// The calling thread's nice value (inherited by the threads it starts).
    pub thread: io::Result<()>,
    /// The session's scheduling group; `Ok(false)` when the kernel has none or the
    /// session is not the caller's own.
    pub autogroup: io::Result<bool>,
}

/// Give the calling thread (and every thread it starts from now on) and, when it leads
/// its session, the session's scheduling group the nice value `nice`. Lowering it below the current value needs
/// `CAP_SYS_NICE`, so krdmad calls this before it drops its capabilities.
pub fn run_ahead(nice: i32) -> Applied {
    Applied {
        thread: set_thread_nice(nice),
        autogroup: set_autogroup_nice(nice),
    }
}

/// The calling thread's nice value.
fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority with integer arguments only; PRIO_PROCESS with a thread id
    // names that one thread in Linux.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_autogroup_nice(nice: i32) -> io::Result<bool> {
    // SAFETY: getsid and getpid take integers only and cannot fail for the caller.
    if unsafe { libc::getsid(0) != libc::getpid() } {
        return Ok(false);
    }
    match std::fs::write("/proc/self/autogroup", nice.to_string()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The nice value of thread `tid` of process `pid` (field 19 of its `stat`).
pub fn thread_nice(pid: u32, tid: u32) -> io::Result<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))?;
    crate::creds::stat_field(&stat, 19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "stat"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_raises_its_own_nice_and_its_children_inherit_it() {
        // Raising nice needs no privilege; do it on a thread of its own so the test
        // runner's threads keep theirs.
        std::thread::spawn(|| {
            let pid = std::process::id();
            // SAFETY: gettid takes no arguments and cannot fail.
            let me = unsafe { libc::gettid() } as u32;
            let before = thread_nice(pid, me).unwrap();
            let target = (before + 3).min(19);
            set_thread_nice(target).unwrap();
            assert_eq!(thread_nice(pid, me).unwrap(), target);
            let child = std::thread::spawn(move || {
                // SAFETY: as above.
                let tid = unsafe { libc::gettid() } as u32;
                thread_nice(pid, tid).unwrap()
            });
            assert_eq!(child.join().unwrap(), target, "a new thread inherits it");
        })
        .join()
        .unwrap();
    }
}
