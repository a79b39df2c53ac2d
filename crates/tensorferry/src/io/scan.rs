//! A cursor over the regular subset of JSON that writers of safetensors headers emit:
//! strings without `\u` escapes, non-negative or negative integers without exponent or
//! fraction, and the punctuation between them.
//!
//! Every method returns `None` at the first byte outside that subset, and never panics
//! nor allocates (but [`Cursor::unescaped_into`], into the caller's string): the fast
//! readers built on it ([`super::fast_header`], [`super::fast_tree`]) then leave the
//! input to the `serde_json` readers, which accept all of JSON and word every error.

/// A position in a JSON text.
#[derive(Clone, Copy)]
pub(crate) struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `text`.
    pub(crate) fn new(text: &'a str) -> Self {
        Cursor { text, at: 0 }
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// Skips JSON whitespace.
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.bytes().get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    pub(crate) fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.bytes().get(self.at).copied()
    }

    /// Consumes `byte` (after whitespace), or fails.
    pub(crate) fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// Consumes `byte` if it comes next; says whether it did.
    pub(crate) fn eat_if(&mut self, byte: u8) -> bool {
        self.eat(byte).is_some()
    }

    /// Consumes `,` and says true, or `close` and says false.
    pub(crate) fn more(&mut self, close: u8) -> Option<bool> {
        match self.peek()? {
            b',' => {
                self.at += 1;
                Some(true)
            }
            b if b == close => {
                self.at += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// Consumes the bare word `word` (`null`, `true`, `false`).
    pub(crate) fn word(&mut self, word: &str) -> Option<()> {
        self.skip_ws();
        let rest = self.bytes().get(self.at..)?;
        rest.starts_with(word.as_bytes())
            .then(|| self.at += word.len())?;
        self.end_of_token()
    }

    /// Fails when a letter or digit follows a token (`truex`, `12e3`, `1.5`).
    fn end_of_token(&self) -> Option<()> {
        match self.bytes().get(self.at) {
            Some(b) if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+') => None,
            _ => Some(()),
        }
    }

    /// A string without escapes or control characters, borrowed from the text.
    pub(crate) fn plain_str(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.at;
        self.at = special_from(self.bytes(), self.at);
        if *self.bytes().get(self.at)? != b'"' {
            return None;
        }
        let s = self.text.get(start..self.at)?;
        self.at += 1;
        Some(s)
    }

    /// A string whose escapes are all short ones (`\"`, `\n`, …): its length once
    /// unescaped, the cursor moved past it.
    pub(crate) fn unescaped_len(&mut self) -> Option<usize> {
        self.eat(b'"')?;
        let mut len = 0usize;
        loop {
            let plain = special_from(self.bytes(), self.at);
            len += plain - self.at;
            self.at = plain;
            match *self.bytes().get(self.at)? {
                b'"' => break,
                b'\\' => {
                    short_escape(*self.bytes().get(self.at + 1)?)?;
                    self.at += 2;
                }
                _ => return None,
            }
            len += 1;
        }
        self.at += 1;
        // Each multi-byte character was counted once per byte: the length in bytes.
        Some(len)
    }

    /// The string [`Cursor::unescaped_len`] measured, appended to `out` unescaped.
    pub(crate) fn unescaped_into(&mut self, out: &mut String) -> Option<()> {
        self.eat(b'"')?;
        loop {
            let start = self.at;
            self.at = special_from(self.bytes(), self.at);
            out.push_str(self.text.get(start..self.at)?);
            match *self.bytes().get(self.at)? {
                b'"' => break,
                b'\\' => {
                    out.push(short_escape(*self.bytes().get(self.at + 1)?)?);
                    self.at += 2;
                }
                _ => return None,
            }
        }
        self.at += 1;
        Some(())
    }

    /// Consumes `"key"` if that string comes next (after whitespace), nothing otherwise:
    /// what [`Cursor::plain_str`] reads when it returns `key`, for a `key` without
    /// specials, in one comparison.
    pub(crate) fn eat_key(&mut self, key: &str) -> bool {
        self.skip_ws();
        let key = key.as_bytes();
        let Some(rest) = self.bytes().get(self.at..) else {
            return false;
        };
        let found = rest.len() > key.len() + 1
            && rest[0] == b'"'
            && rest[key.len() + 1] == b'"'
            && &rest[1..=key.len()] == key;
        if found {
            self.at += key.len() + 2;
        }
        found
    }

    /// A non-negative integer (no sign, fraction, exponent or leading zero).
    pub(crate) fn uint(&mut self) -> Option<u64> {
        self.skip_ws();
        let start = self.at;
        let digits = self
            .bytes()
            .get(start..)?
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let text = &self.bytes()[start..start + digits];
        // Nineteen digits always fit a u64: only longer numbers need checked arithmetic.
        let n = if digits <= 19 {
            text.iter().fold(0u64, |n, &b| n * 10 + u64::from(b - b'0'))
        } else {
            text.iter().try_fold(0u64, |n, &b| {
                n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
            })?
        };
        if digits == 0 || (digits > 1 && text[0] == b'0') {
            return None;
        }
        self.at += digits;
        self.end_of_token()?;
        Some(n)
    }

    /// Skips what [`Cursor::uint`] would read, without its value or range: digits, then
    /// the end of the token.
    pub(crate) fn digits(&mut self) -> Option<()> {
        self.skip_ws();
        let rest = self.bytes().get(self.at..)?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        self.at += digits;
        self.end_of_token()
    }

    /// A `usize` written as [`Cursor::uint`] reads it.
    pub(crate) fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.uint()?).ok()
    }

    /// An integer that fits `i64`.
    pub(crate) fn int(&mut self) -> Option<i64> {
        if self.peek()? == b'-' {
            self.at += 1;
            // serde_json reads `-0` as the float -0.0: not an integer.
            let n = self.uint().filter(|&n| n > 0)?;
            0i64.checked_sub_unsigned(n)
        } else {
            i64::try_from(self.uint()?).ok()
        }
    }

    /// Fails unless only whitespace is left.
    pub(crate) fn finish(mut self) -> Option<()> {
        self.skip_ws();
        (self.at == self.text.len()).then_some(())
    }
}

/// The index of the first `"`, `\\` or control character of `bytes` from `at` on (the
/// length when none), eight bytes at a time.
pub(crate) fn special_from(bytes: &[u8], mut at: usize) -> usize {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    let has_zero = |w: u64| w.wrapping_sub(ONES) & !w & HIGHS;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let found = has_zero(w ^ (ONES * u64::from(b'"')))
            | has_zero(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGHS);
        if found != 0 {
            break;
        }
        at += 8;
    }
    while let Some(&b) = bytes.get(at) {
        if b == b'"' || b == b'\\' || b < 0x20 {
            break;
        }
        at += 1;
    }
    at
}

/// The character a short escape stands for (`None` for `\u` and anything unknown).
fn short_escape(b: u8) -> Option<char> {
    Some(match b {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_numbers_and_words_of_the_subset_are_read() {
        let mut c = Cursor::new(r#" "ab" "a\"b\\n\n" 0 17 -3 true null "é" "#);
        assert_eq!(c.plain_str(), Some("ab"));
        let mut measured = c;
        assert_eq!(measured.unescaped_len(), Some(6));
        let mut s = String::new();
        c.unescaped_into(&mut s).unwrap();
        assert_eq!(s, "a\"b\\n\n");
        assert_eq!((c.uint(), c.uint(), c.int()), (Some(0), Some(17), Some(-3)));
        assert_eq!((c.word("true"), c.word("null")), (Some(()), Some(())));
        assert_eq!(c.unescaped_len(), Some("é".len()));
        assert!(c.finish().is_some());
    }

    #[test]
    fn the_word_scan_stops_where_the_byte_scan_does() {
        let specials = [b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x7f, 0x80, 0xff, b'a'];
        for len in 0..20 {
            for pos in 0..len {
                for &b in &specials {
                    let mut bytes = vec![b'x'; len];
                    bytes[pos] = b;
                    for from in 0..=len {
                        let slow = (from..len)
                            .find(|&i| matches!(bytes[i], b'"' | b'\\' | 0..=0x1f))
                            .unwrap_or(len);
                        assert_eq!(special_from(&bytes, from), slow, "{bytes:?} from {from}");
                    }
                }
            }
        }
    }

    #[test]
    fn anything_outside_the_subset_is_none() {
        for text in [
            r#""a\u0041""#,
            "\"a\u{1}\"",
            "01",
            "1.5",
            "1e3",
            "-",
            "18446744073709551616",
            "truex",
            "\"open",
        ] {
            let mut c = Cursor::new(text);
            let read = match text.as_bytes()[0] {
                b'"' => c.unescaped_len().map(drop),
                b't' => c.word("true"),
                _ => c.int().map(drop),
            };
            assert!(read.is_none(), "{text}");
        }
        assert_eq!(Cursor::new(r#""a\nb""#).plain_str(), None);
        assert_eq!(Cursor::new("-9223372036854775808").int(), Some(i64::MIN));
        assert_eq!(Cursor::new("9223372036854775808").int(), None);
        assert_eq!(Cursor::new("-0").int(), None);
    }
}
