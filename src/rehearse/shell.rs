//! Enough of `sh` to read a rendered command line: `$VAR` expansion with the command's
//! environment, words and quotes, and the simple commands that `&&`, `;` and `|` separate,
//! so that a rehearsal knows which programs a command starts and which paths it names.
//! It reads, it never runs: a construct it does not know (`$(…)`, here-documents) stays
//! text, which at worst hides a program or path from the rehearsal's findings.

use std::collections::BTreeMap;

/// A word of a simple command and the redirection or builtin that reads it, if any.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Word {
    pub text: String,
    /// Read as a file by the shell itself: after `<`, `.` or `source`.
    pub read_by_shell: bool,
}

/// Programs that run for real in a rehearsal: the shell's own commands and harmless
/// utilities, which only touch what the command names (the rehearsal's directory).
pub(crate) const REAL: &[&str] = &[
    "sh", "bash", "dash", "zsh", ".", "source", "export", "cd", "test", "[", "true", "false",
    "echo", "printf", "set", "unset", "exit", "read", "wait", "sleep", "cat", "head", "tail",
    "grep", "mkdir", "touch", "date", "hostname", "basename", "dirname", "pwd", "umask", "ulimit",
    "trap", ":", "eval", "shift", "local", "return",
];

/// Words that start another program: `exec python …`, `env A=1 python …`.
const WRAPPERS: &[&str] = &["exec", "env", "nohup", "time", "nice", "command", "stdbuf"];

/// `text` with `$NAME`, `${NAME}`, `${NAME:+alt}` and `${NAME:-default}` expanded from
/// `env`; the names used that `env` does not set (except in `:+`/`:-` forms).
pub(crate) fn expand(text: &str, env: &BTreeMap<String, String>) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut unset = Vec::new();
    let mut quote = false;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\'' && !quote {
            // A single-quoted string expands nothing.
            let end = chars[i + 1..].iter().position(|&x| x == '\'');
            let end = end.map_or(chars.len(), |e| i + 1 + e);
            out.extend(&chars[i..(end + 1).min(chars.len())]);
            i = end + 1;
            continue;
        }
        if c == '"' {
            quote = !quote;
        }
        if c == '\\' && i + 1 < chars.len() {
            out.push(c);
            out.push(chars[i + 1]);
            i += 2;
            continue;
        }
        if c != '$' || i + 1 >= chars.len() {
            out.push(c);
            i += 1;
            continue;
        }
        let (value, len) = variable(&chars[i + 1..], env, &mut unset);
        match value {
            Some(v) => out.push_str(&v),
            None => out.push('$'),
        }
        i += 1 + len;
    }
    (out, unset)
}

/// The value of the variable reference after a `$` and how many characters it took; `None`
/// when the `$` starts none (`$(`, `$1`).
fn variable(
    rest: &[char],
    env: &BTreeMap<String, String>,
    unset: &mut Vec<String>,
) -> (Option<String>, usize) {
    let name_len = |s: &[char]| {
        s.iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
            .unwrap_or(s.len())
    };
    if rest[0] == '{' {
        let Some(close) = rest.iter().position(|&c| c == '}') else {
            return (None, 0);
        };
        let inner: String = rest[1..close].iter().collect();
        let n = name_len(&rest[1..close]);
        let (name, op) = inner.split_at(n);
        let value = env.get(name).filter(|v| !v.is_empty());
        let v = if let Some(alt) = op.strip_prefix(":+") {
            value.map(|_| expand(alt, env).0).unwrap_or_default()
        } else if let Some(default) = op.strip_prefix(":-") {
            value.cloned().unwrap_or_else(|| expand(default, env).0)
        } else {
            if !env.contains_key(name) {
                unset.push(name.to_string());
            }
            value.cloned().unwrap_or_default()
        };
        return (Some(v), close + 1);
    }
    let n = name_len(rest);
    if n == 0 || rest[0].is_ascii_digit() {
        return (None, 0);
    }
    let name: String = rest[..n].iter().collect();
    if !env.contains_key(&name) {
        unset.push(name.clone());
    }
    (Some(env.get(&name).cloned().unwrap_or_default()), n)
}

/// The simple commands of expanded shell text, each as its words.
pub(crate) fn commands(text: &str) -> Vec<Vec<Word>> {
    let mut all = Vec::new();
    let mut cmd: Vec<Word> = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut reads_next = false;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    let end_word =
        |cmd: &mut Vec<Word>, word: &mut String, in_word: &mut bool, reads: &mut bool| {
            if *in_word {
                let text = std::mem::take(word);
                let sourced = cmd.len() == 1 && (cmd[0].text == "." || cmd[0].text == "source");
                let read_by_shell = *reads || sourced;
                cmd.push(Word {
                    text,
                    read_by_shell,
                });
                *in_word = false;
                *reads = false;
            }
        };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\'' | '"' => {
                let close = chars[i + 1..].iter().position(|&x| x == c);
                let close = close.map_or(chars.len(), |e| i + 1 + e);
                word.extend(&chars[i + 1..close.min(chars.len())]);
                in_word = true;
                i = close + 1;
                continue;
            }
            '\\' if i + 1 < chars.len() => {
                word.push(chars[i + 1]);
                in_word = true;
                i += 2;
                continue;
            }
            ' ' | '\t' => end_word(&mut cmd, &mut word, &mut in_word, &mut reads_next),
            ';' | '&' | '|' | '\n' | '(' | ')' => {
                end_word(&mut cmd, &mut word, &mut in_word, &mut reads_next);
                if !cmd.is_empty() {
                    all.push(std::mem::take(&mut cmd));
                }
            }
            '<' | '>' => {
                // A redirection's file is no argument of the program.
                if in_word && word.chars().all(|d| d.is_ascii_digit()) {
                    word.clear();
                    in_word = false;
                }
                end_word(&mut cmd, &mut word, &mut in_word, &mut reads_next);
                reads_next = c == '<';
                if c == '>' {
                    // The target is written, not read: a word of its own, not the program's.
                    let start = i
                        + 1
                        + chars[i + 1..]
                            .iter()
                            .take_while(|&&x| x == '>' || x == '&' || x == ' ')
                            .count();
                    let stop = chars[start..]
                        .iter()
                        .position(|x| " \t;&|\n()".contains(*x))
                        .map_or(chars.len(), |p| start + p);
                    i = stop;
                    continue;
                }
            }
            _ => {
                word.push(c);
                in_word = true;
            }
        }
        i += 1;
    }
    end_word(&mut cmd, &mut word, &mut in_word, &mut reads_next);
    if !cmd.is_empty() {
        all.push(cmd);
    }
    all
}

/// The program a simple command starts (after assignments and wrappers), and where in its
/// words it is; a `sh -c TEXT` yields the programs of TEXT instead.
pub(crate) fn programs(cmd: &[Word]) -> Vec<String> {
    let mut i = 0;
    while i < cmd.len() {
        let w = &cmd[i].text;
        let assignment = w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if assignment
            || (i > 0 && WRAPPERS.contains(&cmd[i - 1].text.as_str()) && w.starts_with('-'))
        {
            i += 1;
            continue;
        }
        if WRAPPERS.contains(&w.as_str()) {
            i += 1;
            continue;
        }
        if w == "timeout" {
            i += 2;
            continue;
        }
        break;
    }
    let Some(prog) = cmd.get(i) else {
        return Vec::new();
    };
    let name = prog.text.as_str();
    if matches!(name, "sh" | "bash" | "dash" | "zsh") {
        if let Some(pos) = cmd[i + 1..].iter().position(|w| w.text == "-c") {
            if let Some(script) = cmd.get(i + 2 + pos) {
                return commands(&script.text)
                    .iter()
                    .flat_map(|c| programs(c))
                    .collect();
            }
        }
    }
    vec![name.to_string()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn expands_like_sh() {
        let e = env(&[("W", "/opt/w"), ("EMPTY", "")]);
        let (t, unset) = expand(
            "python ${W}/run.py \"$W\" '$W' ${EMPTY:+x=$W} ${R:-d} $NOPE $(x)",
            &e,
        );
        assert_eq!(t, "python /opt/w/run.py \"/opt/w\" '$W'  d  $(x)");
        assert_eq!(unset, vec!["NOPE".to_string()]);
    }

    #[test]
    fn finds_programs_and_files_the_shell_reads() {
        let cmds = commands(
            ". /l/env.sh && export A=1 B=2 && FORCE=1 llamafactory-cli train /l/c.yaml out=/o > /log 2>&1; env Y=1 torchrun a.py < /in; bash -c 'python3 x.py | tee /t'",
        );
        let progs: Vec<String> = cmds.iter().flat_map(|c| programs(c)).collect();
        assert_eq!(
            progs,
            [
                ".",
                "export",
                "llamafactory-cli",
                "torchrun",
                "python3",
                "tee"
            ]
        );
        assert!(cmds[0][1].read_by_shell, "{:?}", cmds[0]);
        assert_eq!(
            cmds[2].iter().map(|w| w.text.as_str()).collect::<Vec<_>>(),
            [
                "FORCE=1",
                "llamafactory-cli",
                "train",
                "/l/c.yaml",
                "out=/o"
            ]
        );
        let input = cmds[3].iter().find(|w| w.text == "/in").unwrap();
        assert!(input.read_by_shell);
    }
}
