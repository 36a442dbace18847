//! `dat.conf` lines for krdma's DAT provider (`libdaplkrdma.so`), one per device, and
//! their idempotent installation into a `dat.conf` (`krdma dat-conf`).
//!
//! A line is what Debian's libdat2 matches exactly: the IA name (`krdma-<device>`), API
//! `u2.0`, `nonthreadsafe`, `default`, the library's absolute path, a provider version,
//! and the device as the IA parameters.

use std::path::Path;

/// The IA-name prefix of krdma's entries.
pub const PREFIX: &str = "krdma-";

/// One `dat.conf` line per device.
pub fn lines(devices: &[String], lib: &Path) -> String {
    devices
        .iter()
        .map(|d| {
            format!(
                "{PREFIX}{d} u2.0 nonthreadsafe default {} dapl.2.0 \"{d}\" \"\"\n",
                lib.display()
            )
        })
        .collect()
}

/// `existing` with every krdma entry replaced by `ours` (other providers' lines and
/// comments kept, in order); installing twice gives the same file.
pub fn merge(existing: &str, ours: &str) -> String {
    let mut out: String = existing
        .lines()
        .filter(|l| !l.trim_start().starts_with(PREFIX))
        .map(|l| format!("{l}\n"))
        .collect();
    out.push_str(ours);
    out
}

/// Write `ours` into the file at `conf` (created if missing); `true` when it changed.
pub fn install(conf: &Path, ours: &str) -> std::io::Result<bool> {
    let existing = match std::fs::read_to_string(conf) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let merged = merge(&existing, ours);
    if merged == existing {
        return Ok(false);
    }
    let tmp = conf.with_extension("krdma-tmp");
    std::fs::write(&tmp, &merged)?;
    std::fs::rename(&tmp, conf)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datconf_install_is_idempotent_and_keeps_other_providers() {
        let dir = std::env::temp_dir().join(format!("krdma-datconf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("dat.conf");
        let other = "# sample\nofa-v2-ib0 u2.0 nonthreadsafe default libdaplofa.so.2 dapl.2.0 \"ib0 0\" \"\"\n";
        std::fs::write(&conf, other).unwrap();
        let ours = lines(
            &["siw0".into(), "rxe0".into()],
            Path::new("/opt/libdaplkrdma.so"),
        );
        assert!(ours.starts_with(
            "krdma-siw0 u2.0 nonthreadsafe default /opt/libdaplkrdma.so dapl.2.0 \"siw0\" \"\"\n"
        ));
        assert!(install(&conf, &ours).unwrap());
        let once = std::fs::read_to_string(&conf).unwrap();
        assert!(
            !install(&conf, &ours).unwrap(),
            "second install changes nothing"
        );
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), once);
        assert!(once.starts_with(other));
        assert_eq!(once.matches("krdma-").count(), 2);
        // A new library path replaces the old entries.
        let moved = lines(&["siw0".into()], Path::new("/usr/lib/libdaplkrdma.so"));
        assert!(install(&conf, &moved).unwrap());
        let now = std::fs::read_to_string(&conf).unwrap();
        assert_eq!(now.matches("krdma-").count(), 1);
        assert!(now.contains("/usr/lib/libdaplkrdma.so"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
