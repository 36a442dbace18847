//! The C interface: `include/it_api.h` compiled by the system C compiler, programs linked
//! against the `libitapi.so` built with the tests.
//!
//! * every structure libitapi reads or writes has the size and member offsets the C
//!   compiler gives it;
//! * `tests/c/itapi_pingpong.c`, a plain IT-API program, connects, ping-pongs Sends, does
//!   an RDMA Write and an RDMA Read with verification, and disconnects — server and client
//!   in separate processes, over siw0 and rxe0 (`ITAPI_IA`), through both front doors;
//! * `tests/c/itapi_api.c`: the calls that need no peer, and hostile input, on each
//!   device;
//! * `tests/c/itapi_wait_dto.c`, issue 10's lost wake-up: one DTO EVD for both queues,
//!   each 1 MiB RDMA Write and Read waited for with `it_evd_wait`, with and without
//!   `IT_EVD_CREATE_FD`.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn include_dir() -> PathBuf {
    repo().join("api/itapi/include")
}

/// The directory holding `libitapi.so` (built as a dependency of these tests).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        if dir.join("libitapi.so").exists() {
            return dir.to_path_buf();
        }
    }
    panic!("libitapi.so not found next to {}", exe.display());
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("krdma-itapi-c-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compile `src` (C) into `out` against the header and libitapi; panics with the
/// compiler's output on failure.
fn cc(src: &Path, out: &Path) {
    let lib = lib_dir();
    let o = Command::new("cc")
        .args(["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(include_dir())
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg("-litapi")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        // An RPATH, not a RUNPATH: it wins over LD_LIBRARY_PATH, which cargo and nextest
        // set with the profile directory in it — whose uplifted libitapi.so is a copy
        // that only `cargo build -p krdma-itapi-capi` refreshes, not a test build.
        .arg("-Wl,--disable-new-dtags")
        .output()
        .expect("run cc (the C compiler)");
    assert!(
        o.status.success(),
        "cc failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn itapi_c_layouts_match_the_header() {
    let rows = itapi::layout();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <it_api.h>\nint main(void) {\n",
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
    eprintln!("{} sizes and offsets agree", rows.len());
    let _ = std::fs::remove_dir_all(dir);
}

/// The functions `it_api.h` declares (names followed by `(` outside preprocessor lines
/// and function-pointer typedefs).
fn declared_functions() -> Vec<String> {
    let header = std::fs::read_to_string(include_dir().join("it_api.h")).unwrap();
    let mut names = Vec::new();
    for line in header.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let bytes = line.as_bytes();
        let mut i = 0;
        while let Some(at) = line[i..].find("it") {
            let start = i + at;
            let fresh = start == 0
                || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
            let end = start
                + line[start..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(line.len() - start);
            let name = &line[start..end];
            let called = line[end..].trim_start().starts_with('(');
            if fresh && called && (name.starts_with("it_") || name.starts_with("itx_")) {
                names.push(name.to_string());
            }
            i = end.max(start + 2);
        }
    }
    names.sort();
    names.dedup();
    names
}

/// The symbol names (demangled) defined in the object file at `path`.
fn defined_symbols(path: &Path) -> Vec<String> {
    let out = Command::new("nm")
        .args(["--defined-only", "-C"])
        .arg(path)
        .output()
        .expect("nm (binutils)");
    assert!(out.status.success(), "nm {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn libitapi_links_no_fuse_front_door() {
    // The layering (docs/architecture.md): a consumer library reaches the kAL in its own
    // process at most (embedded mode), never the daemon's FUSE front door.
    let daemon_only = |s: &String| s.contains("fuser::") || s.contains("kal::fuse::");
    let lib = defined_symbols(&lib_dir().join("libitapi.so"));
    assert!(
        lib.iter().any(|s| s.contains("it_ia_create")) && lib.iter().any(|s| s.contains("ual::")),
        "libitapi.so's symbol table is not there to check (stripped?)"
    );
    let fuse: Vec<&String> = lib.iter().filter(|s| daemon_only(s)).take(5).collect();
    assert!(fuse.is_empty(), "libitapi.so links FUSE code: {fuse:?}");
    // The same names are found where they belong, so the check above can fail.
    let daemon = defined_symbols(&krdma_tests::krdmad_bin());
    assert!(
        daemon.iter().any(daemon_only),
        "krdmad has no FUSE symbols?"
    );
}

#[test]
fn itapi_c_every_declared_function_links() {
    let names = declared_functions();
    assert!(names.len() >= 80, "{names:?}");
    let mut c = String::from("#include <it_api.h>\nvoid *itapi_all[] = {\n");
    for n in &names {
        c += &format!("    (void *)&{n},\n");
    }
    c += "};\nint main(void) { return itapi_all[0] == 0; }\n";
    let dir = scratch("symbols");
    let (src, bin) = (dir.join("symbols.c"), dir.join("symbols"));
    std::fs::write(&src, c).unwrap();
    cc(&src, &bin);
    assert!(Command::new(&bin).status().unwrap().success());
    eprintln!(
        "{} functions declared by it_api.h, all exported by libitapi",
        names.len()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Build `tests/c/<name>.c`.
fn c_program(name: &str) -> PathBuf {
    let bin = scratch(name).join(name);
    cc(&repo().join(format!("tests/c/{name}.c")), &bin);
    bin
}

/// A C program on `case`'s device and front door. In embedded mode each process has its
/// own kAL, whose rxe0 needs an address no other process uses (`n` tells them apart).
fn c_command(bin: &Path, case: &Case, n: u8) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env("KRDMA_DEVICE", case.device_env())
        .env("ITAPI_IA", case.dev)
        .env(
            "KRDMA_RXE_ADDR",
            krdma_tests::private_loopback(150 + n).to_string(),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Wait for `child` up to `limit` (kill it and fail if it runs longer), collecting what
/// `output` (its stdout, or the rest of it) says.
fn finish(
    mut child: Child,
    output: impl Read + Send + 'static,
    what: &str,
    limit: Duration,
) -> String {
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let mut output = output;
        let _ = output.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = reader.join().unwrap();
    assert!(status.success(), "{what} failed ({status}); output:\n{out}");
    out
}

itapi_tests! {
    fn itapi_c_pingpong_program(case) {
        let bin = c_program("itapi_pingpong");
        let mut server = c_command(&bin, case, 0).arg("server").spawn().unwrap();
        let mut out = BufReader::new(server.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).unwrap();
        let (port, addr) = first
            .trim()
            .strip_prefix("LISTENING ")
            .and_then(|rest| rest.split_once(' '))
            .unwrap_or_else(|| panic!("server said {first:?}"));
        let (port, addr) = (port.to_string(), addr.to_string());
        let mut client = c_command(&bin, case, 1)
            .args(["client", &addr, &port])
            .spawn()
            .unwrap();
        let client_out = client.stdout.take().unwrap();
        let limit = Duration::from_secs(60);
        let client_out = finish(client, client_out, "C client", limit);
        assert!(
            client_out.contains("CLIENT OK"),
            "client output:\n{client_out}"
        );
        let server_out = finish(server, out, "C server", limit);
        assert!(
            server_out.contains("SERVER OK"),
            "server output:\n{server_out}"
        );
        eprintln!("C program ok over {} through {}", case.dev, case.door.name());
    }

    // Issue 10's program: one DTO EVD for both queues, a receive posted before the
    // connection, then "post one DTO, it_evd_wait for it" with 1 MiB RDMA Writes and
    // Reads, with and without IT_EVD_CREATE_FD. A lost wake-up hangs a wait until its
    // timeout, and the program fails.
    fn itapi_c_wait_for_each_dto(case) {
        let bin = c_program("itapi_wait_dto");
        for evd_fd in ["0", "1"] {
            let mut server = c_command(&bin, case, 3)
                .env("ITAPI_EVD_FD", evd_fd)
                .arg("server")
                .spawn()
                .unwrap();
            let mut out = BufReader::new(server.stdout.take().unwrap());
            let mut first = String::new();
            out.read_line(&mut first).unwrap();
            let (port, addr) = first
                .trim()
                .strip_prefix("LISTENING ")
                .and_then(|rest| rest.split_once(' '))
                .unwrap_or_else(|| panic!("server said {first:?}"));
            let (port, addr) = (port.to_string(), addr.to_string());
            let mut client = c_command(&bin, case, 4)
                .env("ITAPI_EVD_FD", evd_fd)
                .args(["client", &addr, &port, "20"])
                .spawn()
                .unwrap();
            let client_out = client.stdout.take().unwrap();
            let limit = Duration::from_secs(120);
            let client_out = finish(client, client_out, "C client", limit);
            assert!(client_out.contains("CLIENT OK"), "client output:\n{client_out}");
            let server_out = finish(server, out, "C server", limit);
            assert!(server_out.contains("SERVER OK"), "server output:\n{server_out}");
            eprintln!(
                "wait-per-DTO program ok over {} through {} (IT_EVD_CREATE_FD: {evd_fd})",
                case.dev,
                case.door.name()
            );
        }
    }

    fn itapi_c_api_calls_and_hostile_input(case) {
        let bin = c_program("itapi_api");
        let mut child = c_command(&bin, case, 2).spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let out = finish(child, out, "C API program", Duration::from_secs(60));
        assert!(out.contains("API OK"), "output:\n{out}");
    }
}
