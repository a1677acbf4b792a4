//! The inference server's lifecycle (vLLM or a stand-in): started on the current model
//! before the first rollout, stopped in phase 7 (then, optionally, waiting for GPU memory
//! to drain), restarted in phase 12 on the model phase 11 published.
//!
//! A server only counts as started when its health URL answers 2xx. A port that is
//! already taken is refused before starting: a server left over from an earlier run would
//! otherwise answer the health check and serve the wrong model. A server that dies while
//! it should be serving stops the cluster like any failed command.
//!
//! A start that fails can be retried (`server.start-attempts`, as run.sh's `start_vllm`
//! did three times): vLLM sometimes dies or hangs while loading for reasons a second try
//! does not meet (a slow filesystem, a CUDA initialisation race). Each attempt is stopped
//! the way phase 7 stops a server before the next one, so no half-started engine keeps the
//! port or the GPU memory the next attempt needs.

use super::{Interrupt, Node, Stop};
use crate::events;
use crate::process::ChildExit;
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

/// Why one attempt to start the server failed.
#[derive(Debug)]
enum StartFailure {
    /// It exited before its health URL answered.
    Exited(ChildExit),
    /// It did not answer 2xx within `server.start-timeout`.
    NotHealthy,
}

impl StartFailure {
    fn describe(&self, url: &str, timeout: Duration) -> String {
        match self {
            StartFailure::Exited(exit) => format!("the server exited with {exit} while starting"),
            StartFailure::NotHealthy => format!(
                "the server did not answer {url} with 2xx within server.start-timeout ({})",
                humantime::format_duration(timeout)
            ),
        }
    }

    /// A server that never becomes healthy is this node's failure (exit 1), not a
    /// cluster deadline.
    fn abort_kind(&self) -> AbortKind {
        match self {
            StartFailure::Exited(exit) => AbortKind::CommandFailed {
                exit: exit.to_string(),
            },
            StartFailure::NotHealthy => AbortKind::Error,
        }
    }
}

fn healthy(agent: &ureq::Agent, url: &str) -> bool {
    agent.get(url).call().is_ok_and(|r| r.status().is_success())
}

impl Node {
    fn server_enabled(&self) -> bool {
        !self.cfg.server.command.trim().is_empty() && !self.debug_mode
    }

    /// Start the server on the model this node serves and wait until it is healthy, in at most
    /// `server.start-attempts` attempts, `start-retry-delay` apart.
    pub(super) fn start_server(&mut self) -> Result<(), Stop> {
        if !self.server_enabled() || self.server.is_some() {
            return Ok(());
        }
        // Never on a model this node does not see complete: refused here, before any
        // server starts, so the failure names the model, not the server.
        self.check_model()?;
        let port = self.cfg.server.port;
        self.watchdog.pet("checking the server port");
        if port_in_use(port) {
            return Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!(
                    "server port {port} is already in use {} (perhaps a server left over from an earlier run, such as run.sh's vLLM); stop it or change server.port",
                    crate::process::ports::describe(port)
                ),
                None,
            ));
        }
        let model = self.machine.serving().model().to_string();
        let values = self.values("server", None, Path::new(&model));
        let command = self.cfg.template(&self.cfg.server.command).render(&values);
        let url = self
            .cfg
            .template(&self.cfg.server.health_url)
            .render_raw(&values);
        let env = self.command_env(&values);
        let log = self
            .layout
            .phase_log(self.machine.iteration(), self.rank, "server");
        let attempts = self.cfg.server.start_attempts;
        let timeout = self.cfg.server.start_timeout;
        let mut attempt = 1;
        loop {
            let (pid, failure) = self.start_attempt(attempt, &command, &env, &url, &log)?;
            let Some(failure) = failure else {
                self.server = Some(Server { pid, log });
                return Ok(());
            };
            // The failed server is stopped as phase 7 stops one (its group, its descendants
            // outside it, the port), so nothing of it answers the next attempt's health
            // check or holds its port or GPU memory.
            self.watchdog.pet("stopping the server");
            self.launcher.stop(pid, self.cfg.server.stop_grace);
            self.exited.remove(&pid);
            let why = failure.describe(&url, timeout);
            let retry = attempt < attempts;
            self.append_log(
                &log,
                &format!("### rl-node: start attempt {attempt} of {attempts} failed: {why}; stopped it\n"),
            );
            self.event(events::Event::ServerStartFailed {
                attempt,
                attempts,
                reason: why.clone(),
                retry,
            });
            if !retry {
                return Err(self.fail(
                    failure.abort_kind(),
                    self.rank,
                    None,
                    format!(
                        "{why}; gave up after {attempts} attempt{} (server.start-attempts = {attempts})",
                        if attempts == 1 { "" } else { "s" }
                    ),
                    Some(&log),
                ));
            }
            let delay = self.cfg.server.start_retry_delay;
            self.warn(&format!(
                "server start attempt {attempt} of {attempts} failed: {why}; retrying in {}",
                humantime::format_duration(delay)
            ));
            self.wait_port_free(&format!("start attempt {attempt} failed"), &log)?;
            // Through the node's one wait loop: peers, an abort or a signal end the delay
            // within a poll, and the heartbeat goes on.
            self.waiting.note = format!(
                "server.start-retry-delay ({}) before server start attempt {} of {attempts}",
                humantime::format_duration(delay),
                attempt + 1
            );
            let deadline = self.clock.now() + delay;
            let waited = self.wait_for(deadline, |_| Ok(None::<()>));
            self.waiting.note.clear();
            if let Err(Interrupt::Stop(s)) = waited {
                return Err(s);
            }
            attempt += 1;
        }
    }

    /// One attempt to start the server: its pid, and why it failed (None: it is healthy).
    fn start_attempt(
        &mut self,
        attempt: u32,
        command: &str,
        env: &[(String, String)],
        url: &str,
        log: &Path,
    ) -> Result<(i32, Option<StartFailure>), Stop> {
        let attempts = self.cfg.server.start_attempts;
        let label = self.machine.serving().label();
        let port = self.cfg.server.port;
        // With retries, the log's header line of each start names its attempt: the log
        // keeps every attempt's output, one after the other.
        let of = if attempts > 1 {
            format!(", start attempt {attempt} of {attempts}")
        } else {
            String::new()
        };
        let header = format!("rank {} server on {label}{of}", self.rank);
        let running = self.spawn_supervised("the server", command, env, log, &header)?;
        let pid = running.pid;
        self.info(&format!(
            "server starting on {label} (pid {pid}, port {port}, log {}{of})",
            log.display()
        ));
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        self.waiting.note = format!("the server (pid {pid}) to answer {url}");
        let deadline = running.started + self.cfg.server.start_timeout;
        let waited = self.wait_for(deadline, |n| {
            if let Some(exit) = n.exited.remove(&pid) {
                return Ok(Some(Some(StartFailure::Exited(exit))));
            }
            Ok(healthy(&agent, url).then_some(None))
        });
        self.waiting.note.clear();
        let failure = match waited {
            Ok(failure) => failure,
            Err(Interrupt::Stop(s)) => return Err(s),
            Err(Interrupt::Deadline) => Some(StartFailure::NotHealthy),
        };
        if failure.is_none() {
            let secs = running.started.elapsed().as_secs_f64();
            self.info(&format!("server healthy after {secs:.2}s"));
            self.event(events::Event::ServerStart {
                model: self.machine.serving().model().to_string(),
                secs,
                attempt,
            });
        }
        Ok((pid, failure))
    }

    /// Stop the server: SIGTERM to its group, `stop-grace`, SIGKILL; then make sure the
    /// port is free and, if configured, that GPU memory drained.
    pub(super) fn stop_server(&mut self) -> Result<(), Stop> {
        let Some(server) = self.server.take() else {
            return Ok(());
        };
        self.watchdog.pet("stopping the server");
        let started = self.clock.now();
        self.launcher.stop(server.pid, self.cfg.server.stop_grace);
        self.wait_port_free("the server stopped", &server.log)?;
        self.event(events::Event::ServerStop {
            secs: self.clock.elapsed(started).as_secs_f64(),
        });
        self.wait_gpu_drain()
    }

    /// Wait (at most 10 s) until the stopped server's port is free.
    fn wait_port_free(&mut self, after: &str, log: &Path) -> Result<(), Stop> {
        let port = self.cfg.server.port;
        // Through the node's one wait loop, so a peer's abort or a Ctrl-C is seen within a
        // poll while the port frees.
        let free_by = self.clock.now() + Duration::from_secs(10);
        match self.wait_for(free_by, |n| {
            n.watchdog.pet("waiting for the server port");
            Ok((!port_in_use(port)).then_some(()))
        }) {
            Ok(()) => Ok(()),
            Err(Interrupt::Stop(s)) => Err(s),
            Err(Interrupt::Deadline) => Err(self.fail(
                AbortKind::Error,
                self.rank,
                None,
                format!("server port {port} is still in use 10s after {after}"),
                Some(log),
            )),
        }
    }

    /// Wait until every GPU uses less than `server.gpu-drain-mib`, if nvidia-smi exists.
    fn wait_gpu_drain(&mut self) -> Result<(), Stop> {
        let limit = self.cfg.server.gpu_drain_mib;
        if limit == 0 {
            return Ok(());
        }
        let deadline = self.clock.now() + self.cfg.server.gpu_drain_timeout;
        let mut last = Vec::new();
        let mut last_query: Option<Instant> = None;
        // Through the node's one wait loop (up to gpu-drain-timeout, 5 minutes by
        // default): a peer's abort or a Ctrl-C is honoured within a poll. nvidia-smi is
        // asked at most twice a second.
        let drained = self.wait_for(deadline, |n| {
            if last_query.is_some_and(|t| n.clock.elapsed(t) < Duration::from_millis(500)) {
                return Ok(None);
            }
            last_query = Some(n.clock.now());
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
                self.launcher.stop(pid, self.cfg.server.stop_grace);
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

/// Memory used per GPU in MiB, or None where nvidia-smi is absent or fails
/// (`process::capture`, which the node's reaper hands the exit to).
fn query_gpu_memory() -> Option<Vec<u64>> {
    let (exit, out) = crate::process::capture(
        "nvidia-smi",
        &["--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        Duration::from_secs(30),
    )?;
    if exit != crate::process::ChildExit::Success {
        return None;
    }
    let used: Vec<u64> = String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    (!used.is_empty()).then_some(used)
}
