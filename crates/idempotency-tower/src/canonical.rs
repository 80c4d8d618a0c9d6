//! The canonical form of a JSON body, for [`IdempotencyLayer::canonical_json`].
//!
//! Two bodies share a canonical form only when they are the same JSON text up to the order
//! of object members, insignificant whitespace and string escapes (`"\u0041"` is `"A"`).
//! Anything else stays different:
//!
//! - **Numbers are kept as sent.** Converting them (to `f64`, as RFC 8785 does) makes
//!   `9007199254740993` equal `9007199254740992`, and `0.10000000000000000001` equal `0.1`:
//!   a different request would be answered with another one's stored outcome. So `1`, `1.0`,
//!   `1e0`, `-0` and `0` are five fingerprints; a client that reformats a number on retry gets
//!   a 422, which is safe, where a false equality is not.
//! - **Duplicate keys are kept**, in the order sent, after sorting by key: `{"a":1,"a":2}`
//!   stays distinct from `{"a":2}` whichever duplicate the handler's parser keeps.
//! - **Keys equal but for case** (`"amount"` and `"Amount"` in one object), which some
//!   parsers match as one key, leave the body to its raw bytes: sorting would part them.
//!
//! The output is itself compact JSON (strings re-encoded by serde_json, numbers and literals
//! verbatim, members stably sorted by encoded key), from which the input's tokens can be read
//! back: that is why equal outputs mean equal requests.
//!
//! [`canonical_json`] answers `None` for what it does not canonicalise — not JSON, invalid
//! UTF-8, a lone surrogate escape (`"\ud800"`), nesting deeper than [`MAX_DEPTH`], keys equal
//! but for case — and the layer then fingerprints the raw bytes. Those bytes never equal any
//! canonical output (a canonical output is valid JSON, valid UTF-8, escapes no surrogates,
//! nests at most [`MAX_DEPTH`] deep and holds no object with keys equal but for case), so the
//! fallback cannot make two requests equal either.
//!
//! [`IdempotencyLayer::canonical_json`]: crate::IdempotencyLayer::canonical_json

/// Deeper nesting falls back to the raw bytes: bounds the recursion (stack) on hostile bodies.
/// serde_json refuses the same depth, so the former `Value`-based form fell back there too.
const MAX_DEPTH: usize = 128;

/// The canonical form of `body`, or `None` when it is not JSON this module canonicalises.
///
/// One pass over the bytes: parsing each level from a `RawValue` of the one above would scan
/// every byte once per enclosing level.
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let mut parser = Parser {
        input: body,
        pos: 0,
    };
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != body.len() {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    value.write(&mut out);
    Some(out)
}

enum Node<'a> {
    /// A number, `true`, `false` or `null`, byte for byte as sent.
    Verbatim(&'a [u8]),
    /// A string, decoded and encoded again by serde_json (quotes included).
    String(String),
    Array(Vec<Node<'a>>),
    /// Members sorted by encoded key; duplicates keep the order they were sent in.
    Object(Vec<(String, Node<'a>)>),
}

impl Node<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Node::Verbatim(bytes) => out.extend_from_slice(bytes),
            Node::String(encoded) => out.extend_from_slice(encoded.as_bytes()),
            Node::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out);
                }
                out.push(b']');
            }
            Node::Object(members) => {
                out.push(b'{');
                for (i, (key, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.extend_from_slice(key.as_bytes());
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

/// A strict RFC 8259 parser that keeps what the canonical form needs.
struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.skip_whitespace();
        (self.peek()? == byte).then(|| self.pos += 1)
    }

    fn value(&mut self, depth: usize) -> Option<Node<'a>> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string().map(Node::String),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    fn object(&mut self, depth: usize) -> Option<Node<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let mut members = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                self.skip_whitespace();
                let key = self.string()?;
                self.eat(b':')?;
                members.push((key, self.value(depth)?));
                if self.eat(b',').is_none() {
                    self.eat(b'}')?;
                    break;
                }
            }
        }
        // Stable: duplicates of one key keep their order, so "first wins" and "last wins"
        // parsers read the same member from two bodies with one canonical form.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        // Keys equal but for case may be one key to the handler's parser (Go's
        // encoding/json, Jackson and .NET can match keys ignoring case, the last one
        // winning), and sorting would part them: `{"amount":1,"Amount":100}` and
        // `{"Amount":100,"amount":1}` had one form. Such a body is left to its raw bytes.
        let mut keys: Vec<&String> = members.iter().map(|m| &m.0).collect();
        keys.dedup(); // sorted: duplicates are adjacent
        // Folded every way a parser may fold: Go maps each character to one of its simple
        // case folds (`ſ` is `s`, `ς` is `σ`, `K` (Kelvin) is `k`, `ẞ` is `ß`), Jackson
        // lowercases, and a full mapping turns `ß` into `ss`. Two keys that meet under any
        // of these folds leave the body to its raw bytes (a pair that no parser joins costs
        // only its canonical form). Two folds cover the four: keys equal once lowercased are
        // equal once lowercased then uppercased, and likewise for uppercasing. A third is
        // Jackson's under a Turkish or Azeri default locale (`toLowerCase` of the JVM's
        // locale), which lowercases `İ` and `I` followed by a combining dot above (U+0307) to
        // `i`, and any other `I` to `ı`: Unicode's own lowercasing gives `İ` a combining dot,
        // so the first two left `customer_İd` (or `customer_I\u{307}d`) apart from
        // `customer_id`.
        let folds: [fn(&str) -> String; 3] = [
            |key| {
                key.chars()
                    .flat_map(char::to_uppercase)
                    .flat_map(char::to_lowercase)
                    .collect()
            },
            |key| {
                key.chars()
                    .flat_map(char::to_lowercase)
                    .flat_map(char::to_uppercase)
                    .collect()
            },
            turkish_lowercase,
        ];
        for fold in folds {
            let mut folded: Vec<String> = keys.iter().map(|key| fold(key)).collect();
            folded.sort_unstable();
            folded.dedup();
            if folded.len() != keys.len() {
                return None;
            }
        }
        Some(Node::Object(members))
    }

    fn array(&mut self, depth: usize) -> Option<Node<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let mut items = Vec::new();
        if self.eat(b']').is_none() {
            loop {
                items.push(self.value(depth)?);
                if self.eat(b',').is_none() {
                    self.eat(b']')?;
                    break;
                }
            }
        }
        Some(Node::Array(items))
    }

    /// A string token, re-encoded: serde_json validates it (escapes, control characters,
    /// UTF-8, surrogate pairs) and writes every string one way.
    fn string(&mut self) -> Option<String> {
        let start = self.pos;
        if self.peek()? != b'"' {
            return None;
        }
        let mut i = start + 1;
        loop {
            match *self.input.get(i)? {
                b'"' => break,
                // The escaped byte cannot end the string (`\"`); serde_json checks the escape.
                b'\\' => i += 2,
                _ => i += 1,
            }
        }
        self.pos = i + 1;
        let decoded: String = serde_json::from_slice(&self.input[start..self.pos]).ok()?;
        serde_json::to_string(&decoded).ok()
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<Node<'a>> {
        let end = self.pos + word.len();
        (self.input.get(self.pos..end)? == word).then(|| {
            self.pos = end;
            Node::Verbatim(word)
        })
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, kept as sent.
    fn number(&mut self) -> Option<Node<'a>> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            self.at_least_one_digit()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.at_least_one_digit()?;
        }
        Some(Node::Verbatim(&self.input[start..self.pos]))
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn at_least_one_digit(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}

/// `key` lowercased as Java's `toLowerCase` does in a Turkish or Azeri locale: `İ`, and `I`
/// followed by a combining dot above (which goes), to `i`; any other `I` to `ı`; the rest as
/// Unicode lowercases it.
fn turkish_lowercase(key: &str) -> String {
    let mut folded = String::with_capacity(key.len());
    let mut chars = key.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{130}' => folded.push('i'),
            'I' => {
                // Java drops a dot above that follows other combining marks too (those not
                // of its class); any combining diacritical mark is skipped here, which can
                // only join more keys (their body then goes to its raw bytes).
                let mut marks = String::new();
                while let Some(mark) = chars.next_if(|m| ('\u{300}'..='\u{36f}').contains(m)) {
                    marks.push(mark);
                }
                match marks.find('\u{307}') {
                    Some(dot) => {
                        folded.push('i');
                        marks.remove(dot);
                    }
                    None => folded.push('\u{131}'),
                }
                folded.push_str(&marks);
            }
            c => folded.extend(c.to_lowercase()),
        }
    }
    folded
}

#[cfg(test)]
mod tests {
    use super::canonical_json;
    use proptest::prelude::*;

    fn canonical(body: &str) -> String {
        let bytes =
            canonical_json(body.as_bytes()).unwrap_or_else(|| panic!("{body} should canonicalise"));
        String::from_utf8(bytes).expect("canonical JSON is UTF-8")
    }

    #[test]
    fn different_requests_stay_different() {
        let pairs = [
            // Beyond 2^53: equal as f64.
            (
                r#"{"amount":9007199254740993}"#,
                r#"{"amount":9007199254740992}"#,
            ),
            ("[18446744073709551617]", "[18446744073709551616]"),
            ("0.10000000000000000001", "0.1"),
            ("-0", "0"),
            ("-0.0", "0.0"),
            ("1e2", "100"),
            ("1E400", "1e401"),
            ("1", "1.0"),
            ("1", "1e0"),
            ("1e0", "1E0"),
            ("1e+0", "1e0"),
            // Duplicate keys are not collapsed, and their order is kept.
            (r#"{"a":1,"a":2}"#, r#"{"a":2}"#),
            (r#"{"a":1,"a":2}"#, r#"{"a":2,"a":1}"#),
            (r#"{"a":1,"b":2}"#, r#"{"a":1,"b":2,"b":2}"#),
            // Array order and types matter.
            ("[1,2]", "[2,1]"),
            (r#"["1"]"#, "[1]"),
            ("[null]", "[]"),
            (r#"{"a":{"b":1}}"#, r#"{"a":{"b":1.0}}"#),
            // A key is not a value.
            (r#"{"a":"b"}"#, r#"["a","b"]"#),
            (r#""A""#, r#""a""#),
        ];
        for (a, b) in pairs {
            assert_ne!(canonical(a), canonical(b), "{a} vs {b}");
        }
    }

    #[test]
    fn equal_requests_are_equal() {
        let pairs = [
            (r#"{"b":1,"a":2}"#, r#"{"a":2,"b":1}"#),
            (
                r#" { "currency" : "eur",	"amount" : 1 }
"#,
                r#"{"amount":1,"currency":"eur"}"#,
            ),
            (r#""\u0041""#, r#""A""#),
            (r#"{"\u0041":1}"#, r#"{"A":1}"#),
            (r#""\/""#, r#""/""#),
            (r#""\u00e9""#, r#""é""#),
            (r#""\ud83d\ude00""#, r#""😀""#),
            (r#""\u001F""#, r#""\u001f""#),
            (
                r#"{"a":[ {"y":true,"x":null} ]}"#,
                r#"{"a":[{"x":null,"y":true}]}"#,
            ),
            // Duplicates move with their key, in the order sent.
            (r#"{"a":1,"b":0,"a":2}"#, r#"{"b":0,"a":1,"a":2}"#),
        ];
        for (a, b) in pairs {
            assert_eq!(canonical(a), canonical(b), "{a} vs {b}");
        }
        assert_eq!(
            canonical(r#"{ "b": [1, 2.50, -0e-0], "a": "x\ty" }"#),
            r#"{"a":"x\ty","b":[1,2.50,-0e-0]}"#
        );
    }

    #[test]
    fn what_is_not_canonicalised_falls_back() {
        let deep_ok = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert!(canonical_json(deep_ok.as_bytes()).is_some());
        let too_deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
        let very_deep = "[".repeat(1 << 20);
        let not_json: [&[u8]; 21] = [
            b"",
            b"   ",
            b"amount=1",
            b"{",
            b"{}}",
            b"{} {}",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"01",
            b"1.",
            b".5",
            b"1e",
            b"+1",
            b"NaN",
            b"tru",
            b"\"\\ud800\"",
            b"\"\xff\"",
            b"\"a\nb\"",
            b"\"\\",
        ];
        for body in not_json {
            assert_eq!(
                canonical_json(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(canonical_json(too_deep.as_bytes()), None);
        assert_eq!(canonical_json(very_deep.as_bytes()), None);
    }

    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".*".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                prop::collection::btree_map(".*", inner, 0..8)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whitespace never matters, the form is a fixed point, and it is JSON meaning what
        /// the body meant (serde_json::Value holds no duplicate keys, so none are lost here).
        #[test]
        fn canonical_form_is_the_same_json(value in json()) {
            let compact = serde_json::to_string(&value).unwrap();
            let pretty = serde_json::to_string_pretty(&value).unwrap();
            let form = canonical(&compact);
            prop_assert_eq!(&form, &canonical(&pretty));
            prop_assert_eq!(&canonical(&form), &form);
            // Against the body parsed back, not `value`: serde_json's float parsing may differ
            // from the f64 it printed by one ulp, the same for both.
            let sent: serde_json::Value = serde_json::from_str(&compact).unwrap();
            let meant: serde_json::Value = serde_json::from_str(&form).unwrap();
            prop_assert_eq!(meant, sent);
        }
    }
}
