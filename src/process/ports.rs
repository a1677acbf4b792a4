//! Who listens on a TCP port: a server left over from an earlier run (run.sh's vLLM still
//! on 8999) makes the node's own server fail to start, and "port in use" alone sends the
//! user hunting with `ss` or `lsof` on every machine. The kernel says which socket
//! listens (`/proc/net/tcp`, `/proc/net/tcp6`: local port, state, inode) and which
//! process holds that socket (`/proc/PID/fd/*` links to `socket:[INODE]`), so the refusal
//! can name the pid. Processes of other users cannot be looked into without privileges:
//! then the port is only known to be held.

use std::collections::BTreeSet;
use std::fs;

/// The kernel's state number of a listening TCP socket.
const TCP_LISTEN: &str = "0A";

/// One process holding a listening socket on the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub pid: u32,
    /// Its command line (arguments joined by spaces), or its `comm` when that is empty.
    pub command: String,
}

/// The inodes of the sockets listening on `port` (IPv4 and IPv6) in `table`'s text.
fn listening_inodes(table: &str, port: u16) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
        if f.len() < 10 || f[3] != TCP_LISTEN {
            continue;
        }
        let local_port = f[1]
            .rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok());
        if local_port == Some(port) {
            if let Ok(inode) = f[9].parse::<u64>() {
                if inode != 0 {
                    out.insert(inode);
                }
            }
        }
    }
    out
}

fn command_of(pid: u32) -> String {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        // One line in the message, no terminal escapes from another process's arguments.
        .map(|w| {
            String::from_utf8_lossy(w)
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect()
        })
        .collect();
    if !words.is_empty() {
        return words.join(" ");
    }
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default()
}

/// The processes (that this user may look into) listening on TCP `port`.
pub(crate) fn listeners(port: u16) -> Vec<Holder> {
    let mut inodes = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = fs::read_to_string(table) {
            inodes.extend(listening_inodes(&text, port));
        }
    }
    if inodes.is_empty() {
        return Vec::new();
    }
    let wanted: BTreeSet<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    let mut out = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            fs::read_link(fd.path())
                .ok()
                .and_then(|t| t.to_str().map(|t| wanted.contains(t)))
                .unwrap_or(false)
        });
        if holds {
            out.push(Holder {
                pid,
                command: command_of(pid),
            });
        }
    }
    out.sort_by_key(|h| h.pid);
    out
}

/// "pid 1234 (vllm serve …)", for each holder, or why none is named.
pub(crate) fn describe(port: u16) -> String {
    let holders = listeners(port);
    if holders.is_empty() {
        return "by a process this user cannot look into (another user's; `sudo ss -ltnp` names it)".into();
    }
    let named: Vec<String> = holders
        .iter()
        .map(|h| {
            let mut cmd = h.command.clone();
            if cmd.chars().count() > 200 {
                cmd = cmd.chars().take(200).collect::<String>() + "…";
            }
            format!("pid {} ({cmd})", h.pid)
        })
        .collect();
    format!("by {}", named.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_sockets_are_found_by_port_and_state() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:2327 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:2327 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0000000000000000 20 4 30 10 -1
   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4444 1 0000000000000000 100 0 0 10 0
";
        // 0x2327 = 8999: the listener, not the connection to it; 0x1F90 = 8080.
        assert_eq!(listening_inodes(table, 8999), BTreeSet::from([4242]));
        assert_eq!(listening_inodes(table, 8080), BTreeSet::from([4444]));
        assert!(listening_inodes(table, 9000).is_empty());
    }
}
