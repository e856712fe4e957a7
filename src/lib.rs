//! kiln: policy-as-code for GPU capacity in private LLM inference.
//!
//! Data flows one way: policy text → [`lang`] (AST with spans) →
//! [`compile`] (resolved, type and unit checked, validated) →
//! [`graph::DecisionGraph`] (immutable, evaluated per request).

pub mod backend;
pub mod batch;
pub mod chart;
pub mod cli;
pub mod clock;
pub mod compile;
pub mod diag;
pub mod diff;
pub mod driver;
pub mod embed;
pub mod governance;
pub mod graph;
pub mod lang;
pub mod ops;
pub mod policy_test;
pub mod replay;
pub mod sched;
pub mod server;
pub mod shared;
pub mod source;
pub mod table;
pub mod tls;
pub mod traffic;
pub mod units;

pub use lang::ast;
