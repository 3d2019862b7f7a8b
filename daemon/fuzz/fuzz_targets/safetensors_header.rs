//! Any bytes as a safetensors file: the parser returns an error or a header whose every tensor
//! lies inside the file, never panics, and never allocates by a length it has not checked.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightstream_daemon::store::safetensors::{HeaderLimits, parse_header, read_header};

fuzz_target!(|data: &[u8]| {
    let parsed = parse_header(data, HeaderLimits::NONE);
    let read = read_header(&mut &data[..], data.len() as u64, HeaderLimits::NONE);
    assert_eq!(
        parsed.is_ok(),
        read.is_ok(),
        "the two entry points disagree"
    );
    if let Ok(header) = parsed {
        let mut end = 0;
        for t in &header.tensors {
            assert!(t.file_offset >= end, "tensors overlap or are unsorted");
            end = t.file_offset + t.nbytes;
            assert!(end <= data.len() as u64, "tensor past the end of the file");
        }
    }
});
