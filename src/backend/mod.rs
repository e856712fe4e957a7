//! Backends that run batches: `sim` (the roofline cost model, the embedded
//! default), later `http` and `cuda`.

pub mod sim;
