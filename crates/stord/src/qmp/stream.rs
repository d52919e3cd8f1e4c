//! Splitting a byte stream into JSON texts, as QMP clients send them (one object after
//! another, newlines optional).
//!
//! We only track nesting and strings here; serde_json parses each complete text. Bytes
//! that cannot start a JSON value (outside any object) form a malformed text that runs to
//! the next newline or opening brace, so that garbage produces one error reply and the
//! stream recovers, as QEMU's lexer does.

/// One piece cut from the stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// A complete JSON value (balanced braces/brackets).
    Json(Vec<u8>),
    /// Bytes that are not JSON.
    Garbage(Vec<u8>),
    /// A value nested deeper than [`MAX_NESTING`]: the stream cannot recover from it.
    TooDeep,
}

/// Deepest nesting of objects and arrays accepted (qemu's JSON parser has the same limit).
pub const MAX_NESTING: usize = 1024;

/// The splitter's state across reads.
#[derive(Debug, Default)]
pub struct JsonStream {
    buf: Vec<u8>,
    /// Scan position within `buf`.
    pos: usize,
    depth: usize,
    in_string: bool,
    escape: bool,
}

impl JsonStream {
    /// Bytes held that do not form a complete text yet.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Adds bytes and returns every complete piece.
    pub fn push(&mut self, data: &[u8]) -> Vec<Piece> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut start = 0;
        while self.pos < self.buf.len() {
            let b = self.buf[self.pos];
            if self.depth == 0 {
                if b.is_ascii_whitespace() {
                    if start == self.pos {
                        start += 1;
                    }
                    self.pos += 1;
                    continue;
                }
                if b != b'{' && b != b'[' {
                    // Garbage until a newline or the next opening brace.
                    let mut end = self.pos;
                    while end < self.buf.len() && self.buf[end] != b'\n' && self.buf[end] != b'{' {
                        end += 1;
                    }
                    if end == self.buf.len() && self.buf[end - 1] != b'\n' {
                        // Maybe more garbage follows; wait, unless there is a lot already.
                        if end - start < 4096 {
                            break;
                        }
                    }
                    out.push(Piece::Garbage(self.buf[start..end].to_vec()));
                    self.pos = end;
                    start = end;
                    continue;
                }
            }
            if self.in_string {
                if self.escape {
                    self.escape = false;
                } else if b == b'\\' {
                    self.escape = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else {
                match b {
                    b'"' => self.in_string = true,
                    b'{' | b'[' => {
                        self.depth += 1;
                        if self.depth > MAX_NESTING {
                            out.push(Piece::TooDeep);
                            self.buf.clear();
                            self.pos = 0;
                            self.depth = 0;
                            return out;
                        }
                    }
                    b'}' | b']' => {
                        self.depth -= 1;
                        if self.depth == 0 {
                            out.push(Piece::Json(self.buf[start..=self.pos].to_vec()));
                            start = self.pos + 1;
                        }
                    }
                    _ => {}
                }
            }
            self.pos += 1;
        }
        self.buf.drain(..start);
        self.pos -= start;
        out
    }
}

/// Fuzz entry (`fuzz/fuzz_targets/qmp_stream.rs`): the rest of `data` pushed in chunks of
/// `data[0]` bytes; every text cut out is parsed as JSON. What comes out never exceeds what
/// went in.
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let mut s = JsonStream::default();
    let mut out = 0;
    for chunk in rest.chunks(usize::from(step).max(1)) {
        for p in s.push(chunk) {
            match p {
                Piece::Json(t) => {
                    out += t.len();
                    let _ = serde_json::from_slice::<serde_json::Value>(&t);
                }
                Piece::Garbage(g) => out += g.len(),
                Piece::TooDeep => return,
            }
        }
    }
    assert!(
        out + s.pending() <= rest.len(),
        "pieces larger than the input"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_objects_across_reads_and_ignores_braces_in_strings() {
        let mut s = JsonStream::default();
        assert!(s.push(br#"{"execute": "a\"}{"#).is_empty());
        let p = s.push(b"\"}\n{\"x\":[1,{}]}  {");
        assert_eq!(
            p,
            vec![
                Piece::Json(br#"{"execute": "a\"}{"}"#.to_vec()),
                Piece::Json(br#"{"x":[1,{}]}"#.to_vec())
            ]
        );
        assert_eq!(s.pending(), 1);
    }

    #[test]
    fn garbage_is_one_piece_per_line_and_the_stream_recovers() {
        let mut s = JsonStream::default();
        let p = s.push(b"hello world\n{\"a\":1}\n");
        assert_eq!(
            p,
            vec![
                Piece::Garbage(b"hello world".to_vec()),
                Piece::Json(b"{\"a\":1}".to_vec())
            ]
        );
        // Unbalanced closing at top level is garbage too.
        let p = s.push(b"}}\n");
        assert_eq!(p, vec![Piece::Garbage(b"}}".to_vec())]);
    }

    #[test]
    fn nesting_beyond_the_limit_is_reported_once() {
        let mut s = JsonStream::default();
        let ok = format!("{}{}", "[".repeat(MAX_NESTING), "]".repeat(MAX_NESTING));
        assert!(matches!(&s.push(ok.as_bytes())[..], [Piece::Json(_)]));
        let deep = "[".repeat(MAX_NESTING + 1);
        assert_eq!(s.push(deep.as_bytes()), vec![Piece::TooDeep]);
        assert_eq!(s.pending(), 0);
    }
}
