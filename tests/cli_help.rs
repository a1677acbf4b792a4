//! Each subcommand's `--help` lists only the options it accepts, and plain `rl-node`
//! prints a short summary of the common commands.

mod common;

use common::cluster::BIN;
use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).arg("--help").output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn subcommand_help_lists_only_what_the_subcommand_accepts() {
    let node_only = [
        "--num-nodes",
        "--rl-phase",
        "--master-port",
        "--rollout-split",
        "--data-path",
        "--log-level",
        "--log-format",
    ];
    for cmd in [
        "status",
        "recover",
        "aggregate",
        "demo",
        "doctor",
        "timeline",
    ] {
        let text = help(&[cmd]);
        for flag in node_only {
            assert!(
                !text.contains(flag),
                "`rl-node {cmd} --help` lists {flag}:\n{text}"
            );
        }
    }
    assert!(help(&["status"]).contains("--log-path"));
    assert!(help(&["demo"]).contains("--iterations"));
    // And what a subcommand does not list, it refuses (exit 2), instead of ignoring.
    let out = Command::new(BIN)
        .args(["status", "--num-nodes", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // The node flags are where they apply.
    let text = help(&[]);
    for flag in node_only.iter().chain(&["--master", "--worker", "--fresh"]) {
        assert!(text.contains(flag), "{flag}:\n{text}");
    }
}

#[test]
fn plain_rl_node_prints_a_short_summary_of_the_common_commands() {
    let out = Command::new(BIN).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for cmd in [
        "rl-node --master",
        "rl-node --worker N",
        "rl-node demo",
        "rl-node status",
        "rl-node recover",
        "rl-node doctor",
        "rl-node timeline",
    ] {
        assert!(err.contains(cmd), "{err}");
    }
}

#[test]
fn completions_and_a_man_page_are_generated_from_the_command_line_definition() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&out.stdout);
        // bash and zsh spell options `--master`, fish `-l master`.
        assert!(
            text.contains("master") && text.contains("recover"),
            "{shell}:\n{text}"
        );
    }
    let out = Command::new(BIN).arg("man").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(".TH rl-node 1") && text.contains("\\-\\-worker"),
        "{text}"
    );
}

/// `(default: V)` / `[default: V]` of `--flag` in a help text.
fn shown_default(help: &str, flag: &str) -> Option<String> {
    // The flag's line and, in clap's long layout, the paragraph under it.
    let lines: Vec<&str> = help.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim_start().starts_with(&format!("{flag} ")))?;
    let line: String = lines[at..]
        .iter()
        .take_while(|l| !l.trim().is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    let (_, rest) = line
        .split_once("(default: ")
        .or_else(|| line.split_once("[default: "))?;
    Some(rest.split([')', ']']).next()?.to_string())
}

/// `key = value` of a section in `rl-node show-config` output (value as printed).
fn config_value(show: &str, section: &str, key: &str) -> String {
    let mut inside = false;
    for line in show.lines() {
        if line.starts_with('[') {
            inside = line == format!("[{section}]");
        } else if inside {
            if let Some(v) = line.strip_prefix(&format!("{key} = ")) {
                return v.to_string();
            }
        }
    }
    panic!("no {section}.{key} in:\n{show}")
}

#[test]
fn defaults_shown_in_help_are_the_real_defaults() {
    // Node flags: what a node uses when neither flag, environment nor file sets the key.
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.arg("show-config").current_dir(dir.path());
    for (k, _) in std::env::vars() {
        if k.starts_with("RL_NODE_")
            || ["WORLD_SIZE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"].contains(&k.as_str())
        {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let show = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = help(&[]);
    let mut checked = 0;
    for flag in [
        "--data-path",
        "--num-nodes",
        "--rank-weights",
        "--rl-phase",
        "--eval-interval",
        "--master-port",
    ] {
        let shown = shown_default(&text, flag)
            .unwrap_or_else(|| panic!("{flag} shows no default:\n{text}"));
        let real = config_value(&show, "cluster", flag.trim_start_matches("--"));
        let real = match real.trim_matches('"') {
            "" => "none".to_string(),
            "[]" => "every rank 1".to_string(),
            v => v.to_string(),
        };
        assert_eq!(shown, real, "{flag}: help says {shown}, a node uses {real}");
        checked += 1;
    }
    assert_eq!(checked, 6);

    // Demo flags: the defaults shown are what a plain `rl-node demo` runs.
    let demo_help = help(&["demo"]);
    let demo_dir = tempfile::tempdir().unwrap();
    let run = demo_dir.path().join("run");
    let out = Command::new(BIN)
        .args(["demo", "--dir"])
        .arg(&run)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml = std::fs::read_to_string(run.join("rl-node.toml")).unwrap();
    let cluster_value = |key: &str| config_value(&toml, "cluster", key);
    let d = |flag: &str| {
        shown_default(&demo_help, flag).unwrap_or_else(|| panic!("demo {flag}:\n{demo_help}"))
    };
    // "3, or 4 with --pipeline: …": the plain demo's value comes first.
    let nodes = d("--nodes");
    assert_eq!(
        nodes.split(',').next().unwrap(),
        cluster_value("num-nodes"),
        "{nodes}"
    );
    assert_eq!(d("--iterations"), cluster_value("iterations"));
    assert_eq!(d("--eval-interval"), cluster_value("eval-interval"));
    let weights = cluster_value("rank-weights");
    assert_eq!(d("--rank-weights"), "rank 0 twice the others");
    assert_eq!(weights, "[2, 1, 1]", "rank 0 twice the others of 3 nodes");
    for (flag, arg) in [
        ("--seed", "--seed"),
        ("--samples", "--samples"),
        ("--tasks", "--tasks"),
    ] {
        let shown = d(flag);
        assert!(
            toml.contains(&format!("{arg} {shown} ")),
            "demo {flag} shows {shown}; the toy command is not run with it:\n{toml}"
        );
    }
}

/// Every subcommand reports a usage error the same way (one printer): `error: …` on
/// stderr, nothing on stdout, exit 2, and a hint where there is one.
#[test]
fn every_subcommand_reports_a_usage_error_the_same_way() {
    let missing = std::env::temp_dir().join("rl-node-no-such-dir-for-errors");
    let missing = missing.to_str().unwrap();
    let cases: [(&[&str], &str); 9] = [
        (&["status"], "error: rl-node status needs --log-path DIR"),
        (
            &["timeline"],
            "error: rl-node timeline needs --log-path DIR",
        ),
        (
            &["timeline", "--log-path", missing],
            "error: no rl-node run in",
        ),
        (&["doctor"], "error: rl-node doctor needs --log-path DIR"),
        (&["doctor", "--log-path", missing], "does not exist"),
        (&["recover"], "error: rl-node recover needs --log-path DIR"),
        (
            &[
                "aggregate",
                "--log-path",
                missing,
                "--iteration",
                "1",
                "--split",
                "train",
            ],
            "no such directory",
        ),
        (
            &["show-config", "--config", "/nonexistent/rl-node.toml"],
            "error: cannot read config file /nonexistent/rl-node.toml",
        ),
        (&["--master"], "error: "),
    ];
    for (args, says) in cases {
        let out = Command::new(BIN)
            .args(args)
            .env_remove("RL_NODE_CLUSTER_LOG_PATH")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?} printed to stdout: {stdout}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // A hint follows the error on a line of its own.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rl-node.toml");
    std::fs::write(&config, "[cluster]\nno-such-key = 1\n").unwrap();
    let out = Command::new(BIN)
        .args(["show-config", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains("no-such-key"),
        "{stderr}"
    );
    assert_eq!(
        lines.last().copied(),
        Some("hint: `rl-node show-config` prints every key with its current value"),
        "{stderr}"
    );
}

/// Every `` `rl-node <subcommand>` `` that an error, a hint, a help text or a document names
/// is one `rl-node --help` lists: a hint naming a command that does not exist sends the
/// user nowhere.
#[test]
fn every_subcommand_named_in_messages_and_docs_exists() {
    let help = help(&[]);
    let commands: Vec<&str> = help
        .split_once("Commands:\n")
        .expect("a Commands section")
        .1
        .lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(commands.contains(&"show-config"), "{commands:?}");
    fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = vec![root.join("README.md")];
    for dir in ["src", "docs", "scripts", "examples"] {
        files(&root.join(dir), &mut paths);
    }
    let mut named = 0;
    let mut unknown = vec![];
    for path in paths {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (at, _) in text.match_indices("`rl-node ") {
            let word: String = text[at + "`rl-node ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                .collect();
            if word.is_empty() || word.starts_with('-') {
                continue;
            }
            named += 1;
            if !commands.contains(&word.as_str()) {
                let line = text[..at].lines().count();
                unknown.push(format!(
                    "{}:{line}: `rl-node {word}`",
                    path.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    assert!(named > 20, "only {named} found: is the scan looking?");
    assert!(
        unknown.is_empty(),
        "no such subcommand:\n{}",
        unknown.join("\n")
    );
}

/// Every environment variable the help of any subcommand names. Set to a value no setting
/// takes, it is refused, and the refusal names it: a name that is silently ignored (as
/// `RL_NODE_NUM_NODES` was, for rl-node itself) fails here. The exception is what the
/// training command gets for torchrun (docs/commands.md's table of them).
#[test]
fn every_variable_the_help_names_is_the_real_one() {
    let subcommands = [
        "",
        "status",
        "show-config",
        "aggregate",
        "recover",
        "doctor",
        "timeline",
        "demo",
        "completions",
        "man",
    ];
    let mut names: Vec<String> = Vec::new();
    for s in subcommands {
        let args: Vec<&str> = [s].into_iter().filter(|s| !s.is_empty()).collect();
        for word in
            help(&args).split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        {
            let is_var = word.contains('_')
                && word.len() > 3
                && word.starts_with(|c: char| c.is_ascii_uppercase());
            if is_var && !names.contains(&word.to_string()) {
                names.push(word.to_string());
            }
        }
    }
    // The table in docs/commands.md of what the training command gets for torchrun.
    let commands_doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/commands.md"),
    )
    .unwrap();
    let given = |name: &str| {
        let row = format!("| `{name}` |");
        commands_doc.lines().any(|l| l.starts_with(&row))
    };
    // Read by `doctor --nodes N` for the session every doctor of one job meets in
    // (tests/doctor.rs runs two jobs' doctors side by side).
    let read_elsewhere = ["SLURM_JOB_ID"];
    let dir = tempfile::tempdir().unwrap();
    let mut read = 0;
    for name in &names {
        if given(name) || read_elsewhere.contains(&name.as_str()) {
            continue;
        }
        let mut cmd = Command::new(BIN);
        cmd.args(["--master", "--iterations", "1", "--log-path"])
            .arg(dir.path().join("run"))
            .current_dir(dir.path())
            .stdin(std::process::Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("RL_NODE_")
                || k.contains("RANK")
                || k.contains("SIZE")
                || k.contains("NNODES")
                || k.starts_with("SLURM_")
            {
                cmd.env_remove(k);
            }
        }
        let out = cmd.env(name, "bogus").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{name}=bogus was not refused:\n{err}"
        );
        assert!(
            err.contains(name.as_str()),
            "{name}=bogus refused without naming it:\n{err}"
        );
        read += 1;
    }
    assert!(
        names.iter().any(|n| n == "RL_NODE_CLUSTER_NUM_NODES"),
        "{names:?}"
    );
    assert!(read >= 6, "only {read} variables read in {names:?}");
}

/// What bash completes for `words` (the last one being completed), through the script
/// `rl-node completions bash` prints, driven the way bash drives it (COMP_WORDS,
/// COMP_CWORD, and the function's three arguments).
fn bash_completes(words: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("rl-node.bash");
    let out = Command::new(BIN)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    std::fs::write(&script, &out.stdout).unwrap();
    // The function the script registers for rl-node (`complete -F FUNCTION … rl-node`).
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let function = text
        .lines()
        .find_map(|l| l.split_once("complete -F ").map(|(_, r)| r))
        .and_then(|r| r.split_whitespace().next())
        .expect("a `complete -F` line")
        .to_string();
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let driver = format!(
        "source {}\nCOMP_WORDS=({})\nCOMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))\n\
         {function} rl-node \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"\n",
        script.display(),
        quoted.join(" ")
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&driver)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .filter(|l| !l.is_empty())
        .collect()
}

/// Bash completes a subcommand's own flags after it (clap_complete's script for a program
/// with a hyphen in its name completed nothing there), and never offers rl-node's hidden
/// commands.
#[test]
fn bash_completes_the_flags_of_each_subcommand_and_never_a_hidden_command() {
    for (words, want) in [
        (
            &["rl-node", "status", "--"][..],
            &["--log-path", "--watch", "--json"][..],
        ),
        (&["rl-node", "doctor", "--"], &["--log-path", "--nodes"]),
        (
            &["rl-node", "plan", "--"],
            &["--config", "--iteration", "--rank"],
        ),
    ] {
        let got = bash_completes(words);
        for w in want {
            assert!(got.iter().any(|g| g == w), "{words:?}: {w} not in {got:?}");
        }
    }
    let top = bash_completes(&["rl-node", ""]);
    assert!(top.iter().any(|w| w == "status"), "{top:?}");
    assert!(top.iter().all(|w| !w.starts_with("__")), "{top:?}");
    assert_eq!(bash_completes(&["rl-node", "__"]), Vec::<String>::new());
    for shell in ["zsh", "fish"] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains("rehearse"), "{shell}");
        assert!(
            !script.contains("__guard") && !script.contains("__toy"),
            "{shell}"
        );
    }
}

/// `rl-node man --out-dir DIR` writes a page for every subcommand the main page refers to
/// (`rl-node-status(1)`, …), and none for a hidden command.
#[test]
fn every_man_page_the_main_page_refers_to_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["man", "--out-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    let main = std::fs::read_to_string(dir.path().join("rl-node.1")).unwrap();
    let refs: Vec<String> = main
        .match_indices("rl\\-node\\-")
        .map(|(at, _)| {
            let name: String = main[at..].chars().take_while(|c| *c != '(').collect();
            name.replace("\\-", "-")
        })
        .collect();
    assert!(refs.len() >= 10, "{refs:?}");
    for r in &refs {
        let page = dir.path().join(format!("{r}.1"));
        assert!(page.is_file(), "{r}(1) is referred to but not written");
        assert!(listed.contains(&page.display().to_string()), "{listed}");
    }
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("__")), "{names:?}");
    // Without --out-dir: the main page on stdout, as before.
    let out = Command::new(BIN).arg("man").output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with(".ie"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
