//! kiln: policy-as-code for GPU capacity in private LLM inference.
//!
//! Data flows one way: policy text → [`lang`] (AST with spans) →
//! [`compile`] (resolved, type and unit checked, validated) →
//! [`graph::DecisionGraph`] (immutable, evaluated per request).

pub mod backend;
pub mod cli;
pub mod compile;
pub mod diag;
pub mod diff;
pub mod governance;
pub mod graph;
pub mod lang;
pub mod policy_test;
pub mod sched;
pub mod server;
pub mod sim;
pub mod source;
pub mod traffic;

pub use lang::ast;

/// The policy the gateway decides with: swapped atomically when a new
/// version is activated; each request is decided wholly by one version.
pub type ActivePolicy = arc_swap::ArcSwap<graph::DecisionGraph>;
