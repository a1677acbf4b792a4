//! The environment a command sees. Every placeholder value is also exported as the
//! `RL_NODE_*` variable listed in `config::template::PLACEHOLDERS`; the training command
//! additionally gets the variables torchrun and llamafactory-cli read.

use crate::config::template::PLACEHOLDERS;
pub use crate::config::template::TORCHRUN_ENV;

use std::collections::BTreeMap;

pub fn env_for(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    PLACEHOLDERS
        .iter()
        .filter_map(|(name, env, _)| values.get(name).map(|v| (env.to_string(), v.clone())))
        .collect()
}

pub fn torchrun_env(values: &BTreeMap<&'static str, String>) -> Vec<(String, String)> {
    TORCHRUN_ENV
        .iter()
        .map(|(env, key, _)| {
            (
                env.to_string(),
                values.get(key).cloned().unwrap_or_default(),
            )
        })
        .collect()
}

/// Training processes on this node (`cluster.gpus-per-node`) and where the number came
/// from: a number as given; "auto": the devices in `CUDA_VISIBLE_DEVICES` when set, else
/// the GPUs `nvidia-smi --list-gpus` lists, else 1 (no GPU: one CPU process).
pub fn nproc_per_node(setting: &str) -> (u32, String) {
    if let Ok(n) = setting.trim().parse::<u32>() {
        return (n, "cluster.gpus-per-node".into());
    }
    if let Ok(devices) = std::env::var("CUDA_VISIBLE_DEVICES") {
        let n = devices.split(',').filter(|d| !d.trim().is_empty()).count() as u32;
        if n > 0 {
            return (n, format!("CUDA_VISIBLE_DEVICES={devices}"));
        }
    }
    match list_gpus() {
        Some(n) if n > 0 => (n, "nvidia-smi --list-gpus".into()),
        _ => (1, "no GPU found".into()),
    }
}

/// GPUs `nvidia-smi --list-gpus` lists; None without nvidia-smi, on failure, or after
/// 30 s (a wedged driver must not keep the node from starting). Waits on its child
/// itself: call it before the node's reaper thread starts.
fn list_gpus() -> Option<u32> {
    let (exit, out) = crate::process::capture(
        "nvidia-smi",
        &["--list-gpus"],
        std::time::Duration::from_secs(30),
    )?;
    if exit != crate::process::ChildExit::Success {
        return None;
    }
    let out = String::from_utf8_lossy(&out);
    Some(out.lines().filter(|l| l.starts_with("GPU ")).count() as u32)
}

/// This host's first IP address that is not loopback or link-local, IPv4 before IPv6, in
/// interface order: the address `hostname -I` prints first.
pub fn first_ip_address() -> Option<String> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut found: Vec<IpAddr> = Vec::new();
    // SAFETY: getifaddrs fills a list that is read here and freed once: each node and its
    // address are read only when non-null and before the free, and an address is read as a
    // sockaddr_in or sockaddr_in6 only when its sa_family says that is what it is.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return None;
        }
        let mut cur = head;
        while !cur.is_null() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() {
                match (*addr).sa_family as i32 {
                    libc::AF_INET => {
                        let a = &*(addr as *const libc::sockaddr_in);
                        found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let a = &*(addr as *const libc::sockaddr_in6);
                        found.push(IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    let usable = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified(),
        IpAddr::V6(v6) => {
            !v6.is_loopback() && !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80
        }
    };
    found
        .iter()
        .find(|ip| ip.is_ipv4() && usable(ip))
        .or_else(|| found.iter().find(|ip| usable(ip)))
        .map(|ip| ip.to_string())
}
