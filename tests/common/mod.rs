#![allow(dead_code)]
pub mod sshfs;
