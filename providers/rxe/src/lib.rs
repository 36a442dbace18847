//! the software RoCEv2 provider — placeholder.
//!
//! Nothing here works yet; this crate only reserves its place in the workspace layout.
//! The work is tracked in issue 4.
