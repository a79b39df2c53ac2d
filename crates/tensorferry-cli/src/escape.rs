//! Text that came from a file or from the system, made safe to show on a terminal.
//!
//! A tensor name or a metadata value is whatever the file's author wrote: `\x1b[2J`
//! clears the screen, `\x1b]0;…\x07` retitles the window, `\r` overwrites a line, and a
//! right-to-left override reorders what follows. Shown raw, a downloaded checkpoint
//! could make the table lie. Each such character is written as Rust writes it in a
//! string literal (`\u{1b}`, `\r`), so what is printed reads back as what the file holds.

use std::borrow::Cow;
use std::fmt::Write;

/// Characters a terminal acts on or that change how the text around them shows:
/// control characters (C0, DEL and C1, whose `\u{9b}` is a one-character `ESC [`), and
/// the invisible formatting ones (bidirectional overrides and isolates, zero-width
/// characters, the byte-order mark, tags).
fn acts_on_terminal(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200b}'..='\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{2069}'
                | '\u{feff}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// `text` with the characters a terminal acts on escaped, and backslashes doubled so that
/// an escape in the output always stands for one character of the file. For names and
/// metadata.
pub fn escaped(text: &str) -> Cow<'_, str> {
    escape_where(text, |c| c == '\\' || acts_on_terminal(c))
}

/// `text` with the characters a terminal acts on escaped, backslashes kept: for messages,
/// whose quoted parts have their backslashes doubled already.
pub fn controls_escaped(text: &str) -> Cow<'_, str> {
    escape_where(text, acts_on_terminal)
}

fn escape_where(text: &str, escape: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(&escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            _ if !escape(c) => out.push(c),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            _ => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// JSON text with every character a terminal acts on written as a JSON escape
/// (`\u009b`). A JSON writer escapes C0 controls only; DEL, C1 and formatting characters
/// pass through. Outside its strings JSON text is ASCII, so each such character is
/// inside a string, where an escape stands for the same character: the document reads
/// back the same.
pub fn json_escaped(json: &str) -> Cow<'_, str> {
    let inside_strings = |c: char| c != '\n' && acts_on_terminal(c);
    if !json.chars().any(inside_strings) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if inside_strings(c) {
            for unit in c.encode_utf16(&mut [0; 2]) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed_as_it_is() {
        assert!(matches!(
            escaped("model.layers.0.ümlaut"),
            Cow::Borrowed("model.layers.0.ümlaut")
        ));
    }

    #[test]
    fn terminal_sequences_are_written_as_rust_escapes() {
        assert_eq!(
            escaped("a\x1b[31m\x07\r\n\t\0\u{9b}\x7f\u{202e}b"),
            r"a\u{1b}[31m\u{7}\r\n\t\u{0}\u{9b}\u{7f}\u{202e}b"
        );
    }

    #[test]
    fn names_double_backslashes_and_messages_keep_them() {
        assert_eq!(escaped(r"a\u{1b}"), r"a\\u{1b}");
        assert_eq!(controls_escaped("\"a\\\\b\x1b\""), "\"a\\\\b\\u{1b}\"");
    }

    #[test]
    fn json_escapes_what_its_writer_leaves_and_reads_back_the_same() {
        let value = serde_json::json!({"k\u{9b}": "v\x7f\u{202e}\u{e0041}"});
        let text = serde_json::to_string_pretty(&value).unwrap();
        let safe = json_escaped(&text);
        assert!(!safe.chars().any(|c| c != '\n' && acts_on_terminal(c)));
        assert!(safe.contains(r"\u009b") && safe.contains(r"\udb40\udc41"));
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&safe).unwrap(),
            value
        );
    }
}
