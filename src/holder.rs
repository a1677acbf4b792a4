//! Who holds a rank: a process named by its host, its machine, its pid and its start time.
//!
//! A pid alone is not an identity: after a `kill -9` the kernel may give the dead node's pid
//! to an unrelated process, and a restart that asked only "is pid P alive?" would refuse
//! forever. The start time (clock ticks since boot, `/proc/<pid>/stat` field 22) of the
//! process that now has pid P tells the two apart. The machine id (the kernel's boot id and
//! the pid namespace) says whether the record was written on this very machine and
//! namespace, where the kernel can be asked at all: a host name may be shared by
//! containers on different machines, and a reboot restarts pids. Elsewhere, liveness is
//! judged by watching the holder's heartbeat sequence advance (`node::join`).

use serde::{Deserialize, Serialize};

/// The identity a node writes into its records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ProcessId {
    pub host: String,
    /// Boot id and pid namespace of the machine the process runs on.
    pub machine: String,
    pub pid: u32,
    /// Start time of the process in clock ticks since boot.
    pub start: u64,
}

/// What the kernel of this machine says about a recorded holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// The recorded process is running (same pid, same start time, not a zombie).
    Alive,
    /// Gone: no such pid, a zombie, or the pid now belongs to another process.
    Gone,
    /// The record was written on another machine (or namespace): ask its heartbeat.
    Elsewhere,
}

/// The process that stands for this node to the outside: this process, or, when the node
/// runs under its supervisor (`node::supervisor`), the supervisor, which lives exactly as
/// long as the node can still act. Set once, before the node writes any record.
static NODE_PROCESS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Record that `pid` (the supervisor) stands for this process.
pub fn set_node_process(pid: u32) {
    let _ = NODE_PROCESS.set(pid);
}

/// The pid records name for this node: the supervisor's, else this process's.
pub fn node_process() -> u32 {
    NODE_PROCESS.get().copied().unwrap_or_else(std::process::id)
}

/// This node's process as its records name it (see [`node_process`]).
pub fn this_process() -> ProcessId {
    let pid = node_process();
    ProcessId {
        host: gethostname::gethostname().to_string_lossy().into_owned(),
        machine: machine_id(),
        pid,
        start: start_time(pid).unwrap_or(0),
    }
}

/// The kernel's boot id and this process's pid namespace: equal for two processes exactly
/// when they can see each other's pids.
pub fn machine_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{boot}/{ns}")
}

/// Start time of `pid` (clock ticks since boot), `None` when there is no such process or
/// it is a zombie (dead, not yet reaped).
pub fn start_time(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); field 22 (starttime) is at index 19.
    if fields.first() == Some(&"Z") || fields.first() == Some(&"X") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Ask this machine's kernel about a recorded holder.
pub fn local(holder: &ProcessId) -> Local {
    let me = this_process();
    if holder.host != me.host || holder.machine.is_empty() || holder.machine != me.machine {
        return Local::Elsewhere;
    }
    if holder.pid == me.pid && holder.start == me.start {
        // Ourselves: not another holder.
        return Local::Gone;
    }
    match start_time(holder.pid) {
        Some(t) if t == holder.start => Local::Alive,
        _ => Local::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_pid_is_not_the_holder() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut holder = ProcessId {
            pid,
            start: start_time(pid).unwrap(),
            ..this_process()
        };
        assert_eq!(local(&holder), Local::Alive);
        // The same pid with another start time is another process.
        holder.start += 1;
        assert_eq!(local(&holder), Local::Gone);
        holder.start -= 1;
        // Another machine (or namespace): the kernel here cannot tell.
        let elsewhere = ProcessId {
            machine: "other-boot/pid:[1]".into(),
            ..holder.clone()
        };
        assert_eq!(local(&elsewhere), Local::Elsewhere);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(local(&holder), Local::Gone);
        assert_eq!(local(&this_process()), Local::Gone);
    }
}
