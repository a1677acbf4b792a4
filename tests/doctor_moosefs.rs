//! `rl-node doctor` on a real distributed filesystem (MooseFS, tests/common/moosefs.rs):
//! one doctor per client mount, all started at once as `srun` starts them.

mod common;

use common::doctor::{self, check};
use common::moosefs::{self, Caches, MooseFs};
use common::{finish_within, output_text};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// A session of three doctors on 1 s caches takes tens of seconds; a loaded machine more.
const SESSION_LIMIT: Duration = Duration::from_secs(150);

/// One doctor per mount of `fs`, all started at once with `--nodes N`; every doctor's
/// output, and rank 0's JSON report.
fn session(
    fs: &MooseFs,
    n: usize,
    prefix: &[String],
    args: &[&str],
) -> (Vec<Output>, serde_json::Value) {
    let nodes = n.to_string();
    let mut all = vec!["--json", "--nodes", &nodes, "--timeout", "60s"];
    all.extend_from_slice(args);
    let kids: Vec<Child> = (0..n)
        .map(|i| doctor::spawn(prefix, fs.mount(i), &all))
        .collect();
    let outs: Vec<Output> = kids
        .into_iter()
        .map(|k| finish_within(k, SESSION_LIMIT))
        .collect();
    let all_text: String = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            format!(
                "--- doctor on mount {i}: {:?}\n{}",
                o.status,
                output_text(o)
            )
        })
        .collect();
    let mut rank0 = None;
    for o in &outs {
        // 0: every check ok or warn; 1: a check failed (still a whole report).
        assert!(matches!(o.status.code(), Some(0 | 1)), "{all_text}");
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}:\n{all_text}"));
        if v["session"]["rank"] == 0 {
            rank0 = Some(v);
        }
    }
    (outs, rank0.expect("a rank 0"))
}

fn said(c: &serde_json::Value, what: &str) -> String {
    c[what].as_str().unwrap_or("").to_string()
}

/// Three doctors started at once on `fs`'s three mounts (in its network namespace: its
/// tools answer at once), interrupted once all three have claimed a rank of `session`,
/// that is once each made `.rl-node/`, `doctor/`, its scratch and the session directory
/// through its own client; their outputs.
fn started_until_joined(fs: &MooseFs, session: &str) -> Vec<Output> {
    let net = fs.net_command();
    let args = [
        "--json",
        "--nodes",
        "3",
        "--timeout",
        "60s",
        "--session",
        session,
    ];
    let mut kids: Vec<Child> = (0..3)
        .map(|i| doctor::spawn(&net, fs.mount(i), &args))
        .collect();
    let dir = fs.mount(0).join(".rl-node/doctor").join(session);
    let deadline = Instant::now() + SESSION_LIMIT;
    // A listing asks the server: the test's own lookups would be cached like the nodes'.
    let claims = || {
        std::fs::read_dir(&dir).map_or(0, |l| {
            l.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
                .count()
        })
    };
    while claims() < 3 {
        if kids.iter_mut().any(|k| k.try_wait().unwrap().is_some()) || Instant::now() > deadline {
            let outs: Vec<Output> = kids.into_iter().map(finish_now).collect();
            let all: String = outs
                .iter()
                .map(|o| format!("---\n{}", output_text(o)))
                .collect();
            panic!("a doctor ended (or none joined) before all three joined:\n{all}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for k in &kids {
        let _ = common::kill(k.id() as i32, libc::SIGINT);
    }
    kids.into_iter()
        .map(|k| finish_within(k, SESSION_LIMIT))
        .collect()
}

/// Kills a doctor and returns what it wrote.
fn finish_now(mut c: Child) -> Output {
    let _ = c.kill();
    c.wait_with_output().unwrap()
}

/// Three doctors started at once on three clients with 1 s attribute, entry, direntry and
/// negative caches: each creates `.rl-node/`, `doctor/` and its scratch, then the session
/// directory, while the others do the same through their own caches ("File exists" from
/// mkdir for a name stat cannot see yet). None may fail on that, three times over (twice
/// stopped once all have joined, once to the end). Rank 0 reads the caches from
/// `.params`, and measures both of them failing rl-node: a record renamed over read
/// stale, a directory EEXIST for mkdir and ENOENT for stat; each says the MooseFS option
/// that fixes it, and the trash is noticed (its time unreadable in this last session:
/// the tools cannot reach the master from outside its network namespace).
#[test]
fn three_doctors_at_once_on_1s_caches_never_race_on_their_scratch() {
    let test = "three_doctors_at_once_on_1s_caches_never_race_on_their_scratch";
    let Some(fs) = moosefs::start_for(test, 3, Some(Caches::all(1.0))) else {
        return;
    };
    for rep in 0..2 {
        for o in started_until_joined(&fs, &format!("joined{rep}")) {
            let t = output_text(&o);
            assert!(!t.contains("cannot create"), "repetition {rep}:\n{t}");
            // Interrupted (130), or stopped by a peer's interruption (3).
            assert!(
                matches!(o.status.code(), Some(130 | 3)),
                "repetition {rep}: {:?}\n{t}",
                o.status
            );
        }
    }
    {
        let (outs, v) = session(&fs, 3, &[], &["--session", "whole", "--samples", "1"]);
        for o in &outs {
            let t = output_text(o);
            assert!(!t.contains("cannot create"), "last repetition:\n{t}");
        }
        for key in ["attribute_secs", "entry_secs", "negative_secs"] {
            assert_eq!(v["caches"][key].as_f64(), Some(1.0), "{key}: {v:#}");
        }
        let mount = said(check(&v, "mount"), "evidence");
        assert!(
            mount.contains("/.params: mfsattrcacheto 1s, mfsentrycacheto 1s, mfsdirentrycacheto 1s, mfsnegentrycacheto 1s"),
            "{mount}"
        );
        for (name, fix) in [
            ("eexist-enoent", "mfsnegentrycacheto=0"),
            ("stale-rename", "mfsentrycacheto=0"),
            ("cross-eexist-enoent", "mfsnegentrycacheto=0"),
            ("cross-stale-rename", "mfsentrycacheto=0"),
        ] {
            let c = check(&v, name);
            assert_eq!(c["verdict"], "warn", "{name}: {c:#}");
            assert!(said(c, "advice").contains(fix), "{name}: {c:#}");
        }
        let stale = said(check(&v, "cross-stale-rename"), "evidence");
        let worst = v["session"]["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["stale_rename_ms"].as_f64())
            .fold(0.0, f64::max);
        assert!(
            (500.0..3000.0).contains(&worst),
            "a 1 s entry cache: {worst} ms stale\n{stale}"
        );
        assert!(stale.contains("per barrier"), "{stale}");
        let eexist = said(check(&v, "cross-eexist-enoent"), "evidence");
        assert!(
            eexist.contains("answered EEXIST while stat answered ENOENT for "),
            "{eexist}"
        );
        let trash = check(&v, "trash");
        assert_eq!(trash["verdict"], "warn", "{trash:#}");
        let want = format!("mfssettrashtime -r 0 {}/.rl-node", fs.mount(0).display());
        let advice = said(trash, "advice");
        // Rank 0 may run on any of the three mounts.
        let any_mount = (0..3).any(|i| {
            advice.contains(&format!(
                "mfssettrashtime -r 0 {}/.rl-node",
                fs.mount(i).display()
            ))
        });
        assert!(any_mount, "want like {want}: {trash:#}");
        // Liveness: dead-after at least twice the longest cache plus a heartbeat.
        let dead = humantime::parse_duration(v["timing"]["dead-after"].as_str().unwrap()).unwrap();
        assert!(dead >= Duration::from_secs(2 + 5), "{v:#}");
        let left = fs.mount(0).join(".rl-node/doctor");
        // A listing refreshes this client's view: the session must be gone for it.
        assert!(
            !left.exists() || std::fs::read_dir(&left).unwrap().next().is_none(),
            "left behind in {}",
            left.display()
        );
    }
}

/// With MooseFS's default caches (entry and negative caches off) the same checks pass: a
/// rename over is read anew at once, and mkdir and stat agree. Run inside the master's
/// network namespace, the doctor reads the trash time (a day by default) and advises
/// `mfssettrashtime -r 0 DIR/.rl-node`; done, the trash check passes.
#[test]
fn with_default_caches_the_cache_checks_pass_and_the_trash_advice_works() {
    let test = "with_default_caches_the_cache_checks_pass_and_the_trash_advice_works";
    let Some(fs) = moosefs::start_for(test, 2, None) else {
        return;
    };
    let net = fs.net_command();
    let (_, v) = session(&fs, 2, &net, &["--session", "defaults"]);
    assert_eq!(v["caches"]["entry_secs"].as_f64(), Some(0.0), "{v:#}");
    assert_eq!(v["caches"]["negative_secs"].as_f64(), Some(0.0), "{v:#}");
    for name in [
        "eexist-enoent",
        "stale-rename",
        "cross-eexist-enoent",
        "cross-stale-rename",
    ] {
        assert_eq!(check(&v, name)["verdict"], "ok", "{name}: {v:#}");
    }
    let trash = check(&v, "trash");
    assert_eq!(trash["verdict"], "warn", "{trash:#}");
    assert!(
        said(trash, "evidence").contains("in its trash for 86400 s (mfsgettrashtime)"),
        "{trash:#}"
    );
    // Rank 0 may run on either mount: its own path is in the advice (with `mkdir` first,
    // unless the other doctor's scratch had made `.rl-node/` when it looked).
    let advice = said(trash, "advice");
    let (mount, state) = (0..2)
        .map(|i| (fs.mount(i), fs.mount(i).join(".rl-node")))
        .find(|(_, s)| advice.contains(&format!("mfssettrashtime -r 0 {}", s.display())))
        .unwrap_or_else(|| panic!("{advice}"));
    // The advice, followed: the trash check passes.
    std::fs::create_dir(&state).unwrap();
    let set = Command::new(&net[0])
        .args(&net[1..])
        .args(["mfssettrashtime", "-r", "0"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(set.status.success(), "{}", output_text(&set));
    // Through the client that made it: another client's directory-entry cache
    // (mfsdirentrycacheto, 1 s by default) may still name the `.rl-node` the session
    // removed a moment ago.
    let o = finish_within(doctor::spawn(&net, mount, &["--json"]), SESSION_LIMIT);
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", output_text(&o)));
    let trash = check(&v, "trash");
    assert_eq!(trash["verdict"], "ok", "{trash:#}");
    assert!(said(trash, "evidence").contains("is 0 s"), "{trash:#}");
}
