//! # krdma-mlx — real verbs devices through rdma-core
//!
//! The provider for devices the host's own RDMA stack drives — a ConnectX (`mlx5_0`),
//! or the Linux kernel's soft devices (`rxe0`, `siw0`) — through rdma-core's libibverbs
//! and librdmacm. It has the two halves of the RNIC-PI:
//!
//! * **Kernel half** ([`kernel_devices`]): one [`rnicpi::Provider`] per device libibverbs
//!   lists, named `ibv-<name>` (`ibv-rxe0`, `ibv-mlx5_0`: never clashing with krdma's own
//!   `siw0`/`rxe0`). It reports what `ibv_query_device` says (transport iWARP for
//!   `IBV_TRANSPORT_IWARP`, else IB), ports from `ibv_query_port` and the GID table
//!   (`ibv_query_gid`, zero GIDs skipped, netdev from sysfs `gid_attrs/ndevs`), counters
//!   from sysfs (`ports/N/counters`, `hw_counters`), and
//!   `fast_path: FastPath::Consumer { driver: "ibverbs", device: <name> }`. It creates
//!   nothing (`Unsupported`): a hardware queue lives in memory mapped into the process that
//!   created it, so the consumer's process creates every object through the user half and
//!   the kAL only mirrors them (limits, quotas, `krdma stat`, teardown).
//! * **User half** ([`user_provider`], [`Ibverbs`], driver `ibverbs`): `open` opens the
//!   device (`ibv_context`), one completion channel, an rdma_cm event channel, and a thread
//!   that `poll(2)`s the completion channel, the context's async fd and the rdma_cm channel
//!   and delivers `CqNotify`, the affiliated/unaffiliated asynchronous events and the
//!   connection events to the [`rnicpi::EventSink`] of the object concerned. PD, MR, CQ, QP,
//!   SRQ and memory window (type 2, `ibv_alloc_mw`, where the device has them: the kernel
//!   half reports `memory_windows` from `ibv_query_device`) are libibverbs objects; a
//!   `BindMw` request becomes `IBV_WR_BIND_MW` with the window and registration its PD
//!   knows by key; `post_send`/`post_recv` turn [`rnicpi::Wqe`]s into
//!   `ibv_send_wr`/`ibv_recv_wr` chains, `poll` turns `ibv_wc` into [`rnicpi::Cqe`], `modify`
//!   turns [`rnicpi::QpAttr`] + mask into `ibv_qp_attr` + `IBV_QP_*` (address vector with a
//!   GRH from port 1, path MTU in bytes → `IBV_MTU_*`), so `ual::oob` brings an RC QP to
//!   RTS on an IB/RoCE device exactly as `ibv_rc_pingpong` does. `connect`/`listen`/
//!   `accept` go through librdmacm with the QP created by `ibv_create_qp` (module `cm`).
//!
//! ## Why rdma-mummy-sys
//!
//! The binding is `rdma-mummy-sys` (as used by `sideway`): its build compiles small static
//! stubs that `dlopen("libibverbs.so.1")` / `dlopen("librdmacm.so.1")` when the process
//! starts, so krdma builds and runs on hosts without rdma-core (the calls then fail with
//! `EOPNOTSUPP`/NULL and [`kernel_devices`] is empty), and it provides the inline verbs of
//! `verbs.h` (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`, ...) as Rust functions
//! calling through the context's ops table. It is maintained against current rdma-core.
//! `rdma-core-sys` 0.1.x, the alternative, links libibverbs at build time (no binary
//! without rdma-core installed) and dates from 2017 (no extended verbs, stale structs).
//! Every `unsafe` block of the crate is in [`sys`] (and the unit tests of `conv`, which
//! read back the unions they wrote).
//!
//! ## What a ConnectX host would add
//!
//! The soft devices (kernel rxe/siw) need none of this; on a ConnectX the provider would,
//! behind capability checks (`ibv_query_device_ex`): place small queues or buffers in device
//! memory (`ibv_alloc_dm`), register on-demand-paging memory (ODP, `IBV_ACCESS_ON_DEMAND`)
//! instead of pinning, use the extended verbs (`ibv_create_cq_ex`/`ibv_wr_*` on
//! `ibv_qp_ex`, completion timestamps), and rely on the real doorbells and BlueFlame writes
//! mlx5's libibverbs provider already does in `ibv_post_send`.

mod cm;
mod conv;
mod kernel;
pub mod sys;
mod user;

pub use cm::{IbvListener, IB_PRIVATE_DATA, IWARP_PRIVATE_DATA};
pub use kernel::{kernel_devices, IbvKernelDevice, NAME_PREFIX};
pub use user::{
    user_provider, IbvCq, IbvDevice, IbvMr, IbvMw, IbvPd, IbvQp, IbvSrq, Ibverbs, DRIVER,
};

/// The names of the devices libibverbs lists (empty without libibverbs).
pub fn ibv_device_names() -> Vec<String> {
    sys::list_devices().into_iter().map(|d| d.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rnicpi::user::UserProvider;
    use std::process::Command;

    /// The marker the child prints when it ran.
    const CHILD_OK: &str = "krdma-mlx child: devices=0 ok";

    #[test]
    fn no_device_lists_nothing() {
        // This host (and CI) has libibverbs but no RDMA device; where one exists, each
        // device must come out under its `ibv-` name.
        let names = ibv_device_names();
        let devs = kernel_devices();
        assert_eq!(devs.len(), names.len());
        for (d, n) in devs.iter().zip(&names) {
            assert_eq!(d.attr().name, format!("ibv-{n}"));
            assert!(matches!(
                d.attr().fast_path,
                rnicpi::FastPath::Consumer { .. }
            ));
        }
        if names.is_empty() {
            assert!(Ibverbs.open("rxe0").is_err());
        }
    }

    /// Run by `without_libibverbs_lists_nothing` inside a mount namespace where the library
    /// is /dev/null.
    #[test]
    fn child_without_libibverbs() {
        if std::env::var_os("KRDMA_MLX_CHILD").is_none() {
            return;
        }
        if let Some(lib) = std::env::var_os("KRDMA_MLX_HIDDEN") {
            let len = std::fs::metadata(lib).map(|m| m.len()).unwrap_or(0);
            assert_eq!(len, 0, "the library is not hidden");
        }
        assert!(kernel_devices().is_empty());
        assert!(ibv_device_names().is_empty());
        assert!(user_provider().open("rxe0").is_err());
        println!("{CHILD_OK}");
    }

    #[test]
    fn without_libibverbs_lists_nothing() {
        // Root? (read from /proc: keeps `unsafe` out of this module)
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let root = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0");
        if !root {
            eprintln!("skipped: needs root for a private mount namespace (unshare -m)");
            return;
        }
        let lib = [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
        ]
        .iter()
        .map(|d| std::path::Path::new(d).join(sys::IBVERBS_SONAME))
        .find(|p| p.exists());
        let Some(lib) = lib else {
            // Nothing to hide: the library is already missing, and the test above ran
            // without it.
            eprintln!("skipped: {} is not installed", sys::IBVERBS_SONAME);
            return;
        };
        let lib = std::fs::canonicalize(&lib).unwrap();
        let exe = std::env::current_exe().unwrap();
        let out = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg("mount --bind /dev/null \"$1\" && exec \"$2\" --exact tests::child_without_libibverbs --nocapture --test-threads 1")
            .arg("sh")
            .arg(&lib)
            .arg(&exe)
            .env("KRDMA_MLX_CHILD", "1")
            .env("KRDMA_MLX_HIDDEN", &lib)
            .output()
            .expect("run unshare");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && stderr.contains("unshare failed") {
            assert!(
                std::env::var_os("CI").is_none(),
                "unshare -m failed under CI: {stderr}"
            );
            eprintln!("skipped: no mount namespace here: {stderr}");
            return;
        }
        assert!(out.status.success(), "child failed: {stdout}\n{stderr}");
        assert!(
            stdout.contains(CHILD_OK),
            "child did not run: {stdout}\n{stderr}"
        );
    }
}
