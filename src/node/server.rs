//! The inference server's lifecycle (vLLM or a stand-in): started on the current model
//! before the first rollout, stopped in phase 7 (then, optionally, waiting for GPU memory
//! to drain), restarted in phase 12 on the model phase 11 published.
//!
//! A server only counts as started when its health URL answers 2xx. A port that is
//! already taken is refused before starting: a server left over from an earlier run would
//! otherwise answer the health check and serve the wrong model. A server that dies while
//! it should be serving stops the cluster like any failed command.

use super::procs::ChildExit;
use super::{Interrupt, Node, Stop};
use crate::checkpoint;
use crate::config::Template;
use crate::protocol::AbortKind;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(super) struct Server {
    pub pid: i32,
    pub log: PathBuf,
}

fn port_in_use(port: u16) -> bool {
    let connect = ("127.0.0.1", port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_millis(300)).is_ok());
    connect || TcpListener::bind(("0.0.0.0", port)).is_err()
}

fn healthy(agent: &ureq::Agent, url: &str) -> bool {
    agent.get(url).call().is_ok_and(|r| r.status().is_success())
}

impl Node {
    fn server_enabled(&self) -> bool {
        !self.cfg.server.command.trim().is_empty() && !self.debug_mode
    }

    /// Start the server on `self.model` and wait until it is healthy.
    pub(super) fn start_server(&mut self) -> Result<(), Stop> {
        if !self.server_enabled() || self.server.is_some() {
            return Ok(());
        }
        let port = self.cfg.server.port;
        self.watchdog.pet("checking the server port");
        if port_in_use(port) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!(
                    "server port {port} is already in use: another process (perhaps a server left over from an earlier run) is listening; stop it or change server.port"
                ),
                None,
            ));
        }
        let model = self.model.clone();
        if Path::new(&model).join(checkpoint::MANIFEST).exists() {
            self.watchdog.pet("verifying the model");
            let wd = self.watchdog.clone();
            if let Err(e) =
                checkpoint::verify(Path::new(&model), &mut || wd.pet("verifying the model"))
            {
                return Err(self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!("refusing to start the server on an unverified model: {e}"),
                    None,
                ));
            }
        }
        let values = self.values("server", None, Path::new(&model));
        let command = Template::parse(&self.cfg.server.command)
            .expect("validated at load")
            .render(&values);
        let url = Template::parse(&self.cfg.server.health_url)
            .expect("validated at load")
            .render_raw(&values);
        let env = self.command_env(&values);
        let log = self.layout.phase_log(self.iteration, self.rank, "server");
        let label = self.model_label();
        let header = format!("rank {} server on {label}", self.rank);
        let running = self.spawn_supervised("the server", &command, &env, &log, &header)?;
        let pid = running.pid;
        self.info(&format!(
            "server starting on {label} (pid {pid}, port {port}, log {})",
            log.display()
        ));
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        self.waiting_note = format!("the server (pid {pid}) to answer {url}");
        let deadline = running.started + self.cfg.server.start_timeout;
        let waited = self.wait_for(deadline, |n| {
            if let Some(exit) = n.exited.remove(&pid) {
                return Err(n.fail(
                    AbortKind::CommandFailed {
                        exit: exit.to_string(),
                    },
                    n.rank,
                    None,
                    format!("the server exited with {exit} while starting"),
                    Some(&log),
                ));
            }
            Ok(healthy(&agent, &url).then_some(()))
        });
        self.waiting_note.clear();
        match waited {
            Ok(()) => {}
            Err(Interrupt::Stop(s)) => return Err(s),
            Err(Interrupt::Deadline) => {
                self.registry.stop(pid, self.cfg.server.stop_grace);
                // A server that never becomes healthy is this node's failure (exit 1), not a
                // cluster deadline.
                return Err(self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!(
                        "the server did not answer {url} with 2xx within server.start-timeout ({})",
                        humantime::format_duration(self.cfg.server.start_timeout)
                    ),
                    Some(&log),
                ));
            }
        }
        self.info(&format!(
            "server healthy after {:.2}s",
            running.started.elapsed().as_secs_f64()
        ));
        self.event(serde_json::json!({"event": "server-start", "model": model, "secs": running.started.elapsed().as_secs_f64()}));
        self.server = Some(Server { pid, log });
        Ok(())
    }

    /// Stop the server: SIGTERM to its group, `stop-grace`, SIGKILL; then make sure the
    /// port is free and, if configured, that GPU memory drained.
    pub(super) fn stop_server(&mut self) -> Result<(), Stop> {
        let Some(server) = self.server.take() else {
            return Ok(());
        };
        self.watchdog.pet("stopping the server");
        let started = Instant::now();
        self.registry.stop(server.pid, self.cfg.server.stop_grace);
        let port = self.cfg.server.port;
        // Through the node's one wait loop, so a peer's abort or a Ctrl-C is seen within a
        // poll while the port frees.
        let free_by = Instant::now() + Duration::from_secs(10);
        match self.wait_for(free_by, |n| {
            n.watchdog.pet("waiting for the server port");
            Ok((!port_in_use(port)).then_some(()))
        }) {
            Ok(()) => {}
            Err(Interrupt::Stop(s)) => return Err(s),
            Err(Interrupt::Deadline) => {
                return Err(self.fail(
                    AbortKind::Error,
                    self.rank,
                    None,
                    format!("server port {port} is still in use 10s after the server stopped"),
                    Some(&server.log),
                ))
            }
        }
        self.event(
            serde_json::json!({"event": "server-stop", "secs": started.elapsed().as_secs_f64()}),
        );
        self.wait_gpu_drain()
    }

    /// Wait until every GPU uses less than `server.gpu-drain-mib`, if nvidia-smi exists.
    fn wait_gpu_drain(&mut self) -> Result<(), Stop> {
        let limit = self.cfg.server.gpu_drain_mib;
        if limit == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + self.cfg.server.gpu_drain_timeout;
        let mut last = Vec::new();
        let mut last_query: Option<Instant> = None;
        // Through the node's one wait loop (up to gpu-drain-timeout, 5 minutes by
        // default): a peer's abort or a Ctrl-C is honoured within a poll. nvidia-smi is
        // asked at most twice a second.
        let drained = self.wait_for(deadline, |n| {
            if last_query.is_some_and(|t| t.elapsed() < Duration::from_millis(500)) {
                return Ok(None);
            }
            last_query = Some(Instant::now());
            n.watchdog.pet("waiting for GPU memory");
            let Some(used) = query_gpu_memory() else {
                return Ok(Some(())); // no nvidia-smi or no GPU: nothing to wait for
            };
            if used.iter().all(|m| *m < limit) {
                return Ok(Some(()));
            }
            if used != last {
                n.info(&format!(
                    "waiting for GPU memory to drain: {used:?} MiB in use"
                ));
                last = used;
            }
            Ok(None)
        });
        match drained {
            Ok(()) => Ok(()),
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => Err(self.fail(
                AbortKind::Timeout,
                self.rank,
                None,
                format!(
                    "GPU memory did not drain below {limit} MiB within server.gpu-drain-timeout ({}; in use: {last:?} MiB)",
                    humantime::format_duration(self.cfg.server.gpu_drain_timeout)
                ),
                None,
            )),
        }
    }

    /// A reaped pid that is the server's while it should be serving is a failure.
    pub(super) fn check_server_exit(&mut self, pid: i32, exit: ChildExit) -> Result<bool, Stop> {
        match &self.server {
            Some(s) if s.pid == pid => {
                let log = s.log.clone();
                self.server = None;
                self.registry.stop(pid, self.cfg.server.stop_grace);
                Err(self.fail(
                    AbortKind::CommandFailed {
                        exit: exit.to_string(),
                    },
                    self.rank,
                    None,
                    format!("the inference server exited unexpectedly with {exit}"),
                    Some(&log),
                ))
            }
            _ => Ok(false),
        }
    }
}

/// Memory used per GPU in MiB, or None where nvidia-smi is absent or fails. Runs through
/// the node's reaper-compatible spawning (nothing else may wait on children).
fn query_gpu_memory() -> Option<Vec<u64>> {
    let dir = tempfile_path();
    let out = dir.with_extension("out");
    let status = super::procs::unblocked_signals(&mut std::process::Command::new("sh"))
        .arg("-c")
        .arg(format!(
            "command -v nvidia-smi >/dev/null || exit 127; nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits > '{}'",
            out.display()
        ))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    // The reaper thread collects the child; wait for its output file to be complete by
    // polling the child's existence.
    let pid = status.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(30);
    while super::pid_alive(pid as u32) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(&out).ok();
    let _ = std::fs::remove_file(&out);
    let used: Vec<u64> = text?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    (!used.is_empty()).then_some(used)
}

fn tempfile_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "rl-node-gpu-{}-{}",
        std::process::id(),
        super::random_hex(4)
    ))
}
