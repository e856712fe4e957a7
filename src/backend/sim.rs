//! The roofline cost model of a simulated GPU replica.
