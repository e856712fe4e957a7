//! Comments, read straight from the source text. The parser skips them; the
//! formatter puts each one back next to the node it was written beside, and
//! lint suppressions (`# kiln:allow(rule-id)`) are read from them.

/// One `#` or `//` comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comment {
    /// Byte offset of the comment marker.
    pub start: usize,
    /// The comment text including its marker, without the line break.
    pub text: String,
    /// 0-based line number.
    pub line: usize,
    /// True when only whitespace precedes it on its line.
    pub own_line: bool,
}

/// Finds every comment, skipping `#` and `//` inside string literals.
pub fn scan(text: &str) -> Vec<Comment> {
    let mut out = Vec::new();
    let mut offset = 0;
    for (line_no, line) in text.split('\n').enumerate() {
        let bytes = line.as_bytes();
        let mut in_str = false;
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if in_str {
                if b == b'\\' {
                    i += 2;
                    continue;
                }
                if b == b'"' {
                    in_str = false;
                }
            } else if b == b'"' {
                in_str = true;
            } else if b == b'#' || (b == b'/' && bytes.get(i + 1) == Some(&b'/')) {
                let body = line
                    .get(i..)
                    .unwrap_or("")
                    .trim_end_matches('\r')
                    .trim_end();
                out.push(Comment {
                    start: offset + i,
                    text: body.to_string(),
                    line: line_no,
                    own_line: line.get(..i).is_some_and(|p| p.trim().is_empty()),
                });
                break;
            }
            i += 1;
        }
        offset += line.len() + 1;
    }
    out
}

/// Lint ids named by `kiln:allow(a, b)` in a comment.
pub fn allowed_ids(comment: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let mut rest = comment;
    while let Some(pos) = rest.find("kiln:allow(") {
        let after = &rest[pos + "kiln:allow(".len()..];
        let Some(end) = after.find(')') else { break };
        ids.extend(
            after[..end]
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
        );
        rest = &after[end..];
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_comments_outside_strings() {
        let c = scan("a \"# not\" # yes\n  // own\nb");
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].text, "# yes");
        assert!(!c[0].own_line);
        assert_eq!(c[1].text, "// own");
        assert!(c[1].own_line);
        assert_eq!(c[1].line, 1);
    }

    #[test]
    fn reads_allow_ids() {
        assert_eq!(
            allowed_ids("# kiln:allow(shadowed-rule, unused-definition)"),
            vec!["shadowed-rule", "unused-definition"]
        );
        assert!(allowed_ids("# nothing").is_empty());
    }
}
