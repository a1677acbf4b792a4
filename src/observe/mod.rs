//! What a person (or a script) sees about a run, read from the files alone.

pub mod recover;
pub mod status;
