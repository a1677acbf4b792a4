//! Resume inside a rollout, as run.sh's `--resume` did: a rollout redone after a crash is
//! offered its earlier attempt's partial output (`{resume_from}`, `RL_NODE_RESUME_FROM`),
//! which rl-node keeps as it was; a first attempt gets an empty value.

mod common;
use common::cluster::*;
use std::fs;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// First attempt: writes one record, then hangs (to be killed). A later attempt: continues
/// from the earlier output and adds a record. Every attempt notes what it was offered.
const RESUMABLE: &str = r#"
[phases.rollout]
command = "echo \"[$RL_NODE_RESUME_FROM]\" >> {log_path}/offered; if [ -n \"$RL_NODE_RESUME_FROM\" ]; then cat \"$RL_NODE_RESUME_FROM\" > {output}; echo '{\"b\": 2}' >> {output}; else echo '{\"a\": 1}' > {output}; touch {log_path}/started; exec sleep 60.91; fi"
"#;

#[test]
fn a_rollout_redone_after_a_crash_is_offered_the_earlier_partial_output() {
    let c = TestCluster::new(1, RESUMABLE);
    let mut first = c.spawn(0, &["--iterations", "1"]);
    wait_until(LIMIT, "the first rollout to write and hang", || {
        c.log_path.join("started").exists()
    });
    first.signal(libc::SIGKILL);
    first.wait(LIMIT);
    wait_until(LIMIT, "the killed node's rollout to be stopped", || {
        process_alive_with("sleep 60.91").is_empty()
    });
    let earlier = c
        .log_path
        .join("rollouts/iter-0001/train/rank-0.partial.g1.jsonl");
    assert_eq!(fs::read_to_string(&earlier).unwrap(), "{\"a\": 1}\n");

    let mut again = c.spawn(0, &["--iterations", "1"]);
    assert_eq!(again.wait(LIMIT), 0, "{}", again.stderr());
    let offered: Vec<String> = fs::read_to_string(c.log_path.join("offered"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        offered,
        ["[]".to_string(), format!("[{}]", earlier.display())]
    );
    assert!(
        again
            .stderr()
            .contains("may resume from the earlier attempt's"),
        "{}",
        again.stderr()
    );
    // The earlier attempt's file is untouched; the merged result has both records.
    assert_eq!(fs::read_to_string(&earlier).unwrap(), "{\"a\": 1}\n");
    let merged = fs::read_to_string(c.log_path.join("rollouts/iter-0001/train.jsonl")).unwrap();
    assert_eq!(merged, "{\"a\": 1}\n{\"b\": 2}\n");
}

#[test]
fn resume_from_is_refused_where_it_can_have_no_value() {
    let c = TestCluster::new(1, "[phases.train]\ncommand = \"echo {resume_from}\"\n");
    let mut n = c.spawn(0, &[]);
    assert_eq!(n.wait(LIMIT), 2);
    let err = n.stderr();
    assert!(
        err.contains("phases.train.command") && err.contains("{resume_from}"),
        "{err}"
    );
}
