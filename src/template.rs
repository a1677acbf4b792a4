//! `{name}` templates: the one reader of literal text and `{placeholder}` pieces.
//!
//! Three kinds of template share it, each a [`Dialect`]: phase and server commands
//! (`crate::config::template`), the merge command (`crate::shards::command`) and shard and
//! merged file names (`crate::shards::naming`). A dialect says how braces read
//! ([`Braces`]), which names are placeholders (and what it says about the others), and what
//! else it refuses; a template is read once into a [`Template`], and each kind renders its
//! pieces its own way (shell-quoted, verbatim, or as a file name).
//!
//! In every dialect `{{` and `}}` are a literal `{` and `}`.

/// How a brace that is not half of `{{` or `}}` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Braces {
    /// Shell text, where braces are also shell syntax (`${HOME}`, `{a,b}`, `{ cmd; }`,
    /// JSON): only `{name}` with `name` of lower-case ASCII letters and `_`, not right after
    /// a `$`, is a placeholder; `{name` that runs to the end of the text is unclosed; any
    /// other brace is literal text.
    Shell,
    /// Every `{` opens a placeholder that runs to the next `}`, whatever lies between; a
    /// `}` that closes none is an error.
    Strict,
}

/// A mistake in the braces themselves, whatever the dialect. `at`: the byte offset of the
/// brace in the text read. (Public because `crate::config::TemplateError` carries it.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxError {
    #[error("unclosed `{{` at byte {at}; write `{{{{` for a literal brace")]
    Unclosed { at: usize },
    /// Only in [`Braces::Strict`].
    #[error("unmatched `}}` at byte {at}; write `}}}}` for a literal brace")]
    Unmatched { at: usize },
}

/// Error messages that are plain strings take a syntax error as its message.
impl From<SyntaxError> for String {
    fn from(e: SyntaxError) -> String {
        e.to_string()
    }
}

/// One kind of template: its braces, its placeholders and its refusals. The hooks are
/// called in the order of the text, so the first mistake in the text is the one reported.
pub(crate) trait Dialect {
    /// What a placeholder resolves to (its name, or a field).
    type Var;
    type Error: From<SyntaxError>;
    const BRACES: Braces;

    /// The placeholder `{name}`, or why there is none of that name.
    fn var(&self, name: &str) -> Result<Self::Var, Self::Error>;

    /// Literal text (escapes resolved), checked before anything after it is read.
    fn text(&self, _text: &str) -> Result<(), Self::Error> {
        Ok(())
    }

    /// [`Braces::Shell`]: a `{` that stays literal text, with what lies between it and the
    /// next `}` (`None`: there is no `}` after it), for a dialect that recognises near
    /// misses such as `{RANK}`.
    fn literal_brace(&self, _word: Option<&str>) -> Result<(), Self::Error> {
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece<V> {
    /// Literal text, never empty; adjacent literal text is one piece.
    Text(String),
    Var(V),
}

/// A template read once: literal text and placeholders, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template<V> {
    pieces: Vec<Piece<V>>,
}

impl<V> Template<V> {
    /// Read `text` in dialect `d`.
    pub(crate) fn parse<D: Dialect<Var = V>>(text: &str, d: &D) -> Result<Template<V>, D::Error> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        // Literal text so far becomes a piece once the dialect accepts it.
        let flush = |lit: &mut String, pieces: &mut Vec<Piece<V>>| -> Result<(), D::Error> {
            if !lit.is_empty() {
                d.text(lit)?;
                pieces.push(Piece::Text(std::mem::take(lit)));
            }
            Ok(())
        };
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if (c == b'{' || c == b'}') && b.get(i + 1) == Some(&c) {
                lit.push(c as char);
                i += 2;
                continue;
            }
            match (D::BRACES, c) {
                (Braces::Shell, b'{') if !(i > 0 && b[i - 1] == b'$') => {
                    let rest = &text[i + 1..];
                    let name_len = rest
                        .find(|ch: char| !(ch.is_ascii_lowercase() || ch == '_'))
                        .unwrap_or(rest.len());
                    if name_len > 0 && rest[name_len..].starts_with('}') {
                        flush(&mut lit, &mut pieces)?;
                        pieces.push(Piece::Var(d.var(&rest[..name_len])?));
                        i += name_len + 2;
                        continue;
                    }
                    if name_len > 0 && name_len == rest.len() {
                        flush(&mut lit, &mut pieces)?;
                        return Err(SyntaxError::Unclosed { at: i }.into());
                    }
                    d.literal_brace(rest.find('}').map(|e| &rest[..e]))?;
                }
                (Braces::Strict, b'{') => {
                    let rest = &text[i + 1..];
                    let Some(e) = rest.find('}') else {
                        flush(&mut lit, &mut pieces)?;
                        return Err(SyntaxError::Unclosed { at: i }.into());
                    };
                    flush(&mut lit, &mut pieces)?;
                    pieces.push(Piece::Var(d.var(&rest[..e])?));
                    i += e + 2;
                    continue;
                }
                (Braces::Strict, b'}') => {
                    flush(&mut lit, &mut pieces)?;
                    return Err(SyntaxError::Unmatched { at: i }.into());
                }
                _ => {}
            }
            let ch = text[i..].chars().next().expect("in bounds");
            lit.push(ch);
            i += ch.len_utf8();
        }
        flush(&mut lit, &mut pieces)?;
        Ok(Template { pieces })
    }

    pub(crate) fn pieces(&self) -> &[Piece<V>] {
        &self.pieces
    }

    /// The placeholders, in order (a repeated one as often as it appears).
    pub(crate) fn vars(&self) -> impl Iterator<Item = &V> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Var(v) => Some(v),
            Piece::Text(_) => None,
        })
    }

    /// The text with each placeholder replaced: `value` appends a placeholder's value.
    pub(crate) fn render(&self, value: impl FnMut(&V, &mut String)) -> String {
        render(&self.pieces, value)
    }
}

/// [`Template::render`] for a run of pieces (such as a file name's, cut out of a path).
pub(crate) fn render<V>(pieces: &[Piece<V>], mut value: impl FnMut(&V, &mut String)) -> String {
    let mut out = String::new();
    for p in pieces {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Var(v) => value(v, &mut out),
        }
    }
    out
}

/// Names as a dialect lists them in messages: `{a} {b} {c}`.
pub(crate) fn braced_list<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|n| format!("{{{n}}}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `v` as one shell word: as it is when nothing in it is special, else single-quoted.
/// The one quoting of the program (the demo's commands use it too). Not `shlex`'s: it
/// quotes every word with `=` or `,`, so each Hydra-style override (`a.b=1`) in a rendered
/// command, a plan and a refusal message would show in quotes.
pub(crate) fn shell_word(v: &str) -> String {
    let safe = !v.is_empty()
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c));
    if safe {
        v.to_string()
    } else {
        format!("'{}'", v.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dialect that knows `a`, `b` and `long_name`, refuses literal text containing `!`
    /// (as file names refuse NUL) and takes `{A}` for a near miss of `{a}`; strict or shell.
    struct Test<const STRICT: bool>;

    impl<const STRICT: bool> Dialect for Test<STRICT> {
        type Var = &'static str;
        type Error = String;
        const BRACES: Braces = if STRICT {
            Braces::Strict
        } else {
            Braces::Shell
        };
        fn var(&self, name: &str) -> Result<&'static str, String> {
            ["a", "b", "long_name"]
                .into_iter()
                .find(|n| *n == name)
                .ok_or_else(|| format!("unknown `{name}`"))
        }
        fn text(&self, text: &str) -> Result<(), String> {
            match text.contains('!') {
                true => Err(format!("bad text `{text}`")),
                false => Ok(()),
            }
        }
        fn literal_brace(&self, word: Option<&str>) -> Result<(), String> {
            match word {
                Some("A") => Err("did you mean `{a}`?".into()),
                _ => Ok(()),
            }
        }
    }

    fn shell(text: &str) -> Result<Template<&'static str>, String> {
        Template::parse(text, &Test::<false>)
    }

    fn strict(text: &str) -> Result<Template<&'static str>, String> {
        Template::parse(text, &Test::<true>)
    }

    /// The template back as text, placeholders as `<name>`.
    fn show(t: &Template<&'static str>) -> String {
        t.render(|v, out| {
            out.push('<');
            out.push_str(v);
            out.push('>');
        })
    }

    fn text(s: &str) -> Piece<&'static str> {
        Piece::Text(s.into())
    }

    #[test]
    fn pieces_split_text_and_placeholders() {
        for parse in [shell, strict] {
            let t = parse("x {a}{b} y{long_name}").unwrap();
            assert_eq!(
                t.pieces(),
                [
                    text("x "),
                    Piece::Var("a"),
                    Piece::Var("b"),
                    text(" y"),
                    Piece::Var("long_name")
                ]
            );
            assert_eq!(
                t.vars().copied().collect::<Vec<_>>(),
                ["a", "b", "long_name"]
            );
            assert_eq!(show(&t), "x <a><b> y<long_name>");
            assert_eq!(parse("").unwrap().pieces(), []);
            assert_eq!(parse("{a}").unwrap().pieces(), [Piece::Var("a")]);
        }
    }

    #[test]
    fn doubled_braces_are_literal_in_both() {
        for parse in [shell, strict] {
            let t = parse("{{a}} {{{a}}} }}{{").unwrap();
            assert_eq!(show(&t), "{a} {<a>} }{");
            // Escapes join the literal text around them.
            assert_eq!(t.pieces()[0], text("{a} {"));
        }
    }

    #[test]
    fn unterminated_brace() {
        let unclosed = |at| Err(SyntaxError::Unclosed { at }.to_string());
        assert_eq!(shell("x {a").map(|t| show(&t)), unclosed(2));
        assert_eq!(strict("x {a").map(|t| show(&t)), unclosed(2));
        assert_eq!(strict("{").map(|t| show(&t)), unclosed(0));
        assert_eq!(strict("{a {b").map(|t| show(&t)), unclosed(0));
        // Shell: only a would-be name that runs to the end is unclosed; other braces are
        // shell syntax.
        assert_eq!(shell("{").unwrap().pieces(), [text("{")]);
        assert_eq!(shell("{a,b").unwrap().pieces(), [text("{a,b")]);
        assert_eq!(shell("{A").unwrap().pieces(), [text("{A")]);
        assert_eq!(shell("${a").unwrap().pieces(), [text("${a")]);
        assert_eq!(
            SyntaxError::Unclosed { at: 7 }.to_string(),
            "unclosed `{` at byte 7; write `{{` for a literal brace"
        );
    }

    #[test]
    fn lone_closing_brace() {
        assert_eq!(shell("a} }").unwrap().pieces(), [text("a} }")]);
        assert_eq!(
            strict("ab}").map(|t| show(&t)),
            Err("unmatched `}` at byte 2; write `}}` for a literal brace".into())
        );
        // `{{}` is an escaped `{`, then a lone `}`.
        assert_eq!(
            strict("{{}").map(|t| show(&t)),
            Err(SyntaxError::Unmatched { at: 2 }.to_string())
        );
    }

    #[test]
    fn empty_braces() {
        assert_eq!(shell("x{}y").unwrap().pieces(), [text("x{}y")]);
        assert_eq!(strict("x{}y").map(|t| show(&t)), Err("unknown ``".into()));
    }

    #[test]
    fn unknown_names() {
        assert_eq!(
            shell("{a} {c}").map(|t| show(&t)),
            Err("unknown `c`".into())
        );
        assert_eq!(
            strict("{a} {c}").map(|t| show(&t)),
            Err("unknown `c`".into())
        );
        // Strict: whatever lies between the braces is the name.
        assert_eq!(
            strict("{A b}").map(|t| show(&t)),
            Err("unknown `A b`".into())
        );
        assert_eq!(
            strict("{a{b}").map(|t| show(&t)),
            Err("unknown `a{b`".into())
        );
        assert_eq!(
            strict("${a}").unwrap().pieces(),
            [text("$"), Piece::Var("a")]
        );
    }

    #[test]
    fn shell_syntax_stays_text() {
        let t = shell("echo ${a} {a,b} { x; } {\"k\": 1} {B} {a-} $x{a}").unwrap();
        assert_eq!(show(&t), "echo ${a} {a,b} { x; } {\"k\": 1} {B} {a-} $x<a>");
        // `{a_}` is a placeholder candidate with an unknown name, not text.
        assert_eq!(shell("{a_}"), Err("unknown `a_`".into()));
        // After `$`, even a known name is shell syntax; `$` then `{{` is an escape.
        assert_eq!(show(&shell("${{a}}").unwrap()), "${a}");
        assert_eq!(show(&shell("$}}{a}").unwrap()), "$}<a>");
        // Non-ASCII text around and inside braces.
        assert_eq!(show(&shell("é{a}ü {é}").unwrap()), "é<a>ü {é}");
    }

    #[test]
    fn hooks_run_in_text_order() {
        // Literal braces are shown to the dialect (here `{A}` is a near miss).
        assert_eq!(shell("{a} {A}"), Err("did you mean `{a}`?".into()));
        assert_eq!(shell("{c} {A}"), Err("unknown `c`".into()));
        assert_eq!(shell("{A} {c}"), Err("did you mean `{a}`?".into()));
        // Text is checked before the placeholder or brace mistake after it.
        assert_eq!(shell("x! {c}"), Err("bad text `x! `".into()));
        assert_eq!(shell("{c} x!"), Err("unknown `c`".into()));
        assert_eq!(strict("x! }"), Err("bad text `x! `".into()));
        assert_eq!(strict("x! {"), Err("bad text `x! `".into()));
        assert_eq!(
            strict("} x!"),
            Err(SyntaxError::Unmatched { at: 0 }.to_string())
        );
        assert_eq!(shell("x! {a"), Err("bad text `x! `".into()));
        assert_eq!(shell("{a}x!"), Err("bad text `x!`".into()));
    }

    #[test]
    fn render_pieces_and_lists() {
        let t = strict("d/{a}-{b}.x").unwrap();
        let file = &t.pieces()[1..];
        assert_eq!(
            render(file, |v, out| out.push_str(&v.len().to_string())),
            "1-1.x"
        );
        assert_eq!(braced_list(["a", "b"]), "{a} {b}");
        assert_eq!(braced_list([]), "");
    }

    #[test]
    fn shell_words() {
        assert_eq!(shell_word("a/b.c-d"), "a/b.c-d");
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("my file"), "'my file'");
        assert_eq!(shell_word("env.max_steps=20"), "env.max_steps=20");
        // What `sh` makes of each word is the value itself.
        for v in [
            "it's",
            "$HOME",
            "`id`",
            "a\"b",
            "back\\slash",
            "*",
            "new\nline",
            "",
            "é ü",
            "'\"$`\\!",
            "~root",
            "a;b|c&d",
        ] {
            let out = std::process::Command::new("sh")
                .args(["-c", &format!("printf %s {}", shell_word(v))])
                .output()
                .expect("sh runs");
            assert_eq!(String::from_utf8_lossy(&out.stdout), v, "{v:?}");
        }
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn parsing_never_panics(s in "\\PC*") {
                let _ = shell(&s);
                let _ = strict(&s);
            }

            /// Any text with its braces doubled reads back as itself, in both dialects.
            #[test]
            fn escaped_text_is_literal(s in "[^!]*") {
                let esc = s.replace('{', "{{").replace('}', "}}");
                for parse in [shell, strict] {
                    let t = parse(&esc).unwrap();
                    prop_assert_eq!(t.vars().count(), 0);
                    prop_assert_eq!(show(&t), s.clone());
                }
            }
        }
    }
}
