//! Quantity parsing never panics, and whatever parses prints a canonical string that parses
//! back to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(q) = dramesh_model::Quantity::parse(text) {
            let again = dramesh_model::Quantity::parse(&q.to_string());
            assert_eq!(again.ok(), Some(q), "canonical form of {text:?} must round-trip");
        }
    }
});
