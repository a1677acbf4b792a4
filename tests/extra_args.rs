//! Extra arguments after `--` (run.sh's trailing Hydra overrides) reach every command that
//! says `{extra_args}`, one shell word per argument, exactly as given; every node must be
//! given the same ones (they are part of the configuration fingerprint).

mod common;
use common::cluster::*;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// Each rank's rollout writes the words it received, one per line, and the variable.
const ECHO_ARGS: &str = r#"
[phases.rollout]
command = "printf '[%s]\n' {extra_args} > {log_path}/args-{rank}; printf '%s' \"$RL_NODE_EXTRA_ARGS\" > {log_path}/env-{rank}; echo '{}' > {output}"
"#;

#[test]
fn every_argument_after_the_double_dash_reaches_the_command_as_one_word() {
    let c = TestCluster::new(2, ECHO_ARGS);
    let args = [
        "env_config.max_steps=20",
        "+policy_config.temperature=0.7",
        "env_config.name=two words",
        "quote='it''s'",
        "no_expansion=$HOME;`id`",
        "",
    ];
    let mut cli = vec!["--iterations", "1", "--"];
    cli.extend(args);
    let mut nodes = c.spawn_all(&cli);
    for n in &mut nodes {
        assert_eq!(n.wait(LIMIT), 0, "rank {}:\n{}", n.rank, n.stderr());
    }
    let want: String = args.iter().map(|a| format!("[{a}]\n")).collect();
    for rank in 0..2 {
        let got = fs::read_to_string(c.log_path.join(format!("args-{rank}"))).unwrap();
        assert_eq!(got, want, "rank {rank}");
        // The variable carries the same shell words: `eval "set -- $RL_NODE_EXTRA_ARGS"`.
        let env = fs::read_to_string(c.log_path.join(format!("env-{rank}"))).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("eval \"set -- $0\"; printf '[%s]\\n' \"$@\"")
            .arg(&env)
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            want,
            "rank {rank}: {env}"
        );
    }
}

#[test]
fn without_extra_arguments_the_placeholder_is_empty() {
    let c = TestCluster::new(1, ECHO_ARGS);
    let mut n = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(n.wait(LIMIT), 0, "{}", n.stderr());
    assert_eq!(
        fs::read_to_string(c.log_path.join("args-0")).unwrap(),
        "[]\n"
    );
    assert_eq!(fs::read_to_string(c.log_path.join("env-0")).unwrap(), "");
}

#[test]
fn a_worker_given_other_extra_arguments_is_refused_and_rank_0_says_so() {
    let c = TestCluster::new(2, ECHO_ARGS);
    fs::create_dir_all(&c.log_path).unwrap();
    let mut master = c.spawn(0, &["--iterations", "1", "--", "a=1"]);
    wait_until(LIMIT, "rank 0 to start a generation", || {
        c.log_path.join(".rl-node/cluster.json").exists()
    });
    let mut wrong = c.spawn(1, &["--iterations", "1", "--", "a=2"]);
    assert_eq!(wrong.wait(LIMIT), 2, "{}", wrong.stderr());
    let expected =
        "rank 1 was refused: cluster.extra-args differs (rank 0 has \"a=1\", rank 1 has \"a=2\")";
    wait_until(LIMIT, "rank 0 to report the refusal", || {
        master.stderr().contains(expected)
    });
    let mut right = c.spawn(1, &["--iterations", "1", "--", "a=1"]);
    assert_eq!(right.wait(LIMIT), 0, "{}", right.stderr());
    assert_eq!(master.wait(LIMIT), 0, "{}", master.stderr());
}
