//! Text → AST. The pest grammar (`grammar/kiln.pest`) gives a concrete tree;
//! this module turns it into [`ast`](super::ast) nodes with spans. A syntax
//! error becomes a diagnostic that points at the offending position and says
//! in words what was expected there.

use super::ast::*;
use crate::diag::{Code, Diagnostic};
use crate::source::{FileId, Span};
use pest::iterators::Pair;
use pest::Parser as _;

#[derive(pest_derive::Parser)]
#[grammar = "../grammar/kiln.pest"]
struct KilnParser;

type P<'a> = Pair<'a, Rule>;

fn is_keyword(r: Rule) -> bool {
    matches!(
        r,
        Rule::kw_and
            | Rule::kw_not
            | Rule::kw_pool
            | Rule::kw_model
            | Rule::kw_tier
            | Rule::kw_tenant
            | Rule::kw_cohort
            | Rule::kw_exception
            | Rule::kw_classify
            | Rule::kw_route
            | Rule::kw_admit
            | Rule::kw_fallback
            | Rule::kw_rollout
            | Rule::kw_stage
            | Rule::kw_gate
            | Rule::kw_approval
            | Rule::kw_when
            | Rule::kw_default
            | Rule::kw_accept
            | Rule::kw_queue
            | Rule::kw_max_wait
            | Rule::kw_delay
            | Rule::kw_until
            | Rule::kw_degrade
            | Rule::kw_variant
            | Rule::kw_max_tokens
            | Rule::kw_on
            | Rule::kw_reject
            | Rule::kw_retry_after
            | Rule::kw_demote
            | Rule::kw_rollback
            | Rule::kw_for
            | Rule::kw_require
            | Rule::kw_from
            | Rule::kw_policy
    )
}

/// Children without keyword tokens: the builder only reads what varies.
trait Kids<'a> {
    fn kids(self) -> std::iter::Filter<pest::iterators::Pairs<'a, Rule>, fn(&P<'a>) -> bool>;
}

impl<'a> Kids<'a> for P<'a> {
    fn kids(self) -> std::iter::Filter<pest::iterators::Pairs<'a, Rule>, fn(&P<'a>) -> bool> {
        fn keep(p: &P) -> bool {
            !is_keyword(p.as_rule())
        }
        self.into_inner().filter(keep as fn(&P<'a>) -> bool)
    }
}

/// Parses one file. On a syntax error returns the diagnostic.
pub fn parse(file: FileId, text: &str) -> Result<File, Box<Diagnostic>> {
    if let Some(d) = too_deep(file, text) {
        return Err(Box::new(d));
    }
    let content_end = content_ends(text);
    if text.len() >= PARALLEL_MIN_BYTES {
        if let Some(file) = parse_halves(file, text, &content_end) {
            return Ok(file);
        }
    }
    parse_segment(file, text, 0, text.len(), &content_end)
}

/// Below this size one thread parses faster than two start.
const PARALLEL_MIN_BYTES: usize = 256 * 1024;

/// Parses `text[start..end]` (whole top-level items) as a policy.
fn parse_segment(
    file: FileId,
    text: &str,
    start: usize,
    end: usize,
    content_end: &[u32],
) -> Result<File, Box<Diagnostic>> {
    let segment = text.get(start..end).unwrap_or("");
    let mut pairs = match KilnParser::parse(Rule::policy, segment) {
        Ok(p) => p,
        // Halves are parsed with start > 0 and never report: on failure the
        // whole file is parsed again and that error is the one shown.
        Err(e) => return Err(Box::new(syntax_error(file, segment, e))),
    };
    let b = Builder {
        file,
        offset: start,
        content_end,
    };
    let mut items = Vec::new();
    if let Some(policy) = pairs.next() {
        for p in policy.into_inner() {
            if let Some(item) = b.item(p) {
                items.push(item);
            }
        }
    }
    Ok(File { items })
}

/// Large policies (generated ones reach 10,000 rules) are split at the
/// top-level item nearest the middle and parsed on two threads; the result
/// is the same AST as a single parse. `None` when no split point exists or
/// a half fails (the caller then parses the whole file for the diagnostic).
fn parse_halves(file: FileId, text: &str, content_end: &[u32]) -> Option<File> {
    let mid = text.len() / 2;
    let split = item_starts(text)
        .into_iter()
        .filter(|&p| p > 0)
        .min_by_key(|&p| p.abs_diff(mid))?;
    let (a, b) = std::thread::scope(|s| {
        let second = std::thread::Builder::new()
            .stack_size(8 << 20)
            .spawn_scoped(s, || {
                parse_segment(file, text, split, text.len(), content_end)
            })
            .ok()?;
        let first = parse_segment(file, text, 0, split, content_end);
        Some((first, second.join().ok()?))
    })?;
    let (mut a, b) = (a.ok()?, b.ok()?);
    a.items.extend(b.items);
    Some(a)
}

/// Byte offsets of lines that start a top-level item (depth 0, first word a
/// top-level keyword), skipping strings and comments.
fn item_starts(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let comments = super::comments::scan(text);
    let mut next_comment = 0;
    let mut depth = 0usize;
    let mut in_str = false;
    let bytes = text.as_bytes();
    let mut line_start = true;
    let mut i = 0;
    while i < bytes.len() {
        if !in_str && comments.get(next_comment).is_some_and(|c| c.start == i) {
            i += comments[next_comment].text.len();
            next_comment += 1;
            continue;
        }
        let b = bytes[i];
        if line_start && depth == 0 && !in_str && b.is_ascii_alphabetic() {
            let word_end = bytes[i..]
                .iter()
                .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
                .map_or(bytes.len(), |n| i + n);
            if text
                .get(i..word_end)
                .is_some_and(|w| TOP_KEYWORDS.contains(&w))
            {
                out.push(i);
            }
        }
        match b {
            b'"' => in_str = !in_str,
            b'\\' if in_str => i += 1,
            b'\n' => in_str = false,
            b'{' | b'[' | b'(' if !in_str => depth += 1,
            b'}' | b']' | b')' if !in_str => depth = depth.saturating_sub(1),
            _ => {}
        }
        line_start = b == b'\n';
        i += 1;
    }
    out
}

/// `content_end[i]`: where the content before offset `i` ends, skipping
/// back over whitespace and comments. pest lets a rule's span run over the
/// trivia a failed repetition skipped; diagnostics and the formatter need
/// spans that end on the last real character.
fn content_ends(text: &str) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut trivia: Vec<bool> = bytes
        .iter()
        .map(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        .collect();
    for c in super::comments::scan(text) {
        let end = (c.start + c.text.len()).min(trivia.len());
        for t in trivia.iter_mut().take(end).skip(c.start) {
            *t = true;
        }
    }
    let mut content_end = Vec::with_capacity(bytes.len() + 1);
    content_end.push(0u32);
    for i in 1..=bytes.len() {
        let prev = content_end[i - 1];
        content_end.push(if trivia[i - 1] { prev } else { i as u32 });
    }
    content_end
}

/// Deepest bracket nesting and longest `not not …` run accepted. Real
/// policies stay far below; the limits keep the recursive descent (and every
/// stage after it) inside a thread's stack whatever the input.
pub const MAX_NESTING: usize = 32;

fn too_deep(file: FileId, text: &str) -> Option<Diagnostic> {
    let comments = super::comments::scan(text);
    let mut next_comment = comments.iter().peekable();
    let mut depth = 0usize;
    let mut nots = 0usize;
    let mut in_str = false;
    let mut escaped = false;
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if let Some(c) = next_comment.peek() {
            if c.start == i && !in_str {
                i += c.text.len();
                next_comment.next();
                continue;
            }
        }
        let b = bytes[i];
        if in_str {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' || b == b'\n' {
                in_str = false;
            }
            i += 1;
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if b.is_ascii_alphanumeric() || b == b'_' {
            let mut j = i;
            while j < bytes.len()
                && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_' || bytes[j] == b'-')
            {
                j += 1;
            }
            if text.get(i..j) == Some("not") {
                nots += 1;
            } else {
                nots = 0;
            }
            if nots > MAX_NESTING {
                return Some(too_deep_error(file, i, j));
            }
            i = j;
            continue;
        }
        if depth > MAX_NESTING {
            return Some(too_deep_error(file, i, i + 1));
        }
        i += 1;
    }
    None
}

fn too_deep_error(file: FileId, start: usize, end: usize) -> Diagnostic {
    Diagnostic::error(
        Code::Syntax,
        format!("nesting deeper than {MAX_NESTING} levels"),
    )
    .at(Span::new(file, start, end), "too deep")
    .help("split the condition into several rules or flatten its parentheses")
}

fn rule_name(r: &Rule) -> Option<&'static str> {
    Some(match r {
        Rule::EOI => "end of file",
        Rule::kw_pool
        | Rule::kw_model
        | Rule::kw_tier
        | Rule::kw_tenant
        | Rule::kw_cohort
        | Rule::kw_exception => "a definition (pool, model, tier, tenant, cohort)",
        Rule::kw_classify | Rule::kw_route | Rule::kw_admit | Rule::kw_fallback => {
            "a rule block (classify, route, admit, fallback)"
        }
        Rule::kw_rollout | Rule::kw_approval => "a rollout or approval block",
        Rule::kw_policy => "a policy block",
        Rule::kw_when => "`when …`",
        Rule::kw_default => "`default => …`",
        Rule::kw_accept
        | Rule::kw_queue
        | Rule::kw_delay
        | Rule::kw_degrade
        | Rule::kw_reject
        | Rule::kw_demote => "an outcome",
        Rule::kw_on => "`on POOL`",
        Rule::kw_until => "`until HH:MM`",
        Rule::kw_for => "`for …`",
        Rule::kw_from => "`from \"group\"`",
        Rule::kw_retry_after => "`retry_after DURATION`",
        Rule::pool | Rule::model | Rule::tier | Rule::tenant | Rule::cohort | Rule::exception => {
            "a definition"
        }
        Rule::classify | Rule::route | Rule::admit | Rule::fallback => "a rule block",
        Rule::rollout | Rule::approval => "a rollout or approval block",
        Rule::settings => "a policy block",
        Rule::property => "a field",
        Rule::body => "`{`",
        Rule::name | Rule::path | Rule::path_value => "a name",
        Rule::key => "a field name",
        Rule::rule => "`when …`",
        Rule::default_rule => "`default => …`",
        Rule::expr | Rule::or_expr | Rule::and_expr | Rule::not_expr | Rule::atom => "a condition",
        Rule::operand | Rule::reference => "a signal or value",
        Rule::comparison => "a comparison",
        Rule::cmp_op => "a comparison operator (==, !=, <, <=, >, >=)",
        Rule::kw_and => "`and`",
        Rule::kw_or => "`or`",
        Rule::kw_in => "`in`",
        Rule::outcome => {
            "an outcome (tier, route target, accept, queue, delay, degrade, reject, fallback)"
        }
        Rule::step => "a fallback step (route, queue, demote, reject)",
        Rule::value | Rule::lit_value => "a value",
        Rule::quantity | Rule::number => "a number",
        Rule::unit => "a unit (ms, s, m, h, d, GB, %, …)",
        Rule::string => "a string",
        Rule::list => "a list `[…]`",
        Rule::name_set => "a tier name or a list of tier names",
        Rule::require_rule => "`require N from \"group\" for …` or `require owner for …`",
        Rule::rollback_rule => "`rollback when …`",
        Rule::stage_block => "`stage NAME { … }`",
        Rule::gate_rule => "`gate when …`",
        Rule::degrade_arg => "`variant NAME` or `max_tokens N`",
        _ => return None,
    })
}

fn syntax_error(file: FileId, text: &str, e: pest::error::Error<Rule>) -> Diagnostic {
    use pest::error::{ErrorVariant, InputLocation};
    let (start, end) = match e.location {
        InputLocation::Pos(p) => (p, p),
        InputLocation::Span((s, e)) => (s, e),
    };
    // Point at the whole offending token, not a zero-width caret.
    let end = if end > start {
        end
    } else {
        let rest = text.get(start..).unwrap_or("");
        let tok = rest
            .char_indices()
            .find(|(_, c)| c.is_whitespace())
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        start + tok.clamp(usize::from(!rest.is_empty()), 40)
    };
    let found = text
        .get(start..end)
        .filter(|s| !s.is_empty())
        .map(|s| format!("`{s}`"))
        .unwrap_or_else(|| "end of file".to_string());
    let expected = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => {
            let mut names: Vec<&str> = positives.iter().filter_map(rule_name).collect();
            names.sort();
            names.dedup();
            // Inside a rule block `tier`/`fallback` are outcomes, not items.
            if names.contains(&"`when …`") {
                names.retain(|n| !n.starts_with("a definition") && !n.starts_with("a rule block"));
            }
            names
        }
        ErrorVariant::CustomError { .. } => Vec::new(),
    };
    let at_line_start = text
        .get(..start)
        .map(|b| b.rsplit('\n').next().unwrap_or("").trim().is_empty())
        .unwrap_or(true);
    let label = if expected.is_empty() && at_line_start {
        "expected a definition or a block: pool, model, tier, tenant, cohort, classify, route, admit, fallback, rollout, approval".to_string()
    } else if expected.is_empty() {
        "unexpected here".to_string()
    } else {
        format!("expected {}", join_or(&expected))
    };
    if let Some(d) = unpadded_time(file, text, start) {
        return d;
    }
    if let Some(d) = unclosed_block(file, text, start) {
        return d;
    }
    if let Some(d) = misspelt_quantity(file, text, start) {
        return d;
    }
    let help = hint_for(text, start).unwrap_or_else(|| {
        "check the line against the examples in policies/; each block is `keyword name { … }`"
            .to_string()
    });
    Diagnostic::error(Code::Syntax, format!("unexpected {found}"))
        .at(Span::new(file, start, end), label)
        .help(help)
}

/// `9:00` or `09:5`: the grammar's times of day have two digits on each
/// side, so the parser stops at the `:`; say how to write it instead.
fn unpadded_time(file: FileId, text: &str, pos: usize) -> Option<Diagnostic> {
    let clockish = |c: u8| c.is_ascii_digit() || c == b':';
    let b = text.as_bytes();
    let mut lo = pos.min(b.len());
    while lo > 0 && b.get(lo - 1).copied().is_some_and(clockish) {
        lo -= 1;
    }
    let mut hi = pos.min(b.len());
    while b.get(hi).copied().is_some_and(clockish) {
        hi += 1;
    }
    let tok = text.get(lo..hi)?;
    let (h, m) = tok.split_once(':')?;
    let digits = |x: &str| (1..=2).contains(&x.len()) && x.bytes().all(|c| c.is_ascii_digit());
    if !digits(h) || !digits(m) || (h.len() == 2 && m.len() == 2) {
        return None;
    }
    let (hour, minute): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    let fixed = if m.len() == 1 {
        // `09:5`: 09:05 or 09:50? Offer both.
        format!("`{hour:02}:0{minute}` or `{hour:02}:{minute}0`")
    } else {
        format!("`{hour:02}:{minute:02}`")
    };
    Some(
        Diagnostic::error(
            Code::Syntax,
            format!("`{tok}` is not a time of day as kiln writes it"),
        )
        .at(
            Span::new(file, lo, hi),
            "times of day have two-digit hours and minutes",
        )
        .help(format!(
            "write {fixed} (24-hour `HH:MM`, from `00:00` to `23:59`)"
        )),
    )
}

/// A unit spelt as a word (`minute`, `hour`, `secs`) or a currency sign
/// (`$3.20/hour`): the nearest spelling kiln reads, `None` when none.
fn unit_spelling(word: &str, per: bool) -> Option<&'static str> {
    let w = word.to_ascii_lowercase();
    Some(match w.as_str() {
        "ms" | "msec" | "msecs" | "millis" | "millisecond" | "milliseconds" => "ms",
        "s" | "sec" | "secs" | "second" | "seconds" => "s",
        "m" | "min" | "mins" | "minute" | "minutes" => {
            if per {
                "min"
            } else {
                "m"
            }
        }
        "h" | "hr" | "hrs" | "hour" | "hours" => "h",
        "d" | "day" | "days" => {
            if per {
                "day"
            } else {
                "d"
            }
        }
        "%" | "pct" | "percent" => "%",
        "kb" => "KB",
        "mb" => "MB",
        "gb" => "GB",
        "tb" => "TB",
        "kib" => "KiB",
        "mib" => "MiB",
        "gib" => "GiB",
        "tib" => "TiB",
        _ => return None,
    })
}

/// `2M/minute`, `$3.20/hour`, `500 msec`: a quantity with a unit or period
/// kiln does not spell that way, or a currency sign. Says the nearest
/// valid spelling.
fn misspelt_quantity(file: FileId, text: &str, pos: usize) -> Option<Diagnostic> {
    let tokenish =
        |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'/' | b'$' | b'%' | b'_');
    let b = text.as_bytes();
    let mut lo = pos.min(b.len());
    while lo > 0 && b.get(lo - 1).copied().is_some_and(tokenish) {
        lo -= 1;
    }
    let mut hi = pos.min(b.len());
    while b.get(hi).copied().is_some_and(tokenish) {
        hi += 1;
    }
    let tok = text.get(lo..hi)?;
    let (currency, body) = match tok.strip_prefix('$') {
        Some(rest) => (true, rest),
        None => (false, tok),
    };
    // number, then an optional multiplier, unit and `/period`
    let num_len = body
        .bytes()
        .take_while(|c| c.is_ascii_digit() || *c == b'.' || *c == b'_')
        .count();
    if num_len == 0 || !body.as_bytes().first().is_some_and(u8::is_ascii_digit) {
        return None;
    }
    let (number, rest) = body.split_at(num_len);
    let (value, per) = match rest.split_once('/') {
        Some((v, p)) => (v, Some(p)),
        None => (rest, None),
    };
    let (mult, unit) = match value.chars().next() {
        Some(c @ ('k' | 'K' | 'M' | 'G' | 'B')) if value.len() == 1 => (Some(c), ""),
        _ => (None, value),
    };
    let fixed_unit = if unit.is_empty() {
        Some("")
    } else {
        unit_spelling(unit, false)
    }?;
    let fixed_per = match per {
        None => None,
        Some(p) => Some(unit_spelling(p, true).filter(|u| ["s", "min", "h", "day"].contains(u))?),
    };
    let mut fixed = format!(
        "{number}{}{fixed_unit}",
        mult.map(String::from).unwrap_or_default()
    );
    if let Some(p) = fixed_per {
        fixed.push('/');
        fixed.push_str(p);
    }
    if fixed == tok {
        return None;
    }
    let why = if currency {
        "amounts are plain numbers, with no currency sign"
    } else if per.is_some() {
        "periods are written `/s`, `/min`, `/h` or `/day`"
    } else {
        "units are ms, s, m, h, d, KB, MB, GB, TB, KiB, MiB, GiB, TiB and %"
    };
    let extra = if currency && fixed_per.is_some() && per.is_some() {
        ", and periods are written `/s`, `/min`, `/h` or `/day`"
    } else {
        ""
    };
    Some(
        Diagnostic::error(
            Code::Syntax,
            format!("`{tok}` is not a quantity kiln reads"),
        )
        .at(Span::new(file, lo, hi), format!("did you mean `{fixed}`?"))
        .help(format!("write `{fixed}`: {why}{extra}")),
    )
}

const TOP_KEYWORDS: [&str; 12] = [
    "pool",
    "model",
    "tier",
    "tenant",
    "cohort",
    "exception",
    "classify",
    "route",
    "admit",
    "fallback",
    "rollout",
    "approval",
];

/// A new top-level item starting inside a still-open block is the commonest
/// slip of all (a missing `}`): say so, and point at the block left open.
fn unclosed_block(file: FileId, text: &str, pos: usize) -> Option<Diagnostic> {
    let line_start = text.get(..pos)?.rfind('\n').map_or(0, |i| i + 1);
    let line = text.get(line_start..)?.lines().next()?;
    let word = line
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .next()?;
    if !TOP_KEYWORDS.contains(&word) {
        return None;
    }
    // depth at the start of this line, and where the outermost open block began
    let mut depth = 0usize;
    let mut opened_at = None;
    let comments = super::comments::scan(text);
    let mut next_comment = 0;
    let mut in_str = false;
    for (i, ch) in text.get(..line_start)?.char_indices() {
        while comments
            .get(next_comment)
            .is_some_and(|c| c.start + c.text.len() <= i)
        {
            next_comment += 1;
        }
        if comments.get(next_comment).is_some_and(|c| i >= c.start) {
            continue;
        }
        match ch {
            '"' => in_str = !in_str,
            '\n' => in_str = false,
            '{' | '[' if !in_str => {
                if depth == 0 {
                    opened_at = Some(i);
                }
                depth += 1;
            }
            '}' | ']' if !in_str => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    let opened = opened_at.filter(|_| depth > 0)?;
    let open_line_start = text.get(..opened)?.rfind('\n').map_or(0, |i| i + 1);
    let head = text.get(open_line_start..opened)?.trim();
    Some(
        Diagnostic::error(Code::Syntax, format!("`{head}` is not closed"))
            .at(
                Span::new(file, line_start, line_start + word.len()),
                format!("a new `{word}` starts here, inside it"),
            )
            .also(Span::new(file, opened, opened + 1), "opened here")
            .help("add the missing `}` (or `]`) before this line"),
    )
}

/// A targeted hint for the commonest slips.
fn hint_for(text: &str, pos: usize) -> Option<String> {
    let rest = text.get(pos..)?;
    let word: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    const KEYWORDS: [&str; 13] = [
        "when", "default", "pool", "model", "tier", "tenant", "cohort", "classify", "route",
        "admit", "fallback", "rollout", "approval",
    ];
    if !word.is_empty() && !KEYWORDS.contains(&word.as_str()) {
        if let Some(s) = crate::diag::suggest(&word, KEYWORDS) {
            return Some(s);
        }
    }
    let before = text.get(..pos)?;
    if rest.starts_with('=') && !rest.starts_with("==") && !rest.starts_with("=>") {
        return Some("to compare, write `==`; outcomes follow `=>`".into());
    }
    if rest.starts_with("&&") || rest.starts_with("||") {
        return Some("combine conditions with `and` / `or`".into());
    }
    let opens = before.matches('{').count();
    let closes = before.matches('}').count();
    if rest.trim().is_empty() && opens > closes {
        return Some(format!(
            "{} block(s) opened with `{{` are not closed; add `}}`",
            opens - closes
        ));
    }
    if rest.starts_with('\'') {
        return Some("strings use double quotes: \"…\"".into());
    }
    None
}

fn join_or(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {}", init.join(", "), last),
    }
}

struct Builder<'c> {
    file: FileId,
    /// Where the parsed segment starts in the file.
    offset: usize,
    /// See [`content_ends`].
    content_end: &'c [u32],
}

impl Builder<'_> {
    fn span(&self, p: &P) -> Span {
        let s = p.as_span();
        let (start, end) = (self.offset + s.start(), self.offset + s.end());
        let end = self
            .content_end
            .get(end)
            .map(|&e| (e as usize).max(start))
            .unwrap_or(end);
        Span::new(self.file, start, end)
    }

    fn ident(&self, p: P) -> Ident {
        Ident {
            name: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn item(&self, p: P) -> Option<Item> {
        let span = self.span(&p);
        Some(match p.as_rule() {
            Rule::pool
            | Rule::model
            | Rule::tier
            | Rule::tenant
            | Rule::cohort
            | Rule::exception => {
                let kind = match p.as_rule() {
                    Rule::pool => DeclKind::Pool,
                    Rule::model => DeclKind::Model,
                    Rule::tier => DeclKind::Tier,
                    Rule::tenant => DeclKind::Tenant,
                    Rule::exception => DeclKind::Exception,
                    _ => DeclKind::Cohort,
                };
                let mut it = p.kids();
                let name = self.ident(it.next()?);
                let body = self.body(it.next()?);
                Item::Decl(Decl {
                    kind,
                    name,
                    body,
                    span,
                })
            }
            Rule::classify => {
                let rules = self.rule_block(p.kids().next()?);
                Item::Classify(Classify { rules, span })
            }
            Rule::route => {
                let mut it = p.kids();
                let tiers = self.name_set(it.next()?);
                let model = self.ident(it.next()?);
                let rules = self.rule_block(it.next()?);
                Item::Route(Route {
                    tiers,
                    model,
                    rules,
                    span,
                })
            }
            Rule::admit => {
                let mut it = p.kids();
                let tiers = self.name_set(it.next()?);
                let rules = self.rule_block(it.next()?);
                Item::Admit(Admit { tiers, rules, span })
            }
            Rule::fallback => {
                let mut it = p.kids();
                let tiers = self.name_set(it.next()?);
                let steps = it.filter_map(|s| self.step(s)).collect();
                Item::Fallback(Fallback { tiers, steps, span })
            }
            Rule::rollout => {
                let items = p
                    .kids()
                    .filter_map(|i| match i.as_rule() {
                        Rule::rollback_rule => {
                            let span = self.span(&i);
                            let mut it = i.kids();
                            let cond = self.expr(it.next()?);
                            let hold = it.next().map(|v| self.value(v));
                            Some(RolloutItem::Rollback { cond, hold, span })
                        }
                        Rule::property => Some(RolloutItem::Prop(self.property(i))),
                        Rule::stage_block => Some(RolloutItem::Stage(self.stage(i)?)),
                        _ => None,
                    })
                    .collect();
                Item::Rollout(Rollout { items, span })
            }
            Rule::approval => {
                let rules = p.kids().filter_map(|r| self.require(r)).collect();
                Item::Approval(Approval { rules, span })
            }
            Rule::settings => {
                let body = self.body(p.kids().next()?);
                Item::Settings(Settings { body, span })
            }
            _ => return None,
        })
    }

    fn require(&self, p: P) -> Option<Require> {
        let span = self.span(&p);
        let mut it = p.kids();
        let n = it.next()?;
        let count_span = self.span(&n);
        if n.as_rule() == Rule::require_owner {
            let kinds = self.name_set(it.next()?);
            return Some(Require {
                owner: true,
                count: 1,
                count_span,
                group: String::new(),
                group_span: count_span,
                kinds,
                span,
            });
        }
        let count = n.as_str().parse::<f64>().unwrap_or(0.0) as u32;
        let g = it.next()?;
        let group_span = self.span(&g);
        let group = unescape(g.kids().next().map(|i| i.as_str()).unwrap_or(""));
        let kinds = self.name_set(it.next()?);
        Some(Require {
            owner: false,
            count,
            count_span,
            group,
            group_span,
            kinds,
            span,
        })
    }

    /// `stage NAME { property… gate when COND [for DUR]… }`
    fn stage(&self, p: P) -> Option<Stage> {
        let span = self.span(&p);
        let mut it = p.kids();
        let name = self.ident(it.next()?);
        let items = it
            .filter_map(|i| match i.as_rule() {
                Rule::gate_rule => {
                    let span = self.span(&i);
                    let mut g = i.kids();
                    let cond = self.expr(g.next()?);
                    let hold = g.next().map(|v| self.value(v));
                    Some(StageItem::Gate { cond, hold, span })
                }
                Rule::property => Some(StageItem::Prop(self.property(i))),
                _ => None,
            })
            .collect();
        Some(Stage { name, items, span })
    }

    fn body(&self, p: P) -> Body {
        let span = self.span(&p);
        Body {
            props: p.kids().map(|q| self.property(q)).collect(),
            span,
        }
    }

    fn property(&self, p: P) -> Property {
        let span = self.span(&p);
        let mut key = None;
        let mut args = PropArgs::None;
        let mut values = Vec::new();
        let mut body = None;
        for q in p.kids() {
            match q.as_rule() {
                Rule::flag | Rule::key => key = Some(self.ident(q)),
                Rule::assign => {
                    if let Some(v) = q.kids().next() {
                        args = PropArgs::Assign(self.value(v));
                    }
                }
                Rule::lit_value | Rule::path_value => values.push(self.value(q)),
                Rule::body => body = Some(self.body(q)),
                _ => {}
            }
        }
        if !values.is_empty() {
            args = PropArgs::Values(values);
        }
        Property {
            key: key.unwrap_or(Ident {
                name: String::new(),
                span,
            }),
            args,
            body,
            span,
        }
    }

    fn name_set(&self, p: P) -> NameSet {
        let span = self.span(&p);
        let inner = p.kids().next();
        match inner {
            Some(q) if q.as_rule() == Rule::list => {
                let names = q
                    .kids()
                    .map(|v| {
                        let s = self.span(&v);
                        Ident {
                            name: v.as_str().to_string(),
                            span: s,
                        }
                    })
                    .collect();
                NameSet {
                    names,
                    bracketed: true,
                    span,
                }
            }
            Some(q) => NameSet {
                names: vec![self.ident(q)],
                bracketed: false,
                span,
            },
            None => NameSet {
                names: Vec::new(),
                bracketed: true,
                span,
            },
        }
    }

    fn rule_block(&self, p: P) -> RuleBlock {
        let span = self.span(&p);
        let rules = p.kids().filter_map(|r| self.rule(r)).collect();
        RuleBlock { rules, span }
    }

    fn rule(&self, p: P) -> Option<Rule_> {
        let span = self.span(&p);
        let is_default = p.as_rule() == Rule::default_rule;
        let text = p.as_str();
        let mut it = p.kids();
        let cond = if is_default {
            None
        } else {
            Some(self.expr(it.next()?))
        };
        let outcome = self.outcome(it.next()?);
        let head_end = match &cond {
            Some(c) => c.span.end,
            None => span.start + text.find("default").map(|i| i + 7).unwrap_or(0) as u32,
        };
        let head = Span {
            file: self.file,
            start: span.start,
            end: head_end,
        };
        Some(Rule_ {
            cond,
            outcome,
            head,
            span,
        })
    }

    fn outcome(&self, p: P) -> Outcome {
        let span = self.span(&p);
        let items = p.kids().filter_map(|q| self.outcome_item(q)).collect();
        Outcome { items, span }
    }

    fn outcome_item(&self, q: P) -> Option<OutcomeItem> {
        let span = self.span(&q);
        Some(match q.as_rule() {
            Rule::out_tier => OutcomeItem::Tier(self.ident(q.kids().next()?)),
            Rule::out_tenant => OutcomeItem::Tenant(self.ident(q.kids().next()?)),
            Rule::out_accept => OutcomeItem::Accept(span),
            Rule::out_fallback => OutcomeItem::Fallback(span),
            Rule::out_queue => OutcomeItem::Queue {
                max_wait: self.value(q.kids().next()?),
                span,
            },
            Rule::out_hold => OutcomeItem::Hold {
                max_wait: q
                    .kids()
                    .find(|k| k.as_rule() == Rule::value)
                    .map(|v| self.value(v)),
                span,
            },
            Rule::out_delay => OutcomeItem::Delay {
                until: self.value(q.kids().next()?),
                span,
            },
            Rule::out_degrade => {
                let mut variant = None;
                let mut max_tokens = None;
                for a in q.kids() {
                    let text = a.as_str();
                    if let Some(inner) = a.kids().next() {
                        if text.starts_with("variant") {
                            variant = Some(self.path(inner));
                        } else {
                            max_tokens = Some(self.value(inner));
                        }
                    }
                }
                OutcomeItem::Degrade {
                    variant,
                    max_tokens,
                    span,
                }
            }
            Rule::out_target => {
                let mut it = q.kids();
                let path = self.path(it.next()?);
                let pool = it.next().map(|n| self.ident(n));
                OutcomeItem::Target { path, pool, span }
            }
            Rule::reject_spec => OutcomeItem::Reject(self.reject(q)?),
            _ => return None,
        })
    }

    fn reject(&self, q: P) -> Option<RejectSpec> {
        let span = self.span(&q);
        let mut it = q.kids();
        let n = it.next()?;
        let status_span = self.span(&n);
        let status = n.as_str().parse::<f64>().unwrap_or(0.0).min(65535.0) as u16;
        let mut message = None;
        let mut retry_after = None;
        for r in it {
            match r.as_rule() {
                Rule::string => {
                    message = Some(unescape(r.kids().next().map(|i| i.as_str()).unwrap_or("")))
                }
                Rule::value => retry_after = Some(self.value(r)),
                _ => {}
            }
        }
        Some(RejectSpec {
            status,
            status_span,
            message,
            retry_after,
            span,
        })
    }

    fn step(&self, p: P) -> Option<Step> {
        let span = self.span(&p);
        let q = p.kids().next()?;
        let kind = match q.as_rule() {
            Rule::reject_spec => StepKind::Reject(self.reject(q)?),
            Rule::step_queue => StepKind::Queue(self.value(q.kids().next()?)),
            Rule::step_demote => StepKind::Demote(self.ident(q.kids().next()?)),
            Rule::step_route => {
                let mut it = q.kids();
                let path = self.path(it.next()?);
                let pool = it.next().map(|n| self.ident(n));
                StepKind::Route { path, pool }
            }
            _ => return None,
        };
        Some(Step { kind, span })
    }

    fn path(&self, p: P) -> Vec<Ident> {
        if p.as_rule() == Rule::name {
            return vec![self.ident(p)];
        }
        p.kids().map(|n| self.ident(n)).collect()
    }

    fn value(&self, p: P) -> Value {
        let span = self.span(&p);
        let p = match p.as_rule() {
            Rule::value | Rule::lit_value | Rule::path_value => match p.kids().next() {
                Some(q) => q,
                None => {
                    return Value {
                        kind: ValueKind::List(Vec::new()),
                        span,
                    }
                }
            },
            _ => p,
        };
        let kind = match p.as_rule() {
            Rule::quantity => ValueKind::Quantity(quantity(&p)),
            Rule::string => {
                ValueKind::Str(unescape(p.kids().next().map(|i| i.as_str()).unwrap_or("")))
            }
            Rule::bool => ValueKind::Bool(p.as_str() == "true"),
            Rule::date => {
                let s = p.as_str();
                let num = |r: std::ops::Range<usize>| s.get(r).and_then(|x| x.parse().ok());
                ValueKind::Date(CivilDate {
                    year: num(0..4).unwrap_or(0),
                    month: num(5..7).map_or(0, |m: u16| m.min(255) as u8),
                    day: num(8..10).map_or(0, |d: u16| d.min(255) as u8),
                })
            }
            Rule::time_of_day => {
                let s = p.as_str();
                let hour: u8 = s.get(0..2).and_then(|x| x.parse().ok()).unwrap_or(0);
                let minute: u8 = s.get(3..5).and_then(|x| x.parse().ok()).unwrap_or(0);
                ValueKind::TimeOfDay(Clock { hour, minute })
            }
            Rule::path | Rule::name => ValueKind::Path(self.path(p)),
            Rule::list => ValueKind::List(p.kids().map(|v| self.value(v)).collect()),
            Rule::range => {
                let mut it = p.kids();
                match (it.next(), it.next()) {
                    (Some(a), Some(b)) => {
                        ValueKind::Range(Box::new(self.value(a)), Box::new(self.value(b)))
                    }
                    _ => ValueKind::List(Vec::new()),
                }
            }
            _ => ValueKind::Str(p.as_str().to_string()),
        };
        Value { kind, span }
    }

    fn expr(&self, p: P) -> Expr {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::expr | Rule::atom => {
                let text = p.as_str();
                let mut inner: Vec<P> = p.kids().collect();
                if inner.len() == 1 {
                    let only = inner.remove(0);
                    let e = self.expr(only);
                    if text.trim_start().starts_with('(') && e.span != span {
                        // `( expr )` as written: keep the parentheses for fmt
                        return Expr {
                            kind: ExprKind::Paren(Box::new(e)),
                            span,
                        };
                    }
                    return e;
                }
                Expr {
                    kind: ExprKind::And(inner.into_iter().map(|q| self.expr(q)).collect()),
                    span,
                }
            }
            Rule::or_expr | Rule::and_expr => {
                let is_or = p.as_rule() == Rule::or_expr;
                let parts: Vec<Expr> = p
                    .kids()
                    .filter(|q| !matches!(q.as_rule(), Rule::kw_and | Rule::kw_or))
                    .map(|q| self.expr(q))
                    .collect();
                if parts.len() == 1 {
                    return parts.into_iter().next().unwrap_or(Expr {
                        kind: ExprKind::And(Vec::new()),
                        span,
                    });
                }
                Expr {
                    kind: if is_or {
                        ExprKind::Or(parts)
                    } else {
                        ExprKind::And(parts)
                    },
                    span,
                }
            }
            Rule::not_expr => {
                let mut negated = false;
                let mut inner = None;
                // `kids()` hides keywords; here the keyword is the meaning.
                for q in p.into_inner() {
                    if q.as_rule() == Rule::kw_not {
                        negated = true;
                    } else {
                        inner = Some(q);
                    }
                }
                match inner {
                    Some(q) if negated => Expr {
                        kind: ExprKind::Not(Box::new(self.expr(q))),
                        span,
                    },
                    Some(q) => self.expr(q),
                    None => Expr {
                        kind: ExprKind::And(Vec::new()),
                        span,
                    },
                }
            }
            Rule::test => {
                let mut it = p.into_inner();
                let Some(lhs) = it.next().map(|q| self.operand(q)) else {
                    return Expr {
                        kind: ExprKind::And(Vec::new()),
                        span,
                    };
                };
                let kind = match it.next() {
                    Some(suffix) if suffix.as_rule() == Rule::comparison => {
                        let mut parts = suffix.into_inner();
                        let op = parts.next().map(|q| match q.as_str() {
                            "==" => CmpOp::Eq,
                            "!=" => CmpOp::Ne,
                            "<=" => CmpOp::Le,
                            ">=" => CmpOp::Ge,
                            "<" => CmpOp::Lt,
                            _ => CmpOp::Gt,
                        });
                        let rhs = parts.next().map(|q| self.operand(q));
                        match (op, rhs) {
                            (Some(op), Some(rhs)) => ExprKind::Cmp { lhs, op, rhs },
                            _ => ExprKind::And(Vec::new()),
                        }
                    }
                    Some(suffix) => {
                        let set = suffix
                            .into_inner()
                            .find(|q| q.as_rule() != Rule::kw_in)
                            .map(|q| self.value(q));
                        match set {
                            Some(set) => ExprKind::In { lhs, set },
                            None => ExprKind::And(Vec::new()),
                        }
                    }
                    None => ExprKind::Truth(lhs),
                };
                Expr { kind, span }
            }
            Rule::operand => Expr {
                kind: ExprKind::Truth(self.operand(p)),
                span,
            },
            _ => Expr {
                kind: ExprKind::And(Vec::new()),
                span,
            },
        }
    }

    fn operand(&self, p: P) -> Operand {
        let p = if p.as_rule() == Rule::operand {
            match p.kids().next() {
                Some(q) => q,
                None => {
                    return Operand::Lit(Value {
                        kind: ValueKind::List(Vec::new()),
                        span: Span::default(),
                    })
                }
            }
        } else {
            p
        };
        if p.as_rule() == Rule::reference {
            let span = self.span(&p);
            let mut base = None;
            let mut arg = None;
            let mut fields = Vec::new();
            for q in p.kids() {
                match q.as_rule() {
                    Rule::name if base.is_none() => base = Some(self.ident(q)),
                    Rule::name => fields.push(self.ident(q)),
                    Rule::call_arg => {
                        if let Some(a) = q.kids().next() {
                            arg = Some(match a.as_rule() {
                                Rule::string => {
                                    let s = self.span(&a);
                                    CallArg::Str(
                                        unescape(a.kids().next().map(|i| i.as_str()).unwrap_or("")),
                                        s,
                                    )
                                }
                                _ => CallArg::Name(self.ident(a)),
                            });
                        }
                    }
                    _ => {}
                }
            }
            return Operand::Ref(Reference {
                base: base.unwrap_or(Ident {
                    name: String::new(),
                    span,
                }),
                arg,
                fields,
                span,
            });
        }
        Operand::Lit(self.value(p))
    }
}

type Rule_ = super::ast::Rule;

fn quantity(p: &P) -> Quantity {
    let raw = p.as_str().to_string();
    let mut number = 0.0;
    let mut multiplier = None;
    let mut unit = None;
    let mut per = None;
    for q in p.clone().kids() {
        match q.as_rule() {
            Rule::number => number = q.as_str().parse().unwrap_or(0.0),
            Rule::multiplier => multiplier = q.as_str().chars().next(),
            Rule::unit => unit = Some(q.as_str().to_string()),
            Rule::per => per = Some(q.as_str().trim_start_matches('/').to_string()),
            _ => {}
        }
    }
    Quantity {
        raw,
        number,
        multiplier,
        unit,
        per,
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(o) => out.push(o),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Escapes a string for printing back inside double quotes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_parse_equals_single_parse() {
        let mut text = String::from("# big\ntier t { priority 1 }\n");
        let mut k = 0;
        while text.len() < PARALLEL_MIN_BYTES * 2 {
            text.push_str(&format!(
                "tenant team-{k} {{\n  owner \"o\" # {{ not a brace\n  tiers [t]\n}}\n\nclassify {{\n  when tenant == team-{k} and header(\"x\") == \"}}\" => tier t\n  default => tier t\n}}\n"
            ));
            k += 1;
        }
        let ce = content_ends(&text);
        let single = parse_segment(FileId(0), &text, 0, text.len(), &ce).expect("parses");
        let halves = parse_halves(FileId(0), &text, &ce).expect("splits and parses");
        assert_eq!(single, halves);
        assert_eq!(parse(FileId(0), &text).ok(), Some(single));
    }

    #[test]
    fn a_syntax_error_in_a_large_file_is_reported_at_its_place() {
        let mut text = String::new();
        for k in 0..20_000 {
            text.push_str(&format!("tier t{k} {{ priority 1 }}\n"));
        }
        text.push_str("tier broken { priority = }\n");
        let err = parse(FileId(0), &text).expect_err("syntax error");
        let span = err.span.expect("span");
        let line_start = text[..span.start as usize].rfind('\n').map_or(0, |i| i + 1);
        assert!(text[line_start..].starts_with("tier broken { priority = }"));
        assert_eq!(&text[span.start as usize..span.start as usize + 1], "}");
    }
}
