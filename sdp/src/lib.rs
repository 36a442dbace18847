//! SDP and the offload switch — placeholder.
//!
//! Nothing here works yet; this crate only reserves its place in the workspace layout.
//! The work is tracked in issue (to be filed).
