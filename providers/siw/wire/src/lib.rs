//! iWARP wire formats (being written).
