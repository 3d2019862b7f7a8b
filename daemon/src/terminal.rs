//! Text for people's terminals. Names come from other users (model names, tensor names, file
//! names, session labels): before one is printed in a table, a log line or a message, the
//! characters a terminal would act on instead of showing are escaped, so that a name cannot
//! retitle a window, clear a screen, or reorder what follows it. JSON output keeps names as
//! they are (JSON escapes them its own way).

use std::borrow::Cow;
use std::fmt;

/// Whether a terminal acts on `c` rather than showing it: C0 and C1 controls (ESC, BEL, CR,
/// newline …), DEL, and the marks that reorder bidirectional text or break lines.
fn acts(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}'
                | '\u{2028}' | '\u{2029}'
        )
}

/// `text` with each character a terminal would act on written as `\u{…}` (ESC is `\u{1b}`);
/// borrowed when there is none.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(acts) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if acts(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Displays a name escaped ([`escape_controls`]): `format!("{}", Shown(&name))`.
pub struct Shown<'a>(pub &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape_controls(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_terminal_acts_on_is_escaped_and_the_rest_kept() {
        let cases = [
            ("\x1b]0;PWNED\x07", "\\u{1b}]0;PWNED\\u{7}"),
            ("\x1b[2Jclear", "\\u{1b}[2Jclear"),
            ("a\nb\rc\td\0", "a\\u{a}b\\u{d}c\\u{9}d\\u{0}"),
            ("del\x7f", "del\\u{7f}"),
            ("c1\u{9b}31m", "c1\\u{9b}31m"),
            ("evil\u{202E}txt.exe", "evil\\u{202e}txt.exe"),
            ("\u{2066}iso\u{2069}", "\\u{2066}iso\\u{2069}"),
            ("line\u{2028}sep", "line\\u{2028}sep"),
            ("flux.1-dev — LoRA ü 模型", "flux.1-dev — LoRA ü 模型"),
            ("", ""),
        ];
        let failed: Vec<String> = (cases.iter())
            .filter(|(name, want)| escape_controls(name) != *want)
            .map(|(name, want)| format!("{name:?}: want {want:?}, got {:?}", escape_controls(name)))
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
        assert!(matches!(escape_controls("plain"), Cow::Borrowed("plain")));
        assert_eq!(Shown("a\x07").to_string(), "a\\u{7}");
    }
}
