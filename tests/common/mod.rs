#![allow(dead_code)]
pub mod cluster;
pub mod smallfs;
pub mod sshfs;
