//! A linear pre-scan that bounds the nesting depth and the node count of YAML and JSON text
//! before it reaches the parser, and notes the plain scalars YAML 1.1 reads as octal integers.
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
//!
//! Nodes (scalars and collections) are counted the same way, so the parser's memory, which is
//! proportional to the nodes it builds (see README "Limits"), is bounded before it is spent. An
//! alias counts as every node of its document so far, an upper bound of what its anchor can
//! expand to, so alias bombs are refused too (at the price of over-counting documents with many
//! aliases).
//!
//! YAML 1.1, which kubectl's parser follows, reads an unquoted `0755` as the octal integer 493;
//! the YAML 1.2 parser here reads it as a string. [`Prescan::plain_octals`] lists such plain
//! scalars, so the loader can convert exactly the ones a typed field refuses as strings.

/// Deepest nesting accepted in a manifest. Real DRA and Karmada objects are under 20 levels by
/// this count; serde's own recursion limit for both YAML and JSON is 128.
pub const MAX_DEPTH: usize = 64;

/// Most nodes (scalars and collections, aliases expanded as bounded in the module docs) accepted
/// in one file or request text: 2,000,000, about 300 MB of parser memory at its peak.
pub const MAX_NODES: usize = 2_000_000;

/// What [`prescan`] refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deepest nesting.
    pub max_depth: usize,
    /// Most nodes.
    pub max_nodes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_depth: MAX_DEPTH,
            max_nodes: MAX_NODES,
        }
    }
}

/// What a successful [`prescan`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prescan {
    /// Deepest nesting seen.
    pub depth: usize,
    /// Nodes counted (an upper bound).
    pub nodes: usize,
    /// Distinct unquoted scalars of the form `[-+]?0[0-7]+`, sorted: YAML 1.1 octal integers.
    pub plain_octals: Vec<String>,
}

/// Why [`prescan`] refused a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrescanError {
    /// Nested deeper than the limit.
    TooDeep(TooDeep),
    /// More nodes than the limit.
    TooManyNodes {
        /// 1-based line where the count passed the limit.
        line: usize,
        /// The limit exceeded.
        limit: usize,
    },
}

impl std::fmt::Display for PrescanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrescanError::TooDeep(d) => d.fmt(f),
            PrescanError::TooManyNodes { line, limit } => write!(
                f,
                "more than {limit} YAML nodes (scalars, collections, expanded aliases) by line {line}"
            ),
        }
    }
}

impl std::error::Error for PrescanError {}

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
    let limits = Limits {
        max_depth: limit,
        max_nodes: usize::MAX,
    };
    match prescan(text, &limits) {
        Ok(p) => Ok(p.depth),
        Err(PrescanError::TooDeep(d)) => Err(d),
        // Not reached: the node count saturates at usize::MAX, which is never exceeded.
        Err(PrescanError::TooManyNodes { line, .. }) => Err(TooDeep { line, limit }),
    }
}

/// Scans `text` once (see the module docs), stopping at the first limit it exceeds.
pub fn prescan(text: &str, limits: &Limits) -> Result<Prescan, PrescanError> {
    let mut scan = Scan {
        b: text.as_bytes(),
        i: 0,
        line: 1,
        line_start: 0,
        indents: Vec::new(),
        flow: 0,
        key_col: 0,
        max: 0,
        limit: limits.max_depth,
        nodes: 0,
        doc_start_nodes: 0,
        max_nodes: limits.max_nodes,
        octals: std::collections::BTreeSet::new(),
    };
    scan.run()?;
    Ok(Prescan {
        depth: scan.max,
        nodes: scan.nodes,
        plain_octals: scan.octals.into_iter().collect(),
    })
}

/// `[-+]?0[0-7]+`: an integer in YAML 1.1's octal form.
pub fn is_yaml11_octal(s: &str) -> bool {
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    digits.len() >= 2
        && digits.starts_with('0')
        && digits.bytes().all(|c| (b'0'..=b'7').contains(&c))
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
    /// Nodes counted so far, aliases weighted as in the module docs.
    nodes: usize,
    /// `nodes` when the current document started.
    doc_start_nodes: usize,
    max_nodes: usize,
    /// Plain scalars that YAML 1.1 reads as octal integers.
    octals: std::collections::BTreeSet<String>,
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

    fn note(&mut self) -> Result<(), PrescanError> {
        let depth = self.indents.len() + self.flow;
        self.max = self.max.max(depth);
        if depth > self.limit {
            return Err(PrescanError::TooDeep(TooDeep {
                line: self.line,
                limit: self.limit,
            }));
        }
        Ok(())
    }

    /// Counts `n` more nodes.
    fn count(&mut self, n: usize) -> Result<(), PrescanError> {
        self.nodes = self.nodes.saturating_add(n);
        if self.nodes > self.max_nodes {
            return Err(PrescanError::TooManyNodes {
                line: self.line,
                limit: self.max_nodes,
            });
        }
        Ok(())
    }

    /// A block collection whose first key or entry sits at `col`.
    fn roll(&mut self, col: usize) -> Result<(), PrescanError> {
        if self.flow == 0 && self.indents.last().is_none_or(|&top| col > top) {
            self.indents.push(col);
            self.count(1)?;
        }
        self.note()
    }

    fn run(&mut self) -> Result<(), PrescanError> {
        while self.i < self.b.len() {
            // Start of a line: document markers, directives, and dedents in block context.
            if self.i == self.line_start {
                if self.b[self.i..].starts_with(b"---") || self.b[self.i..].starts_with(b"...") {
                    if blank(self.peek(3)) {
                        self.indents.clear();
                        self.flow = 0;
                        self.doc_start_nodes = self.nodes;
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
        Ok(())
    }

    /// Moves to the `\n` ending this line (or the end of the text).
    fn skip_line(&mut self) {
        self.i = match self.b[self.i..].iter().position(|&c| c == b'\n') {
            Some(n) => self.i + n,
            None => self.b.len(),
        };
    }

    /// One token starting at a non-blank byte.
    fn token(&mut self) -> Result<(), PrescanError> {
        let c = self.b[self.i];
        let col = self.col();
        match c {
            b'[' | b'{' => {
                self.flow += 1;
                self.bump();
                self.count(1)?;
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
                self.count(1)
            }
            b'\'' => {
                self.quoted(b'\'');
                self.count(1)?;
                self.after_scalar(col)
            }
            b'"' => {
                self.quoted(b'"');
                self.count(1)?;
                self.after_scalar(col)
            }
            b'&' | b'*' | b'!' => {
                if c == b'*' {
                    // An anchor's subtree is at most everything of this document so far.
                    self.count((self.nodes - self.doc_start_nodes).max(1))?;
                }
                while !blank(self.peek(0)) {
                    if self.flow > 0 && matches!(self.b[self.i], b',' | b'[' | b']' | b'{' | b'}') {
                        break;
                    }
                    self.i += 1; // not a newline
                }
                Ok(())
            }
            _ => {
                let start = self.i;
                self.plain();
                if let Ok(s) = std::str::from_utf8(&self.b[start..self.i]) {
                    let s = s.trim_end();
                    if is_yaml11_octal(s) {
                        self.octals.insert(s.to_string());
                    }
                }
                self.count(1)?;
                self.after_scalar(col)
            }
        }
    }

    /// A scalar followed by `:` is a key: in block context it opens a mapping at its column.
    fn after_scalar(&mut self, col: usize) -> Result<(), PrescanError> {
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

    fn scan(t: &str, max_nodes: usize) -> Result<Prescan, PrescanError> {
        prescan(
            t,
            &Limits {
                max_depth: MAX_DEPTH,
                max_nodes,
            },
        )
    }

    #[test]
    fn counts_nodes() {
        // Root mapping, three keys, three values.
        assert_eq!(scan("a: b\nc: 'd'\ne: \"f\"\n", 100).unwrap().nodes, 7);
        // Root mapping, key, flow sequence and three scalars.
        assert_eq!(scan("a: [1, 2, 3]\n", 100).unwrap().nodes, 6);
        assert_eq!(scan("a: |\n  x\n  y\n", 100).unwrap().nodes, 3);
        let wide = format!("a: [{}]\n", vec!["1"; 1000].join(","));
        assert_eq!(scan(&wide, 1003).unwrap().nodes, 1003);
        assert_eq!(
            scan(&wide, 1002),
            Err(PrescanError::TooManyNodes {
                line: 1,
                limit: 1002
            })
        );
    }

    #[test]
    fn alias_bombs_are_refused() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        let mut prev = 'a';
        for name in 'b'..='z' {
            bomb.push_str(&format!(
                "{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
            prev = name;
        }
        let e = scan(&bomb, MAX_NODES).unwrap_err();
        assert!(matches!(e, PrescanError::TooManyNodes { .. }), "{e}");
        // A few aliases in a small document pass.
        let few = "a: &x {k: v}\nb: *x\nc: *x\n";
        assert!(scan(few, 100).is_ok());
        // Aliases of earlier documents do not weigh on later ones.
        let docs = format!("{}---\na: &x 1\nb: *x\n", "k: v\n".repeat(50));
        assert!(scan(&docs, 110).unwrap().nodes <= 110);
    }

    #[test]
    fn notes_plain_octal_scalars_only() {
        let t = "a: 0755\nb: '0644'\nc: \"0600\"\nd: 0644 # mode\ne: 0x1F\nf: 089\ng: 0\nh: [-0777, 012]\ni: 0755\n";
        assert_eq!(
            scan(t, 100).unwrap().plain_octals,
            ["-0777", "012", "0644", "0755"]
        );
        assert!(is_yaml11_octal("+017"));
        assert!(!is_yaml11_octal("0"));
        assert!(!is_yaml11_octal("08"));
        assert!(!is_yaml11_octal("0o17"));
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
