//! FUSE front door (being written).
