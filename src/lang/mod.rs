//! The language front end: grammar → AST, and the formatter.

pub mod ast;
pub mod comments;
pub mod format;
pub mod parser;

pub use parser::parse;
