//! How a node's command is started, at the least cost to the node: the node has many
//! threads and starts a command per item (per-task rollouts start hundreds a minute), so
//! a fork, which copies the page tables of the whole node, and a shell that is not needed
//! are most of what an item costs the node beyond the command's own work.
//!
//! - posix_spawn, not fork: on Linux it is a clone that shares the node's memory until the
//!   exec. std's `Command` takes that path only without a `pre_exec` closure, and the
//!   node needs the child's signal mask emptied (it blocks its stop signals in every
//!   thread, `node::signals`; std hands the caller's mask on to the child), which a
//!   closure would do. posix_spawn's own attribute does it here instead.
//! - No `sh -c` when the command line is plain words ([`plain_words`]): the program is
//!   started with those words, as the shell would have started it.
//!
//! Whatever this cannot start as the shell would (a program not found, a PATH with a
//! relative directory, an exec the kernel refuses, such as a script without `#!`) is
//! started under `sh -c` as before: a missing program still fails with the shell's "not
//! found" in the command's log and exit code 127.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// First words that a shell does not pass to a program of that name: its keywords and its
/// builtins (dash's and bash's, as `sh` is either). `echo`, `printf`, `test`, `kill`,
/// `pwd`, `true` and `false` exist as programs too, but the builtins differ from them.
const SHELL_WORDS: &[&str] = &[
    // Keywords.
    "!",
    "{",
    "}",
    "case",
    "coproc",
    "do",
    "done",
    "elif",
    "else",
    "esac",
    "fi",
    "for",
    "function",
    "if",
    "in",
    "select",
    "then",
    "time",
    "until",
    "while",
    // POSIX special builtins.
    ".",
    ":",
    "break",
    "continue",
    "eval",
    "exec",
    "exit",
    "export",
    "readonly",
    "return",
    "set",
    "shift",
    "times",
    "trap",
    "unset",
    // Other builtins of dash and bash.
    "alias",
    "bg",
    "bind",
    "builtin",
    "caller",
    "cd",
    "chdir",
    "command",
    "compgen",
    "complete",
    "compopt",
    "declare",
    "dirs",
    "disown",
    "echo",
    "enable",
    "false",
    "fc",
    "fg",
    "getopts",
    "hash",
    "help",
    "history",
    "jobs",
    "kill",
    "let",
    "local",
    "logout",
    "mapfile",
    "popd",
    "printf",
    "pushd",
    "pwd",
    "read",
    "readarray",
    "shopt",
    "source",
    "suspend",
    "test",
    "true",
    "type",
    "typeset",
    "ulimit",
    "umask",
    "unalias",
    "wait",
];

/// The words of `command` when a shell would start one program with exactly these words
/// as its arguments: words of letters, digits and `-_./:,+@%=` only, separated by spaces
/// or tabs (nothing a shell expands, quotes, redirects or splits commands at), the first
/// neither an assignment (`VAR=value`) nor a shell keyword or builtin. `None` otherwise:
/// the command needs `sh -c`.
pub(crate) fn plain_words(command: &str) -> Option<Vec<&str>> {
    let plain = |w: &str| {
        w.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:,+@%=".contains(&b))
    };
    let words: Vec<&str> = command
        .split([' ', '\t'])
        .filter(|w| !w.is_empty())
        .collect();
    let first = *words.first()?;
    let plain =
        words.iter().all(|w| plain(w)) && !first.contains('=') && !SHELL_WORDS.contains(&first);
    plain.then_some(words)
}

/// Where a shell whose PATH is `path` finds the program `name`: `name` itself when it
/// holds a `/`, else the first executable file `name` in the directories of `path`.
/// `None` when the shell would look in a directory that depends on where the command
/// runs (an empty or relative entry) or is dash's own (`%`) before finding it.
fn find(name: &str, path: &OsStr) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(name.into());
    }
    for dir in std::env::split_paths(path) {
        if !dir.is_absolute() || dir.as_os_str().as_bytes().contains(&b'%') {
            return None;
        }
        let p = dir.join(name);
        if super::is_executable(&p) {
            return Some(p);
        }
    }
    None
}

/// The descriptors a started command gets: its output (standard output and error) and,
/// for an item worker ([`super::spawn_worker`]), the read end of its items' pipe as
/// standard input and the write end of its replies' pipe as descriptor 3
/// ([`REPLY_FD`]); standard input is /dev/null otherwise.
#[derive(Clone, Copy)]
pub(crate) struct Io<'a> {
    pub out: BorrowedFd<'a>,
    pub worker: Option<(BorrowedFd<'a>, BorrowedFd<'a>)>,
}

/// The descriptor an item worker writes its replies to (`RL_NODE_REPLY_FD`).
pub const REPLY_FD: i32 = 3;

/// Start `command` with this process's environment and `env` set in it (a later pair
/// wins, as with `Command::envs`), in a process group of its own, its descriptors as `io`
/// says: the program itself when the line is plain words and the program is found, else
/// `sh -c command`. Its pid (the group's id).
pub(crate) fn start(command: &str, env: &[(String, String)], io: Io) -> io::Result<i32> {
    let own_path = env.iter().rev().find(|(k, _)| k == "PATH");
    let path = match own_path {
        Some((_, p)) => Some(OsString::from(p)),
        None => std::env::var_os("PATH"),
    };
    if let Some(words) = plain_words(command) {
        if let Some(program) = path.as_deref().and_then(|p| find(words[0], p)) {
            let argv = words.iter().map(OsStr::new);
            // Refused (such as a script without `#!`, which the shell runs itself): the
            // shell does what it does with it, or says why not.
            if let Ok(pid) = spawn(&program, argv, env, true, io) {
                return Ok(pid);
            }
        }
    }
    let sh = match own_path {
        // The command's own PATH decides which `sh` runs, as with any program name.
        Some((_, p)) => find("sh", OsStr::new(p)),
        None => Some(super::shell().to_path_buf()),
    };
    let argv = ["sh", "-c", command].map(OsStr::new);
    match sh {
        Some(sh) => spawn(&sh, argv.into_iter(), env, false, io),
        None => spawn_searched(command, env, io),
    }
}

/// `sh -c command` as std starts it, which searches the command's PATH in the forked
/// child: for a PATH [`find`] leaves to the shell (a relative directory before `sh`).
fn spawn_searched(command: &str, env: &[(String, String)], io: Io) -> io::Result<i32> {
    use std::os::unix::process::CommandExt;
    let out = io.out.try_clone_to_owned()?;
    let mut cmd = std::process::Command::new("sh");
    super::unblocked_signals(&mut cmd)
        .arg("-c")
        .arg(command)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0);
    if let Some((items, replies)) = io.worker {
        cmd.stdin(items.try_clone_to_owned()?);
        let replies = replies.as_raw_fd();
        // SAFETY: dup2 is async-signal-safe; `replies` stays open until `spawn` returns
        // (the caller holds it), and the duplicate at REPLY_FD is not close-on-exec.
        unsafe {
            cmd.pre_exec(move || match libc::dup2(replies, REPLY_FD) {
                -1 => Err(io::Error::last_os_error()),
                _ => Ok(()),
            });
        }
    }
    let child = cmd.spawn()?;
    // The reaper thread collects it; dropping `Child` neither waits nor kills.
    Ok(child.id() as i32)
}

/// This process's environment with `env` set in it, as `NAME=value` strings; with `PWD`
/// set to the current directory when it has none, as the shell would have set it for a
/// program it starts (`pwd`).
fn environment(env: &[(String, String)], pwd: bool) -> io::Result<Vec<CString>> {
    let mut vars: std::collections::BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    vars.extend(env.iter().map(|(k, v)| (k.into(), v.into())));
    if pwd && !vars.contains_key(OsStr::new("PWD")) {
        if let Ok(dir) = std::env::current_dir() {
            vars.insert("PWD".into(), dir.into());
        }
    }
    vars.into_iter()
        .map(|(k, v)| {
            let mut line = k.into_vec();
            line.push(b'=');
            line.extend(v.into_vec());
            cstring(line)
        })
        .collect()
}

fn cstring(bytes: impl Into<Vec<u8>>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in a command's argument or environment",
        )
    })
}

/// Runs its closure when dropped: the destroy call of a posix_spawn object, on every path.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// posix_spawn's result (an error number, not -1 and errno) as a `Result`.
fn check(rc: libc::c_int) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// posix_spawn `program` with `argv`, the environment of [`environment`], in a new
/// process group, no signal blocked and SIGPIPE at its default action (std's `Command`
/// resets it too: Rust ignores it in this process), standard input from /dev/null (an
/// item worker's: its items' pipe, and its replies' pipe at [`REPLY_FD`]) and standard
/// output and error to `io.out`. The program's pid.
fn spawn<'a>(
    program: &Path,
    argv: impl Iterator<Item = &'a OsStr>,
    env: &[(String, String)],
    pwd: bool,
    io: Io,
) -> io::Result<i32> {
    let program = cstring(program.as_os_str().as_bytes())?;
    let argv: Vec<CString> = argv
        .map(|w| cstring(w.as_bytes()))
        .collect::<Result<_, _>>()?;
    let envp = environment(env, pwd)?;
    let null_ended = |v: &[CString]| -> Vec<*mut libc::c_char> {
        let mut p: Vec<_> = v.iter().map(|s| s.as_ptr().cast_mut()).collect();
        p.push(std::ptr::null_mut());
        p
    };
    let (argv_p, envp_p) = (null_ended(&argv), null_ended(&envp));
    let dev_null: &CStr = c"/dev/null";
    let mut attr = MaybeUninit::<libc::posix_spawnattr_t>::uninit();
    let mut actions = MaybeUninit::<libc::posix_spawn_file_actions_t>::uninit();
    let (attr, actions) = (attr.as_mut_ptr(), actions.as_mut_ptr());
    // SAFETY: `attr` and `actions` are initialised by their init calls before any other
    // use and destroyed once (the guards, created right after a successful init), and
    // stay in place meanwhile (pointers to locals that outlive the guards). The sigset_t
    // values are initialised by sigemptyset before use. Every pointer handed to
    // posix_spawn points into a live CString or a null-ended vector of them, and `io.out`
    // (and a worker's pipes) are open descriptors for the whole call. The child runs no
    // code of this process: posix_spawn does the set-up the attributes describe, then
    // execs.
    unsafe {
        check(libc::posix_spawnattr_init(attr))?;
        let _attr = Defer(|| {
            libc::posix_spawnattr_destroy(attr);
        });
        let mut none = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(none.as_mut_ptr());
        check(libc::posix_spawnattr_setsigmask(attr, none.as_ptr()))?;
        let mut default = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(default.as_mut_ptr());
        libc::sigaddset(default.as_mut_ptr(), libc::SIGPIPE);
        check(libc::posix_spawnattr_setsigdefault(attr, default.as_ptr()))?;
        check(libc::posix_spawnattr_setpgroup(attr, 0))?;
        let flags = libc::POSIX_SPAWN_SETSIGMASK
            | libc::POSIX_SPAWN_SETSIGDEF
            | libc::POSIX_SPAWN_SETPGROUP;
        check(libc::posix_spawnattr_setflags(attr, flags as libc::c_short))?;

        check(libc::posix_spawn_file_actions_init(actions))?;
        let _actions = Defer(|| {
            libc::posix_spawn_file_actions_destroy(actions);
        });
        let (fd, null) = (io.out.as_raw_fd(), dev_null.as_ptr());
        check(libc::posix_spawn_file_actions_adddup2(actions, fd, 1))?;
        check(libc::posix_spawn_file_actions_adddup2(actions, fd, 2))?;
        match io.worker {
            // The pipes' descriptors are above 9 (`super::spawn_worker`): no dup2 here
            // lands on a descriptor a later one reads from, and none is its own target
            // (which would leave it close-on-exec).
            Some((items, replies)) => {
                check(libc::posix_spawn_file_actions_adddup2(
                    actions,
                    items.as_raw_fd(),
                    0,
                ))?;
                check(libc::posix_spawn_file_actions_adddup2(
                    actions,
                    replies.as_raw_fd(),
                    REPLY_FD,
                ))?;
            }
            None => check(libc::posix_spawn_file_actions_addopen(
                actions,
                0,
                null,
                libc::O_RDONLY,
                0,
            ))?,
        }

        let mut pid: libc::pid_t = 0;
        check(libc::posix_spawn(
            &mut pid,
            program.as_ptr(),
            actions,
            attr,
            argv_p.as_ptr(),
            envp_p.as_ptr(),
        ))?;
        Ok(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn plain_words_are_the_programs_arguments() {
        assert_eq!(
            plain_words("python3  train.py\t--lr=0.1 out/x.jsonl a,b+c@d%e:f"),
            Some(vec![
                "python3",
                "train.py",
                "--lr=0.1",
                "out/x.jsonl",
                "a,b+c@d%e:f"
            ])
        );
        assert_eq!(
            plain_words("/opt/bin/run-item"),
            Some(vec!["/opt/bin/run-item"])
        );
        assert_eq!(plain_words("./run.sh x"), Some(vec!["./run.sh", "x"]));
    }

    #[test]
    fn what_a_shell_reads_needs_the_shell() {
        for line in [
            "",
            "   ",
            "a | b",
            "a; b",
            "a && b",
            "a > out",
            "a < in",
            "a 2>&1",
            "(a)",
            "a &",
            "echo $HOME",
            "cp ${A} b",
            "a `b`",
            "a 'quoted word'",
            "a \"x\"",
            "a \\n",
            "ls *.json",
            "ls x?",
            "ls [ab]",
            "ls ~/x",
            "cp {a,b} c",
            "a # comment",
            "a\nb",
            "FOO=1 python3 x.py",
            "a=b",
            "python3 x.py ü",
        ] {
            assert_eq!(plain_words(line), None, "{line:?}");
        }
    }

    #[test]
    fn shell_keywords_and_builtins_need_the_shell() {
        for line in [
            "cd /tmp",
            "exit 3",
            "export A",
            ". env.sh",
            "source env.sh",
            "set -e",
            "exec x",
            "eval x",
            "if x",
            "for x",
            "while x",
            "echo hi",
            "printf x",
            "true",
            "false",
            "test -f x",
            "kill 1",
            "umask 022",
            "ulimit -n",
            "wait",
            "read x",
            "trap x",
        ] {
            assert_eq!(plain_words(line), None, "{line:?}");
        }
        // Only as the first word: as an argument it is a word like any other.
        assert_eq!(
            plain_words("grep exit log"),
            Some(vec!["grep", "exit", "log"])
        );
    }

    #[test]
    fn a_program_is_found_as_the_shell_finds_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for d in [&a, &b] {
            std::fs::create_dir(d).unwrap();
        }
        let exe = |p: &Path, mode: u32| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        exe(&a.join("tool"), 0o644);
        exe(&b.join("tool"), 0o755);
        let path = std::env::join_paths([&a, &b]).unwrap();
        // Not executable in a: b's.
        assert_eq!(find("tool", &path), Some(b.join("tool")));
        assert_eq!(find("missing", &path), None);
        assert_eq!(find("./x/tool", &path), Some("./x/tool".into()));
        // A relative or empty entry first: where it points depends on the command's
        // directory, so the shell looks.
        let rel = std::env::join_paths([Path::new("rel"), &b]).unwrap();
        assert_eq!(find("tool", &rel), None);
        assert_eq!(find("tool", OsStr::new(&format!(":{}", b.display()))), None);
    }

    /// Runs `command` with `start` while this thread blocks SIGTERM, waits for it and
    /// returns its pid, its exit and its output.
    fn run_blocked(command: &str, env: &[(String, String)]) -> (i32, i32, String) {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let file = std::fs::File::create(&log).unwrap();
        // Registered as a waiter before the node's reaper (another test's, in this
        // process under `cargo test`) can collect it, as `spawn_waited` does.
        let mut waiters = super::super::WAITERS.lock().unwrap();
        // SAFETY: sigset_t is plain data, initialised by sigemptyset; the calls change
        // this test thread's mask only, and the second puts back what the first saved.
        let pid = unsafe {
            let mut set = MaybeUninit::<libc::sigset_t>::uninit();
            libc::sigemptyset(set.as_mut_ptr());
            libc::sigaddset(set.as_mut_ptr(), libc::SIGTERM);
            let mut old = MaybeUninit::<libc::sigset_t>::uninit();
            libc::pthread_sigmask(libc::SIG_BLOCK, set.as_ptr(), old.as_mut_ptr());
            let io = Io {
                out: std::os::fd::AsFd::as_fd(&file),
                worker: None,
            };
            let pid = start(command, env, io);
            libc::pthread_sigmask(libc::SIG_SETMASK, old.as_ptr(), std::ptr::null_mut());
            pid.unwrap()
        };
        let reaped = super::super::REAPER.load(Ordering::SeqCst).then(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            waiters.insert(pid, tx);
            rx
        });
        drop(waiters);
        let exit = match reaped {
            Some(rx) => rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap(),
            None => {
                let mut status = 0;
                // SAFETY: waits for this test's own child; `status` is a live local.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                super::super::ChildExit::from_wait_status(status)
            }
        };
        let exit = match exit {
            super::super::ChildExit::Success => 0,
            super::super::ChildExit::Exit(c) => c,
            other => panic!("{command}: {other}"),
        };
        (pid, exit, std::fs::read_to_string(&log).unwrap())
    }

    /// A plain command runs as the program itself (no shell) and a shell command under
    /// `sh`, both with no signal blocked although the starting thread blocks SIGTERM, in
    /// a group of their own, with the environment given.
    #[test]
    fn commands_run_unblocked_in_their_own_group() {
        let status = "/proc/self/status";
        let (pid, _, text) =
            run_blocked(&format!("grep -e SigBlk -e PPid -e NSpgid {status}"), &[]);
        let me = std::process::id();
        assert!(
            text.contains(&format!("PPid:\t{me}\n")),
            "not the program itself: {text}"
        );
        assert!(text.contains("SigBlk:\t0000000000000000"), "{text}");
        assert!(text.contains(&format!("NSpgid:\t{pid}")), "{text}");

        let (pid, _, text) = run_blocked(&format!("grep -E '^(SigBlk|NSpgid)' {status}"), &[]);
        assert!(text.contains("SigBlk:\t0000000000000000"), "{text}");
        assert!(text.contains(&format!("NSpgid:\t{pid}")), "{text}");

        let env = [("RL_TEST_MARK".to_string(), "x1".to_string())];
        let (_, _, text) = run_blocked("printenv RL_TEST_MARK", &env);
        assert_eq!(text, "x1\n");
    }

    /// What the shell would say and do when the program is missing, for a plain command
    /// too: it went to the shell.
    #[test]
    fn a_missing_program_is_the_shells_not_found() {
        let (_, exit, text) = run_blocked("rl-node-no-such-program x", &[]);
        assert_eq!(exit, 127, "{text}");
        assert!(
            text.contains("rl-node-no-such-program: not found"),
            "{text}"
        );
    }
}
