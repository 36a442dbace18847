//! siw (being written)
