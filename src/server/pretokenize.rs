//! cl100k_base's pre-tokenizer for ASCII text, by hand: the pieces
//! `bpe_openai`'s regex gives, without running it. Every prompt is counted
//! on the request path, and the regex (a lazy DFA, with look-ahead
//! emulated by a second pattern) cost ~750 instructions a piece, most of
//! what counting a short prompt cost. Text with any non-ASCII byte still
//! goes through the regex; `the_regexs_pieces` checks this scanner against
//! it on generated ASCII text.
//!
//! The pattern, tried in order at each position (leftmost-first):
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}{1,3}
//! | ' '?[^\s\p{L}\p{N}]+[\r\n]* | \s*[\r\n]+ | \s+$ | \s+(?!\S) | \s+
//! ```
//!
//! On ASCII, `\p{L}` is a letter, `\p{N}` a digit and `\s` one of
//! `\t \n \x0b \x0c \r` and space.

fn letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}

fn digit(b: u8) -> bool {
    b.is_ascii_digit()
}

fn space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

fn newline(b: u8) -> bool {
    matches!(b, b'\r' | b'\n')
}

/// Neither whitespace, letter nor digit.
fn other(b: u8) -> bool {
    !space(b) && !letter(b) && !digit(b)
}

/// The end of the run from `i` of bytes that satisfy `f`.
fn run(t: &[u8], mut i: usize, f: impl Fn(u8) -> bool) -> usize {
    while i < t.len() && f(t[i]) {
        i += 1;
    }
    i
}

/// The length of the piece at `i` (`i < t.len()`, `t` ASCII): always at
/// least 1.
fn piece(t: &[u8], i: usize) -> usize {
    let c = t[i];
    let next = t.get(i + 1).copied();
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == b'\'' {
        let lower = |k: usize| t.get(i + k).map(u8::to_ascii_lowercase);
        match lower(1) {
            Some(b's' | b't' | b'm' | b'd') => return 2,
            Some(b'r' | b'v') if lower(2) == Some(b'e') => return 3,
            Some(b'l') if lower(2) == Some(b'l') => return 3,
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if letter(c) {
        return run(t, i, letter) - i;
    }
    if !newline(c) && !digit(c) && next.is_some_and(letter) {
        return run(t, i + 1, letter) - i;
    }
    // \p{N}{1,3}
    if digit(c) {
        return (run(t, i, digit) - i).min(3);
    }
    // ' '?[^\s\p{L}\p{N}]+[\r\n]*
    let start = if c == b' ' && next.is_some_and(other) {
        i + 1
    } else {
        i
    };
    if other(t[start]) {
        let end = run(t, start, other);
        return run(t, end, newline) - i;
    }
    // Only whitespace is left: c is whitespace.
    let end = run(t, i, space);
    // \s*[\r\n]+: up to the run's last newline.
    if let Some(last) = t[i..end].iter().rposition(|&b| newline(b)) {
        return last + 1;
    }
    // \s+$
    if end == t.len() {
        return end - i;
    }
    // \s+(?!\S): the run but its last, which goes with what follows;
    // else \s+ (a run of one).
    if end - i >= 2 {
        end - i - 1
    } else {
        end - i
    }
}

/// Calls `f` with each piece of `text`, which must be ASCII (the caller
/// sends other text to the regex).
pub fn ascii_pieces(text: &str, mut f: impl FnMut(&str)) {
    let t = text.as_bytes();
    let mut i = 0;
    while i < t.len() {
        let n = piece(t, i).max(1);
        // ASCII: every byte is a char boundary.
        f(text.get(i..i + n).unwrap_or(""));
        i += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ours(text: &str) -> Vec<String> {
        let mut v = Vec::new();
        ascii_pieces(text, |p| v.push(p.to_string()));
        v
    }

    fn regexs(text: &str) -> Vec<String> {
        bpe_openai::cl100k_base()
            .split(text)
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_cases_that_decide_between_patterns() {
        for text in [
            "",
            "Write one short sentence about kilns.",
            "You are a helpful assistant.",
            "it's they're I'VE we'll he'd 'sun 'x ''",
            "  two   spaces\tand tabs\t\tx",
            "end with spaces   ",
            "lines\r\n\r\n  indented\n\n\n",
            " \n x",
            "12345 1 22 333 4444",
            "a+b=c; (x) -> [y] {z}!!! ?!\n\n",
            " ... ' 's",
            "\u{1}\u{7f}ctrl\u{b}\u{c}vt",
            "\ttab-led \x0bword",
            "x \n",
            "'",
            " ",
        ] {
            assert_eq!(ours(text), regexs(text), "{text:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Any ASCII text, dense in what the patterns turn on: the
        /// regex's pieces, in order, covering the text.
        #[test]
        fn the_regexs_pieces(
            parts in proptest::collection::vec(
                prop_oneof![
                    "[a-zA-Z]{1,6}",
                    "[0-9]{1,5}",
                    "[ \\t\\r\\n\\x0b\\x0c]{1,4}",
                    "'[sStTrReEvVmMlLdD]{0,2}",
                    "[!-/:-@\\[-`{-~]{1,3}",
                    "[\\x00-\\x08\\x0e-\\x1f\\x7f]",
                ],
                0..24,
            )
        ) {
            let text: String = parts.concat();
            prop_assert_eq!(ours(&text), regexs(&text));
        }

        /// Any ASCII bytes at all.
        #[test]
        fn any_ascii(text in "[\\x00-\\x7f]{0,40}") {
            prop_assert_eq!(ours(&text), regexs(&text));
        }
    }
}
