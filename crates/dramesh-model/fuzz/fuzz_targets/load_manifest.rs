//! Feeds arbitrary bytes to the manifest loader as YAML and as JSON; it must return Ok or a
//! LoadError, never panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = dramesh_model::load::load_str(Path::new("fuzz.yaml"), text);
        let _ = dramesh_model::load::load_str(Path::new("fuzz.json"), text);
    }
});
