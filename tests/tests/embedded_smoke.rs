//! The uAL over the embedded kAL: context, devices, PD/CQ/MR lifecycle and stats.

use ual::{Context, Target, VerbsError};

#[test]
fn embedded_context_lifecycle() {
    krdma_tests::setup_embedded();
    let ctx = Context::open_target(&Target::Embedded).unwrap();
    let (head, rows) = ctx.stat_contexts().unwrap();
    assert!(head.total >= 1);
    assert!(rows
        .iter()
        .any(|r| r.id == ctx.id() && r.pid == std::process::id()));
    assert_eq!(ctx.alloc_pd(99).err(), Some(VerbsError::NoSuchResource));
}
