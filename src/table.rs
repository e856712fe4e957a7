//! Plain-text tables for the command line, laid out by comfy-table: no
//! borders or rules (`presets::NOTHING`, so output stays plain ASCII
//! around the cells and greps and diffs well), every column as wide as its
//! widest cell (a long tier or tenant name widens its column instead of
//! pushing the row out of line), two spaces between columns, no trailing
//! blanks. Markdown tables (`--format markdown`) are written where they are
//! used: they need alignment markers that comfy-table does not write.

use comfy_table::{presets, CellAlignment, Table};

/// How a column's cells sit in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

pub use Align::{Left, Right};

/// A table with these column headers and alignments, to add rows to and
/// [`render`].
pub fn new(header: &[(&str, Align)]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING);
    t.set_header(header.iter().map(|(h, _)| *h).collect::<Vec<_>>());
    let aligns: Vec<Align> = header.iter().map(|(_, a)| *a).collect();
    lay_out(&mut t, &aligns);
    t
}

/// A table of these rows without a header, its columns aligned as
/// `aligns` says (left where it says nothing).
pub fn headless(rows: Vec<Vec<String>>, aligns: &[Align]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING);
    t.add_rows(rows);
    let n = t.column_count();
    let aligns: Vec<Align> = (0..n)
        .map(|i| aligns.get(i).copied().unwrap_or(Left))
        .collect();
    lay_out(&mut t, &aligns);
    t
}

fn lay_out(t: &mut Table, aligns: &[Align]) {
    for (i, a) in aligns.iter().enumerate() {
        if let Some(c) = t.column_mut(i) {
            // The last column needs no gap after it.
            let right = if i + 1 == aligns.len() { 0 } else { 2 };
            c.set_padding((0, right));
            c.set_cell_alignment(match a {
                Left => CellAlignment::Left,
                Right => CellAlignment::Right,
            });
        }
    }
}

/// The table's lines, each after `indent` and without trailing blanks,
/// each ending in a newline.
pub fn render(t: &Table, indent: &str) -> String {
    let mut out = String::new();
    for l in t.lines() {
        out.push_str(indent);
        out.push_str(l.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_fit_their_widest_cell_and_align() {
        let mut t = new(&[("name", Left), ("requests", Right), ("note", Left)]);
        t.add_row(vec!["a-very-long-tenant-name-indeed", "7", "x"]);
        t.add_row(vec!["b", "12345", ""]);
        let out = render(&t, "  ");
        assert_eq!(
            out,
            "  name                            requests  note\n  \
             a-very-long-tenant-name-indeed         7  x\n  \
             b                                  12345\n"
        );
    }

    #[test]
    fn an_empty_table_is_its_header() {
        let t = new(&[("a", Left), ("b", Right)]);
        assert_eq!(render(&t, ""), "a  b\n");
    }
}
