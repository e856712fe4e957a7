//! Wall time, read in one place: Unix epoch time for records, request ids
//! and signatures. The scheduler core never reads it (its time is
//! injected through [`crate::driver::Clock`]), which is what keeps a
//! replay reproducible.

/// Milliseconds since the Unix epoch (0 if the system clock is before it).
pub fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Whole seconds since the Unix epoch.
pub fn unix_s() -> u64 {
    (unix_ms() / 1000.0) as u64
}

/// UTC minute of day and weekday (0 = Monday) now, for time-of-day rules.
pub fn minute_and_weekday() -> (u32, u8) {
    let now = jiff::Timestamp::now().to_zoned_datetime(jiff::tz::TimeZone::UTC);
    let minute = u32::from(now.hour().unsigned_abs()) * 60 + u32::from(now.minute().unsigned_abs());
    (minute, now.weekday().to_monday_zero_offset().unsigned_abs())
}
