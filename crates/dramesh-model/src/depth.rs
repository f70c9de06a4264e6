//! A linear pre-scan that bounds the nesting depth of YAML and JSON text before it reaches the
//! parser.
//!
//! libyaml's scanner keeps per-level state that makes parsing quadratic in nesting depth (a
//! 100,000-level file took over 30 s), and serde's own recursion limit only applies after the
//! whole document has been scanned. This scan follows libyaml's tokenization closely enough to
//! count what libyaml counts: block levels (its indentation stack: mapping keys and `-` entries
//! at a deeper column) plus flow levels (`[` and `{` outside quoted scalars, comments and block
//! scalars). JSON is YAML flow style, so the same scan covers it.
//!
//! Guarantee: time and memory are linear in the text, and a document whose parser-visible depth
//! exceeds the limit is refused. The count may exceed the true depth slightly (a mapping in a
//! sequence entry counts both), never fall short of libyaml's.

/// Deepest nesting accepted in a manifest. Real DRA and Karmada objects are under 20 levels by
/// this count; serde's own recursion limit for both YAML and JSON is 128.
pub const MAX_DEPTH: usize = 64;

/// Where the text first nests deeper than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooDeep {
    /// 1-based line.
    pub line: usize,
    /// The limit exceeded.
    pub limit: usize,
}

impl std::fmt::Display for TooDeep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "nesting deeper than {} levels at line {}",
            self.limit, self.line
        )
    }
}

/// The deepest nesting of `text` (see the module docs for what counts), stopping early with
/// an error once it exceeds `limit`.
pub fn check_depth(text: &str, limit: usize) -> Result<usize, TooDeep> {
    Scan {
        b: text.as_bytes(),
        i: 0,
        line: 1,
        line_start: 0,
        indents: Vec::new(),
        flow: 0,
        key_col: 0,
        max: 0,
        limit,
    }
    .run()
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
    line: usize,
    /// Index of the first byte of the current line.
    line_start: usize,
    /// Columns of the open block collections (libyaml's indentation stack).
    indents: Vec<usize>,
    /// Open flow collections.
    flow: usize,
    /// Column of the last key or `-` entry on this line: a block scalar's content must be
    /// indented deeper than it.
    key_col: usize,
    max: usize,
    limit: usize,
}

fn blank(c: Option<u8>) -> bool {
    matches!(c, None | Some(b' ' | b'\t' | b'\r' | b'\n'))
}

impl Scan<'_> {
    fn peek(&self, k: usize) -> Option<u8> {
        self.b.get(self.i + k).copied()
    }

    /// Column of `i` (bytes since the line start).
    fn col(&self) -> usize {
        self.i - self.line_start
    }

    fn bump(&mut self) {
        if self.b[self.i] == b'\n' {
            self.line += 1;
            self.line_start = self.i + 1;
        }
        self.i += 1;
    }

    fn note(&mut self) -> Result<(), TooDeep> {
        let depth = self.indents.len() + self.flow;
        self.max = self.max.max(depth);
        if depth > self.limit {
            return Err(TooDeep {
                line: self.line,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// A block collection whose first key or entry sits at `col`.
    fn roll(&mut self, col: usize) -> Result<(), TooDeep> {
        if self.flow == 0 && self.indents.last().is_none_or(|&top| col > top) {
            self.indents.push(col);
        }
        self.note()
    }

    fn run(mut self) -> Result<usize, TooDeep> {
        while self.i < self.b.len() {
            // Start of a line: document markers, directives, and dedents in block context.
            if self.i == self.line_start {
                if self.b[self.i..].starts_with(b"---") || self.b[self.i..].starts_with(b"...") {
                    if blank(self.peek(3)) {
                        self.indents.clear();
                        self.flow = 0;
                        self.i += 3;
                        continue;
                    }
                } else if self.b[self.i] == b'%' {
                    self.skip_line();
                    continue;
                }
            }
            let c = self.b[self.i];
            match c {
                b' ' | b'\t' | b'\r' | b'\n' => self.bump(),
                b'#' => self.skip_line(),
                _ => {
                    if self.flow == 0 {
                        let col = self.col();
                        while self.indents.last().is_some_and(|&top| top > col) {
                            self.indents.pop();
                        }
                    }
                    self.token()?;
                }
            }
        }
        Ok(self.max)
    }

    /// Moves to the `\n` ending this line (or the end of the text).
    fn skip_line(&mut self) {
        self.i = match self.b[self.i..].iter().position(|&c| c == b'\n') {
            Some(n) => self.i + n,
            None => self.b.len(),
        };
    }

    /// One token starting at a non-blank byte.
    fn token(&mut self) -> Result<(), TooDeep> {
        let c = self.b[self.i];
        let col = self.col();
        match c {
            b'[' | b'{' => {
                self.flow += 1;
                self.bump();
                self.note()
            }
            b']' | b'}' => {
                self.flow = self.flow.saturating_sub(1);
                self.bump();
                Ok(())
            }
            b',' => {
                self.bump();
                Ok(())
            }
            b'-' | b'?' | b':' if blank(self.peek(1)) || (self.flow > 0 && c != b'-') => {
                self.bump();
                if c == b'-' {
                    self.key_col = col;
                    self.roll(col)?;
                }
                Ok(())
            }
            b'|' | b'>' if self.flow == 0 => {
                self.block_scalar();
                Ok(())
            }
            b'\'' => {
                self.quoted(b'\'');
                self.after_scalar(col)
            }
            b'"' => {
                self.quoted(b'"');
                self.after_scalar(col)
            }
            b'&' | b'*' | b'!' => {
                while !blank(self.peek(0)) {
                    if self.flow > 0 && matches!(self.b[self.i], b',' | b'[' | b']' | b'{' | b'}') {
                        break;
                    }
                    self.i += 1; // not a newline
                }
                Ok(())
            }
            _ => {
                self.plain();
                self.after_scalar(col)
            }
        }
    }

    /// A scalar followed by `:` is a key: in block context it opens a mapping at its column.
    fn after_scalar(&mut self, col: usize) -> Result<(), TooDeep> {
        let mut j = self.i;
        while matches!(self.b.get(j), Some(b' ' | b'\t')) {
            j += 1;
        }
        if self.b.get(j) == Some(&b':') && (blank(self.b.get(j + 1).copied()) || self.flow > 0) {
            self.key_col = col;
            self.roll(col)?;
        }
        Ok(())
    }

    fn quoted(&mut self, q: u8) {
        self.bump();
        while self.i < self.b.len() {
            let c = self.b[self.i];
            if q == b'"' && c == b'\\' {
                self.bump();
                if self.i < self.b.len() {
                    self.bump();
                }
                continue;
            }
            self.bump();
            if c == q {
                if q == b'\'' && self.peek(0) == Some(b'\'') {
                    self.bump(); // '' is an escaped quote
                    continue;
                }
                return;
            }
        }
    }

    /// A plain scalar: in flow context it ends at a flow indicator; everywhere at `: `,
    /// ` #` or the end of the line (continuation lines are scanned as tokens again, which
    /// only ever counts more).
    fn plain(&mut self) {
        while self.i < self.b.len() {
            let c = self.b[self.i];
            if c == b'\n' {
                return;
            }
            if c == b':' && (blank(self.peek(1)) || self.flow > 0) {
                return;
            }
            if self.flow > 0 && matches!(c, b',' | b'[' | b']' | b'{' | b'}') {
                return;
            }
            if matches!(c, b' ' | b'\t') && self.peek(1) == Some(b'#') {
                return;
            }
            self.i += 1; // not a newline
        }
    }

    /// `|` or `>`: the rest of the header line, then every line that is blank or indented
    /// deeper than the key or entry that holds the scalar.
    fn block_scalar(&mut self) {
        let parent = self.key_col;
        let top_level = self.indents.is_empty();
        self.skip_line();
        while self.i < self.b.len() {
            // self.b[self.i] is the '\n' ending the previous line.
            let start = self.i + 1;
            let mut j = start;
            while self.b.get(j) == Some(&b' ') {
                j += 1;
            }
            let indent = j - start;
            let empty = matches!(self.b.get(j), None | Some(b'\n' | b'\r'));
            if !(empty || indent > parent || (top_level && indent > 0)) {
                return;
            }
            self.bump(); // the '\n'
            self.skip_line();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(t: &str) -> usize {
        check_depth(t, usize::MAX).unwrap()
    }

    #[test]
    fn counts_block_flow_and_json() {
        assert_eq!(depth("a: b\n"), 1);
        assert_eq!(depth("a:\n  b:\n    c: d\n"), 3);
        assert_eq!(depth("a:\n- b: c\n  d: e\n"), 2);
        assert_eq!(depth("- - - x\n"), 3);
        assert_eq!(depth("a: [[1, {b: [2]}]]\n"), 5);
        assert_eq!(depth(r#"{"a": [{"b": {"c": 1}}]}"#), 4);
        // Back out again: siblings do not add up.
        assert_eq!(depth("a:\n  b:\n    c: d\ne:\n  f: g\n"), 3);
        assert_eq!(depth("a: [1]\nb: [2]\nc: [3]\n"), 2);
    }

    #[test]
    fn brackets_in_strings_comments_and_block_scalars_do_not_count() {
        assert_eq!(depth("a: \"[[[[\"\nb: '{{{{'\n"), 1);
        assert_eq!(depth("a: 'it''s [[['\n"), 1);
        assert_eq!(depth("a: x # [[[[\n"), 1);
        assert_eq!(depth("a: device.attributes[\"x\"].y[0]\n"), 1);
        assert_eq!(depth("a: |\n  [[[[\n  {{{{\nb: c\n"), 1);
        assert_eq!(depth("- k: >-\n    [[[[\n  j: 1\n"), 2);
        assert_eq!(depth(r#"{"a": "\"[[[["}"#), 1);
    }

    #[test]
    fn markers_reset_between_documents() {
        assert_eq!(depth("a: [[[\n---\nb: c\n"), 4);
        assert_eq!(check_depth("a: [[[\n---\nb: [[[\n", 4), Ok(4));
    }

    #[test]
    fn deep_text_stops_at_the_limit() {
        let flow = "[".repeat(100_000);
        assert_eq!(
            check_depth(&flow, MAX_DEPTH),
            Err(TooDeep {
                line: 1,
                limit: MAX_DEPTH
            })
        );
        let block: String = (0..200).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert_eq!(
            check_depth(&block, MAX_DEPTH),
            Err(TooDeep {
                line: MAX_DEPTH + 1,
                limit: MAX_DEPTH
            })
        );
        let dashes = "- ".repeat(100_000);
        assert!(check_depth(&dashes, MAX_DEPTH).is_err());
        // A key hidden behind an apostrophe inside a plain scalar is still seen.
        assert!(check_depth(&format!("a: b 'c\nd: {flow}"), MAX_DEPTH).is_err());
    }
}
