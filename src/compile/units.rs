//! The compiler's view of [`crate::units`]: literals of the AST given their
//! type and base-unit value.

use crate::lang::ast::{Quantity, Value, ValueKind};
pub use crate::units::{show, weekday, Ty, Typed, UnitError, WEEKDAYS};

pub fn quantity(q: &Quantity) -> Result<Typed, UnitError> {
    crate::units::quantity(crate::units::QuantityParts {
        raw: &q.raw,
        number: q.number,
        multiplier: q.multiplier,
        unit: q.unit.as_deref(),
        per: q.per.as_deref(),
    })
}

/// The type of a literal value, if it is a scalar literal.
pub fn literal(v: &Value) -> Option<Result<Typed, UnitError>> {
    match &v.kind {
        ValueKind::Quantity(q) => Some(quantity(q)),
        ValueKind::TimeOfDay(m) => Some(Ok(Typed {
            ty: Ty::TimeOfDay,
            value: f64::from(*m),
        })),
        _ => None,
    }
}
