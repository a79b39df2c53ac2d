//! A cursor over JSON text: the one tokenizer of the header codec ([`super::header`]) and
//! of the tree record ([`super::tree_census`], [`super::tree_decode`]).
//!
//! It reads all of JSON (RFC 8259), borrowing strings without escapes from the text and
//! measuring or unescaping the others, and never panics. A fault is a [`Fault`]: a
//! position and words in the form `serde_json` gives them (`expected `,` or `}``,
//! `invalid type: string "x", expected a sequence`), which [`Fault::describe`] turns into
//! a message ending in `at line L column C`.

use std::borrow::Cow;

/// Deepest nesting of arrays and objects in a text (as `serde_json`'s limit).
const MAX_NESTING: usize = 127;

/// A fault in a JSON text: where, and what.
#[derive(Debug)]
pub(crate) struct Fault(Box<(usize, String)>);

/// The result of reading a JSON token.
pub(crate) type Scan<T> = std::result::Result<T, Fault>;

impl Fault {
    /// A fault at byte `at` of the text.
    pub(crate) fn new(at: usize, what: impl Into<String>) -> Fault {
        Fault(Box::new((at, what.into())))
    }

    /// The byte of the text where it went wrong.
    pub(crate) fn at(&self) -> usize {
        self.0 .0
    }

    /// What went wrong, without the position.
    pub(crate) fn what(&self) -> &str {
        &self.0 .1
    }

    /// The fault in words, with its line and column in `text`.
    pub(crate) fn describe(&self, text: &str) -> String {
        let at = self.0 .0.min(text.len());
        let before = &text.as_bytes()[..at];
        let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
        let column = at
            - before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1)
            + 1;
        format!("{} at line {line} column {column}", self.what())
    }
}

/// Why a reading stopped: a fault of the JSON, or another error (an entry or a tree that
/// the JSON describes and that is at fault).
pub(crate) enum Stop {
    /// A fault of the JSON text.
    Json(Fault),
    /// Any other error.
    Other(crate::error::Error),
}

impl From<Fault> for Stop {
    fn from(f: Fault) -> Self {
        Stop::Json(f)
    }
}

impl From<crate::error::Error> for Stop {
    fn from(e: crate::error::Error) -> Self {
        Stop::Other(e)
    }
}

/// A JSON number, as `serde_json` reads it: an integer when it has neither fraction nor
/// exponent and fits, else a float.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Number {
    /// A non-negative integer.
    U(u64),
    /// A negative integer.
    I(i64),
    /// Anything else.
    F(f64),
}

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

    /// A cursor at byte `at` of `text` (a position an earlier cursor reported).
    pub(crate) fn at(text: &'a str, at: usize) -> Self {
        Cursor { text, at }
    }

    /// The byte offset of the cursor.
    pub(crate) fn pos(&self) -> usize {
        self.at
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// A fault at the cursor.
    pub(crate) fn fault(&self, what: impl Into<String>) -> Fault {
        Fault::new(self.at, what)
    }

    /// Skips JSON whitespace.
    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.bytes().get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    #[inline]
    pub(crate) fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.bytes().get(self.at).copied()
    }

    /// Consumes `byte` (after whitespace), or fails.
    #[inline]
    pub(crate) fn eat(&mut self, byte: u8) -> Scan<()> {
        if self.peek() == Some(byte) {
            self.at += 1;
            return Ok(());
        }
        Err(self.not_eaten(byte))
    }

    /// Why [`Cursor::eat`] found no `byte`.
    #[cold]
    fn not_eaten(&self, byte: u8) -> Fault {
        match self.bytes().get(self.at) {
            Some(_) => self.fault(format!("expected `{}`", byte as char)),
            None => self.fault("EOF while parsing a value"),
        }
    }

    /// Consumes `byte` if it comes next; says whether it did.
    #[inline]
    pub(crate) fn eat_if(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        self.at += usize::from(found);
        found
    }

    /// Consumes `,` and says true, or `close` and says false.
    #[inline]
    pub(crate) fn more(&mut self, close: u8) -> Scan<bool> {
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                Ok(true)
            }
            Some(b) if b == close => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.no_more(close)),
        }
    }

    /// Why [`Cursor::more`] found neither `,` nor `close`.
    #[cold]
    fn no_more(&self, close: u8) -> Fault {
        match self.bytes().get(self.at) {
            Some(_) => self.fault(format!("expected `,` or `{}`", close as char)),
            None if close == b'}' => self.fault("EOF while parsing an object"),
            None => self.fault("EOF while parsing a list"),
        }
    }

    /// Opens an object: true when it is empty (and then closed too).
    pub(crate) fn open(&mut self, open: u8) -> Scan<bool> {
        self.eat(open)?;
        Ok(self.eat_if(if open == b'{' { b'}' } else { b']' }))
    }

    /// Calls `each` with every key of the object at the cursor, the cursor at its value;
    /// a value that is not an object is a type fault naming `want`.
    pub(crate) fn object<E: From<Fault>>(
        &mut self,
        want: &str,
        mut each: impl FnMut(&mut Cursor<'a>, Cow<'a, str>) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.peek() != Some(b'{') {
            return Err(self.wrong_type(want).into());
        }
        if self.open(b'{')? {
            return Ok(());
        }
        loop {
            let key = self.key()?;
            each(self, key)?;
            if !self.more(b'}')? {
                return Ok(());
            }
        }
    }

    /// Calls `each` with the cursor at every item of the array at the cursor, and counts
    /// them; a value that is not an array is a type fault naming `want`.
    pub(crate) fn array<E: From<Fault>>(
        &mut self,
        want: &str,
        mut each: impl FnMut(&mut Cursor<'a>) -> Result<(), E>,
    ) -> Result<u32, E> {
        if self.peek() != Some(b'[') {
            return Err(self.wrong_type(want).into());
        }
        if self.open(b'[')? {
            return Ok(0);
        }
        let mut n = 0u32;
        loop {
            each(self)?;
            n = n
                .checked_add(1)
                .ok_or_else(|| self.fault("an array is too long"))?;
            if !self.more(b']')? {
                return Ok(n);
            }
        }
    }

    /// The key of an object member and its colon: borrowed when it has no escape.
    #[inline]
    pub(crate) fn key(&mut self) -> Scan<Cow<'a, str>> {
        if self.peek() != Some(b'"') {
            return Err(match self.peek() {
                None => self.fault("EOF while parsing an object"),
                Some(_) => self.fault("key must be a string"),
            });
        }
        let key = self.str()?;
        self.eat(b':')?;
        Ok(key)
    }

    /// Consumes `"key":` if that member key comes next (after whitespace), nothing
    /// otherwise: what [`Cursor::key`] reads as `key`, for a `key` without specials, in
    /// one comparison.
    #[inline]
    pub(crate) fn eat_key(&mut self, key: &str) -> bool {
        self.skip_ws();
        let key = key.as_bytes();
        let rest = &self.bytes()[self.at..];
        let found = rest.len() > key.len() + 2
            && rest[0] == b'"'
            && rest[key.len() + 1] == b'"'
            && rest[key.len() + 2] == b':'
            && &rest[1..=key.len()] == key;
        if found {
            self.at += key.len() + 3;
        }
        found
    }

    /// Calls `piece` with each run of plain text and each unescaped character of the
    /// string at the cursor, which it passes.
    fn string(&mut self, mut piece: impl FnMut(&'a str, Option<char>)) -> Scan<()> {
        self.eat(b'"')?;
        loop {
            let start = self.at;
            self.at = special_from(self.bytes(), self.at);
            if self.at > start {
                piece(&self.text[start..self.at], None);
            }
            match self.bytes().get(self.at) {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(());
                }
                Some(b'\\') => {
                    self.at += 1;
                    let c = self.escape()?;
                    piece("", Some(c));
                }
                Some(_) => {
                    return Err(self
                        .fault("control character (\\u0000-\\u001F) found while parsing a string"))
                }
                None => return Err(self.fault("EOF while parsing a string")),
            }
        }
    }

    /// The character of the escape after a backslash.
    fn escape(&mut self) -> Scan<char> {
        let Some(&b) = self.bytes().get(self.at) else {
            return Err(self.fault("EOF while parsing a string"));
        };
        self.at += 1;
        if b != b'u' {
            return short_escape(b).ok_or_else(|| self.fault("invalid escape"));
        }
        let first = self.hex4()?;
        if !(0xD800..0xE000).contains(&first) {
            return Ok(char::from_u32(first).expect("not a surrogate"));
        }
        if first >= 0xDC00 || !self.bytes()[self.at..].starts_with(b"\\u") {
            return Err(self.fault("lone leading surrogate in hex escape"));
        }
        self.at += 2;
        let second = self.hex4()?;
        if !(0xDC00..0xE000).contains(&second) {
            return Err(self.fault("lone leading surrogate in hex escape"));
        }
        let c = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
        char::from_u32(c).ok_or_else(|| self.fault("invalid unicode code point"))
    }

    /// Four hex digits.
    fn hex4(&mut self) -> Scan<u32> {
        let Some(digits) = self.bytes().get(self.at..self.at + 4) else {
            return Err(self.fault("EOF while parsing a string"));
        };
        let mut n = 0;
        for &d in digits {
            let v = (d as char)
                .to_digit(16)
                .ok_or_else(|| self.fault("invalid escape"))?;
            n = n * 16 + v;
        }
        self.at += 4;
        Ok(n)
    }

    /// The string at the cursor when it holds no escape (most strings): found whole by one
    /// scan for its end, and passed. `None`, the cursor only past whitespace, for any
    /// other string or value.
    #[inline]
    pub(crate) fn plain_str(&mut self) -> Option<&'a str> {
        self.skip_ws();
        let bytes = self.bytes();
        if bytes.get(self.at) != Some(&b'"') {
            return None;
        }
        let end = special_from(bytes, self.at + 1);
        if bytes.get(end) != Some(&b'"') {
            return None;
        }
        let s = &self.text[self.at + 1..end];
        self.at = end + 1;
        Some(s)
    }

    /// The string at the cursor: borrowed from the text when it holds no escape.
    #[inline]
    pub(crate) fn str(&mut self) -> Scan<Cow<'a, str>> {
        match self.plain_str() {
            Some(s) => Ok(Cow::Borrowed(s)),
            None => self.escaped_str(),
        }
    }

    /// [`Cursor::str`] for a string with escapes (or a fault).
    fn escaped_str(&mut self) -> Scan<Cow<'a, str>> {
        let mut out: Cow<'a, str> = Cow::Borrowed("");
        self.string(|run, c| match (&mut out, c) {
            (Cow::Borrowed(""), None) => out = Cow::Borrowed(run),
            (out, None) => out.to_mut().push_str(run),
            (out, Some(c)) => out.to_mut().push(c),
        })?;
        Ok(out)
    }

    /// The length in bytes of the string at the cursor once unescaped; nothing allocated.
    #[inline]
    pub(crate) fn str_len(&mut self) -> Scan<usize> {
        match self.plain_str() {
            Some(s) => Ok(s.len()),
            None => self.escaped_len(),
        }
    }

    /// [`Cursor::str_len`] for a string with escapes (or a fault).
    fn escaped_len(&mut self) -> Scan<usize> {
        let mut len = 0;
        self.string(|run, c| len += run.len() + c.map_or(0, char::len_utf8))?;
        Ok(len)
    }

    /// The string at the cursor, appended to `out` unescaped.
    pub(crate) fn str_into(&mut self, out: &mut String) -> Scan<()> {
        self.string(|run, c| {
            out.push_str(run);
            if let Some(c) = c {
                out.push(c);
            }
        })
    }

    /// The number at the cursor, as `serde_json` reads it.
    pub(crate) fn number(&mut self) -> Scan<Number> {
        self.skip_ws();
        let start = self.at;
        let bytes = self.bytes();
        let digits_from = |at: usize| {
            bytes[at.min(bytes.len())..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count()
        };
        let negative = bytes.get(self.at) == Some(&b'-');
        self.at += usize::from(negative);
        let int = digits_from(self.at);
        if int == 0 || (int > 1 && bytes[self.at] == b'0') {
            return Err(self.fault("invalid number"));
        }
        self.at += int;
        let mut float = false;
        if bytes.get(self.at) == Some(&b'.') {
            let frac = digits_from(self.at + 1);
            if frac == 0 {
                return Err(Fault::new(self.at + 1, "invalid number"));
            }
            self.at += 1 + frac;
            float = true;
        }
        if let Some(b'e' | b'E') = bytes.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = bytes.get(self.at) {
                self.at += 1;
            }
            let exp = digits_from(self.at);
            if exp == 0 {
                return Err(self.fault("invalid number"));
            }
            self.at += exp;
            float = true;
        }
        let text = &self.text[start..self.at];
        if !float {
            let magnitude = &text[usize::from(negative)..];
            if let Ok(n) = magnitude.parse::<u64>() {
                if !negative {
                    return Ok(Number::U(n));
                }
                if n > 0 {
                    if let Some(i) = 0i64.checked_sub_unsigned(n) {
                        return Ok(Number::I(i));
                    }
                }
            }
        }
        match text.parse::<f64>() {
            Ok(f) if f.is_finite() => Ok(Number::F(f)),
            _ => Err(Fault::new(start, "number out of range")),
        }
    }

    /// A non-negative integer that fits `usize`; `want` words the type asked for.
    #[inline]
    pub(crate) fn usize(&mut self, want: &str) -> Scan<usize> {
        match self.plain_usize() {
            Some(n) => Ok(n),
            None => self.general_usize(want),
        }
    }

    /// The common case of [`Cursor::usize`]: up to 19 digits (no leading zero) that fit,
    /// with neither fraction nor exponent after them, passed. `None`, the cursor only past
    /// whitespace, for any other number or value.
    #[inline(always)]
    pub(crate) fn plain_usize(&mut self) -> Option<usize> {
        self.skip_ws();
        let rest = &self.bytes()[self.at..];
        // Digits counted and summed in one loop; 19 digits never overflow a u64.
        let (mut digits, mut n) = (0usize, 0u64);
        while let Some(&b) = rest.get(digits) {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            if digits == 19 {
                return None;
            }
            n = n * 10 + u64::from(d);
            digits += 1;
        }
        let plain = digits >= 1
            && (digits == 1 || rest[0] != b'0')
            && !matches!(rest.get(digits), Some(b'.' | b'e' | b'E'));
        if !plain {
            return None;
        }
        let n = usize::try_from(n).ok()?;
        self.at += digits;
        Some(n)
    }

    /// [`Cursor::usize`] for any number, or the fault.
    #[cold]
    fn general_usize(&mut self, want: &str) -> Scan<usize> {
        let start = *self;
        match self.typed(want)? {
            Number::U(n) => usize::try_from(n)
                .map_err(|_| start.fault(format!("invalid value: integer `{n}`, expected {want}"))),
            Number::I(i) => {
                Err(start.fault(format!("invalid value: integer `{i}`, expected {want}")))
            }
            Number::F(_) => unreachable!("typed() refuses floats"),
        }
    }

    /// An integer that fits `i64`.
    pub(crate) fn i64(&mut self) -> Scan<i64> {
        let start = *self;
        match self.typed("i64")? {
            Number::U(n) => i64::try_from(n)
                .map_err(|_| start.fault(format!("invalid value: integer `{n}`, expected i64"))),
            Number::I(i) => Ok(i),
            Number::F(_) => unreachable!("typed() refuses floats"),
        }
    }

    /// An integer number at the cursor; anything else is a type fault naming `want`.
    fn typed(&mut self, want: &str) -> Scan<Number> {
        match self.peek() {
            Some(b'-' | b'0'..=b'9') => {
                let start = *self;
                match self.number()? {
                    Number::F(f) => Err(start.fault(format!(
                        "invalid type: floating point `{f}`, expected {want}"
                    ))),
                    n => Ok(n),
                }
            }
            _ => Err(self.wrong_type(want)),
        }
    }

    /// `true` or `false`.
    pub(crate) fn bool(&mut self) -> Scan<bool> {
        match self.peek() {
            Some(b't') => self.word("true").map(|()| true),
            Some(b'f') => self.word("false").map(|()| false),
            _ => Err(self.wrong_type("a boolean")),
        }
    }

    /// `null`.
    pub(crate) fn null(&mut self) -> Scan<()> {
        match self.peek() {
            Some(b'n') => self.word("null"),
            _ => Err(self.wrong_type("unit")),
        }
    }

    /// The bare word `word`.
    fn word(&mut self, word: &str) -> Scan<()> {
        self.skip_ws();
        if self.bytes()[self.at..].starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(())
        } else {
            Err(self.fault("expected ident"))
        }
    }

    /// Skips any one value inside `depth` arrays and objects (the nesting of the whole
    /// text bounded as `serde_json` bounds it).
    pub(crate) fn skip_value(&mut self, depth: usize) -> Scan<()> {
        match self.peek() {
            Some(open @ (b'{' | b'[')) => {
                if depth >= MAX_NESTING {
                    return Err(self.fault("recursion limit exceeded"));
                }
                let close = if open == b'{' { b'}' } else { b']' };
                if self.open(open)? {
                    return Ok(());
                }
                loop {
                    if open == b'{' {
                        self.key()?;
                    }
                    self.skip_value(depth + 1)?;
                    if !self.more(close)? {
                        return Ok(());
                    }
                }
            }
            Some(b'"') => self.string(|_, _| {}),
            Some(b't' | b'f') => self.bool().map(drop),
            Some(b'n') => self.null(),
            Some(b'0'..=b'9') => {
                // The common case, digits and a delimiter, without the general reader.
                let rest = &self.bytes()[self.at..];
                let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
                if (digits == 1 || rest[0] != b'0')
                    && !matches!(rest.get(digits), Some(b'.' | b'e' | b'E'))
                {
                    self.at += digits;
                    return Ok(());
                }
                self.number().map(drop)
            }
            Some(b'-') => self.number().map(drop),
            Some(_) => Err(self.fault("expected value")),
            None => Err(self.fault("EOF while parsing a value")),
        }
    }

    /// The value at the cursor is not of the type `want`: the fault as `serde_json` words
    /// it (a syntax fault when there is no value at all).
    pub(crate) fn wrong_type(&self, want: &str) -> Fault {
        let mut c = *self;
        let found = match c.peek() {
            Some(b'"') => match c.str() {
                Ok(s) => format!("string {:?}", super::tree_meta::shorten(&s)),
                Err(fault) => return fault,
            },
            Some(b'-' | b'0'..=b'9') => match c.number() {
                Ok(Number::U(n)) => format!("integer `{n}`"),
                Ok(Number::I(i)) => format!("integer `{i}`"),
                Ok(Number::F(f)) => format!("floating point `{f}`"),
                Err(fault) => return fault,
            },
            Some(b't') => "boolean `true`".into(),
            Some(b'f') => "boolean `false`".into(),
            Some(b'n') => "null".into(),
            Some(b'{') => "map".into(),
            Some(b'[') => "sequence".into(),
            Some(_) => return c.fault("expected value"),
            None => return c.fault("EOF while parsing a value"),
        };
        c.fault(format!("invalid type: {found}, expected {want}"))
    }

    /// Fails unless only whitespace is left.
    pub(crate) fn finish(mut self) -> Scan<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.fault("trailing characters")),
        }
    }
}

/// The index of the first `"`, `\\` or control character of `bytes` from `at` on (the
/// length when none), eight bytes at a time.
#[inline]
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
    fn strings_numbers_and_words_are_read() {
        let mut c =
            Cursor::new(r#" "ab" "a\"b\\n\n" 0 17 -3 true null "é" "\u00e9\ud83d\ude00" 1.5e3 "#);
        assert!(matches!(c.str(), Ok(Cow::Borrowed("ab"))));
        let mut measured = c;
        assert_eq!(measured.str_len().unwrap(), 6);
        let mut s = String::new();
        c.str_into(&mut s).unwrap();
        assert_eq!(s, "a\"b\\n\n");
        assert_eq!(
            (
                c.usize("u").unwrap(),
                c.usize("u").unwrap(),
                c.i64().unwrap()
            ),
            (0, 17, -3)
        );
        assert!(c.bool().unwrap());
        c.null().unwrap();
        assert_eq!(c.str_len().unwrap(), "é".len());
        assert_eq!(c.str().unwrap(), "é😀");
        assert_eq!(c.number().unwrap(), Number::F(1500.0));
        assert!(c.finish().is_ok());
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

    /// Every token as `serde_json` reads it, or refused where it refuses it.
    #[test]
    fn tokens_are_read_as_serde_json_reads_them() {
        for text in [
            r#""a\u0041""#,
            "\"a\u{1}\"",
            r#""\ud800""#,
            r#""\udc00x""#,
            r#""\x""#,
            "\"open",
            "01",
            "1.5",
            "1e3",
            "-",
            "-0",
            "1.",
            "1e",
            "18446744073709551616",
            "-9223372036854775809",
            "1e400",
            "9223372036854775808",
            "-9223372036854775808",
            "true",
            "truex",
            "nul",
            "[1,[2,{}]]",
            r#"{"a":1,}"#,
            "[1 2]",
            r#"{"a" 1}"#,
            "{1:2}",
            " ",
        ] {
            let mine = {
                let mut c = Cursor::new(text);
                c.skip_value(0).and_then(|()| c.finish())
            };
            let serde = serde_json::from_str::<serde_json::Value>(text);
            assert_eq!(mine.is_ok(), serde.is_ok(), "{text}: {mine:?} {serde:?}");
            if let (Ok(()), Ok(serde_json::Value::Number(n))) = (&mine, &serde) {
                let read = Cursor::new(text).number().unwrap();
                let want = match (n.as_u64(), n.as_i64()) {
                    (Some(u), _) => Number::U(u),
                    (None, Some(i)) => Number::I(i),
                    _ => Number::F(n.as_f64().unwrap()),
                };
                assert_eq!(read, want, "{text}");
            }
            if let (Ok(()), Ok(serde_json::Value::String(s))) = (&mine, &serde) {
                assert_eq!(Cursor::new(text).str().unwrap(), *s);
            }
        }
    }

    #[test]
    fn nesting_is_bounded_where_serde_json_bounds_it() {
        for n in 120..135 {
            let text = format!("{{\"a\":{}{}}}", "[".repeat(n), "]".repeat(n));
            let mut c = Cursor::new(&text);
            c.open(b'{').unwrap();
            c.key().unwrap();
            let mine = c.skip_value(1);
            let serde = serde_json::from_str::<serde_json::Value>(&text);
            assert_eq!(mine.is_ok(), serde.is_ok(), "{n}");
        }
    }

    #[test]
    fn a_fault_names_its_line_and_column() {
        let text = "{\n  \"a\" 1}";
        let mut c = Cursor::new(text);
        c.open(b'{').unwrap();
        let fault = c.key().unwrap_err();
        assert_eq!(fault.describe(text), "expected `:` at line 2 column 7");
    }
}
