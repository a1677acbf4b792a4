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
    for cmd in ["status", "recover", "aggregate", "demo"] {
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
