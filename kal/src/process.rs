//! Daemon-side peer (being written).
