//! The semantic cache's guard: the details of a question that an
//! embedding barely sees but that change its answer.
//!
//! A sentence encoder scores "How do I reset my password?" and "How do I
//! not reset my password?" at 0.93, "my March invoice" and "my August
//! invoice" at 0.91: above any useful threshold. So before two questions
//! are compared at all, their *signatures* must be equal: the multiset of
//!
//! - negations (`not`, `no`, `never`, `without`, any `n't`, …), counted;
//! - numbers and words holding a digit (`3`, `1,000` = `1000`, `4g`,
//!   `gpt-4`), number words (`two`, `hundred`, `first`, `twice`, …);
//! - months, weekdays and relative days (`march`, `mar`, `friday`,
//!   `tomorrow`; `may` only written `May` inside a sentence, where it is
//!   not the verb);
//! - time units (`day`, `week`, `monthly`, `annual`, …) and currencies
//!   (`$`, `€`, `euro`, `usd`, …);
//! - names: capitalised words inside a sentence, and words with a capital
//!   after their first letter (`iPhone`, `PayPal`, `ATM`), lowercased;
//! - words of direction whose opposite an embedding puts next to them
//!   (`freeze`/`unfreeze`, `enable`/`disable`, `before`/`after`, …), each
//!   as itself.
//!
//! The gateway folds the signature into the scope a question is compared
//! in ([`crate::sched::semantic`]), so questions that differ in one of these
//! are never compared. What it costs in recall (paraphrases that write a
//! name in another case, or a number as a word) is measured on
//! `benches/semantic/eval-pairs.tsv` (BENCHMARKS.md).

/// Words that negate, counted (`n't` contractions are found by suffix).
const NEGATIONS: &[&str] = &[
    "not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "cannot",
    "without", "dont", "cant", "wont", "isnt", "arent", "doesnt", "didnt", "hasnt", "havent",
    "wasnt", "werent", "shouldnt", "wouldnt", "couldnt", "mustnt", "aint", "neednt",
];

const NUMBER_WORDS: &[&str] = &[
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
    "hundred",
    "thousand",
    "million",
    "billion",
    "half",
    "quarter",
    "once",
    "twice",
    "double",
    "triple",
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "last",
    "next",
    "previous",
];

/// Months by their names and abbreviations (`may` is handled apart).
const MONTHS: &[(&str, &str)] = &[
    ("january", "m01"),
    ("jan", "m01"),
    ("february", "m02"),
    ("feb", "m02"),
    ("march", "m03"),
    ("mar", "m03"),
    ("april", "m04"),
    ("apr", "m04"),
    ("june", "m06"),
    ("jun", "m06"),
    ("july", "m07"),
    ("jul", "m07"),
    ("august", "m08"),
    ("aug", "m08"),
    ("september", "m09"),
    ("sep", "m09"),
    ("sept", "m09"),
    ("october", "m10"),
    ("oct", "m10"),
    ("november", "m11"),
    ("nov", "m11"),
    ("december", "m12"),
    ("dec", "m12"),
];

const DAYS: &[&str] = &[
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
    "today",
    "tomorrow",
    "yesterday",
    "tonight",
    "weekend",
    "weekday",
];

/// Words whose opposites embed alike: each must match itself (a stem:
/// `enabled`, `enables` and `enabling` are `enable`).
const DIRECTIONS: &[&str] = &[
    "enabl",
    "disabl",
    "activat",
    "deactivat",
    "freez",
    "froze",
    "unfreez",
    "unfroze",
    "block",
    "unblock",
    "lock",
    "unlock",
    "increas",
    "decreas",
    "rais",
    "lower",
    "upgrad",
    "downgrad",
    "upload",
    "download",
    "import",
    "export",
    "subscrib",
    "unsubscrib",
    "deposit",
    "withdraw",
    "withdrew",
    "frozen",
    "buy",
    "bought",
    "sell",
    "sold",
    "before",
    "after",
    "above",
    "below",
    "more",
    "less",
    "fewer",
    "install",
    "uninstall",
    "encrypt",
    "decrypt",
    "login",
    "logout",
    "accept",
    "reject",
    "declin",
    "approv",
    "allow",
    "deny",
    "denied",
    "max",
    "minimum",
    "maximum",
    "earliest",
    "latest",
    "cheapest",
    "fastest",
    "slowest",
    "highest",
    "lowest",
    "incoming",
    "outgoing",
    "inbound",
    "outbound",
    "credit",
    "debit",
    "physical",
    "virtual",
    "personal",
    "business",
    "joint",
    // Found by the first run of the accuracy set (BENCHMARKS.md): "the
    // end of the month" and "the start of the month" scored 0.96.
    "open",
    "clos",
    "start",
    "end",
    "begin",
    "beginning",
    "most",
    "least",
    "best",
    "worst",
    "new",
    "old",
];

/// Time units, singular (a trailing `s` is dropped before the look-up).
const UNITS: &[(&str, &str)] = &[
    ("second", "u:s"),
    ("minute", "u:min"),
    ("hour", "u:h"),
    ("hourly", "u:h"),
    ("day", "u:d"),
    ("daily", "u:d"),
    ("week", "u:w"),
    ("weekly", "u:w"),
    ("month", "u:mo"),
    ("monthly", "u:mo"),
    ("year", "u:y"),
    ("yearly", "u:y"),
    ("annual", "u:y"),
    ("annually", "u:y"),
];

const CURRENCIES: &[(&str, &str)] = &[
    ("dollar", "$"),
    ("usd", "$"),
    ("euro", "€"),
    ("eur", "€"),
    ("pound", "£"),
    ("gbp", "£"),
    ("sterling", "£"),
    ("yen", "¥"),
    ("jpy", "¥"),
    ("franc", "chf"),
    ("chf", "chf"),
    ("rupee", "inr"),
    ("inr", "inr"),
    ("yuan", "cny"),
    ("cny", "cny"),
    ("bitcoin", "btc"),
    ("btc", "btc"),
];

/// The guarded details of `text`, sorted (a multiset): two questions may
/// share a cached answer only when their signatures are equal.
pub fn signature(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut sentence_start = true;
    let mut negations = 0usize;
    for raw in text.split(|c: char| c.is_whitespace()) {
        for c in raw.chars() {
            if let Some(sym) = currency_symbol(c) {
                out.push(sym.to_string());
            }
        }
        // The word without the punctuation around it; inner `-`, `'`, `.`
        // and `,` stay (`gpt-4`, `don't`, `3.5`, `1,000`).
        let word = raw.trim_matches(|c: char| !c.is_alphanumeric());
        let starts = sentence_start;
        sentence_start = raw.ends_with(['.', '?', '!', ':', ';']) || raw.is_empty() && starts;
        if word.is_empty() {
            continue;
        }
        let lower = word.to_lowercase();
        let bare: String = lower
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == '.' || *c == '-')
            .collect();
        let apostrophe_free: String = lower.chars().filter(|c| c.is_alphanumeric()).collect();
        if NEGATIONS.contains(&apostrophe_free.as_str())
            || lower.ends_with("n't")
            || lower.ends_with("n’t")
        {
            negations += 1;
            continue;
        }
        if word.chars().any(|c| c.is_ascii_digit()) {
            // `1,000` and `1000` are one number; `3.5` keeps its point.
            out.push(format!("#{}", bare.trim_end_matches('.')));
            continue;
        }
        if NUMBER_WORDS.contains(&apostrophe_free.as_str()) {
            out.push(format!("#{apostrophe_free}"));
            continue;
        }
        if let Some((_, m)) = MONTHS.iter().find(|(n, _)| *n == apostrophe_free) {
            out.push((*m).to_string());
            continue;
        }
        if apostrophe_free == "may" && !starts && word.starts_with('M') {
            out.push("m05".to_string());
            continue;
        }
        if DAYS.contains(&apostrophe_free.as_str()) {
            out.push(format!("d:{apostrophe_free}"));
            continue;
        }
        let singular = apostrophe_free
            .strip_suffix('s')
            .unwrap_or(&apostrophe_free);
        let unit = UNITS
            .iter()
            .chain(CURRENCIES)
            .find(|(n, _)| *n == apostrophe_free || *n == singular);
        if let Some((_, u)) = unit {
            out.push((*u).to_string());
            continue;
        }
        if let Some(d) = DIRECTIONS.iter().find(|d| {
            apostrophe_free.strip_prefix(**d).is_some_and(|rest| {
                [
                    "", "e", "es", "ed", "ing", "s", "d", "al", "ion", "ions", "ation", "ations",
                ]
                .contains(&rest)
            })
        }) {
            out.push(format!("v:{d}"));
            continue;
        }
        let mut chars = word.chars();
        let first_upper = chars.next().is_some_and(char::is_uppercase);
        let inner_upper = chars.any(char::is_uppercase);
        if inner_upper || (first_upper && !starts && word != "I") {
            out.push(format!("n:{apostrophe_free}"));
        }
    }
    out.extend(std::iter::repeat_n("¬".to_string(), negations));
    out.sort();
    out
}

fn currency_symbol(c: char) -> Option<&'static str> {
    match c {
        '$' => Some("$"),
        '€' => Some("€"),
        '£' => Some("£"),
        '¥' => Some("¥"),
        '₹' => Some("inr"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &str, b: &str) -> bool {
        signature(a) == signature(b)
    }

    #[test]
    fn paraphrases_keep_one_signature() {
        assert!(same("Enabling it", "How do I enable it?"));
        assert!(same(
            "How do I reset my password?",
            "I forgot my password, how can I reset it?"
        ));
        assert!(same(
            "My card hasn't arrived yet.",
            "Why didn't my card arrive?"
        ));
        assert!(same(
            "Can I pay with Apple Pay? Thanks.",
            "Is Apple Pay supported?"
        ));
        assert!(same("I can't log in", "I cannot log in"));
        assert!(same("May I change my PIN?", "Can I change my PIN?"));
        assert!(same("Where is the 1,000 limit?", "where is the 1000 limit"));
    }

    #[test]
    fn a_changed_detail_changes_the_signature() {
        for (a, b) in [
            (
                "How do I reset my password?",
                "How do I not reset my password?",
            ),
            ("Send me my March invoice", "Send me my August invoice"),
            (
                "Send me my invoice for May 3",
                "Send me my invoice for May 4",
            ),
            (
                "Is the office open on Friday?",
                "Is the office open on Monday?",
            ),
            ("Is the office open today?", "Is the office open tomorrow?"),
            ("What is the monthly fee?", "What is the annual fee?"),
            ("Can I pay in euros?", "Can I pay in dollars?"),
            ("Can I pay in €?", "Can I pay in $?"),
            (
                "Does it work with my iPhone?",
                "Does it work with my Pixel?",
            ),
            ("How do I order two cards?", "How do I order three cards?"),
            ("Compare GPT-4 and Llama", "Compare GPT-3 and Llama"),
            ("Refund my second order", "Refund my first order"),
            ("How do I freeze my card?", "How do I unfreeze my card?"),
            ("Enable two-factor login", "Disable two-factor login"),
            (
                "Why was my payment declined?",
                "Why was my payment approved?",
            ),
            (
                "My balance at the end of the month",
                "My balance at the start of the month",
            ),
            (
                "Which shop did I pay most often?",
                "Which shop did I pay least often?",
            ),
            ("How do I open an account?", "How do I close an account?"),
        ] {
            assert!(!same(a, b), "{a:?} and {b:?} share {:?}", signature(a));
        }
    }

    #[test]
    fn a_capital_at_a_sentence_start_is_not_a_name() {
        assert_eq!(
            signature("Where is my card? Please help."),
            Vec::<String>::new()
        );
        assert_eq!(signature("my card is Visa"), vec!["n:visa".to_string()]);
    }

    #[test]
    fn negations_are_counted() {
        assert_eq!(signature("I don't want no trouble").len(), 2);
        assert!(!same("not a", "not not a"));
    }
}
