//! Sequences of peer FPDUs and consumer requests through a siw QP engine connected over
//! memory (`siw::harness`): STags, tagged offsets, MSNs and sizes near the registered
//! ones, Read Requests, Read Responses aimed at the reads outstanding, Terminates, Sends
//! into posted receives, raw bytes, a socket that fills up, closes. Oracle: no panic,
//! and no write outside what the operation under way may touch — every registration is
//! a guarded buffer whose accessor checks each write against the ranges open at that
//! moment, and whose guards (and, for read-only registrations, contents) are checked
//! after each action.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| siw::harness::run(data));
