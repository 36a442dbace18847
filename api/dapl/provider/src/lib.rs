//! # libdaplkrdma — krdma's DAT 2.0 provider for the system's `libdat2`
//!
//! Unmodified uDAPL programs (Debian's `dtest`, `dtestcm`, `dtestsrq`, `dapltest`, MPI
//! and storage stacks written to DAT) open krdma's devices through the DAT registry:
//! a `dat.conf` line names this library (`krdma dat-conf` prints them), libdat2 loads
//! it and calls [`dat_provider_init`](registry::dat_provider_init), which registers one
//! `DAT_PROVIDER` table per name; every later call arrives through that table.
//!
//! * **Handles** (`handles`): pointers to blocks whose first word is the table, never
//!   freed or reused, looked up in a table before use — garbage, stale and wrong-kind
//!   handles get `DAT_INVALID_HANDLE`.
//! * **The boundary** (`boundary`): no panic crosses into C, null and misaligned
//!   pointers are refused, every error is a DAT code.
//! * **Progress** needs no calls from the consumer: data placement and connection
//!   handling run in the stack's own threads (the provider engines, the uAL event
//!   thread), so `dtest -W` (spinning on memory) and `dtestcm` (polling) work.
//! * **Thread safety**: registered `nonthreadsafe` (what Debian's consumers ask for),
//!   safe from any number of threads anyway.
//! * **Loading**: linked "nodelete", so libdat2's `dlclose` after the last IA keeps it
//!   mapped, with its threads' code; init and fini run again at each cycle.
//!
//! The objects behind the handles are `krdma-dapl`'s (the Rust API), which stand on
//! the core they share with IT-API.

mod boundary;
mod ep;
mod evd;
mod ext;
mod handles;
mod ia;
mod log;
mod mem;
pub mod registry;
mod sp;
pub mod sys;
mod ud;
mod vtable;
