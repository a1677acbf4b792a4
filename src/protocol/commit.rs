//! `CommitMachine`: the one procedure by which a command's output becomes committed work
//! (a rank's rollout or eval shard, an item's output, rank 0's prepared data, an aggregate
//! command's merged file), as a sans-I/O state machine in the style of
//! [`super::machine::NodeMachine`].
//!
//! The procedure, whatever is committed:
//! 1. the fence: this node's generation must still be current ([`super::fence`]);
//! 2. a look at what the command left: its `{output}`, and where the rules say so the
//!    final name too (a command may have written it itself, as webgym's rollout does);
//! 3. the decision: commit `{output}`, adopt the final name, commit an empty file, or
//!    refuse (both names written, neither, something that is not a file);
//! 4. the data made durable before its name (an fsync of the file), the rename that never
//!    replaces (`RENAME_NOREPLACE`: a name another writer committed stays), and the
//!    directory's fsync, which makes the name durable before anything (a journal line)
//!    says it is there.
//!
//! Each step is one [`Effect`] the driver performs and answers with one [`Input`]; the
//! machine then says the [`Outcome`]. The driver words the outcome for its site (which
//! command, which file); the order of the steps is decided here alone, once for every
//! kind of commit, and every state change checks it ([`CommitMachine::assert_invariants`],
//! in debug builds and in the simulator).

use super::fence::Site;
use std::path::{Path, PathBuf};

/// What the commit does when the command wrote the final name itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The final name is not looked at: only `{output}` is committed.
    NotLooked,
    /// The command's own file is adopted as committed (after its data is synced).
    Adopt,
    /// Refused: only `{output}` is committed ([`Refusal::WroteFinal`]).
    Refuse,
}

/// What the commit does when the command left nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nothing {
    /// Refused ([`Refusal::Nothing`]).
    Refuse,
    /// An empty file is created under the final name (exclusively: a name another writer
    /// committed meanwhile is taken, see [`Taken`]).
    Empty,
}

/// What the commit does when another writer committed the final name first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// It fails ([`Outcome::Failed`] with `taken`).
    Fail,
    /// It yields: the other commit stands, `{output}` is removed ([`Outcome::Lost`]). An
    /// item's takeover or backup attempt commits this way.
    Yield,
}

/// The rules of one commit.
#[derive(Debug, Clone)]
pub struct Rules {
    /// Which commit the fence guards (a mutation site of its own).
    pub site: Site,
    /// What the command writes (`{output}`).
    pub output: PathBuf,
    /// The committed name.
    pub dest: PathBuf,
    /// Whether `{output}` is looked at first. Without a look it is known to be there (the
    /// driver looked before it fenced, because a missing one is no commit at all).
    pub look: bool,
    /// `{output}` may be a directory (prepared data, an aggregate command's output).
    pub dirs: bool,
    /// `{output}` is durable already (rl-node wrote it and synced it through its own
    /// handle): it is not synced again.
    pub synced: bool,
    pub written: Written,
    pub nothing: Nothing,
    pub taken: Taken,
    /// The journal item appended right after the fence, before the commit (a deliberate
    /// mutation: the simulator's tests show a crash between the two is caught).
    pub journal_first: Option<String>,
}

/// A deliberately broken commit, for the simulator's own tests (never set by the node):
/// shows that the simulator catches it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// `{output}` is renamed into place without its data synced first: a machine that
    /// crashes after the commit loses what the command wrote behind a durable name that a
    /// journal line already says is there.
    Unsynced,
}

/// What a look found under a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    File,
    Dir,
    /// A symbolic link, a FIFO, a device: never committed, never followed.
    Other,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Check that this node's generation is current at `site`. A fenced node stops: the
    /// driver does not answer (the commit is abandoned with the node).
    Fence(Site),
    /// Append this journal item, of the work being committed ([`Rules::journal_first`]).
    Journal(String),
    /// Look at a name without following a link: [`Input::Looked`].
    Look(PathBuf),
    /// Make a file's data durable: [`Input::Done`].
    Sync(PathBuf),
    /// Rename `from` to `to`, never replacing `to`: [`Input::Done`], or the error
    /// (`AlreadyExists` when another writer committed `to`).
    Rename { from: PathBuf, to: PathBuf },
    /// Create an empty file exclusively, its directory synced after the link:
    /// [`Input::Created`].
    CreateEmpty(PathBuf),
    /// Remove a file (ours, after another commit won): answered by [`Input::Done`]
    /// whatever happened.
    Remove(PathBuf),
    /// Make the names in a directory durable: [`Input::Done`].
    SyncDir(PathBuf),
}

/// What happened, in answer to the last effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// The fence passed, or the journal line was appended.
    Passed,
    Looked(Option<Found>),
    Done,
    /// Whether the exclusive create made the file (`false`: the name was there).
    Created(bool),
    /// The effect failed with this error (its kind, for `AlreadyExists`, and its words).
    Failed(std::io::ErrorKind, String),
}

/// Why a commit was refused: what the command left is not a commit rl-node can make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The command wrote both `{output}` and the final name.
    Both,
    /// The command wrote the final name itself and the rules commit only `{output}`.
    WroteFinal,
    /// The command wrote neither.
    Nothing,
    /// This name is not a regular file (or a directory, where the rules allow one).
    NotAFile(PathBuf),
}

/// How the commit ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The final name is committed and durable. `adopted`: it is the file the command
    /// wrote there itself; `empty`: an empty file made because the command wrote nothing.
    Committed {
        adopted: bool,
        empty: bool,
    },
    /// Another writer committed the final name first ([`Taken::Yield`]); ours is gone.
    Lost,
    Refused(Refusal),
    /// A step failed: the path it was on, and the error. `taken`: the final name was
    /// committed by another writer while the command ran (never replaced).
    Failed {
        path: PathBuf,
        error: String,
        taken: bool,
    },
}

/// Where the procedure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Fence,
    Journal,
    LookOutput,
    LookDest,
    /// Syncing `{output}` before its rename.
    SyncOutput,
    Rename,
    /// Syncing the adopted final name.
    SyncAdopted,
    CreateEmpty,
    /// Removing our `{output}` after another commit won.
    Remove,
    SyncDir,
    Ended,
}

/// One commit's procedure (see the module's documentation).
#[derive(Debug)]
pub struct CommitMachine {
    rules: Rules,
    step: Step,
    /// What the look found under `{output}`.
    output: Option<Found>,
    /// Whether the fence passed (every write comes after it).
    fenced: bool,
    /// Whether `{output}` was synced (its rename comes after it).
    synced: bool,
    /// The outcome once the directory is synced (or at once, for a refusal or failure).
    pending: Option<Outcome>,
    outcome: Option<Outcome>,
    /// The effect asked and not yet answered.
    asked: Option<Effect>,
    /// A deliberate mutation, for the simulator's own tests.
    mutation: Option<Mutation>,
}

impl CommitMachine {
    pub fn new(rules: Rules) -> CommitMachine {
        CommitMachine::broken(rules, None)
    }

    /// A machine whose procedure is broken on purpose by `mutation` (the `sim` feature's
    /// tests only; without it, as [`CommitMachine::new`]).
    #[doc(hidden)]
    pub fn broken(rules: Rules, mutation: Option<Mutation>) -> CommitMachine {
        let mut m = CommitMachine {
            mutation,
            rules,
            step: Step::Fence,
            output: None,
            fenced: false,
            synced: false,
            pending: None,
            outcome: None,
            asked: None,
        };
        m.ask();
        m
    }

    /// The next effect to perform, once; `None` while one is unanswered or once ended.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        match self.asked {
            Some(_) => None,
            None => {
                let e = self.effect();
                self.asked = e.clone();
                e
            }
        }
    }

    /// How the commit ended, once it has.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    fn ask(&mut self) {
        self.asked = None;
    }

    fn effect(&self) -> Option<Effect> {
        let r = &self.rules;
        Some(match self.step {
            Step::Fence => Effect::Fence(r.site),
            Step::Journal => Effect::Journal(r.journal_first.clone().expect("journal first")),
            Step::LookOutput => Effect::Look(r.output.clone()),
            Step::LookDest => Effect::Look(r.dest.clone()),
            Step::SyncOutput => Effect::Sync(r.output.clone()),
            Step::Rename => Effect::Rename {
                from: r.output.clone(),
                to: r.dest.clone(),
            },
            Step::SyncAdopted => Effect::Sync(r.dest.clone()),
            Step::CreateEmpty => Effect::CreateEmpty(r.dest.clone()),
            Step::Remove => Effect::Remove(r.output.clone()),
            Step::SyncDir => Effect::SyncDir(parent(&r.dest).to_path_buf()),
            Step::Ended => return None,
        })
    }

    /// The answer to the effect last asked.
    pub fn handle(&mut self, input: Input) {
        assert!(
            self.asked.is_some(),
            "commit: an answer ({input:?}) with no effect asked"
        );
        let failed = |m: &CommitMachine, path: &Path, error: String, taken: bool| Outcome::Failed {
            path: path.to_path_buf(),
            error,
            taken: taken && m.rules.taken == Taken::Fail,
        };
        let r = self.rules.clone();
        match (self.step, input) {
            (Step::Fence, Input::Passed) => {
                self.fenced = true;
                self.step = match (r.journal_first.is_some(), r.look) {
                    (true, _) => Step::Journal,
                    (false, true) => Step::LookOutput,
                    (false, false) => self.commit_output(Found::File),
                };
            }
            (Step::Journal, Input::Passed) => {
                self.step = match r.look {
                    true => Step::LookOutput,
                    false => self.commit_output(Found::File),
                };
            }
            (Step::LookOutput, Input::Looked(found)) => {
                self.output = found;
                self.step = match r.written {
                    Written::NotLooked => self.decide(None),
                    Written::Adopt | Written::Refuse => Step::LookDest,
                };
            }
            (Step::LookDest, Input::Looked(found)) => self.step = self.decide(Some(found)),
            (Step::SyncOutput, Input::Done) => {
                self.synced = true;
                self.step = Step::Rename;
            }
            (Step::Rename, Input::Done) => {
                self.pending = Some(Outcome::Committed {
                    adopted: false,
                    empty: false,
                });
                self.step = Step::SyncDir;
            }
            (Step::Rename, Input::Failed(std::io::ErrorKind::AlreadyExists, _))
                if r.taken == Taken::Yield =>
            {
                self.step = Step::Remove;
            }
            (Step::SyncAdopted, Input::Done) => {
                self.pending = Some(Outcome::Committed {
                    adopted: true,
                    empty: false,
                });
                self.step = Step::SyncDir;
            }
            // `create_new` syncs the directory after its link, and nothing is added to it
            // after: a second fsync of it would make nothing more durable.
            (Step::CreateEmpty, Input::Created(true)) => {
                self.end(Outcome::Committed {
                    adopted: false,
                    empty: true,
                });
            }
            (Step::CreateEmpty, Input::Created(false)) => match r.taken {
                Taken::Yield => self.step = Step::Remove,
                Taken::Fail => {
                    let o = failed(self, &r.dest, "appeared meanwhile".into(), true);
                    self.end(o);
                }
            },
            (Step::Remove, Input::Done | Input::Failed(..)) => {
                self.pending = Some(Outcome::Lost);
                self.step = Step::SyncDir;
            }
            (Step::SyncDir, Input::Done) => {
                let o = self.pending.take().expect("an outcome waits for the sync");
                self.end(o);
            }
            (step, Input::Failed(kind, error)) => {
                let path = match self.effect() {
                    Some(Effect::Rename { from, .. }) => from,
                    Some(
                        Effect::Look(p)
                        | Effect::Sync(p)
                        | Effect::CreateEmpty(p)
                        | Effect::Remove(p)
                        | Effect::SyncDir(p),
                    ) => p,
                    _ => r.dest.clone(),
                };
                let taken = step == Step::Rename && kind == std::io::ErrorKind::AlreadyExists;
                // A failed directory sync leaves the commit not durable: it failed.
                self.pending = None;
                let o = failed(self, &path, error, taken);
                self.end(o);
            }
            (step, input) => panic!("commit: {input:?} is no answer to {step:?}"),
        }
        self.ask();
        self.assert_invariants();
    }

    /// The step after looking: what the command left decides the commit.
    fn decide(&mut self, dest: Option<Option<Found>>) -> Step {
        let r = &self.rules;
        match (self.output, dest.flatten()) {
            (Some(_), Some(_)) => self.refuse(Refusal::Both),
            (Some(found), None) => self.commit_output(found),
            (None, Some(found)) => match (r.written, found) {
                (Written::Adopt, Found::File) => Step::SyncAdopted,
                (Written::Adopt, _) => self.refuse(Refusal::NotAFile(r.dest.clone())),
                _ => self.refuse(Refusal::WroteFinal),
            },
            (None, None) => match r.nothing {
                Nothing::Empty => Step::CreateEmpty,
                Nothing::Refuse => self.refuse(Refusal::Nothing),
            },
        }
    }

    /// Commit `{output}` (found as `found`), unless it is not something to commit.
    fn commit_output(&mut self, found: Found) -> Step {
        match (found, self.rules.dirs) {
            (Found::File, _) | (Found::Dir, true) if self.unsynced() || self.rules.synced => {
                self.synced = true;
                Step::Rename
            }
            (Found::File, _) | (Found::Dir, true) => Step::SyncOutput,
            _ => self.refuse(Refusal::NotAFile(self.rules.output.clone())),
        }
    }

    /// Whether this commit is broken on purpose to skip the data's sync (the flag that
    /// says it was synced is set all the same, so that the simulator's invariants, not
    /// the machine's assertion, have to catch it).
    fn unsynced(&self) -> bool {
        super::mutation(self.mutation) == Some(Mutation::Unsynced)
    }

    fn refuse(&mut self, why: Refusal) -> Step {
        self.outcome = Some(Outcome::Refused(why));
        Step::Ended
    }

    fn end(&mut self, o: Outcome) {
        self.outcome = Some(o);
        self.step = Step::Ended;
    }

    /// The procedure's order, checked after every state change (debug builds and the
    /// simulator): nothing is written before the fence passed, no rename before its
    /// data was synced, an outcome only at the end, and a commit only once durable.
    pub fn assert_invariants(&self) {
        if !(cfg!(debug_assertions) || cfg!(feature = "sim")) {
            return;
        }
        let writes = !matches!(self.step, Step::Fence | Step::Ended);
        assert!(
            !writes || self.fenced,
            "commit: {:?} before the fence passed",
            self.step
        );
        assert!(
            self.step != Step::Rename || self.synced,
            "commit: a rename before its data was synced"
        );
        assert_eq!(
            self.outcome.is_some(),
            self.step == Step::Ended,
            "commit: an outcome must come exactly at the end"
        );
        assert!(
            self.pending.is_none() || self.step == Step::SyncDir,
            "commit: an outcome held back, but not for the directory's sync"
        );
        if let Some(Outcome::Committed { .. } | Outcome::Lost) = &self.outcome {
            assert!(self.fenced, "commit: committed without the fence");
        }
    }
}

fn parent(p: &Path) -> &Path {
    p.parent().unwrap_or(Path::new("."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    fn rules() -> Rules {
        Rules {
            site: Site::ShardCommit,
            output: "/d/r/rank-0.partial.g1.jsonl".into(),
            dest: "/d/r/rank-0.jsonl".into(),
            look: true,
            dirs: false,
            synced: false,
            written: Written::Adopt,
            nothing: Nothing::Refuse,
            taken: Taken::Fail,
            journal_first: None,
        }
    }

    /// Run `m` answering each effect with the next of `answers`; the effects asked and
    /// the outcome.
    fn run(rules: Rules, answers: &[Input]) -> (Vec<Effect>, Outcome) {
        let mut m = CommitMachine::new(rules);
        let mut asked = vec![];
        let mut answers = answers.iter();
        while let Some(e) = m.poll_effect() {
            assert_eq!(m.poll_effect(), None, "one effect at a time");
            asked.push(e);
            m.handle(answers.next().expect("an answer for every effect").clone());
        }
        assert!(answers.next().is_none(), "every answer was asked for");
        (asked, m.outcome().cloned().expect("ended"))
    }

    fn p(s: &str) -> PathBuf {
        s.into()
    }

    #[test]
    fn output_is_fenced_looked_at_synced_renamed_without_replacing_and_its_directory_synced() {
        let (effects, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(Some(Found::File)),
                Input::Looked(None),
                Input::Done,
                Input::Done,
                Input::Done,
            ],
        );
        assert_eq!(
            effects,
            [
                Effect::Fence(Site::ShardCommit),
                Effect::Look(p("/d/r/rank-0.partial.g1.jsonl")),
                Effect::Look(p("/d/r/rank-0.jsonl")),
                Effect::Sync(p("/d/r/rank-0.partial.g1.jsonl")),
                Effect::Rename {
                    from: p("/d/r/rank-0.partial.g1.jsonl"),
                    to: p("/d/r/rank-0.jsonl")
                },
                Effect::SyncDir(p("/d/r")),
            ]
        );
        assert_eq!(
            outcome,
            Outcome::Committed {
                adopted: false,
                empty: false
            }
        );
    }

    #[test]
    fn a_final_name_the_command_wrote_is_adopted_only_as_a_regular_file_and_only_where_allowed() {
        let (effects, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Looked(Some(Found::File)),
                Input::Done,
                Input::Done,
            ],
        );
        assert_eq!(effects[3], Effect::Sync(p("/d/r/rank-0.jsonl")));
        assert_eq!(effects[4], Effect::SyncDir(p("/d/r")));
        assert_eq!(
            outcome,
            Outcome::Committed {
                adopted: true,
                empty: false
            }
        );
        // A link planted under the final name is not adopted (nor followed).
        let (effects, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Looked(Some(Found::Other)),
            ],
        );
        assert_eq!(effects.len(), 3);
        assert_eq!(
            outcome,
            Outcome::Refused(Refusal::NotAFile(p("/d/r/rank-0.jsonl")))
        );
        // Where only {output} is committed, the command's own file is refused.
        let refuse = Rules {
            written: Written::Refuse,
            ..rules()
        };
        let (_, outcome) = run(
            refuse,
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Looked(Some(Found::File)),
            ],
        );
        assert_eq!(outcome, Outcome::Refused(Refusal::WroteFinal));
    }

    #[test]
    fn both_names_written_or_neither_is_refused_before_any_write() {
        for (output, dest, why) in [
            (Some(Found::File), Some(Found::File), Refusal::Both),
            (None, None, Refusal::Nothing),
        ] {
            let (effects, outcome) = run(
                rules(),
                &[Input::Passed, Input::Looked(output), Input::Looked(dest)],
            );
            assert!(effects
                .iter()
                .all(|e| matches!(e, Effect::Fence(_) | Effect::Look(_))));
            assert_eq!(outcome, Outcome::Refused(why));
        }
        // A directory as {output} only where the rules take one.
        let (_, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(Some(Found::Dir)),
                Input::Looked(None),
            ],
        );
        assert_eq!(
            outcome,
            Outcome::Refused(Refusal::NotAFile(p("/d/r/rank-0.partial.g1.jsonl")))
        );
        let dirs = Rules {
            dirs: true,
            ..rules()
        };
        let (effects, _) = run(
            dirs,
            &[
                Input::Passed,
                Input::Looked(Some(Found::Dir)),
                Input::Looked(None),
                Input::Done,
                Input::Done,
                Input::Done,
            ],
        );
        assert!(matches!(effects[4], Effect::Rename { .. }));
    }

    #[test]
    fn nothing_written_commits_an_empty_file_exclusively_without_a_second_directory_sync() {
        let empty = Rules {
            nothing: Nothing::Empty,
            ..rules()
        };
        let (effects, outcome) = run(
            empty.clone(),
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Looked(None),
                Input::Created(true),
            ],
        );
        assert_eq!(
            effects.last(),
            Some(&Effect::CreateEmpty(p("/d/r/rank-0.jsonl")))
        );
        assert_eq!(
            outcome,
            Outcome::Committed {
                adopted: false,
                empty: true
            }
        );
        // Another writer's file under the name is never replaced: the commit fails.
        let (_, outcome) = run(
            empty,
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Looked(None),
                Input::Created(false),
            ],
        );
        assert!(matches!(outcome, Outcome::Failed { taken: true, .. }));
    }

    #[test]
    fn a_commit_that_yields_removes_its_output_and_syncs_the_directory_when_another_won() {
        let item = Rules {
            site: Site::Other,
            written: Written::NotLooked,
            nothing: Nothing::Empty,
            taken: Taken::Yield,
            ..rules()
        };
        let (effects, outcome) = run(
            item.clone(),
            &[
                Input::Passed,
                Input::Looked(Some(Found::File)),
                Input::Done,
                Input::Failed(ErrorKind::AlreadyExists, "File exists".into()),
                Input::Done,
                Input::Done,
            ],
        );
        assert_eq!(
            &effects[1..],
            [
                Effect::Look(p("/d/r/rank-0.partial.g1.jsonl")),
                Effect::Sync(p("/d/r/rank-0.partial.g1.jsonl")),
                Effect::Rename {
                    from: p("/d/r/rank-0.partial.g1.jsonl"),
                    to: p("/d/r/rank-0.jsonl")
                },
                Effect::Remove(p("/d/r/rank-0.partial.g1.jsonl")),
                Effect::SyncDir(p("/d/r")),
            ]
        );
        assert_eq!(outcome, Outcome::Lost);
        // An empty item whose name another attempt made meanwhile yields too.
        let (effects, outcome) = run(
            item,
            &[
                Input::Passed,
                Input::Looked(None),
                Input::Created(false),
                Input::Done,
                Input::Done,
            ],
        );
        assert_eq!(
            effects[3],
            Effect::Remove(p("/d/r/rank-0.partial.g1.jsonl"))
        );
        assert_eq!(outcome, Outcome::Lost);
    }

    #[test]
    fn a_name_taken_while_the_command_ran_fails_a_commit_that_does_not_yield() {
        let (_, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(Some(Found::File)),
                Input::Looked(None),
                Input::Done,
                Input::Failed(ErrorKind::AlreadyExists, "File exists".into()),
            ],
        );
        assert_eq!(
            outcome,
            Outcome::Failed {
                path: p("/d/r/rank-0.partial.g1.jsonl"),
                error: "File exists".into(),
                taken: true
            }
        );
        // Any other failure names its step's path and is not "taken".
        let (_, outcome) = run(
            rules(),
            &[
                Input::Passed,
                Input::Looked(Some(Found::File)),
                Input::Looked(None),
                Input::Failed(ErrorKind::Other, "Input/output error".into()),
            ],
        );
        assert!(
            matches!(outcome, Outcome::Failed { taken: false, ref path, .. } if path == &p("/d/r/rank-0.partial.g1.jsonl"))
        );
    }

    #[test]
    fn without_a_look_the_output_known_to_be_there_is_committed_after_the_fence_and_a_journal_first_comes_right_after_it(
    ) {
        let prepared = Rules {
            site: Site::Other,
            look: false,
            dirs: true,
            written: Written::NotLooked,
            journal_first: Some("rollout-train".into()),
            ..rules()
        };
        let (effects, _) = run(
            prepared,
            &[
                Input::Passed,
                Input::Passed,
                Input::Done,
                Input::Done,
                Input::Done,
            ],
        );
        assert_eq!(effects[0], Effect::Fence(Site::Other));
        assert_eq!(effects[1], Effect::Journal("rollout-train".into()));
        assert!(matches!(effects[2], Effect::Sync(_)));
        assert!(matches!(effects[3], Effect::Rename { .. }));
    }

    #[test]
    fn the_unsynced_mutation_renames_without_the_data_sync_and_only_with_the_sim_feature() {
        let mut m = CommitMachine::broken(rules(), Some(Mutation::Unsynced));
        let mut asked = vec![];
        let answers = [
            Input::Passed,
            Input::Looked(Some(Found::File)),
            Input::Looked(None),
        ];
        for a in answers {
            asked.push(m.poll_effect().unwrap());
            m.handle(a);
        }
        let next = m.poll_effect().unwrap();
        match cfg!(feature = "sim") {
            true => assert!(matches!(next, Effect::Rename { .. }), "{next:?}"),
            false => assert!(matches!(next, Effect::Sync(_)), "{next:?}"),
        }
    }

    /// A plausible answer to `e`, drawn from `pick`.
    fn answer(e: &Effect, pick: u8) -> Input {
        let fail = || Input::Failed(ErrorKind::Other, "Input/output error".into());
        match (e, pick % 5) {
            (_, 4) if !matches!(e, Effect::Fence(_) | Effect::Journal(_)) => fail(),
            (Effect::Fence(_) | Effect::Journal(_), _) => Input::Passed,
            (Effect::Look(_), k) => Input::Looked(
                [
                    None,
                    Some(Found::File),
                    Some(Found::Dir),
                    Some(Found::Other),
                ][k as usize],
            ),
            (Effect::Rename { .. }, 1) => {
                Input::Failed(ErrorKind::AlreadyExists, "File exists".into())
            }
            (Effect::CreateEmpty(_), k) => Input::Created(k % 2 == 0),
            _ => Input::Done,
        }
    }

    proptest::proptest! {
        /// Whatever the directory answers, under any rules: the fence comes first; nothing
        /// is written before it; `{output}` is renamed only after its data was synced; a
        /// commit is reported only after its name was made durable (the directory synced
        /// after the rename, or the exclusive create, which syncs it); a commit that does
        /// not yield never removes anything; and the procedure ends.
        #[test]
        fn any_answers_keep_the_procedures_order(
            picks in proptest::collection::vec(0u8..20, 12),
            look in proptest::bool::ANY,
            dirs in proptest::bool::ANY,
            written in 0usize..3,
            empty in proptest::bool::ANY,
            yields in proptest::bool::ANY,
            journal_first in proptest::bool::ANY,
            synced in proptest::bool::ANY,
        ) {
            let rules = Rules {
                look,
                dirs,
                written: [Written::NotLooked, Written::Adopt, Written::Refuse][written],
                nothing: if empty { Nothing::Empty } else { Nothing::Refuse },
                taken: if yields { Taken::Yield } else { Taken::Fail },
                journal_first: journal_first.then(|| "rollout-train".to_string()),
                synced,
                ..rules()
            };
            let mut m = CommitMachine::new(rules.clone());
            let mut trace: Vec<(Effect, Input)> = vec![];
            let mut picks = picks.into_iter();
            while let Some(e) = m.poll_effect() {
                let a = answer(&e, picks.next().expect("at most 12 steps"));
                trace.push((e, a.clone()));
                m.handle(a);
            }
            let outcome = m.outcome().cloned().expect("ended");
            proptest::prop_assert!(matches!(trace[0].0, Effect::Fence(_)));
            let output = &rules.output;
            for (i, (e, _)) in trace.iter().enumerate() {
                if let Effect::Rename { from, .. } = e {
                    proptest::prop_assert_eq!(from, output);
                    let synced_here = trace[..i].iter().any(|(e, a)| *e == Effect::Sync(output.clone()) && *a == Input::Done);
                    proptest::prop_assert!(synced != synced_here, "renamed unsynced, or synced twice: {:?}", trace);
                }
                if matches!(e, Effect::Remove(_)) {
                    proptest::prop_assert!(yields, "removed without yielding: {:?}", trace);
                }
            }
            if let Outcome::Committed { empty, adopted } = outcome {
                let last = &trace.last().unwrap();
                let durable = match empty {
                    true => last.0 == Effect::CreateEmpty(rules.dest.clone()) && last.1 == Input::Created(true),
                    false => matches!(last.0, Effect::SyncDir(_)) && last.1 == Input::Done,
                };
                proptest::prop_assert!(durable, "reported before durable: {:?}", trace);
                let named = trace.iter().any(|(e, a)| match (e, adopted) {
                    (Effect::Rename { .. }, false) => *a == Input::Done,
                    (Effect::Sync(p), true) => *p == rules.dest && *a == Input::Done,
                    _ => empty,
                });
                proptest::prop_assert!(named, "committed without a commit: {:?}", trace);
                proptest::prop_assert!(!adopted || rules.written == Written::Adopt);
            }
            if let Outcome::Lost = outcome {
                proptest::prop_assert!(yields);
            }
        }
    }

    #[test]
    #[should_panic(expected = "no answer to")]
    fn an_answer_that_does_not_fit_the_step_is_a_driver_bug() {
        let mut m = CommitMachine::new(rules());
        m.poll_effect();
        m.handle(Input::Created(true));
    }
}
