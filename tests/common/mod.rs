#![allow(dead_code)]
pub mod sshfs;
pub mod cluster;
